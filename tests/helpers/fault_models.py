"""Pairs of runs with one known fault each, for the diagnosis tests: a small model whose faults are switched on by name.

Importable (the forked DDP fits pickle nothing, but the module must be importable by the test and the example)."""

from __future__ import annotations

import random
import time
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

WIDTH = 4096  # 16 samples x 4096 features: a mean over 65536 values, which CPU threads split (see Center)


class Center(nn.Module):
    """Subtracts the mean of the whole activation: a reduction that another intra-op thread count splits differently."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean()


class Outside(nn.Module):
    """Identity until switched on; then adds noise from a generator seeded by the clock: outside every seed."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return x
        gen = torch.Generator().manual_seed(time.time_ns() % 2**62)
        return x + 1e-3 * torch.rand(x.shape[-1], generator=gen)


def points(n: int = 64) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 8, generator=gen), torch.randn(n, 1, generator=gen))


class FaultNet(L.LightningModule):
    """Linear, Tanh, Center, Dropout, Outside, Linear; ``fault`` names the one thing this run does differently.

    Faults: ``"extra_draw"`` (one more torch draw in ``training_step`` at ``fault_step``, before the forward),
    ``"late_draw"`` (after it), ``"python_draw"`` (from python's ``random``), ``"swap"`` (the batches of steps
    ``fault_step`` and ``fault_step + 1`` swapped), ``"outside"`` (``Outside`` switched on from ``fault_step``); a
    dropout probability (``p``) and a learning rate (``lr``) are arguments.
    """

    def __init__(
        self, fault: str | None = None, fault_step: int = 1, p: float = 0.2, lr: float = 0.1, batch_size: int = 16,
        width: int = WIDTH, accumulate: int = 1,
    ) -> None:  # fmt: skip
        super().__init__()
        self.fault, self.fault_step, self.p, self.lr = fault, fault_step, p, lr
        self.batch_size, self.width = batch_size, width
        self.net: nn.Module | None = None

    def configure_model(self) -> None:
        if self.net is None:
            w = self.width
            self.net = nn.Sequential(
                nn.Linear(8, w), nn.Tanh(), Center(), nn.Dropout(self.p), Outside(), nn.Linear(w, 1)
            )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        at_fault = self.global_step == self.fault_step
        if self.fault == "extra_draw" and at_fault:
            torch.rand(1)
        if self.fault == "python_draw" and at_fault:
            random.random()
        self.net[4].active = self.fault == "outside" and self.global_step >= self.fault_step
        out = self.net(x)
        if self.fault == "late_draw" and at_fault:
            out = out + 0.0 * torch.rand(1)
        return nn.functional.mse_loss(out, y)

    def train_dataloader(self) -> DataLoader:
        data = points()
        order = list(range(len(data)))
        if self.fault == "swap":
            b, s = self.batch_size, self.fault_step
            order[s * b : (s + 1) * b], order[(s + 1) * b : (s + 2) * b] = (
                order[(s + 1) * b : (s + 2) * b],
                order[s * b : (s + 1) * b],
            )
        return DataLoader(Subset(data, order), batch_size=self.batch_size, shuffle=False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
