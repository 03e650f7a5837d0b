"""The ``kasoku`` command line: the only place argparse lives, a thin adapter from argv to
configs and library calls.

One set of conventions across sub-commands: ``--device auto`` (cuda when available), ``--out
DIR`` for what a command writes (by default under ``runs/``), comma lists for what a sweep
varies (``--batch-size 32,64``). A user's mistake ends in one line, ``kasoku: error: ...``,
saying what to do, and exit code 2; a warning is one line, ``kasoku: warning: ...``.

The parser is built from modules that do not import torch (configs, their choices, the
registries' names), and each command's ``run`` imports its engine when it runs: ``--version``,
``--help``, ``list`` and every mistake in the arguments answer without loading torch
(``tests/test_cli_startup.py``).
"""
from __future__ import annotations

import argparse
import sys
import warnings

from kasoku.cli import args as a
from kasoku.core.errors import ConfigError, DataError, KasokuWarning, NonFiniteError
from kasoku.core.interrupts import signal_of, stopped_line
from kasoku.core.queues import request_queues
from kasoku.core.version import __version__
from kasoku.distributed.failures import note, peer_lost
from kasoku.distributed.launch import exit_worker, under_launcher
from kasoku.distributed.world import World
from kasoku.train.run_dir import (
    AUTO,
    OUTPUT_ROOT,
    SnapshotError,
    check_writable,
    find_snapshot,
    new_folders,
    remove_empty,
    remove_empty_made,
)

EXIT_USAGE = 2
"""A user's mistake: a bad value, a missing file, an incompatible snapshot."""
EXIT_FAILED = 1
"""The work ran and failed: training diverged, a benchmark run crashed."""


def build_parser() -> a.Parser:
    from kasoku.cli import (  # deferred: the commands' modules, not needed by --version
        allreduce_bench,
        bench,
        compare,
        data,
        listing,
        profile,
        run,
        scale,
        train,
    )
    parser = a.Parser(prog="kasoku",
                      description="Measure, explain and accelerate deep-learning training.")
    parser.add_argument("--version", action="version", version=f"kasoku {__version__}")
    sub = parser.add_subparsers(
        dest="command", required=True, parser_class=a.Parser,
        metavar="{list,train,profile,run,bench,compare,data,allreduce-bench,scale}")
    listing.add_parser(sub)
    train.add_parser(sub)
    profile.add_parser(sub)
    run.add_parser(sub)
    bench.add_parser(sub)
    compare.add_parser(sub)
    data.add_parser(sub)
    allreduce_bench.add_parser(sub)
    scale.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``kasoku ARGV``; returns the exit code (0 done, 1 the work failed, 2 a mistake in
    the command or its inputs, 128 + N stopped by signal N). No arguments print the help (on
    stdout) and return 2, as a missing command does in argparse tools."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv == ["--version"]:  # as the parser would answer it, without building the parser
        print(f"kasoku {__version__}")
        return 0
    from kasoku.cli.profile import split_script  # deferred: as build_parser's
    argv, script = split_script(argv)  # the script's words are not kasoku's
    if script is None:  # a user's script runs in the environment it would have without kasoku
        request_queues()  # before anything starts CUDA: side streams need queues of their own
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        parser = build_parser()
        if not argv:  # the help rather than "a command is required"; still 2: nothing was done
            parser.print_help()
            return EXIT_USAGE
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help, --version, or a bad value (its line is printed)
            return exc.code if isinstance(exc.code, int) else EXIT_USAGE
        args.argv = argv
        if script is not None:
            args.script = script
        return _run(args)


def run_as_program() -> None:
    """``python -m kasoku``: ``main`` as a process's whole life. In a worker of a
    data-parallel run it ends through ``exit_worker`` (see there: the interpreter's shutdown
    can abort a process that used gloo). A Ctrl-C that reaches here (while the parser is
    built, or the command's engine imported) is one line and exit code 130."""
    try:
        code = main()
    except KeyboardInterrupt as exc:
        code = _interrupted(exc)
    if under_launcher():
        exit_worker(code)
    sys.exit(code)


def run_worker(argv: list[str], usage: str, parse, handler) -> int:
    """One worker of a data-parallel ``kasoku train`` or ``profile``, started with its
    request's JSON (``argv``: that one word, else ``usage`` and exit 2): the request read by
    ``parse``, CUDA's queues set before anything starts CUDA, warnings and errors said as
    ``kasoku``'s command line says them, ``handler(request)``'s exit code."""
    if len(argv) != 1:
        print(usage, file=sys.stderr)
        return EXIT_USAGE
    request = parse(argv[0])
    request_queues()
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        return _run(argparse.Namespace(handler=lambda _args: handler(request),
                                       dist_timeout=request.run.dist.dist_timeout))


def _run(args) -> int:
    # an --out this command makes and a signal stops before anything is written there goes
    created = new_folders(args.out) if getattr(args, "out", None) is not None else []
    try:
        return _handle(args, created)
    finally:
        remove_empty_made()  # a new folder the command left empty (it failed, or wrote nothing)


def _handle(args, created: list) -> int:
    try:
        _check_out(args)
        return args.handler(args)
    except (ConfigError, DataError, SnapshotError) as exc:
        _error(exc)
        return EXIT_USAGE
    except NonFiniteError as exc:
        _error(exc)
        return EXIT_FAILED
    except KeyboardInterrupt as exc:
        remove_empty(created)
        return _interrupted(exc)
    except Exception as exc:
        if not under_launcher():
            raise
        from kasoku.distributed.ddp import describe_failure  # deferred: torch (module doc)
        # A worker of a data-parallel run: one line naming it, not a traceback from each.
        timeout = getattr(args, "dist_timeout", None) or 300.0
        line, lost = describe_failure(exc, World.from_env().rank, timeout), peer_lost(exc)
        # For kasoku's launching process, which names the worker that failed on its own; a
        # worker that only lost its peer says nothing more to the terminal then.
        if not (note("failed", line=line, peer_lost=lost) and lost):
            print(f"kasoku: error: {line}", file=sys.stderr, flush=True)
        return EXIT_FAILED


def _interrupted(exc: KeyboardInterrupt) -> int:
    """The exit code of a run a signal stopped: the one the interruption carries (whoever
    raised it with one said what stopped and how to go on), else 128 + the signal's number
    after one line, ``kasoku: interrupted`` for SIGINT (not in a worker of a data-parallel
    run: its launcher says it)."""
    if hasattr(exc, "exit_code"):
        return exc.exit_code
    if not under_launcher():
        print(stopped_line(exc), file=sys.stderr, flush=True)
    return 128 + signal_of(exc)


def _check_out(args) -> None:
    """Refuse (``ConfigError``) a command's output folder that cannot take files, before any
    work, and in a data-parallel run before its workers start: ``--out`` (every command that
    writes has it, ``data make-jpeg``'s destination included), else where the command writes
    without one, a resumed run's folder or ``runs/``. A redraw that writes nothing
    (``--report --no-chart``) is let through."""
    if not hasattr(args, "out") or (getattr(args, "report", False)
                                    and getattr(args, "no_chart", False)):
        return
    if args.out is not None:
        check_writable(args.out)
    elif getattr(args, "resume", None) not in (None, AUTO):
        try:  # the run goes on in its snapshot's folder
            folder = find_snapshot(args.resume).parent
        except SnapshotError:
            return  # the command says what is wrong with --resume
        check_writable(folder, flag="--resume",
                       advice="give --out a folder you can write to, to continue it there")
    else:
        check_writable(OUTPUT_ROOT, flag="the default output folder",
                       advice="give --out a folder you can write to")


def _error(exc: BaseException) -> None:
    line = _one_line(str(exc))
    print(f"kasoku: error: {_worker()}{line}", file=sys.stderr, flush=True)
    if under_launcher():  # the launching process names the worker that failed on its own
        note("failed", line=f"{_worker()}{line}", peer_lost=False)


def _worker() -> str:
    """``worker R: `` in a worker of a data-parallel run of several, else nothing."""
    if not under_launcher():
        return ""
    try:
        world = World.from_env()
    except ConfigError:
        return ""
    return f"worker {world.rank}: " if world.world_size > 1 else ""


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """One line, no source code: ``kasoku: warning: MESSAGE`` (others' warnings also name
    their category)."""
    text = _one_line(str(message)) or category.__name__
    if not issubclass(category, KasokuWarning):
        text += f" [{category.__name__}]"
    print(f"kasoku: warning: {text}", file=file or sys.stderr, flush=True)
