"""Bad input files, one rule for every loader (``kasoku.data.bad_files``), on real JPEG files: a
truncated JPEG (a real one cut in half), a text file named ``.jpg``, an empty file. Every loader
that runs on this CPU skips the same files with the same reasons; ``kasoku train`` lists each one,
with its reason, in ``bad_files.jsonl``, without a traceback; ``data bench`` says where its list
is. The GPU decoders cannot run here: their ``load`` is checked with the library call replaced."""
import io
import json
import os
import signal
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile
from torch import nn

from kasoku.cli import main
from kasoku.core.errors import DataError, reset_warnings
from kasoku.data import jpeg_decoders
from kasoku.data.bad_files import (
    BAD_FILES,
    BadFile,
    BadFileList,
    BadFileWriter,
    check_file,
    read_checked,
    truncation,
)
from kasoku.data.imagefolder import ImageFolder
from kasoku.data.registry import create_loader, list_loaders, loader_kind
from kasoku.train import Trainer, TrainingInterrupted
from kasoku.train.extensions import BadFileLog

BAD = {"cut.jpg": "truncated", "notes.jpg": "not an image", "empty.jpg": "empty"}
"""The bad files each folder of these tests holds, and why each is bad."""


def jpeg_bytes(seed: int, size=(24, 20), fmt="JPEG") -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


def write_folder(root, per_class=4, classes=3):
    """``per_class`` good JPEGs in each class folder (one of them with NUL padding after its
    end, which is good), and the files of ``BAD`` spread over the classes."""
    for c in range(classes):
        (root / f"class_{c}").mkdir(parents=True)
        for i in range(per_class):
            (root / f"class_{c}" / f"img_{i}.jpg").write_bytes(jpeg_bytes(10 * c + i))
    (root / "class_0" / "padded.jpg").write_bytes(jpeg_bytes(99) + b"\0" * 600)
    whole = jpeg_bytes(7, size=(64, 48))
    (root / "class_0" / "cut.jpg").write_bytes(whole[:len(whole) // 2])
    (root / "class_1" / "notes.jpg").write_text("this is not a jpeg\n")
    (root / f"class_{classes - 1}" / "empty.jpg").write_bytes(b"")
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("bad") / "images")


def listed(path) -> list[dict]:
    """The lines of a ``bad_files.jsonl``."""
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def named(records) -> dict:
    return {r.path.rsplit("/", 1)[-1]: r.reason for r in records}


# -- the rule -------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_a_whole_image_passes_and_any_cut_of_it_is_truncated(fmt):
    data = jpeg_bytes(1, fmt=fmt)
    truncation(data, "x")
    truncation(data + b"\0" * 1000, "x")  # padding after the end is allowed
    for cut in (len(data) // 2, len(data) - 1, 20):
        with pytest.raises(BadFile, match="truncated") as caught:
            truncation(data[:cut], "x")
        assert caught.value.reason == "truncated" and caught.value.path == "x"
        with pytest.raises(BadFile):  # padding does not make a cut file whole
            truncation(data[:cut] + b"\0" * 300, "x")


def verdict(check, *args) -> str | None:
    """The reason ``check(*args)`` gives (its ``BadFile``'s), None when it passes."""
    try:
        check(*args)
    except BadFile as bad:
        return bad.reason
    return None


def test_the_rule_reads_bytes_arrays_and_files_alike(tmp_path):
    """``truncation`` on bytes (Pillow), on a uint8 array (torchvision's byte tensor) and
    ``check_file`` on the file (nvImageCodec) give the same verdict, padding of any length
    included."""
    whole = jpeg_bytes(2, size=(80, 60))
    cases = {"whole": whole, "cut": whole[:len(whole) // 2], "padded": whole + b"\0" * 5000,
             "cut-padded": whole[:700] + b"\0" * 5000, "tiny": whole[:3], "text": b"hello",
             "empty": b""}
    for name, data in cases.items():
        path = tmp_path / f"{name}.jpg"
        path.write_bytes(data)
        verdicts = [verdict(truncation, data, path),
                    verdict(truncation, np.frombuffer(data, dtype=np.uint8), path),
                    verdict(check_file, path), verdict(read_checked, path)]
        expected = {"cut": "truncated", "cut-padded": "truncated", "tiny": "truncated",
                    "empty": "empty"}.get(name)
        assert verdicts == [expected] * 4, name


def test_a_missing_file_is_unreadable_and_bad_files_pickle(tmp_path):
    with pytest.raises(BadFile, match="unreadable: No such file") as caught:
        read_checked(tmp_path / "gone.jpg")
    assert isinstance(caught.value, DataError)
    with pytest.raises(BadFile, match="unreadable"):
        check_file(tmp_path / "gone.jpg")
    import pickle
    again = pickle.loads(pickle.dumps(caught.value))  # as a loader worker sends it back
    assert (again.path, again.reason, str(again)) == (caught.value.path, caught.value.reason,
                                                      str(caught.value))


def test_pillow_decodes_a_truncated_jpeg_yet_every_loader_skips_it(folder, monkeypatch):
    """The disagreement the rule ends: with LOAD_TRUNCATED_IMAGES Pillow decodes the cut file
    (as nvJPEG does), without it Pillow refuses it; ImageFolder skips it either way."""
    cut = (folder / "class_0" / "cut.jpg").read_bytes()
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    Image.open(io.BytesIO(cut)).load()  # decoded: the rule, not Pillow, decides
    dataset = ImageFolder(folder, train=False, image_size=8)
    index = [p.name for p, _ in dataset.samples].index("cut.jpg")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dataset[index]
    assert named(dataset.bad_files) == {"cut.jpg": "truncated"}


def test_the_gpu_decoders_load_applies_the_rule(folder):
    """torchvision's and nvImageCodec's ``load`` (the library calls replaced: no GPU here)
    refuse the truncated and the empty file before their decoder sees them."""
    seen = []
    torchvision = object.__new__(jpeg_decoders._TorchvisionDecoder)
    torchvision._read = lambda p: torch.tensor(list(Path(p).read_bytes()), dtype=torch.uint8)
    nvimgcodec = object.__new__(jpeg_decoders._NvImgCodecDecoder)
    nvimgcodec._nv = types.SimpleNamespace(CodeStream=lambda p: seen.append(p) or p)
    for decoder in (torchvision, nvimgcodec):
        for name, reason in (("cut.jpg", "truncated"), ("empty.jpg", "empty")):
            path = next(folder.glob(f"class_*/{name}"))
            with pytest.raises(BadFile) as caught:
                decoder.load(path)
            assert caught.value.reason == reason
        assert decoder.load(folder / "class_0" / "padded.jpg") is not None
    assert seen == [str(folder / "class_0" / "padded.jpg")]


# -- every loader -----------------------------------------------------------------------------

CPU_LOADERS = [name for name in list_loaders() if loader_kind(name).needs != "in-memory"]
"""Every registered kind that reads an image folder (all but ``device``, which needs tensors)."""
SETTINGS = {"threads": "threads:2", "multiprocess": "multiprocess:2",
            "gpu-jpeg": "gpu-jpeg:2", "gpu-jpeg-procs": "gpu-jpeg-procs:2"}


@pytest.mark.parametrize("name", CPU_LOADERS)
def test_every_loader_skips_the_same_files_for_the_same_reasons(name, folder):
    dataset = ImageFolder(folder, train=True, image_size=8, seed=1)
    loader = create_loader(SETTINGS.get(name, name), dataset, 4, "cpu", seed=2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            batches = [next(loader) for _ in range(2 * loader.batches_per_epoch)]
        assert all(len(b[0]) == 4 for b in batches)  # replaced: no batch is short
        assert named(loader.skipped_records) == BAD
        assert loader.skipped == len(BAD) == len(loader.bad_file_list)  # once each, 2 epochs
    finally:
        getattr(loader, "close", lambda: None)()


def test_the_first_bad_file_is_warned_naming_the_list():
    reset_warnings()
    bad = BadFileList()
    bad.listed_in = "runs/r/bad_files.jsonl"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert bad.add("/d/a.jpg", "truncated") and bad.add("/d/b.jpg", "empty")
        assert not bad.add("/d/a.jpg", "truncated")
    assert [str(w.message) for w in caught] == [
        ("skipping bad file /d/a.jpg (truncated): its samples are replaced by the next good "
         "image; every bad file is listed, with its reason, in runs/r/bad_files.jsonl "
         "(--strict-data makes a bad file an error)")]
    assert [(r.path, r.reason) for r in bad] == [("/d/a.jpg", "truncated"),
                                                 ("/d/b.jpg", "empty")]


def test_writers_of_one_list_never_repeat_a_path(tmp_path):
    """Two writers (two workers of a data-parallel run) append to one file; each path once."""
    first, second = BadFileWriter(tmp_path / BAD_FILES), BadFileWriter(tmp_path / BAD_FILES)
    assert first.append([{"path": "/a", "reason": "empty"}, {"path": "/b", "reason": "x"}]) == 2
    assert second.append([{"path": "/b", "reason": "x"}, {"path": "/c", "reason": "y"}]) == 1
    assert first.append([{"path": "/c", "reason": "y"}]) == 0
    lines = listed(tmp_path / BAD_FILES)
    assert [d["path"] for d in lines] == ["/a", "/b", "/c"]
    assert first.count() == second.count() == 3


# -- the training run ----------------------------------------------------------------------

WORKLOAD = '''
from torch import nn
from kasoku import Recipe, Workload
from kasoku.data.imagefolder import imagefolder_datasets

class TinyFolder(Workload):
    recipe = Recipe(optimizer="sgd", lr=0.01, batch_size=4, epochs=2)
    cpu_threads = 1

    def build_model(self):
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 3))

    def build_datasets(self, data, seed=0):
        return imagefolder_datasets(data.root, image_size=8, seed=seed, strict=data.strict)
'''


@pytest.fixture(scope="module")
def split_folder(tmp_path_factory):
    """ROOT/train and ROOT/val, each holding the bad files of ``BAD``, and a workload file."""
    root = tmp_path_factory.mktemp("split")
    write_folder(root / "data" / "train")
    write_folder(root / "data" / "val", per_class=2)
    (root / "tiny.py").write_text(WORKLOAD)
    return root


def train(split_folder, out, *extra):
    return main(["train", f"{split_folder / 'tiny.py'}:TinyFolder", "--data",
                 str(split_folder / "data"), "--device", "cpu", "--no-progress", "--out",
                 str(out), *extra])


@pytest.mark.parametrize("loader", ["serial", "multiprocess:2"])
def test_kasoku_train_lists_every_bad_file_once_and_no_traceback(split_folder, tmp_path,
                                                                  capsys, loader):
    reset_warnings()
    out = tmp_path / "run"
    assert train(split_folder, out, "--loader", loader) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = listed(out / BAD_FILES)
    by_split = {(d["split"], d["path"].rsplit("/", 1)[-1]): d["reason"] for d in lines}
    assert by_split == {**{("train", k): v for k, v in BAD.items()},
                        **{("validation", k): v for k, v in BAD.items()}}
    assert len(lines) == len(by_split)  # two epochs, each file once
    folders = {"train": split_folder / "data" / "train",
               "validation": split_folder / "data" / "val"}
    assert all(d["path"].startswith(f"{folders[d['split']]}/") for d in lines)
    assert all(isinstance(d["epoch"], int) and d["iteration"] >= 1 for d in lines)
    warned = [s for s in err.splitlines() if "skipping bad file" in s]
    assert warned and f"listed, with its reason, in {out / BAD_FILES}" in warned[0]
    assert f"{len(lines)} bad files skipped, each listed with its reason in {out / BAD_FILES}" \
        in err
    log = listed(out / "log.jsonl")
    assert log[-1]["data/skipped"] == len(BAD)


def test_every_worker_of_a_data_parallel_run_lists_its_shards_bad_files(split_folder, tmp_path,
                                                                         capsys):
    """Two workers, one epoch: each meets only the bad files of its shard, and all of them are
    in the one list (every worker appends to it)."""
    out = tmp_path / "run"
    assert train(split_folder, out, "--procs", "2", "--epochs", "1") == 0
    lines = listed(out / BAD_FILES)
    assert sorted((d["split"], d["path"].rsplit("/", 1)[-1], d["reason"]) for d in lines) == \
        sorted((split, k, v) for split in ("train", "validation") for k, v in BAD.items())
    assert "Traceback" not in capsys.readouterr().err


def test_a_resumed_run_adds_no_line_for_a_file_already_listed(split_folder, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(split_folder, out, "--epochs", "1") == 0
    first = (out / BAD_FILES).read_text()
    assert train(split_folder, out, "--epochs", "2", "--resume", str(out)) == 0
    assert (out / BAD_FILES).read_text() == first
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("stop", ["crash", "ctrl-c"])
def test_a_crash_or_ctrl_c_loses_none_of_the_bad_files_found(folder, tmp_path, stop):
    """The first step fails (or gets SIGINT): its batch held a bad file (the folder in order:
    class_0/cut.jpg first), which is in the list when ``run`` returns."""
    loader = create_loader("serial", ImageFolder(folder, train=True, image_size=8), 4, "cpu",
                           shuffle=False)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 3))

    def first_step(model, batch, optimizer):
        if stop == "crash":
            raise RuntimeError("the step broke")
        os.kill(os.getpid(), signal.SIGINT)  # the trainer finishes the step, then stops
        return {}

    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                      nn.functional.cross_entropy, stop_trigger=(2, "epoch"), out=tmp_path,
                      step_fn=first_step)
    trainer.extend(BadFileLog())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises((RuntimeError, TrainingInterrupted)):
            trainer.run()
    assert "cut.jpg" in named(loader.skipped_records)
    assert sorted(d["path"] for d in listed(tmp_path / BAD_FILES)) == loader.skipped_files


def test_data_bench_lists_the_bad_files_and_says_where(folder, tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["data", "bench", str(folder), "--loader", "serial,multiprocess:2",
                 "--device", "cpu", "--batch-size", "4", "--image-size", "8", "--warmup", "1",
                 "--batches", "2", "--windows", "1", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    lines = listed(out / BAD_FILES)
    assert lines and len(lines) == len({d["path"] for d in lines})  # each file once
    assert {d["path"].rsplit("/", 1)[-1]: d["reason"] for d in lines}.items() <= BAD.items()
    assert f"bad files: {len(lines)}, each listed with its reason in {out / BAD_FILES}" \
        in captured.out
