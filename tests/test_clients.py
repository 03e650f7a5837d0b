"""Scripts written for the frameworks users train with -- Lightning, Hugging Face Accelerate and
Hugging Face's ``Trainer`` -- profiled and run by kasoku unchanged, in real processes, as a user
runs them: the steps kasoku counts are the optimizer steps the framework made (each script
prints its own count last), the step's phases are the framework's forward, backward and update
(Lightning's forward and backward run inside ``optimizer.step(closure)``), the advice's lines
are the script's own, its output and exit code are its own, and ``kasoku run --auto`` keeps
only what it measured faster and leaves one logger folder, the whole run's.

Optional: each test skips where its framework is absent (the ``clients`` extra, which the
test set-up does not install; README's test section). A framework's start-up alone takes
seconds, and each test runs the script several times: all are slow."""
from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
from test_profile_script import kasoku, write

pytestmark = pytest.mark.slow

WINDOW = ["--skip", "2", "--measure-steps", "2", "--warmup", "1", "--steps", "3", "--estimate"]
"""9 steps: 2 skipped, 2 timed, 1 profiler warm-up, the anchor, 3 analysed (steps 7-9)."""
PHASES = ["data", "forward", "backward", "update"]

LIGHTNING = textwrap.dedent("""
    import sys

    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset


    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):  # Lightning steps it as optimizer.step(closure)
            return torch.optim.Adam(self.parameters(), lr=1e-3)


    def main():
        torch.manual_seed(0)
        steps, code = int(sys.argv[1]), int(sys.argv[2])
        logged = sys.argv[3:] == ["logged"]  # the default logger and checkpoints, or none
        data = TensorDataset(torch.randn(512, 32), torch.randint(4, (512,)))
        loader = DataLoader(data, batch_size=16)
        trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=logged,
                            enable_checkpointing=logged, enable_progress_bar=False,
                            enable_model_summary=False)
        trainer.fit(Tiny(), loader)
        print(f"lightning: global_step {trainer.global_step}")
        sys.exit(code)


    if __name__ == "__main__":
        main()
""")

ACCELERATE = textwrap.dedent("""
    import sys

    import torch
    from accelerate import Accelerator
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset


    def main():
        torch.manual_seed(0)
        epochs, code = int(sys.argv[1]), int(sys.argv[2])
        accelerator = Accelerator(cpu=True)
        data = TensorDataset(torch.randn(320, 32), torch.randint(4, (320,)))
        loader = DataLoader(data, batch_size=16, shuffle=True)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        model, opt, loader = accelerator.prepare(model, opt, loader)  # a loader of its own
        steps = 0
        for _ in range(epochs):
            for x, y in loader:
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                opt.step()
                steps += 1
        print(f"accelerate: {steps} optimizer steps")
        sys.exit(code)


    if __name__ == "__main__":
        main()
""")

HF_TRAINER = textwrap.dedent("""
    import sys

    import torch
    from torch.utils.data import Dataset
    from transformers import (BertConfig, BertForSequenceClassification, Trainer,
                              TrainingArguments)


    class RandomTokens(Dataset):
        def __len__(self):
            return 256

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return {"input_ids": torch.randint(100, (16,), generator=g),
                    "labels": torch.tensor(i % 2)}


    def main():
        steps, code, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
        config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=2, intermediate_size=64,
                            max_position_embeddings=32)
        torch.manual_seed(0)
        model = BertForSequenceClassification(config)  # from a config: nothing downloaded
        args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=8,
                                 report_to=[], use_cpu=True, save_strategy="no",
                                 logging_strategy="no", disable_tqdm=True, seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=RandomTokens())
        trainer.train()
        print(f"hf trainer: global_step {trainer.state.global_step}")
        sys.exit(code)


    if __name__ == "__main__":
        main()
""")


def line_of(script: str, text: str) -> int:
    """The line of ``script`` that holds ``text``."""
    return next(i for i, line in enumerate(script.splitlines(), 1) if text in line)


def profiled(folder: Path, name: str, script: str, *args: str) -> dict:
    """``kasoku profile WINDOW -- python NAME ARGS`` in ``folder``, ended well with the
    script's own output; its profile.json."""
    write(folder, name, script)
    run = kasoku("profile", *WINDOW, "--out", "prof", "--", "python", name, *args, cwd=folder)
    assert run.returncode == 0, run.stderr
    assert f"kasoku: {name}: 2 steps timed on cpu" in run.stderr
    assert "steps 7-9 profiled" in run.stderr
    result = json.loads((folder / "prof" / "profile.json").read_text())
    assert result["steps_seen"] == 9 and result["figures"]["steps"] == 3
    return result


def steps_run(folder: Path, name: str, *args: str, code: int) -> tuple[str, int]:
    """``kasoku run -- python NAME ARGS`` in ``folder``, ended with the script's exit
    ``code``: the script's last printed line and the training steps kasoku's last line
    counted."""
    run = kasoku("run", "--", "python", name, *args, cwd=folder)
    assert run.returncode == code, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    found = re.fullmatch(rf"kasoku: {re.escape(name)} ended with exit code {code} with no lever "
                         r"\(as given\): ([\d,]+) training steps in .*", last)
    assert found, last
    return run.stdout.strip().splitlines()[-1], int(found[1].replace(",", ""))


def test_lightning_steps_and_phases_are_its_optimizer_s(tmp_path):
    pytest.importorskip("lightning")
    result = profiled(tmp_path, "light.py", LIGHTNING, "20", "0")
    # the closure's forward and backward run inside optimizer.step(closure): forward and
    # backward, not the update; Adam's arithmetic after them is the update
    phases = result["figures"]["phases_host_ms"]
    assert list(phases) == PHASES and all(phases[p] > 0 for p in PHASES[1:]), phases
    facts = result["facts"]
    assert facts["loader_site"] == f"light.py:{line_of(LIGHTNING, 'loader = DataLoader(')}"
    assert facts["forward_site"] == f"light.py:{line_of(LIGHTNING, 'self.net(x)')}"
    last, steps = steps_run(tmp_path, "light.py", "23", "3", code=3)
    assert last == "lightning: global_step 23" and steps == 23


def test_accelerate_steps_phases_and_the_script_s_loader_line(tmp_path):
    pytest.importorskip("accelerate")
    result = profiled(tmp_path, "acc.py", ACCELERATE, "1", "0")
    assert list(result["figures"]["phases_host_ms"]) == PHASES
    # prepare() makes a DataLoader of its own from the script's dataset: the line is the
    # script's
    assert result["facts"]["loader_site"] == \
        f"acc.py:{line_of(ACCELERATE, 'loader = DataLoader(')}"
    last, steps = steps_run(tmp_path, "acc.py", "2", "4", code=4)
    assert last == "accelerate: 40 optimizer steps" and steps == 40


def test_hugging_face_trainer_steps_are_its_global_steps(tmp_path):
    pytest.importorskip("transformers")
    result = profiled(tmp_path, "hft.py", HF_TRAINER, "12", "0", str(tmp_path / "hf"))
    phases = result["figures"]["phases_host_ms"]
    assert list(phases) == PHASES and all(phases[p] > 0 for p in PHASES[1:]), phases
    # Trainer makes its DataLoader in train(): the edit is its setting, at the script's call
    assert result["facts"]["loader_site"] == \
        f"hft.py:{line_of(HF_TRAINER, 'trainer.train()')} (made by transformers in that call)"
    last, steps = steps_run(tmp_path, "hft.py", "11", "5", str(tmp_path / "hf"), code=5)
    assert last == "hf trainer: global_step 11" and steps == 11


def test_auto_on_a_lightning_script_keeps_only_what_was_measured_faster(tmp_path):
    # The acceptance test of the script levers: a Lightning script with its default logger
    # and checkpoints, profiled, its levers tried in fresh runs, then run whole.
    pytest.importorskip("lightning")
    write(tmp_path, "light.py", LIGHTNING)
    run = kasoku("run", "--auto", "--skip", "2", "--measure-steps", "6", "--measure-seconds",
                 "0.2", "--warmup", "1", "--steps", "2", "--rounds", "1", "--", "python",
                 "light.py", "60", "0", "logged", cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "lightning: global_step 60"
    ours = [line for line in run.stderr.splitlines() if line.startswith("kasoku: ")]
    assert re.fullmatch(r"kasoku: light\.py ran to its end with .*: 60 training steps in .*",
                        ours[-2]), ours[-2]
    last = ours[-1]
    tried = json.loads(next((tmp_path / "runs").glob("*/profile.json")).read_text())[
        "verdict"].get("tried") or []
    faster = {" ".join(t["args"]) for t in tried if t.get("result") == "faster"}
    if last.startswith("kasoku: kept "):
        kept = re.match(r"kasoku: kept (.*): measured \d+\.\d\dx \((\d+\.\d\d-\d+\.\d\d over "
                        r"\d+ rounds|1 round, noise \d+%)\) beside the script as given; (.*)",
                        last)
        assert kept, last
        assert kept[1] in faster or len(faster) > 1  # several: measured together
        assert any(words in kept[3] for words in (
            "the losses of the timed steps within", "the losses were not compared",
            "changes the losses by", "not its arithmetic",
            "what the script computes is unchanged")), last
    else:  # none faster, or the faster ones moved the losses: each try shown
        why = "none was measured faster" if not faster else \
            r".* faster, but changes the losses by \d+\.\d%: not kept"
        assert re.fullmatch(rf"kasoku: no lever kept: {why} \(tried: "
                            r"\S+ \d+\.\d\dx, [^;]+(; \S+ \d+\.\d\dx, [^;]+)*\)", last), last
    # the profile and the tries ran in scratch folders: one logger folder, the whole run's
    assert [p.name for p in (tmp_path / "lightning_logs").iterdir()] == ["version_0"]
    assert (tmp_path / "lightning_logs" / "version_0" / "checkpoints"
            / "epoch=1-step=60.ckpt").is_file()
