"""What a resumed run does with the settings given again (``kasoku train --resume``)."""
from __future__ import annotations

import torch

from kasoku.core.errors import warn_once
from kasoku.core.flags import flag
from kasoku.distributed import World
from kasoku.distributed.launch import under_launcher
from kasoku.run import RunConfig
from kasoku.train import Trainer


def resumed_settings(trainer: Trainer, run: RunConfig, state: dict) -> None:
    """What a resume does with the settings given again: ``--lr`` replaces the snapshot's
    rate (``_set_base_lr``); ``--seed`` cannot change a run under way (its weights, order and
    augmentation come from the snapshot), said once."""
    train = run.train
    if "lr" in run.given:
        _set_base_lr(trainer, train.lr)
    saved_world = int((state.get("loader") or {}).get("world_size", 1))
    world = World.from_env().world_size if under_launcher() else 1
    if saved_world != world:
        batch = trainer.run_info["batch_size"]
        warn_once(f"the snapshot was taken with {saved_world} worker"
                  f"{'s' * (saved_world != 1)}, this run has {world}: it goes on from the "
                  f"same sample of epoch {trainer.updater.epoch_detail:.4g}, but with a global "
                  f"batch of {batch * world} instead of {batch * saved_world}, so it is not "
                  f"the run {saved_world} workers would have made (the batches, their order "
                  f"over the workers and the random streams differ)")
    saved = (state.get("loader") or {}).get("seed")
    if "seed" in run.given and saved is not None and train.seed != saved:
        warn_once(f"{flag('train.seed')} {train.seed} is not used: a resumed run keeps its "
                  f"snapshot's seed ({saved}) for its data order and augmentation")


def _set_base_lr(trainer: Trainer, lr: float) -> None:
    """After a resume: make ``lr`` the base learning rate (the snapshot's optimizer state
    brought its own), scaling every group's rate and schedule base alike, with a warning: the
    run no longer continues the snapshot's exactly."""
    groups = trainer.optimizer.param_groups
    old = float(groups[0].get("initial_lr", groups[0]["lr"]))
    if old == lr:
        return
    factor = lr / old
    for group in groups:
        if "initial_lr" in group:
            group["initial_lr"] = float(group["initial_lr"]) * factor
        if torch.is_tensor(group["lr"]):
            group["lr"].mul_(factor)  # in place: a captured CUDA graph reads this tensor
        else:
            group["lr"] = group["lr"] * factor
    warn_once(f"{flag('train.lr')} {lr:g} replaces the snapshot's learning rate {old:g} from "
              f"iteration {trainer.updater.iteration} on; the resumed run is no longer the one the "
              "snapshot would have continued")
