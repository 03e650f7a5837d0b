"""``kasoku train|bench FILE.py:NAME``: a user's own workload, from the documented example in
examples/ and from files written here, through the same commands as the built-in ones."""
import json
from pathlib import Path

import pytest

from kasoku.cli import main
from kasoku.core.errors import ConfigError
from kasoku.workloads import Workload, create_workload

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "stripes_cnn.py"


def test_the_example_is_a_workload_by_class_and_by_function():
    wl = create_workload(f"{EXAMPLE}:StripesCNN")
    assert isinstance(wl, Workload) and wl.name == "StripesCNN" and wl.sample_unit == "images"
    wide = create_workload(f"{EXAMPLE}:wide_stripes_cnn", epochs=1)
    assert wide.width == 32 and wide.recipe.epochs == 1


def test_train_the_example_learns_and_resumes(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", f"{EXAMPLE}:StripesCNN", "--synthetic-size", "256", "--batch-size", "32",
            "--no-progress", "--threads", "1", "--out", str(out)]
    assert main([*args, "--epochs", "1"]) == 0
    assert main([*args[:-2], "--epochs", "3", "--resume", str(out)]) == 0
    log = [json.loads(line) for line in open(out / "log.jsonl")]
    assert [e["epoch"] for e in log] == [1, 2, 3]
    assert log[-1]["validation/main/accuracy"] > 0.8  # stripes are easy to tell apart
    assert "# StripesCNN" in capsys.readouterr().err


@pytest.mark.slow  # a bench sweep of the example: about 15 s on 2 cores
def test_bench_the_example_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["bench", f"{EXAMPLE}:StripesCNN", "--device", "cpu", "--batch-size", "16",
                 "--config", "+fused", "--steps", "2", "--windows", "1", "--warmup", "1",
                 "--numerics-steps", "2", "--threads", "1", "--peak-size", "64", "--out",
                 str(out)]) == 0
    records = [json.loads(line) for line in open(out / "results.jsonl")]
    assert {r["rung"] for r in records} == {"plain", "+fused"}
    assert all(r["status"] == "ok" and r["unit"] == "images" for r in records)
    assert "images/s" in capsys.readouterr().out


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "mine.py"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, name, message", [
    ("x = 1\n", "Missing", "defines no 'Missing'"),
    ("x = 1\n", "x", "not a kasoku Workload \\(it gave a value of type int\\)"),
    ("raise RuntimeError('broken on import')\n", "W", "running .* failed \\(RuntimeError"),
    ("def W():\n    raise ValueError('no')\n", "W", "calling W\\(\\) failed"),
])
def test_a_file_that_gives_no_workload_is_a_clear_error(tmp_path, text, name, message):
    with pytest.raises(ConfigError, match=message):
        create_workload(f"{write(tmp_path, text)}:{name}")


def test_a_missing_file_is_one_line_from_the_command_line(tmp_path, capsys):
    assert main(["train", f"{tmp_path}/none.py:W"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such file" in err


def test_a_workload_that_builds_nothing_says_what_to_define(tmp_path, capsys):
    path = write(tmp_path, "from kasoku import Workload\n\nclass Empty(Workload):\n    pass\n")
    assert main(["train", f"{path}:Empty"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "does not define build_model() or build_datasets()" in err
