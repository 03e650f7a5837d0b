"""A user's training script run in this process, unchanged, as ``python SCRIPT.py ARGS`` or
``python -m MODULE ARGS`` would run it: as ``__main__``, with its own ``sys.argv``, the
user's working directory, and ``sys.path[0]`` its folder (the working directory for a
module); both put back after. Its exit code is passed through, and an exception it raises is
shown with its own traceback, the frames of this bootstrap and of ``runpy`` left out.

``kasoku.commands.script_profile`` watches its steps from outside; this module knows nothing
of profiling.
"""
from __future__ import annotations

import importlib.util
import os
import re
import runpy
import shlex
import sys
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

from kasoku.core.errors import ConfigError

PYTHON_SHOWWARNING = warnings._showwarning_orig
"""Python's own way to print a warning, for the script's warnings: the warnings module's
original function (its ``_showwarning_orig``), not ``warnings.showwarning`` as this module
finds it, since ``kasoku.cli.main`` replaces that with kasoku's lines before it imports the
command's engine (this module among them)."""

PYTHON = re.compile(r"python(\d+(\.\d+)?)?(\.exe)?$")
"""What names the interpreter in front of a script: python, python3, python3.11."""


@dataclass(frozen=True)
class ScriptCommand:
    """The command after ``--``: a script file or a module, and the script's own arguments."""
    argv: tuple[str, ...]
    """As given."""
    path: Path | None
    module: str | None
    args: tuple[str, ...]

    @property
    def name(self) -> str:
        """The script's file name, or the module's name."""
        return self.path.name if self.path is not None else str(self.module)

    @property
    def text(self) -> str:
        return shlex.join(self.argv)


def parse_command(argv: list[str]) -> ScriptCommand:
    """``python SCRIPT.py ARGS``, ``SCRIPT.py ARGS`` or ``python -m MODULE ARGS`` as a
    ``ScriptCommand``; a missing script or module, or options of python's own, are a
    ``ConfigError`` saying what to give."""
    words = list(argv)
    if not words:
        raise ConfigError("give the script's command after --: kasoku profile -- python "
                          "train.py ARGS")
    rest = words[1:] if PYTHON.match(Path(words[0]).name) or words[0] == sys.executable \
        else words
    if rest[:1] == ["-m"]:
        if len(rest) < 2:
            raise ConfigError("python -m needs a module: kasoku profile -- python -m MODULE")
        if not _module_exists(rest[1]):
            raise ConfigError(f"no module named {rest[1]!r} here (run from the folder that "
                              f"holds it, or install it)")
        return ScriptCommand(tuple(words), None, rest[1], tuple(rest[2:]))
    if not rest or rest[0].startswith("-"):
        raise ConfigError(f"{shlex.join(words)}: give a script (python SCRIPT.py ARGS) or a "
                          f"module (python -m MODULE ARGS); python's own options are not "
                          f"taken here")
    path = Path(rest[0])
    if not path.is_file():
        raise ConfigError(f"the script {path} does not exist"
                          if not path.exists() else f"the script {path} is not a file")
    return ScriptCommand(tuple(words), path, None, tuple(rest[1:]))


def _module_exists(name: str) -> bool:
    sys.path.insert(0, os.getcwd())  # where python -m looks first
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
    finally:
        sys.path.pop(0)


class ScriptStopped(BaseException):
    """Raised inside the script to end it early (``--stop-after-window``): a BaseException,
    so a script's ``except Exception`` does not swallow it, while its ``with`` blocks and
    ``finally`` clauses run as it unwinds."""


@dataclass
class ScriptEnd:
    """How the script ended: its exit ``code``, whether it ``raised`` (its traceback was
    shown), whether it was ``stopped`` by ``ScriptStopped`` and whether Ctrl-C
    ``interrupted`` it (not a ``sys.exit(130)`` of its own)."""
    code: int
    raised: bool = False
    stopped: bool = False
    interrupted: bool = False


def run_script(command: ScriptCommand, hidden: tuple[str, ...] = ()) -> ScriptEnd:
    """Run the script to its end; returns how it ended. Never raises for the script's own
    exceptions (they are printed as the script's, the frames of ``hidden`` files left out
    too); Ctrl-C ends it with 130."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    if command.path is not None:
        sys.argv = [str(command.path), *command.args]
        sys.path[0] = str(command.path.resolve().parent)
    else:
        sys.argv = [str(command.module), *command.args]
        sys.path[0] = os.getcwd()
    try:
        with warnings.catch_warnings():
            warnings.showwarning = PYTHON_SHOWWARNING
            if command.module is not None:
                runpy.run_module(command.module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(str(command.path), run_name="__main__")
        return ScriptEnd(0)
    except ScriptStopped:
        return ScriptEnd(0, stopped=True)
    except SystemExit as exc:
        return ScriptEnd(exit_code(exc))
    except KeyboardInterrupt:
        return ScriptEnd(130, interrupted=True)
    except BaseException as exc:  # noqa: BLE001 -- the script's own failure, shown as its own
        print_script_traceback(exc, hidden)
        return ScriptEnd(1, raised=True)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        _flush()


def exit_code(exc: SystemExit) -> int:
    """The process's exit code for ``sys.exit(code)`` as Python gives it: None 0, an int
    itself, anything else printed to stderr and 1."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


BOOTSTRAP_FILES = frozenset({__file__, runpy.__file__, "<frozen runpy>"})
"""Frames left out of a script's traceback, with those of the files ``hidden`` adds (runpy
is frozen into the interpreter from Python 3.11: its frames name no file)."""


def print_script_traceback(exc: BaseException, hidden: tuple[str, ...] = ()) -> None:
    """``exc``'s traceback as Python would print it for the script alone: the frames of
    this bootstrap, of runpy and of ``hidden`` files (the step watcher's) left out."""
    sys.stderr.write("".join(_formatted(exc, BOOTSTRAP_FILES | set(hidden))))
    sys.stderr.flush()


def _formatted(exc: BaseException, skip: set) -> list[str]:
    te = traceback.TracebackException.from_exception(exc)
    node, seen = te, set()
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        node.stack = traceback.StackSummary.from_list(
            [f for f in node.stack if f.filename not in skip])
        node = node.__cause__ or node.__context__
    return list(te.format())


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing to keep
            pass
