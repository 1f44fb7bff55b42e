"""Per-sample random streams for evaluation and prediction, keyed by the sample's dataset index.

An evaluation pass draws from its own streams (:mod:`~lightning_determinism.seeding.isolation`), one per rank: what a
sample draws there (a sampled continuation, a Monte-Carlo dropout mask) depends on which rank it landed on, how many
samples were before it in its batch and how large the batch was. Measured with ``torch.multinomial`` over 12 prompts:
1 of 12 continuations is the same on 1 and 2 processes at eval batch 1 and 4.

:func:`sample_streams` gives each sample of a batch a generator of its own, seeded from ``derive_seed(base, "sample",
stage, epoch, step, call, index)``: the pass (the keys of :func:`~lightning_determinism.seeding.isolation
.evaluation_streams`, without the rank) and the sample's dataset index. A sample draws the same numbers on any number
of processes, at any batch size and position, and another pass draws others. Inside the block:

- :meth:`SampleStreams.multinomial`, :meth:`SampleStreams.rand` and :meth:`SampleStreams.randn` draw row by row, each
  row from its sample's generator;
- ``F.dropout`` (``nn.Dropout`` in train mode, as Monte-Carlo dropout sets it) on a tensor whose first dimension is
  the batch draws each sample's mask from its generator.

With :func:`~lightning_determinism.invariance.batch_invariant.batch_invariant` on (the strategies'
``batch_invariant=True``), the probabilities a sample draws from have the same bits on every layout too, so its
continuation is the same token for token.

Cost: one generator per sample (seeding it costs a few µs) and a Python loop over the batch per draw.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from lightning_determinism.seeding.isolation import current_evaluation_keys, current_evaluation_pass
from lightning_determinism.seeding.seeds import current_seeds, derive_seed


def sample_seed(base_seed: int, index: int, stage: str, epoch: int, step: int, call: int = 0) -> int:
    """The seed of the stream of the sample at dataset ``index`` in one evaluation pass (no rank: any layout).

    Examples:
        >>> sample_seed(42, 7, "predict", 0, 0) == sample_seed(42, 7, "predict", 0, 0)
        True
        >>> sample_seed(42, 7, "predict", 0, 0) == sample_seed(42, 8, "predict", 0, 0)
        False
    """
    return derive_seed(base_seed, "sample", stage, epoch, step, call, index)


def _indices(indices: Any) -> list[int]:
    if isinstance(indices, torch.Tensor):
        if indices.is_floating_point() or indices.is_complex() or indices.dim() != 1:
            raise TypeError(
                f"`indices` must be a 1-d integer tensor of dataset indices, got {indices.dim()}-d {indices.dtype}"
            )
        values = [int(i) for i in indices.tolist()]
    elif isinstance(indices, Sequence) and not isinstance(indices, (str, bytes)):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
            raise TypeError(f"`indices` must hold ints (dataset indices), got {list(indices)!r}")
        values = list(indices)
    else:
        raise TypeError(f"`indices` must be a sequence or 1-d tensor of dataset indices, got {type(indices).__name__}")
    negative = [i for i in values if i < 0]
    if negative:
        raise ValueError(f"`indices` must be dataset indices (>= 0), got {negative[0]}")
    return values


class SampleStreams:
    """One generator per sample of a batch; see :func:`sample_streams`, which makes one.

    Args:
        seeds: one seed per sample, in batch order.

    Examples:
        >>> streams = SampleStreams([sample_seed(1, i, "predict", 0, 0) for i in (4, 9)])
        >>> len(streams)
        2
    """

    def __init__(self, seeds: Sequence[int]) -> None:
        self.seeds = list(seeds)
        self._generators: dict[torch.device, list[torch.Generator]] = {}

    def __len__(self) -> int:
        return len(self.seeds)

    def generators(self, device: torch.device | str = "cpu") -> list[torch.Generator]:
        """The samples' generators on ``device`` (made at first use, then advanced by each draw)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in self._generators:
            self._generators[device] = [torch.Generator(device).manual_seed(seed) for seed in self.seeds]
        return self._generators[device]

    def _rows(self, tensor: torch.Tensor, what: str) -> list[torch.Generator]:
        if tensor.dim() == 0 or tensor.shape[0] != len(self):
            raise ValueError(f"`{what}` must have one row per sample ({len(self)}), got shape {tuple(tensor.shape)}")
        return self.generators(tensor.device)

    def multinomial(self, probs: torch.Tensor, num_samples: int = 1, replacement: bool = False) -> torch.Tensor:
        """``torch.multinomial`` row by row, row ``j`` from sample ``j``'s generator: ``(batch, num_samples)``."""
        generators = self._rows(probs, "probs")
        rows = [
            torch.multinomial(row, num_samples, replacement, generator=g)
            for row, g in zip(probs, generators, strict=True)
        ]
        return torch.stack(rows)

    def rand(self, *size: int, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> torch.Tensor:
        """``(batch, *size)`` uniform numbers, row ``j`` from sample ``j``'s generator."""
        generators = self.generators(device)
        return torch.stack([torch.rand(size, generator=g, device=device, dtype=dtype) for g in generators])

    def randn(self, *size: int, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> torch.Tensor:
        """``(batch, *size)`` normal numbers, row ``j`` from sample ``j``'s generator."""
        generators = self.generators(device)
        return torch.stack([torch.randn(size, generator=g, device=device, dtype=dtype) for g in generators])

    def dropout(self, input: torch.Tensor, p: float = 0.5) -> torch.Tensor:
        """Inverted dropout with sample ``j``'s mask drawn from its generator (``input``'s first dimension: batch)."""
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"`p` must be in [0, 1], got {p}")
        generators = self._rows(input, "input")
        if p == 0.0:
            return input.clone()
        if p == 1.0:
            return torch.zeros_like(input)
        draws = zip(input, generators, strict=True)
        masks = torch.stack([torch.empty_like(row).bernoulli_(1.0 - p, generator=g) for row, g in draws])
        return input * masks * (1.0 / (1.0 - p))


class _DropoutRouting(TorchFunctionMode):
    """``F.dropout`` in train mode on a batch-first tensor of the streams' batch: each sample's mask from its stream."""

    def __init__(self, streams: SampleStreams) -> None:
        super().__init__()
        self.streams = streams

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.dropout:
            input, p, training, inplace = _dropout_arguments(*args, **kwargs)
            if training and input.dim() > 0 and input.shape[0] == len(self.streams):
                out = self.streams.dropout(input, p)
                return input.copy_(out) if inplace else out
        return func(*args, **kwargs)


def _dropout_arguments(
    input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> tuple[torch.Tensor, float, bool, bool]:
    return input, p, training, inplace


@contextmanager
def sample_streams(
    indices: Any,
    *,
    base_seed: int | None = None,
    stage: str | None = None,
    epoch: int | None = None,
    step: int | None = None,
    call: int | None = None,
) -> Iterator[SampleStreams]:
    """Give each sample of a batch its own random stream, keyed by its dataset index, for the length of a block.

    Args:
        indices: the batch's dataset indices, in batch order (a 1-d integer tensor or a sequence of ints).
        base_seed: the run's base seed; default: the evaluation pass's (a deterministic strategy's loops), else the
            one the package seeded this process with.
        stage: the pass's stage; default: the evaluation pass under way (a deterministic strategy's loops), else
            ``"evaluation"``.
        epoch: the pass's epoch; default as ``stage`` (else 0).
        step: the pass's step; default as ``stage`` (else 0).
        call: which call of the pass's stage, epoch and step in the process; default: the pass's (the ``k``-th
            ``trainer.predict`` at one step draws its own numbers, as Monte-Carlo sampling wants). ``call=0`` gives
            every call the first call's numbers: a prompt gets one continuation however often it is predicted.

    Yields:
        The batch's :class:`SampleStreams`.

    Raises:
        TypeError: if ``indices`` is not a sequence or 1-d tensor of ints.
        ValueError: if an index is negative.
        RuntimeError: if no base seed is given and the package has not seeded this process.

    Examples:
        >>> import torch
        >>> probs = torch.tensor([[0.2, 0.3, 0.5], [0.6, 0.2, 0.2], [0.1, 0.1, 0.8]])
        >>> with sample_streams([10, 11, 12], base_seed=3) as streams:
        ...     together = streams.multinomial(probs)
        >>> with sample_streams([11], base_seed=3) as streams:  # sample 11 alone, in another batch
        ...     alone = streams.multinomial(probs[1:2])
        >>> torch.equal(alone[0], together[1])
        True
    """
    seeds = _indices(indices)
    pass_keys = current_evaluation_keys() or (None, 0)
    if base_seed is None:
        base_seed = pass_keys[0] if pass_keys[0] is not None else current_seeds()["base_seed"]
        if base_seed is None:
            raise RuntimeError(
                "sample_streams() needs the run's base seed: pass `base_seed`, or seed the process with set_seed() or"
                " a deterministic strategy first"
            )
    under_way = current_evaluation_pass() or ("evaluation", 0, 0)
    keys = (
        under_way[0] if stage is None else stage,
        under_way[1] if epoch is None else int(epoch),
        under_way[2] if step is None else int(step),
        pass_keys[1] if call is None else int(call),
    )
    streams = SampleStreams([sample_seed(base_seed, index, *keys) for index in seeds])
    with _DropoutRouting(streams):
        yield streams
