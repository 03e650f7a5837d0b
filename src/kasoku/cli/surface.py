"""The command line's surface -- sub-commands, their options, defaults and choices -- as one
JSON document, so a test can pin it and any unplanned change shows up as a diff.

    python -m kasoku.cli.surface > tests/cli_surface.json   # after a planned change
"""
from __future__ import annotations

import argparse
import json

from kasoku.cli import build_parser
from kasoku.data.registry import list_loaders, loader_kind


def surface(parser: argparse.ArgumentParser | None = None) -> dict:
    """``{command path: [option records]}`` for every (sub-)command of ``parser``, and the
    loader kinds ``--loader`` takes (``"--loader kinds"``)."""
    if parser is None:
        parser = build_parser()
    commands: dict[str, list] = {}
    _walk(parser, parser.prog, commands)
    commands["--loader kinds"] = [{"kind": k, "count": loader_kind(k).count}
                                  for k in list_loaders()]
    return commands


def _walk(parser: argparse.ArgumentParser, path: str, commands: dict) -> None:
    records = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                _walk(sub, f"{path} {name}", commands)
            continue
        if isinstance(action, argparse._HelpAction):
            continue
        records.append({
            "flags": list(action.option_strings) or [action.dest],
            "dest": action.dest,
            "default": _plain(action.default),
            "nargs": action.nargs,
            "const": _plain(action.const),
            "choices": list(action.choices) if action.choices else
            _plain(getattr(action.type, "choices", None)),
            "config_default": _plain(getattr(action, "config_default", None)),
            "type": getattr(action.type, "__name__", None) if action.type else None,
            "required": bool(action.required),
            "action": type(action).__name__,
        })
    commands[path] = records


def _plain(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


if __name__ == "__main__":
    print(json.dumps(surface(), indent=1, sort_keys=True))
