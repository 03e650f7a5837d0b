"""A rung's advice read beside the ladder: a run's own profiled window advises a lever, and
the next rung of the same sweep often is that lever, measured. Where it is, the advice says
what the next rung measured (``amended``): faster, within the noise, or slower; a lever the
next rung measured slower is not advised.
"""
from __future__ import annotations

from kasoku.advisor.levers import read_change
from kasoku.commands.bench.results import median_rate


def lever_settings(lever: dict) -> dict:
    """A saved lever's change as the ``AccelConfig`` fields it sets (``--precision bf16
    --channels-last`` -> ``{"precision": "bf16", "channels_last": True}``); {} for a lever
    that changes more than those (the rungs of a ladder differ only in them)."""
    change = read_change(lever)
    if any(not key.startswith("accel.") for key in change):
        return {}
    return {key.removeprefix("accel."): value for key, value in change.items()}


def _sets(config: dict | None, settings: dict) -> bool:
    """Whether ``config`` (a record's) has every one of ``settings`` on."""
    config = config or {}
    for key, value in settings.items():
        have = config.get(key)
        if value is True and not have or value is not True and str(have) != str(value):
            return False
    return True


def next_rung_measure(record: dict, following: dict | None) -> str | None:
    """What the next rung (``following``, at the same batch size) measured of the lever
    ``record``'s verdict advises, when that rung adds exactly it: ``"x0.89, slower"``,
    ``"~x1.02, within the noise"``, ``"x1.52, faster"``; None otherwise."""
    if following is None or following.get("status") != "ok":
        return None
    settings = lever_settings((record.get("verdict") or {}).get("lever") or {})
    if not settings or _sets(record.get("config"), settings) \
            or not _sets(following.get("config"), settings):
        return None
    a, b = record["figures"]["samples_per_s"], following["figures"]["samples_per_s"]
    ratio = median_rate(following) / median_rate(record)
    if b["max"] < a["min"]:
        return f"x{ratio:.2f}, slower"
    if b["min"] > a["max"]:
        return f"x{ratio:.2f}, faster"
    return f"~x{ratio:.2f}, within the noise"


def amended(record: dict, following: dict | None) -> str:
    """The verdict line of ``record``, with what the next rung measured of its advice; a
    lever measured slower is named as such instead of advised."""
    line = record["verdict"]["line"]
    measured = next_rung_measure(record, following)
    if measured is None:
        return line
    lever = record["verdict"]["lever"]
    flags = " ".join(lever["args"])
    if measured.endswith("slower"):
        head = line.split(" -> ")[0]
        return (f"{head} -> not {flags}: the next rung ({following['rung']}) measured it "
                f"{measured} here")
    return f"{line}; the next rung ({following['rung']}) measured it {measured}"
