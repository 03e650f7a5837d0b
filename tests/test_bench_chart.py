"""``kasoku bench``'s ladder chart (``plot_ladder``): each rung its own color in the legend,
a rung the machine skipped included (once drawn in the first rung's blue) and said not run."""
from __future__ import annotations

import pytest

from kasoku.commands.bench.report import plot_ladder


def _run(rung: str, rate: float, status: str = "ok") -> dict:
    record = {"rung": rung, "batch_size": 64, "status": status, "unit": "samples",
              "device": "cpu"}
    if status == "ok":
        record["figures"] = {"samples_per_s": {"median": rate, "min": 0.95 * rate,
                                               "max": 1.05 * rate}}
    return record


def test_a_skipped_rung_has_its_own_color_and_says_it_did_not_run(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure
    drawn = []
    saved = Figure.savefig
    monkeypatch.setattr(Figure, "savefig",
                        lambda self, *a, **k: (drawn.append(self), saved(self, *a, **k))[1])
    records = [_run("plain", 1000.0), _run("+bf16", 0.0, "skipped"), _run("+compile", 1500.0)]
    path = plot_ladder(records, tmp_path / "ladder.png", "mnist-mlp on a CPU")
    assert path.read_bytes()[:4] == b"\x89PNG"
    legend = drawn[0].axes[0].get_legend()
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels == ["plain", "+bf16 (not run)", "+compile"]
    colors = [tuple(h.get_facecolor()) for h in legend.legend_handles]
    assert len(set(colors)) == 3
