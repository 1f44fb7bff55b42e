"""Datasets and worker functions that data-loader workers unpickle: torch and NumPy only, no Lightning.

A worker started by a fork server or spawned imports the module its dataset comes from; this one costs a fork server
~2.5 s of CPU where ``tests.helpers.lightning_models`` (Lightning) costs ~5.5 s.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset


class StreamDataset(Dataset):
    """Each item says which worker produced it and draws once from each global stream (python, numpy, torch)."""

    def __init__(self, n: int = 16, tag: int = 0) -> None:
        self.n = n
        self.tag = tag

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        info = torch.utils.data.get_worker_info()
        return {
            "index": i,
            "tag": self.tag,
            "worker": -1 if info is None else info.id,
            "torch_seed": str(torch.initial_seed()),
            "pytorch_worker_seed": "none" if info is None else str(info.seed),
            "torch": torch.rand(3).tolist(),
            "numpy": float(np.random.rand()),
            "python": random.random(),
        }


class PlainBatches:
    """An iterable of batches that is not a DataLoader."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __iter__(self) -> Any:
        return iter([[self.dataset[j] for j in range(i, i + 2)] for i in range(0, len(self.dataset), 2)])

    def __len__(self) -> int:
        return len(self.dataset) // 2


def user_worker_init(worker_id: int) -> None:
    """A user's own worker_init_fn: it overrides the torch stream of each worker."""
    torch.manual_seed(1000 + worker_id)


def _uncollated(batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return batch


def mask_collate(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Masks drawn in the collate from the process's global streams, as ``DataCollatorForLanguageModeling`` does.

    15 % of the entries of ``x`` are chosen (``torch.bernoulli``), 80 % of those zeroed, half the rest replaced by
    noise (``torch.randn``); python's and numpy's streams pick a column to scale. ``x`` comes back masked, the model
    trains on it; ``chosen`` is the mask.
    """
    ids = torch.stack([torch.as_tensor(item["id"]) for item in items])
    x = torch.stack([torch.as_tensor(item["x"]) for item in items]).float()
    chosen = torch.bernoulli(torch.full(x.shape, 0.15)).bool()
    zeroed = torch.bernoulli(torch.full(x.shape, 0.8)).bool() & chosen
    noised = torch.bernoulli(torch.full(x.shape, 0.5)).bool() & chosen & ~zeroed
    x = torch.where(noised, torch.randn(x.shape), x.masked_fill(zeroed, 0.0))
    x[:, random.randrange(x.shape[1])] *= 1.0 + float(np.random.rand())
    return {"id": ids, "x": x, "chosen": chosen}
