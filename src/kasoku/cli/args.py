"""Argument types that validate a value where it is parsed (one line saying what is wrong and
what to give), the parser that prints that line alone, and flags made from config dataclasses:
their help is the field's docstring, so the library documents a setting once."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import math
import sys
import typing

from kasoku.core.errors import ConfigError
from kasoku.core.flags import FLAGS
from kasoku.data.registry import parse_loader_spec
from kasoku.train.config import max_threads


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line, ``PROG: error: WHAT (see PROG
    --help)``, and exit 2, instead of the usage block and the message. Options must be spelt
    out: ``--epoch`` is not taken for ``--epochs``."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        text = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {text} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but words no option takes are said by the command they were given
        to (``kasoku train: ... (see kasoku train --help)``), with the nearest of its options
        where one is near (``did you mean --epochs?``)."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self._command_of(parsed).unrecognized(extras)
        return parsed

    def _command_of(self, parsed) -> "Parser":
        """The (sub)command's parser that ``parsed`` went through last."""
        parser = self
        while True:
            subs = [x for x in parser._actions if isinstance(x, argparse._SubParsersAction)]
            chosen = subs and subs[0].choices.get(getattr(parsed, subs[0].dest, None) or "")
            if not isinstance(chosen, Parser):
                return parser
            parser = chosen

    def unrecognized(self, extras: list[str]):
        """Exit 2 with one line naming ``extras``, and the option nearest the first
        unknown one when there is one (``difflib``)."""
        message = f"unrecognized arguments: {' '.join(extras)}"
        unknown = next((w.split("=", 1)[0] for w in extras if w.startswith("-")), None)
        if unknown is not None:
            # compared without the dashes, which every option shares
            own = [o[2:] for o in self._option_string_actions if o.startswith("--")]
            near = difflib.get_close_matches(unknown.lstrip("-"), own, n=1, cutoff=0.75)
            if near:
                message += f"; did you mean --{near[0]}?"
        self.error(message)


def _fail(message: str):
    raise argparse.ArgumentTypeError(message)


def positive_int(text: str) -> int:
    """A whole number >= 1."""
    value = _int(text)
    if value < 1:
        _fail(f"must be a whole number >= 1, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    """A whole number >= 0."""
    value = _int(text)
    if value < 0:
        _fail(f"must be a whole number >= 0, got {text!r}")
    return value


def threads(text: str) -> int:
    """A whole number from 1 to ``kasoku.train.config.max_threads()``."""
    value = positive_int(text)
    most = max_threads()
    if value > most:
        _fail(f"must be at most {most} (4 x the {most // 4} cores here), got {text!r}")
    return value


def seed(text: str) -> int:
    """A whole number in [0, 2**32)."""
    value = _int(text)
    if not 0 <= value < 2 ** 32:
        _fail(f"must be a whole number from 0 to {2 ** 32 - 1}, got {text!r}")
    return value


def _int(text: str) -> int:
    try:
        return int(text.strip())
    except (ValueError, AttributeError):
        _fail(f"must be a whole number, got {text!r}")


def positive_float(text: str) -> float:
    """A finite number > 0 (``nan``, ``inf`` and ``1e999`` are refused)."""
    try:
        value = float(text)
    except ValueError:
        _fail(f"must be a number, got {text!r}")
    if not math.isfinite(value) or value <= 0:
        _fail(f"must be a positive, finite number, got {text!r}")
    return value


def fraction(text: str) -> float:
    """A number from 0 to below 1 (a decay: 1 would never move)."""
    try:
        value = float(text)
    except ValueError:
        _fail(f"must be a number, got {text!r}")
    if not 0 <= value < 1:
        _fail(f"must be a number from 0 to below 1, got {text!r}")
    return value


def split_list(text: str, expected: str) -> list[str]:
    """The items of a comma-separated ``text``, blanks left out (the others as given, not
    stripped); none at all is refused as ``expected EXPECTED, got TEXT``."""
    items = [item for item in text.split(",") if item.strip()]
    if not items:
        _fail(f"expected {expected}, got {text!r}")
    return items


def int_list(text: str) -> list[int]:
    """``32,64,128``: whole numbers >= 1, comma-separated."""
    return [positive_int(item)
            for item in split_list(text, "N or N,N,...: whole numbers >= 1")]


def resolution(text: str) -> tuple[int, int]:
    """``WIDTHxHEIGHT``, each from 8 to 16384."""
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        _fail(f"must look like 500x375 (WIDTHxHEIGHT), got {text!r}")
    if not (8 <= w <= 16384 and 8 <= h <= 16384):
        _fail(f"width and height must be from 8 to 16384 pixels, got {text!r}")
    return w, h


def resolutions(text: str) -> list[tuple[int, int]]:
    return [resolution(item) for item in split_list(text, "WxH[,WxH...]")]


def device(text: str) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (whether this machine has it is checked when
    the command runs)."""
    name, sep, index = text.partition(":")
    if text == "auto" or (name in ("cpu", "cuda") and not sep) \
            or (name == "cuda" and index.isdigit()):
        return text
    _fail(f"must be auto, cpu, cuda or cuda:N, got {text!r}")


def loader_spec(text: str) -> str:
    """A loader as ``--loader`` takes it: ``KIND`` or ``KIND:N`` of the loader registry."""
    try:
        parse_loader_spec(text)
    except ConfigError as exc:
        _fail(str(exc))
    return text


def choice(values):
    """A type that accepts one of ``values`` and names them all when it refuses."""
    def parse(text: str) -> str:
        if text not in values:
            _fail(f"must be one of {', '.join(values)}, got {text!r}")
        return text
    parse.__name__ = "choice"
    parse.choices = tuple(values)  # for the CLI's surface (kasoku.cli.surface)
    return parse


@functools.lru_cache(maxsize=None)
def field_docs(cls) -> dict[str, str]:
    """``{field: docstring}`` of a dataclass whose fields carry a string literal below them."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):  # no source shipped: flags without help texts
        return {}
    body = tree.body[0].body
    docs = {}
    for stmt, after in zip(body, body[1:]):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) \
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                and isinstance(after.value.value, str):
            docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


RUN_SECTIONS = {"DataConfig": "data", "TrainConfig": "train", "AccelConfig": "accel",
                "DistConfig": "dist", "KFACConfig": "kfac"}
"""The configs of a run (``kasoku.run.RunConfig``), by class name, and their section in
``kasoku.core.flags.FLAGS``."""


def add_fields(group, cls, flags: dict[str, dict | None]) -> None:
    """Add one option per entry of ``flags`` (field name -> argparse overrides, or None for
    the defaults) for fields of dataclass ``cls``: the flag is ``--field-name`` unless the
    overrides give ``flag``; the help is the field's docstring; a bool field is a switch; the
    type follows the annotation (int: a whole number >= 1, float: a positive finite number)
    unless the overrides give one. The option's ``dest`` is the field name and its default
    None (unset: the config's default applies), so ``config_from(args, cls)`` builds the
    config. A field of a run's configs (``kasoku.run.RunConfig``) takes its flag from
    ``kasoku.core.flags.FLAGS``, the one map of them."""
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
    section = RUN_SECTIONS.get(cls.__name__)
    for name, overrides in flags.items():
        kwargs = dict(overrides or {})
        if section is not None:
            assert "flag" not in kwargs, f"{section}.{name}: its flag is kasoku.core.flags'"
            flag = FLAGS[f"{section}.{name}"]
        else:
            flag = kwargs.pop("flag", "--" + name.replace("_", "-"))
        hint = hints[name]
        kwargs.setdefault("help", docs.get(name, "").replace("%", "%%"))
        field = cls.__dataclass_fields__[name]
        kwargs.setdefault("default", None)
        if hint is bool:
            kwargs.setdefault("action", "store_true")
        else:
            base = _base_type(hint)
            kwargs.setdefault("type", {int: positive_int, float: positive_float}.get(base, base))
            if field.default not in (None, dataclasses.MISSING) and "default" not in \
                    kwargs["help"]:
                kwargs["help"] += f" (default: {str(field.default).replace('%', '%%')})"
        action = group.add_argument(flag, dest=name, **kwargs)
        # Unset means the config's own default: recorded for the CLI's surface.
        action.config_default = field.default


def _base_type(hint):
    if typing.get_origin(hint) is typing.Literal:  # a closed choice of names
        return str
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return _base_type(args[0]) if args else hint


def config_from(args: argparse.Namespace, cls, **extra):
    """``cls`` from the options ``add_fields`` added: the fields given on the command line
    (not None) plus ``extra``; the others keep the config's defaults."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in vars(args).items() if k in names and v is not None}
    values.update(extra)
    return cls(**values)


def synthetic_loader(args: argparse.Namespace, data) -> dict:
    """``{"loader": "device"}`` where a run trains on synthetic data (``data``, a
    ``DataConfig``) on a GPU and the command gave no ``--loader``: its batches made from
    samples held on the device, so that it measures the model, not the host drawing random
    numbers; {} otherwise (``--procs N``: CPU processes). Where the samples are too many to
    hold, the run falls back to the serial loader and says so
    (``kasoku.commands.train.held_synthetic``). The host's data path on synthetic data is a
    loader chosen (``--loader serial``, ``threads:N``, ``multiprocess:N``)."""
    if not data.synthetic or getattr(args, "loader", None) is not None \
            or getattr(args, "procs", None):  # CPU processes: the host's path is theirs
        return {}
    from kasoku.commands.device import resolve_device  # deferred: torch, when a run starts
    return {"loader": "device"} if resolve_device(args.device).type == "cuda" else {}
