"""What a stream's position is made of, shared by the resumable streams and their resume on another grid.

A stream's seed per (rank, worker, epoch), the seeding of its epoch, the seed of each batch's ``collate_fn`` call,
the random streams it draws from in the main process (swapped in around its work), whether its dataset restores its
own position (the state protocol), and the digest that checks a replayed item against the saved one.
"""

from __future__ import annotations

import contextlib
import random
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate, default_convert

from lightning_determinism._compat.data import hf_shuffles
from lightning_determinism.seeding.seeds import derive_seed


def has_state_protocol(dataset: object) -> bool:
    """Whether ``dataset.state_dict()`` / ``load_state_dict()`` restore its position exactly (else it is replayed).

    Examples:
        >>> has_state_protocol(range(3))
        False
    """
    if not (callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))):
        return False
    if type(dataset).__module__.startswith("datasets."):  # Hugging Face: its state drops the shuffle buffer (#7901)
        return not hf_shuffles(dataset)
    return True


def item_digest(item: Any) -> int:
    """A cheap digest of one item (tensors by their first 64 KiB, shapes and dtypes; other values by ``repr``).

    Examples:
        >>> item_digest({"x": torch.arange(3)}) == item_digest({"x": torch.arange(3)})
        True
        >>> item_digest(torch.arange(3)) == item_digest(torch.arange(1, 4))
        False
    """
    crc = 0
    stack = [item]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            flat = value.detach().reshape(-1)[: 65536 // max(1, value.element_size())].cpu().contiguous()
            crc = zlib.crc32(repr((tuple(value.shape), str(value.dtype))).encode(), crc)
            crc = zlib.crc32(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"", crc)
        elif isinstance(value, np.ndarray):
            stack.append(torch.from_numpy(np.ascontiguousarray(value)))
        elif isinstance(value, dict):
            for key in sorted(value, key=repr):
                crc = zlib.crc32(repr(key).encode(), crc)
                stack.append(value[key])
        elif isinstance(value, (list, tuple)):
            stack.extend(reversed(value))
        else:
            crc = zlib.crc32(repr(value).encode(), crc)
    return crc


def stream_seed(base: int, rank: int, worker: int, epoch: int) -> int:
    """The seed of (``rank``, ``worker``)'s stream in ``epoch``."""
    return derive_seed(base, rank, "stream", worker, epoch)


def collate_seed(base: int, rank: int, worker: int, epoch: int, delivered: int) -> int:
    """The seed of the ``collate_fn`` call for the batch that follows ``delivered`` items of a (rank, worker) stream.

    A function of the batch's place in its stream only, not of what the worker drew before it.
    """
    return derive_seed(base, rank, "collate", worker, epoch, delivered)


def may_draw(collate_fn: Any) -> bool:
    """Whether a ``collate_fn`` needs a seed of its own: any but PyTorch's ``default_collate``/``default_convert``."""
    return collate_fn not in (default_collate, default_convert)


@contextlib.contextmanager
def seeded_streams(seed: int) -> Iterator[None]:
    """Within: python, numpy and torch's CPU stream seeded with ``seed``; the states found are put back after.

    Examples:
        >>> _ = torch.manual_seed(0)
        >>> with seeded_streams(7):
        ...     a = torch.rand(2)
        >>> after = torch.rand(2)  # the outer stream did not move
        >>> _ = torch.manual_seed(0)
        >>> torch.equal(after, torch.rand(2))
        True
        >>> with seeded_streams(7):
        ...     torch.equal(a, torch.rand(2))
        True
    """
    outer = random.getstate(), np.random.get_state(), torch.get_rng_state()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)
    try:
        yield
    finally:
        random.setstate(outer[0])
        np.random.set_state(outer[1])
        torch.set_rng_state(outer[2])


def seed_stream(seed: int, dataset: Any, epoch: int) -> None:
    """Seed python, numpy and torch's CPU stream with ``seed`` and tell the dataset its epoch (``set_epoch``)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)
    set_epoch = getattr(dataset, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)


class IsolatedStreams:
    """The python, numpy and torch CPU streams of a stream read in the main process, swapped in around its work."""

    def __init__(self) -> None:
        self._state: tuple[Any, Any, torch.Tensor] | None = None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within: the stream's streams are the global ones (seeded by the stream at its epoch's start)."""
        outer = random.getstate(), np.random.get_state(), torch.get_rng_state()
        if self._state is not None:
            random.setstate(self._state[0])
            np.random.set_state(self._state[1])
            torch.set_rng_state(self._state[2])
        try:
            yield
        finally:
            self._state = random.getstate(), np.random.get_state(), torch.get_rng_state()
            random.setstate(outer[0])
            np.random.set_state(outer[1])
            torch.set_rng_state(outer[2])


__all__ = [
    "IsolatedStreams",
    "collate_seed",
    "has_state_protocol",
    "item_digest",
    "may_draw",
    "seed_stream",
    "seeded_streams",
    "stream_seed",
]
