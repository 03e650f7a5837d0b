"""Bad files skipped by the data: counted in the log (``data/skipped``) and announced once per
epoch that skipped new ones."""
import json
import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from kasoku.data.imagefolder import ImageFolder
from kasoku.data.loader import SerialLoader
from kasoku.data.parallel_loader import ProcessLoader, ThreadLoader
from kasoku.data.prefetch import DevicePrefetcher
from kasoku.train import LogReport, Trainer
from kasoku.train.extensions import SkippedReport

LOADERS = {
    "serial": lambda ds: SerialLoader(ds, 4, seed=1),
    "threads": lambda ds: ThreadLoader(ds, 4, seed=1, num_threads=2),
    "processes": lambda ds: ProcessLoader(ds, 4, seed=1, num_workers=2),
    "prefetched": lambda ds: DevicePrefetcher(ThreadLoader(ds, 4, seed=1, num_threads=2),
                                              torch.device("cpu")),
}


def write_folder(root, bad=True):
    rng = np.random.default_rng(0)
    for c in range(3):
        (root / f"class_{c}").mkdir(parents=True)
        for i in range(4):
            pixels = rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"class_{c}" / f"img_{i}.jpg")
    if bad:
        (root / "class_1" / "img_1.jpg").write_bytes(b"this is not a jpeg")
        (root / "class_2" / "img_0.jpg").write_bytes(b"")  # zero bytes
    return root


def train(root, out, make, epochs=2):
    torch.manual_seed(0)
    loader = make(ImageFolder(root, train=True, image_size=16))
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 3))
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                      nn.functional.cross_entropy, stop_trigger=(epochs, "epoch"), out=out)
    trainer.extend(LogReport())
    trainer.extend(SkippedReport())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the dataset's own warning per bad file
            trainer.run()
    finally:
        getattr(loader, "close", lambda: None)()
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", list(LOADERS))
def test_skipped_files_are_logged_and_announced_once(name, tmp_path, capsys):
    log = train(write_folder(tmp_path / "data"), tmp_path / "out", LOADERS[name])
    assert [e["epoch"] for e in log] == [1, 2]
    assert [e["data/skipped"] for e in log] == [2, 2]
    lines = [line for line in capsys.readouterr().err.splitlines() if "skipped" in line]
    assert len(lines) == 1
    assert lines[0].startswith("epoch 1: 2 bad files skipped so far (first: ")
    assert "class_1/img_1.jpg" in lines[0] and "--strict-data" in lines[0]


def test_clean_data_logs_zero_and_prints_nothing(tmp_path, capsys):
    log = train(write_folder(tmp_path / "data", bad=False), tmp_path / "out", LOADERS["serial"],
                epochs=1)
    assert log[0]["data/skipped"] == 0
    assert "skipped" not in capsys.readouterr().err


def test_a_new_bad_file_in_a_later_epoch_is_announced_again(tmp_path, capsys):
    class Loader:  # the count grows at epoch 1 and again at epoch 3
        skipped_files = []
        skipped = property(lambda self: len(self.skipped_files))

    class Fake:
        train_loader = Loader()
        updater = type("U", (), {"epoch": 0})()

    trainer, report = Fake(), SkippedReport()
    for epoch, files in [(1, ["/d/a.jpg"]), (2, ["/d/a.jpg"]), (3, ["/d/a.jpg", "/d/b.jpg"])]:
        trainer.updater.epoch, trainer.train_loader.skipped_files = epoch, files
        report(trainer)
    assert capsys.readouterr().err.splitlines() == [
        "epoch 1: 1 bad file skipped so far (first: /d/a.jpg); --strict-data makes the first "
        "one an error",
        "epoch 3: 2 bad files skipped so far (first: /d/a.jpg); --strict-data makes the first "
        "one an error"]


def test_kasoku_train_logs_the_count(tmp_path):
    from kasoku.commands.train import train_run
    from kasoku.data.config import DataConfig
    from kasoku.run import resolve
    from kasoku.train.config import TrainConfig
    from kasoku.workloads import create_workload
    run = resolve(create_workload("sine-lstm"),
                  DataConfig(synthetic=True, synthetic_train_size=100, synthetic_val_size=20),
                  TrainConfig(epochs=1, batch_size=50, out=tmp_path, progress=False))
    run.check()
    trainer = train_run(run)
    assert isinstance(trainer.get_extension("SkippedReport"), SkippedReport)
    assert trainer.get_extension("LogReport").log[-1]["data/skipped"] == 0
