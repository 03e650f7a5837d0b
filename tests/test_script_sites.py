"""The lines kasoku's advice names in a script: the DataLoader the script wrote, not the one a
library makes again from the same dataset (Accelerate's ``prepare``), here a library module
outside the script's folder doing what it does."""
from __future__ import annotations

import json
import sys
import textwrap

from kasoku.cli import main

LIBRARY = textwrap.dedent("""
    from torch.utils.data import DataLoader


    def prepare(loader):  # as accelerate.Accelerator.prepare: a new loader, the same dataset
        return DataLoader(loader.dataset, batch_size=loader.batch_size)
""")

SCRIPT = textwrap.dedent("""
    import time
    import torch
    from torch.utils.data import DataLoader, Dataset
    from fakeaccel import prepare


    class Slow(Dataset):
        def __len__(self):
            return 256

        def __getitem__(self, i):
            time.sleep(0.001)
            return torch.randn(8), i % 2


    loader = DataLoader(Slow(), batch_size=8)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = prepare(loader)
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
""")


def profiled_facts(tmp_path, monkeypatch, module: str, library_text: str, script: str) -> dict:
    """The facts of ``script``'s profile, run with ``module`` (``library_text``) importable
    from a folder outside the script's, as an installed package is."""
    library, project = tmp_path / "site-packages", tmp_path / "project"
    library.mkdir()
    project.mkdir()
    (library / f"{module}.py").write_text(library_text)
    (project / "train.py").write_text(script)
    monkeypatch.chdir(project)
    # after sys.path[0], which the script's run sets to its own folder, as an installed package
    monkeypatch.setattr(sys, "path", [sys.path[0], str(library), *sys.path[1:]])
    out = tmp_path / "profile"
    assert main(["profile", "--skip", "2", "--measure-steps", "2", "--warmup", "1", "--steps",
                 "2", "--estimate", "--out", str(out), "--", "python", "train.py"]) == 0
    return json.loads((out / "profile.json").read_text())["facts"]


def test_the_loader_s_line_is_the_script_s_not_the_library_s(tmp_path, monkeypatch):
    facts = profiled_facts(tmp_path, monkeypatch, "fakeaccel", LIBRARY, SCRIPT)
    line = SCRIPT.splitlines().index("loader = DataLoader(Slow(), batch_size=8)") + 1
    assert facts["loader_site"] == f"train.py:{line}"


TRAINER = textwrap.dedent("""
    from torch.utils.data import DataLoader


    def train(dataset, step):  # as transformers.Trainer.train: a DataLoader of its own
        for x, y in DataLoader(dataset, batch_size=8):
            step(x, y)
""")

TRAINED = SCRIPT.replace("from fakeaccel import prepare", "from faketrainer import train").replace(
    "loader = DataLoader(Slow(), batch_size=8)\n", "").replace("""loader = prepare(loader)
for x, y in loader:
""", """

def step(x, y):
""") + "\n\ntrain(Slow(), step)\n"


def test_a_loader_a_library_makes_inside_the_script_s_call_is_said_to_be_the_library_s(
        tmp_path, monkeypatch):
    # the edit at that line is the library's setting (TrainingArguments'), not a DataLoader
    # the line writes
    facts = profiled_facts(tmp_path, monkeypatch, "faketrainer", TRAINER, TRAINED)
    line = TRAINED.splitlines().index("train(Slow(), step)") + 1
    assert facts["loader_site"] == f"train.py:{line} (made by faketrainer in that call)"


TRANSFORMED = textwrap.dedent("""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset


    class Normalize(nn.Module):  # as torchvision's transforms are: modules, called per sample
        def forward(self, x):
            return (x - 0.5) / 0.25


    class Data(Dataset):
        def __init__(self):
            self.transform = Normalize()

        def __len__(self):
            return 128

        def __getitem__(self, i):
            return self.transform(torch.rand(8)), i % 2


    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in DataLoader(Data(), batch_size=8):
        out = model(x)
        loss = nn.functional.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
""")


def test_the_forward_s_line_is_the_model_s_not_a_transform_s(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text(TRANSFORMED)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "profile"
    assert main(["profile", "--skip", "2", "--measure-steps", "2", "--warmup", "1", "--steps",
                 "2", "--estimate", "--out", str(out), "--", "python", "train.py"]) == 0
    facts = json.loads((out / "profile.json").read_text())["facts"]
    line = TRANSFORMED.splitlines().index("    out = model(x)") + 1
    assert facts["forward_site"] == f"train.py:{line}"
