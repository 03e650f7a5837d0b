"""``sine-lstm``: seed 001's recurrent study, a 5-unit LSTM predicting the next value of a sine
wave. The data is always generated (there are no files), so ``--synthetic`` changes nothing."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kasoku.core.errors import warn_once
from kasoku.core.flags import flag
from kasoku.data.config import DataConfig
from kasoku.workloads.dataset_facts import synthetic_sizes
from kasoku.workloads.registry import Recipe, Workload, register_workload

if TYPE_CHECKING:
    import torch
    from torch import nn

SEQ_LEN = 50
SIZES = (10000, 1000)
"""Default (train, val) window counts; ``data.synthetic_train_size``/``val_size`` override."""


@register_workload("sine-lstm")
class SineLSTMWorkload(Workload):
    description = "LSTM (Linear-LSTM-Linear, 5 units) predicting a sine wave's next value"
    has_accuracy = False
    generated_data = True
    """No real dataset exists: build_datasets never needs --data."""
    # The seed gives no recipe. Measured on the default 10k windows: Adam at 1e-2 takes the
    # validation MSE from ~0.5 to 6e-3 in one epoch and 1.3e-3 in five; at 1e-3 it is still
    # 2.4e-2 after five epochs (a 5-unit LSTM wants the larger step).
    recipe = Recipe(optimizer="adam", lr=1e-2, batch_size=100, epochs=20)
    epoch_samples = SIZES[0]
    """The windows it generates by default."""
    # A 5-unit LSTM is hundreds of tiny operators per step: one thread beats two (0.4 vs
    # 1.7 s per epoch on the 2-core CPU with another job running), as OpenMP barriers cost
    # more than the arithmetic they split.
    cpu_threads = 1

    def build_model(self) -> nn.Module:
        from kasoku.models import SineLSTM  # deferred: torch (workloads.registry's doc)
        return SineLSTM(n_input=1, n_units=5, n_output=1)

    def build_datasets(self, data: DataConfig, seed: int = 0):
        if data.root is not None:
            warn_once(f"{self.name} generates its data; {flag('data.root')} {data.root} is ignored")
        n_train, n_val = synthetic_sizes(data, SIZES)
        from kasoku.data.sine import sine_datasets  # deferred: torch
        return sine_datasets(n_train, n_val, seq_len=SEQ_LEN, seed=seed)

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        import torch  # deferred: torch (registry's doc); as cheap as a global's lookup
        return torch.nn.functional.mse_loss(output, target)

    def metric_fn(self, output: torch.Tensor, target: torch.Tensor) -> None:
        return None
