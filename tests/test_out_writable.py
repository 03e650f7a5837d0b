"""An output folder that cannot take files (a file, a path under a file, a read-only or
unpermitted folder) is refused in one line, exit 2, before any work, by every command that
writes; a data-parallel run refuses it in the launching process, before its workers start."""
import importlib
import os
import subprocess
import sys

import pytest

from kasoku.cli import main
from kasoku.core.errors import ConfigError
from kasoku.train.run_dir import check_writable

# Tiny settings: were the check missing, each would start its work (the engines are replaced
# by a sentinel below, so the test fails at once instead of running it).
COMMANDS = {
    "train": ["train", "sine-lstm", "--synthetic-size", "200", "--batch-size", "50",
              "--no-progress", "--threads", "1"],
    "train --procs": ["train", "sine-lstm", "--synthetic-size", "200", "--batch-size", "50",
                      "--no-progress", "--threads", "1", "--procs", "2"],
    "profile": ["profile", "sine-lstm", "--synthetic-size", "200", "--batch-size", "50"],
    "bench": ["bench", "mnist-mlp", "--device", "cpu", "--batch-size", "8", "--steps", "2"],
    "compare": ["compare", "mnist-mlp", "--devices", "cpu"],
    "data bench": ["data", "bench", "mnist-mlp", "--synthetic"],
    "allreduce-bench": ["allreduce-bench", "--procs", "2"],
    "scale": ["scale", "mnist-mlp", "--procs", "1,2"],
    "data make-jpeg": ["data", "make-jpeg", "--count", "2", "--classes", "1",
                       "--resolution", "16x16"],
    "data download": ["data", "download", "mnist"],
}
# Where each command looks its engine up when it runs (most import it then, from its module).
ENGINES = [("kasoku.commands.train", "train_run"), ("kasoku.cli.train", "launch"),
           ("kasoku.commands.profile", "profile_run"), ("kasoku.cli.profile", "launch"),
           ("kasoku.commands.bench.sweep", "run_sweep"),
           ("kasoku.commands.bench.compare", "run_compare"),
           ("kasoku.commands.bench.compare_train", "train_on_devices"),
           ("kasoku.commands.bench.data_bench", "run_data_bench"),
           ("kasoku.cli.allreduce_bench", "run_allreduce_bench"),
           ("kasoku.commands.scale", "run_scale"), ("kasoku.data.jpeg_synth", "make_jpeg_folder"),
           ("kasoku.data.download", "fetch_dataset")]


def _writes(folder) -> bool:
    """Whether a file can be created in ``folder`` (root writes through permissions)."""
    try:
        with open(os.path.join(folder, ".probe"), "w"):
            pass
    except OSError:
        return False
    os.unlink(os.path.join(folder, ".probe"))
    return True


def _read_only_path() -> str:
    """A path in a folder that refuses new files even to root (/sys, /proc)."""
    for parent in ("/sys", "/proc"):
        if os.path.isdir(parent) and not _writes(parent):
            return os.path.join(parent, "kasoku-out")
    pytest.skip("no folder here refuses new files to this user")


class WorkStarted(Exception):
    pass


def _started(name):
    def engine(*args, **kwargs):
        raise WorkStarted(name)
    return engine


@pytest.fixture
def no_work(monkeypatch):
    """Every command's engine replaced by one that raises ``WorkStarted``. The modules that
    bind an engine by name when first imported are imported before, so none keeps the fake
    after the test (compare's trainer, when a later test of the same process imports it)."""
    for module in ("kasoku.commands.bench.compare_train", "kasoku.cli.train_worker"):
        importlib.import_module(module)
    for module, name in ENGINES:
        monkeypatch.setattr(importlib.import_module(module), name, _started(name))


@pytest.fixture
def unpermitted(tmp_path):
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o555)
    if _writes(folder):
        folder.chmod(0o755)
        pytest.skip("permissions do not stop this user's writes (root)")
    yield folder
    folder.chmod(0o755)


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("kasoku: error: "), err
    return lines[0]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", ["file", "under a file", "read-only", "no permission"])
def test_an_unwritable_out_is_one_line_before_any_work(command, case, tmp_path, no_work,
                                                       capsys, request):
    file = tmp_path / "file"
    file.write_text("kept")
    out = {"file": lambda: file, "under a file": lambda: file / "sub",
           "read-only": _read_only_path,
           "no permission": lambda: request.getfixturevalue("unpermitted") / "run"}[case]()
    assert main([*COMMANDS[command], "--out", str(out)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"--out {out}" in line
    assert ("a file" in line) if case in ("file", "under a file") else \
        ("choose a folder you can write to" in line)
    assert file.read_text() == "kept"
    assert out == file or not os.path.exists(out)


@pytest.mark.parametrize("command", ["bench", "train", "data bench"])
def test_the_default_folder_in_an_unwritable_cwd_is_refused(command, no_work, capsys,
                                                             monkeypatch):
    monkeypatch.chdir(os.path.dirname(_read_only_path()))
    assert main(COMMANDS[command]) == 2
    assert "give --out a folder you can write to" in _one_error_line(capsys.readouterr().err)


def test_a_writable_out_passes_and_nothing_is_left(tmp_path, no_work):
    check_writable(tmp_path / "a" / "b")
    check_writable(tmp_path)
    assert list(tmp_path.iterdir()) == []  # neither the folder nor the probe file
    with pytest.raises(WorkStarted, match="run_sweep"):
        main([*COMMANDS["bench"], "--out", str(tmp_path / "a" / "b")])


def test_check_writable_names_the_folder_that_refuses(tmp_path, unpermitted):
    with pytest.raises(ConfigError, match=f"cannot create the folder \\({unpermitted}: "):
        check_writable(unpermitted / "x" / "y")
    with pytest.raises(ConfigError, match="cannot write in the folder"):
        check_writable(unpermitted)


@pytest.mark.parametrize("argv", [COMMANDS["bench"], COMMANDS["train --procs"]],
                         ids=["bench", "train --procs 2"])
def test_a_real_process_refuses_in_one_line(argv, tmp_path):
    """The issue's cases as a user meets them: bench used to measure its peaks and first rung
    and then die in a traceback; a data-parallel run must refuse once, not once per worker."""
    out = _read_only_path()
    proc = subprocess.run([sys.executable, "-m", "kasoku", *argv, "--out", out],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          check=False)
    assert proc.returncode == 2, proc.stderr
    assert f"--out {out}: cannot create the folder" in _one_error_line(proc.stderr)
    assert proc.stdout == ""  # no peak, rung or run header: nothing started
    assert list(tmp_path.iterdir()) == []
