"""The whole command-line surface, pinned: sub-commands, options, defaults, choices. A planned
change regenerates the file (``python -m kasoku.cli.surface > tests/cli_surface.json``) and
shows up in review as its diff; an unplanned one fails here. Then the conventions every
sub-command keeps."""
import json
from pathlib import Path

import pytest

from kasoku.cli import build_parser
from kasoku.cli.surface import surface

PINNED = Path(__file__).with_name("cli_surface.json")


def test_the_surface_is_the_pinned_one():
    now = json.loads(json.dumps(surface(), sort_keys=True))
    pinned = json.loads(PINNED.read_text())
    for command in sorted(set(now) | set(pinned)):
        assert now.get(command) == pinned.get(command), (
            f"`{command}` changed; if that was planned: python -m kasoku.cli.surface > "
            f"{PINNED.relative_to(Path.cwd()) if PINNED.is_relative_to(Path.cwd()) else PINNED}")


def options(command: str) -> dict:
    return {flag: record for record in surface()[command] for flag in record["flags"]}


COMMANDS = [c for c in surface() if c.startswith("kasoku ") and c != "kasoku data"]


@pytest.mark.parametrize("command", COMMANDS)
def test_conventions(command):
    opts = options(command)
    if "--device" in opts:  # cuda when available, everywhere
        assert opts["--device"]["default"] == "auto" and opts["--device"]["type"] == "device"
    # every command that writes takes --out (kasoku run writes nothing: the script does)
    if command not in ("kasoku list", "kasoku run"):
        assert "--out" in opts
    for flag, record in opts.items():
        assert not flag.startswith("-") or flag.startswith("--") or flag in ("-h",), flag
        if record["type"] == "float":  # numbers go through the validating types
            pytest.fail(f"{command} {flag} takes a bare float: use a validating type")
    if "--threads" in opts:
        assert opts["--threads"]["type"] == "threads"  # bounded by the cores there are
    if "--batch-size" in opts:  # one value for a run, a comma list for a sweep
        want = "positive_int" if command in ("kasoku train", "kasoku profile") else "int_list"
        assert opts["--batch-size"]["type"] == want


def test_help_speaks_to_users():
    parser = build_parser()
    texts = [parser.format_help()]
    for action in parser._subparsers._group_actions:
        for sub in action.choices.values():
            texts.append(sub.format_help())
            for inner in getattr(sub, "_subparsers", None) and \
                    sub._subparsers._group_actions or []:
                texts += [p.format_help() for p in inner.choices.values()]
    text = "\n".join(texts)
    for internal in ("seed 00", "kasoku.accel", "kasoku.commands.", "AccelConfig"):
        assert internal not in text, internal
