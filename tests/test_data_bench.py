"""``kasoku data bench``: loaders measured alone and against a model, on real JPEG files and real
worker processes; and ``kasoku.perf.cpu`` on a real busy child process."""
import io
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from kasoku.cli import main
from kasoku.commands.bench.data_bench import DataBenchRequest, expand_loaders, run_data_bench
from kasoku.commands.bench.data_report import verdict
from kasoku.commands.bench.data_sources import prepare_jpeg_folders
from kasoku.core.errors import ConfigError
from kasoku.data.config import DataConfig
from kasoku.data.jpeg_synth import make_jpeg_folder
from kasoku.perf.cpu import busy_cores, cpu_seconds, process_cpu_seconds

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NUM_IMAGES, BATCH = 48, 4  # 12 batches per epoch


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("jpegs") / "small"
    make_jpeg_folder(folder, NUM_IMAGES, 64, 48, num_classes=4, progress=False)
    return folder


def _bench(out, **kwargs) -> tuple:
    stream, progress = io.StringIO(), io.StringIO()
    settings = dict(out=out, batch_sizes=(BATCH,), image_size=16, warmup=1, batches=2, windows=3,
                    device="cpu")
    result = run_data_bench(DataBenchRequest(**{**settings, **kwargs}), stream, progress)
    return result, stream.getvalue(), progress.getvalue()


def test_loader_list_expands_bare_numbers_to_the_kind_before():
    assert expand_loaders("multiprocess:1,2,4") == ["multiprocess:1", "multiprocess:2",
                                                    "multiprocess:4"]
    assert expand_loaders("serial, multiprocess:1,2,8,threads:4,2,device") == [
        "serial", "multiprocess:1", "multiprocess:2", "multiprocess:8", "threads:4",
        "threads:2", "device"]
    with pytest.raises(ConfigError, match="continues no loader"):
        expand_loaders("4,serial")
    with pytest.raises(ConfigError, match="the serial loader takes no :N"):
        expand_loaders("serial,2")
    with pytest.raises(ConfigError, match="unknown loader 'procs:2'"):
        expand_loaders("procs:2")
    with pytest.raises(ConfigError, match="names no loader"):
        expand_loaders(" , ")


def test_cpu_seconds_of_a_busy_child_process():
    burn = ("import sys, time\nt = time.process_time()\n"
            "while time.process_time() - t < 0.3: pass\n"
            "print('done', flush=True)\nsys.stdin.read()\n")
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        before, t0 = cpu_seconds([child.pid]), time.perf_counter()
        assert child.stdout.readline().strip() == "done"
        after, wall_s = cpu_seconds([child.pid]), time.perf_counter() - t0
        used = after[child.pid] - before[child.pid]
        assert 0.25 <= used <= wall_s + 0.02  # 10 ms clock ticks
        assert busy_cores(before, after, wall_s) == pytest.approx(used / wall_s)
    finally:
        child.stdin.close()
        child.wait(timeout=10)
    assert process_cpu_seconds(child.pid) is None  # gone: left out, not an error
    assert busy_cores(before, cpu_seconds([child.pid]), 1.0) == 0.0


def test_cpu_seconds_of_this_process_count_its_work():
    start = process_cpu_seconds()
    t = time.process_time()
    while time.process_time() - t < 0.05:
        pass
    assert process_cpu_seconds(os.getpid()) - start >= 0.05


def test_loaders_alone_on_a_jpeg_folder(jpegs, tmp_path):
    # 1 + 11 warm-up batches are epoch 0; the 3 windows of 4 batches are exactly epoch 1, so
    # the bytes delivered are every file once.
    result, table, progress = _bench(tmp_path, sources=(str(jpegs),), warmup=11, batches=4,
                                     loaders=("serial", "threads:2", "multiprocess:1",
                                              "multiprocess:2"))
    assert result.exit_code == 0
    files = [p.stat().st_size for p in jpegs.glob("class_*/*.jpg")]
    lines = [json.loads(s) for s in open(tmp_path / "data_bench.jsonl")]
    assert lines == json.loads(json.dumps(result.records))
    assert [r["loader"] for r in lines] == ["serial", "threads:2", "multiprocess:1",
                                            "multiprocess:2"]
    for r in lines:
        f = r["figures"]
        assert r["schema"] == "kasoku.data_bench/1" and r["status"] == "ok", r["error"]
        assert r["resolution"] == "64x48" and r["settings"]["num_samples"] == NUM_IMAGES
        assert 0 < f["images_per_s"]["min"] <= f["images_per_s"]["median"] \
            <= f["images_per_s"]["max"] \
                and f["images_per_s"]["n"] == 3 + f["stability"]["extra_windows"]
        assert f["bytes_basis"] == "file"
        # Windows beyond the 3 (taken when they disagree, on a busy machine) read into the
        # next epoch: then the images read are not every file once, only files of this folder.
        exact = f["stability"]["extra_windows"] == 0
        assert f["bytes_per_image"] == pytest.approx(np.mean(files), rel=1e-9 if exact else 0.2)
        assert min(files) <= f["bytes_per_image"] <= max(files)
        assert f["mb_per_s"] * 1e6 / f["images_per_s"]["median"] == \
            pytest.approx(np.mean(files), rel=0.01 if exact else 0.2)
        assert f["cpu_cores"] > 0 and 0 < f["cpu_percent"] <= 100
        assert f["first_batch_s"] > 0 and f["warmup_s"] > 0
        assert r["env"]["cpu_count"] == os.cpu_count()
    assert "multiprocess:2" in table and "MB/s" in table
    assert "[4/4] small (64x48) multiprocess:2 bs 4:" in progress
    assert (tmp_path / "data_bench.png").read_bytes()[:8] == PNG_MAGIC


def test_bytes_follow_the_loader_order_exactly(jpegs, tmp_path):
    from kasoku.data.imagefolder import ImageFolder
    from kasoku.data.loader import SerialLoader
    result, _, _ = _bench(tmp_path, sources=(str(jpegs),), loaders=("serial",))
    sizes = np.array([p.stat().st_size for p, _ in ImageFolder(jpegs, train=True).samples])
    loader = SerialLoader(range(NUM_IMAGES), BATCH, seed=0, drop_last=True)
    f = result.records[0]["figures"]
    batches = 2 * f["images_per_s"]["n"]  # windows of 2 batches, more where they disagreed
    # after the first batch and the warm-up one, in the loader's order across epochs
    order = np.concatenate([loader.epoch_indices(e).numpy() for e in range(3)])
    taken = order[(1 + 1) * BATCH:(1 + 1 + batches) * BATCH]
    assert f["bytes_per_image"] == pytest.approx(sizes[taken].mean(), rel=1e-12)


def test_a_failing_loader_is_recorded_and_the_sweep_goes_on(jpegs, tmp_path):
    result, table, progress = _bench(tmp_path, sources=(str(jpegs),),
                                     loaders=("device", "serial"))
    failed, ok = result.records
    assert failed["status"] == "error" and "in-memory" in failed["error"]
    assert "images_per_s" not in failed["figures"]
    assert ok["status"] == "ok" and result.exit_code == 1
    assert "ERROR" in progress and "error" in table


def test_loaders_against_a_model_on_cpu(tmp_path):
    result, table, progress = _bench(
        tmp_path, sources=("mnist-mlp",), loaders=("serial", "device"), model="mnist-mlp",
        batch_sizes=(20,), image_size=None,
        data=DataConfig(synthetic=True, synthetic_train_size=200))
    assert result.exit_code == 0, [r["error"] for r in result.records]
    for r in result.records:
        f = r["figures"]
        assert f["bytes_basis"] == "stored sample" and f["bytes_per_image"] == 784
        assert f["model_synthetic_images_per_s"]["median"] > 0
        assert f["fed_images_per_s"]["median"] > 0 and f["fed_images_per_s"]["n"] == 3
        assert f["margin"] == pytest.approx(
            f["images_per_s"]["median"] / f["model_synthetic_images_per_s"]["median"])
        assert f["fed_fraction"] > 0
        assert r["model"]["workload"] == "mnist-mlp" and r["model"]["config"]["kind"] == "kasoku"
    assert "fed samples/s" in table and "mnist-mlp on synthetic" in table
    assert (tmp_path / "data_bench.png").read_bytes()[:8] == PNG_MAGIC


def test_each_batch_size_has_a_model_build_of_its_own(tmp_path, monkeypatch):
    # A CUDA graph holds one batch shape, and the step is compiled for its own shapes: one
    # build serving several batch sizes ran the later ones outside its graph. Each build sees
    # batches of one size only, measured on synthetic batches and then fed.
    from kasoku.commands.bench import data_measure
    real, builds = data_measure.make_runner, []

    def recording(*args, **kwargs):
        runner, sizes = real(*args, **kwargs), set()
        builds.append(sizes)

        def run(batches):
            def seen():
                for x, y in batches:
                    sizes.add(len(x))
                    yield x, y
            return runner(seen())
        return run
    monkeypatch.setattr(data_measure, "make_runner", recording)
    result, _, progress = _bench(
        tmp_path, sources=("mnist-mlp",), loaders=("serial", "device"), model="mnist-mlp",
        batch_sizes=(10, 20), image_size=None,
        data=DataConfig(synthetic=True, synthetic_train_size=200))
    assert result.exit_code == 0, [r["error"] for r in result.records]
    assert builds == [{10}, {20}]
    assert [r["batch_size"] for r in result.records] == [10, 10, 20, 20]
    assert all(r["figures"]["fed_images_per_s"]["median"] > 0 for r in result.records)
    assert progress.index("bs 10 on synthetic") < progress.index("serial bs 10") \
        < progress.index("bs 20 on synthetic") < progress.index("serial bs 20")


def test_a_source_of_another_shape_than_the_model_is_refused(jpegs, tmp_path):
    with pytest.raises(ConfigError, match=r"shape \(3, 224, 224\).*mnist-mlp takes"):
        _bench(tmp_path, sources=(str(jpegs),), model="mnist-mlp", image_size=None)


def test_generated_folders_are_made_once_and_reused(tmp_path):
    said = []
    first = prepare_jpeg_folders(tmp_path, [(32, 24)], 6, say=said.append)
    assert first == [tmp_path / "32x24"] and said[-1].startswith("making 6 JPEG images")
    stamp = {p: p.stat().st_mtime_ns for p in first[0].glob("class_*/*.jpg")}
    assert len(stamp) == 6
    assert prepare_jpeg_folders(tmp_path, [(32, 24)], 4, say=said.append) == first
    assert said[-1].startswith("reusing") and \
        stamp == {p: p.stat().st_mtime_ns for p in first[0].glob("class_*/*.jpg")}
    prepare_jpeg_folders(tmp_path, [(32, 24)], 8, say=said.append)  # too few: made again
    assert said[-1].startswith("making 8") and len(list(first[0].glob("class_*/*.jpg"))) == 8


def test_cli_end_to_end(tmp_path, capsys):
    out = tmp_path / "out"
    args = ["data", "bench", "--resolution", "32x24", "--images", "12", "--loader",
            "serial,multiprocess:1", "--batch-size", "4", "--image-size", "16",
            "--warmup", "0", "--batches", "2", "--device", "cpu", "--out", str(out)]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "making 12 JPEG images of 32x24" in captured.err
    assert "[2/2] 32x24 multiprocess:1 bs 4" in captured.err and "multiprocess:1" in captured.out
    assert len(list((out / "jpeg" / "32x24").glob("class_*/*.jpg"))) == 12
    records = [json.loads(s) for s in open(out / "data_bench.jsonl")]
    assert [(r["status"], r["source_kind"]) for r in records] == [("ok", "generated")] * 2

    assert main(["data", "bench", "--report", "--out", str(out)]) == 0
    assert "32x24" in capsys.readouterr().out
    assert (out / "data_bench.png").read_bytes()[:8] == PNG_MAGIC


def test_prefetch_reaches_the_loaders_that_make_batches_ahead(jpegs, tmp_path):
    result, _, _ = _bench(tmp_path, sources=(str(jpegs),), prefetch=3,
                          loaders=("serial", "multiprocess:1", "threads:2"))
    assert result.exit_code == 0
    assert [r["figures"]["prefetch_batches"] for r in result.records] == [None, 3, 3]


@pytest.mark.parametrize("argv, message", [
    (["nowhere"], "neither a folder nor a workload"),
    (["mnist-mlp", "--loader", "serial,fast:2"], "unknown loader 'fast:2'"),
    (["mnist-mlp", "--precision", "bf16"], "give --model"),
    ([], "give a SOURCE"),
    (["mnist-mlp", "--synthetic", "--synthetic-size", "10", "--batch-size", "20"],
     "less than one batch of 20"),
])
def test_cli_errors_are_clear(argv, message, tmp_path, capsys):
    assert main(["data", "bench", *argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_prefetch_must_be_positive(tmp_path, capsys):
    assert main(["data", "bench", "mnist-mlp", "--prefetch", "0", "--out", str(tmp_path)]) == 2
    assert "whole number >= 1, got '0'" in capsys.readouterr().err


def test_process_loaders_get_windows_long_enough_for_their_workers():
    from kasoku.commands.bench.data_measure import scaled_to_workers as _scaled_to_workers
    req = DataBenchRequest(warmup=3, batches=10)
    assert _scaled_to_workers(req, "serial") is req
    two = _scaled_to_workers(req, "multiprocess:2")  # warm-up 2N = 4, windows 4N = 8 < 10
    assert (two.warmup, two.batches) == (4, 10)
    long = _scaled_to_workers(req, "multiprocess:16")
    assert (long.warmup, long.batches) == (32, 64)


def test_cores_busy_never_exceed_the_cores_there_are(jpegs, tmp_path, monkeypatch):
    # /proc counts CPU time in clock ticks: a window's reading can overshoot (2.10 cores of 2).
    import kasoku.perf.cpu as cpu
    monkeypatch.setattr(cpu, "busy_cores", lambda *a: cpu.usable_cores() + 0.1)
    result, table, _ = _bench(tmp_path, sources=(str(jpegs),), loaders=("serial",))
    f = result.records[0]["figures"]
    assert f["cpu_cores"] == cpu.usable_cores() and f["cpu_percent"] == 100
    assert "(100%)" in table


def test_an_error_is_said_whole_under_the_table_and_no_chart_is_said_as_none(jpegs, tmp_path):
    result, table, _ = _bench(tmp_path, sources=(str(jpegs),), loaders=("device",))
    (failed,) = result.records
    assert failed["status"] == "error" and len(failed["error"]) > 60
    assert f"bs {BATCH}: {failed['error']}\n" in table  # the whole message, not its first 60
    assert "chart: none (no loader was measured)" in table and "None" not in table


def test_the_loader_against_the_model_claims_nothing_inside_the_noise():
    def figures(loader, model):
        rate = {"median": sum(loader) / 2, "min": loader[0], "max": loader[1]}
        synthetic = {"median": sum(model) / 2, "min": model[0], "max": model[1]}
        return {"images_per_s": rate, "model_synthetic_images_per_s": synthetic,
                "margin": rate["median"] / synthetic["median"]}
    assert verdict(figures((900, 1100), (1950, 2050)), "cuda") == "x0.5: the GPU waits 50%"
    assert verdict(figures((2900, 3100), (950, 1050)), "cpu") == "x3.0: keeps up"
    assert verdict(figures((900, 1300), (1000, 1200)), "cuda") == \
        "~x1.0: within the noise of the model's rate"


def test_the_charts_markers_say_their_batch_size_and_source_where_several(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    from kasoku.commands.bench.data_report import plot_data_bench
    texts, real = [], Axes.annotate

    def annotate(self, text, *args, **kwargs):
        texts.append(text)
        return real(self, text, *args, **kwargs)
    monkeypatch.setattr(Axes, "annotate", annotate)

    def record(source, loader, bs):
        return {"status": "ok", "source_label": source, "loader": loader, "batch_size": bs,
                "figures": {"images_per_s": {"median": 100.0, "min": 90.0, "max": 110.0}},
                "env": {"cpu_name": "cpu", "cpu_count": 2}}
    plot_data_bench([record("a", "serial", 8)], tmp_path / "one.png")
    assert texts == ["serial"]
    texts.clear()
    plot_data_bench([record("a", "serial", 8), record("a", "device", 16)], tmp_path / "two.png")
    assert texts == ["serial (bs 8)", "device (bs 16)"]
    texts.clear()
    plot_data_bench([record("a", "serial", 8), record("b", "serial", 8)], tmp_path / "src.png")
    assert texts == ["serial (a)", "serial (b)"]
    assert (tmp_path / "src.png").read_bytes()[:8] == PNG_MAGIC
