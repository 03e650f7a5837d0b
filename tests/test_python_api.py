"""The trainer used from Python with a user's own nn.Module and a plain torch Dataset (the
README's example), not a kasoku workload."""
import json

import torch
from torch import nn
from torch.utils.data import TensorDataset

from kasoku.data.loader import SerialLoader
from kasoku.train import Trainer
from kasoku.train.extensions import Evaluator, LogReport, PrintReport


def accuracy(output, target):
    return (output.argmax(1) == target).float().mean()


def test_own_module_and_torch_dataset(tmp_path, capsys):
    torch.manual_seed(0)
    x = torch.randn(400, 8)
    y = (x[:, 0] + x[:, 1] > 0).long()
    train_set, val_set = TensorDataset(x[:300], y[:300]), TensorDataset(x[300:], y[300:])
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = SerialLoader(train_set, batch_size=30, seed=0)
    trainer = Trainer(model, optimizer, loader, nn.functional.cross_entropy, metric_fn=accuracy,
                      stop_trigger=(5, "epoch"), out=tmp_path)
    trainer.extend(Evaluator(val_set, model, nn.functional.cross_entropy, metric_fn=accuracy))
    trainer.extend(LogReport())
    trainer.extend(PrintReport())
    trainer.run()
    log = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    assert [e["epoch"] for e in log] == [1, 2, 3, 4, 5]
    assert log[-1]["validation/main/accuracy"] > 0.85
    assert log[-1]["main/loss"] < log[0]["main/loss"]
    assert "validation/main/accuracy" in capsys.readouterr().out
