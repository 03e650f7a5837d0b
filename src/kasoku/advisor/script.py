"""A script's verdict (``kasoku profile -- python SCRIPT.py``), typed: the ``Verdict`` judged
once from the window's figures, its lever and ``tried`` the script's advice once its levers are
measured (``kasoku.commands.script_ab``), and what only a script's verdict has: the levers that
need an edit to the script, whether any lever was measured, the proofs of the bound left
unconfirmed. Carried as an object from ``judge`` until ``profile.json`` holds its ``to_dict``;
``from_dict`` reads a saved one back (the A/B runs of a script under torchrun, made from the
launching process).
"""
from __future__ import annotations

from dataclasses import dataclass

from kasoku.advisor.levers import Lever
from kasoku.advisor.verdict import Verdict


@dataclass
class ScriptVerdict:
    verdict: Verdict
    """The rule, its reason, its lever (the advice, once advised), what was tried."""
    edits: list[Lever] | None = None
    """The script's levers that need an edit to it (said, not measured); None until
    advised."""
    measured: bool | None = None
    """Whether any lever was measured; None until advised."""
    unconfirmed: list[str] | None = None
    """The labels of the ``--confirm`` experiments that need an edit to the script; None
    without ``--confirm``."""

    @property
    def rule(self) -> str:
        return self.verdict.rule

    @property
    def lever(self) -> Lever:
        return self.verdict.lever

    @property
    def line(self) -> str:
        return self.verdict.line

    def to_dict(self) -> dict:
        """The verdict's ``to_dict``, then ``edits`` (each its text and expected effect),
        ``measured`` and ``unconfirmed`` where set: ``profile.json``'s ``verdict``."""
        out = self.verdict.to_dict()
        if self.edits is not None:
            out["edits"] = [{"text": e.text, "expect": e.expect} for e in self.edits]
        if self.measured is not None:
            out["measured"] = self.measured
        if self.unconfirmed is not None:
            out["unconfirmed"] = list(self.unconfirmed)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "ScriptVerdict":
        """``to_dict`` read back (an edit as its text and expected effect)."""
        edits = d.get("edits")
        unconfirmed = d.get("unconfirmed")
        return cls(Verdict.from_dict(d),
                   None if edits is None else [Lever(e["text"], e["expect"]) for e in edits],
                   d.get("measured"), None if unconfirmed is None else list(unconfirmed))
