"""DistributedPerplexity: exact-count, float64, memory-bounded perplexity that agrees across processes.

The per-token negative log-likelihood is computed chunk by chunk as ``(max - x_target) + log(sum(exp(x - max)))``:
the difference of logits is taken in float64, the exponentials in float32 (at least) inside a chunk that fits in
cache; each row's exponentials, and then the per-token values, are summed in float64. Nothing of size ``N x V`` is
ever allocated, and the result stays finite where ``softmax().log()`` underflows to ``inf``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.plot import _AX_TYPE, _PLOT_OUT_TYPE

from lightning_determinism.errors import DeterminismWarning

_CHUNK_BYTES_CPU = 2 * 2**20  # a chunk of float32 rows that stays in a CPU's L2/L3 cache (fastest measured)
_CHUNK_BYTES_CUDA = 256 * 2**20  # on a GPU, fewer and larger kernels win
_EXP_FLOOR = -87.0  # exp() below this is subnormal: ~35x slower on CPUs, and < 2e-38 of the row's sum


class _PerplexityStats(NamedTuple):
    nll_sum: Tensor  # float64 scalar
    tokens: Tensor  # int64 scalar
    nonfinite: Tensor  # int64 scalar: counted tokens whose NLL is inf or nan


def _check_inputs(preds: Tensor, target: Tensor, ignore_index: int | None) -> None:
    if not isinstance(preds, Tensor) or not preds.is_floating_point():
        kind = preds.dtype if isinstance(preds, Tensor) else type(preds).__name__
        raise TypeError(f"`preds` must be a floating point tensor of logits, got {kind}")
    if (
        not isinstance(target, Tensor)
        or target.is_floating_point()
        or target.is_complex()
        or target.dtype == torch.bool
    ):
        kind = target.dtype if isinstance(target, Tensor) else type(target).__name__
        raise TypeError(f"`target` must be an integer tensor of token ids, got {kind}")
    if preds.ndim not in (2, 3) or preds.shape[:-1] != target.shape:
        raise ValueError(
            "`preds` must be [B, T, V] with `target` [B, T], or [N, V] with `target` [N];"
            f" got preds {tuple(preds.shape)} and target {tuple(target.shape)}"
        )
    if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
        raise TypeError(f"`ignore_index` must be an int or None, got {ignore_index!r}")


def _chunk_rows(vocab_size: int, device: torch.device, chunk_size: int | None) -> int:
    if chunk_size is not None:
        return chunk_size
    budget = _CHUNK_BYTES_CUDA if device.type == "cuda" else _CHUNK_BYTES_CPU
    return max(1, budget // (4 * max(vocab_size, 1)))


def _token_nll(logits: Tensor, ids: Tensor, chunk_size: int | None = None) -> Tensor:
    """Per-token NLL (float64) of valid ``ids`` ``[N]`` under ``logits`` ``[N, V]``, one cache-sized chunk at a time.

    ``nll = (max - x_target) + log(sum(exp(x - max)))``: the first term is exact in float64; the exponentials are
    float32 (at least) and each row's sum of them is accumulated in float64. Both choices are measured, not taken
    on faith (``benchmarks/perplexity.py``): a float32 row sum drops the many tiny terms of a peaked distribution
    (a bias of -1e-8 relative per token on logits like a trained LM's), and ``exp2``/the fused softmax kernels,
    though 1.5-3x faster on CPUs, carry a bias of 1e-9 to 1e-6 per token, which a sum over billions of tokens keeps.
    """
    vocab = logits.shape[-1]
    work_dtype = torch.promote_types(logits.dtype, torch.float32)
    rows = _chunk_rows(vocab, logits.device, chunk_size)
    n = logits.shape[0]
    shifted = torch.empty((min(rows, n), vocab), dtype=work_dtype, device=logits.device)
    row_max = torch.empty((n, 1), dtype=logits.dtype, device=logits.device)
    row_sum = torch.empty(n, dtype=torch.float64, device=logits.device)
    for start in range(0, n, rows):
        chunk = logits[start : start + rows]
        k = chunk.shape[0]
        y = shifted[:k]
        top = torch.amax(chunk, dim=-1, keepdim=True, out=row_max[start : start + k])
        if chunk.dtype == work_dtype:
            torch.sub(chunk, top, out=y)
        else:  # fp16/bf16: upcast first, so the difference is taken in float32
            y.copy_(chunk).sub_(top)
        y.clamp_(min=_EXP_FLOOR).exp_()
        torch.sum(y, dim=-1, dtype=torch.float64, out=row_sum[start : start + k])
    picked = logits.gather(-1, ids[:, None])
    return (row_max.double() - picked.double()).squeeze(-1) + row_sum.log()


def _perplexity_update(
    preds: Tensor, target: Tensor, ignore_index: int | None = None, chunk_size: int | None = None
) -> _PerplexityStats:
    """Sum of the per-token NLL (float64), number of counted tokens (int64) and how many NLLs are not finite.

    Args:
        preds: logits ``[B, T, V]`` or ``[N, V]``, any float dtype (half types are upcast per chunk).
        target: token ids ``[B, T]`` or ``[N]``.
        ignore_index: a target value that is not counted.
        chunk_size: rows per chunk; ``None`` picks about 2 MiB of float32 per chunk (256 MiB on CUDA).

    Raises:
        TypeError: ``preds`` not floating point, ``target`` not integer.
        ValueError: mismatched shapes, or a target outside ``[0, V)`` that is not ``ignore_index``.
    """
    _check_inputs(preds, target, ignore_index)
    vocab = preds.shape[-1]
    logits = preds.reshape(-1, vocab)
    ids = target.reshape(-1).long()
    keep = ids != ignore_index if ignore_index is not None else torch.ones_like(ids, dtype=torch.bool)
    bad = keep & ((ids < 0) | (ids >= vocab))
    if bool(bad.any()):
        first = int(ids[bad][0])
        raise ValueError(
            f"`target` values must be in [0, {vocab}) or equal `ignore_index`={ignore_index}, got {first}"
            f" ({int(bad.sum())} such tokens)"
        )
    nll = _token_nll(logits, torch.where(keep, ids, torch.zeros_like(ids)), chunk_size)
    counted = nll[keep]
    return _PerplexityStats(
        nll_sum=counted.sum(),
        tokens=keep.sum(dtype=torch.int64),
        nonfinite=(~torch.isfinite(counted)).sum(dtype=torch.int64),
    )


def _perplexity_compute(nll_sum: Tensor, count: Tensor) -> Tensor:
    """``exp(nll_sum / count)`` in float64: ``inf`` on overflow, NaN when nothing was counted."""
    if int(count) == 0:
        return torch.tensor(float("nan"), dtype=torch.float64, device=nll_sum.device)
    return torch.exp(nll_sum.double() / count.double())


def _warn_nonfinite(nonfinite: int, count: int) -> None:
    warnings.warn(
        f"`preds` held non-finite logits: the NLL of {nonfinite} of {count} counted tokens is inf or nan, so the"
        " perplexity is not finite.",
        DeterminismWarning,
        stacklevel=3,
    )


def perplexity(preds: Tensor, target: Tensor, ignore_index: int | None = None, chunk_size: int | None = None) -> Tensor:
    """Perplexity of ``target`` under the logits ``preds``, as a float64 scalar.

    Args:
        preds: logits ``[B, T, V]`` or ``[N, V]`` in any float dtype.
        target: token ids ``[B, T]`` or ``[N]``.
        ignore_index: a target value that is not counted (e.g. ``-100`` for padding).
        chunk_size: rows per chunk; ``None`` chooses by memory (about 2 MiB of float32 on CPU).

    Returns:
        ``exp(mean NLL)``; NaN with a warning when no token is counted.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> logits = torch.randn(2, 5, 4)
        >>> target = torch.randint(4, (2, 5))
        >>> target[1, 3:] = -100
        >>> ppl = perplexity(logits, target, ignore_index=-100)
        >>> ref = torch.nn.functional.cross_entropy(logits.double().flatten(0, 1), target.flatten(), ignore_index=-100)
        >>> bool(torch.isclose(ppl, ref.exp(), rtol=1e-6)), ppl.dtype  # float32 logits: ~1e-8 per token
        (True, torch.float64)
    """
    stats = _perplexity_update(preds, target, ignore_index, chunk_size)
    count = int(stats.tokens)
    if count == 0:
        warnings.warn(
            "perplexity counted no token (all ignored or empty); returning nan", DeterminismWarning, stacklevel=2
        )
    elif int(stats.nonfinite):
        _warn_nonfinite(int(stats.nonfinite), count)
    return _perplexity_compute(stats.nll_sum, stats.tokens)


class DistributedPerplexity(Metric):
    """Perplexity with a float64 NLL sum and an int64 token count, summed across processes on ``compute()``.

    Unlike ``torchmetrics.text.Perplexity`` (float32 states, ``softmax().log()``, an ``N x V`` probability matrix per
    update), the count stays exact past ``2**24`` tokens, the NLL is finite wherever the true value is, and an
    update's extra memory is one chunk of rows. The states are dtype-locked: ``half()``, ``set_dtype()`` and
    Lightning's ``bf16-true``/``16-true`` precision cannot downgrade them.

    Args:
        ignore_index: a target value that is not counted (e.g. ``-100``).
        chunk_size: rows per chunk; ``None`` chooses by memory.
        kwargs: passed to :class:`torchmetrics.Metric` (``process_group``, ``sync_on_compute``, ...).

    Example:
        >>> _ = torch.manual_seed(0)
        >>> metric = DistributedPerplexity(ignore_index=-100)
        >>> logits, target = torch.randn(2, 6, 10), torch.randint(10, (2, 6))
        >>> metric.update(logits[:1], target[:1])
        >>> metric.update(logits[1:], target[1:])
        >>> bool(torch.isclose(metric.compute(), perplexity(logits, target), rtol=1e-12))
        True
        >>> metric.count
        tensor(12)
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False
    plot_lower_bound = 1.0

    _LOCKED_DTYPES = {"nll_sum": torch.float64, "count": torch.int64}

    nll_sum: Tensor
    count: Tensor

    def __init__(self, ignore_index: int | None = None, chunk_size: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
            raise TypeError(f"`ignore_index` must be an int or None, got {ignore_index!r}")
        if chunk_size is not None and (
            isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
        ):
            raise ValueError(f"`chunk_size` must be a positive int or None, got {chunk_size!r}")
        self.ignore_index = ignore_index
        self.chunk_size = chunk_size
        self.add_state("nll_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")
        self._warned_nonfinite = False
        self._warned_empty = False
        # Same bookkeeping as `update` (cache invalidation, update count) for the second way in.
        self.update_from_loss = self._wrap_update(self.update_from_loss)  # type: ignore[method-assign]

    def update(self, preds: Tensor, target: Tensor) -> None:  # type: ignore[override]
        """Add a batch of logits ``[B, T, V]`` (or ``[N, V]``) and token ids ``[B, T]`` (or ``[N]``)."""
        stats = _perplexity_update(preds, target, self.ignore_index, self.chunk_size)
        self.nll_sum += stats.nll_sum.to(self.nll_sum.device)
        self.count += stats.tokens.to(self.count.device)
        if not self._warned_nonfinite and int(stats.nonfinite):
            self._warned_nonfinite = True
            _warn_nonfinite(int(stats.nonfinite), int(stats.tokens))

    def update_from_loss(self, loss_sum: Tensor | float, num_tokens: Tensor | int) -> None:
        """Add an already summed NLL (e.g. a Hugging Face model's mean loss times its token count).

        Args:
            loss_sum: the *summed* NLL over ``num_tokens`` tokens, natural log.
            num_tokens: how many tokens it covers, a non-negative integer.

        Raises:
            TypeError: ``num_tokens`` not an integer.
            ValueError: ``num_tokens`` negative or ``loss_sum`` not a scalar.
        """
        tokens = num_tokens.item() if isinstance(num_tokens, Tensor) and num_tokens.numel() == 1 else num_tokens
        if isinstance(tokens, bool) or not isinstance(tokens, int):
            raise TypeError(f"`num_tokens` must be a non-negative int (or integer tensor), got {num_tokens!r}")
        if tokens < 0:
            raise ValueError(f"`num_tokens` must be >= 0, got {tokens}")
        loss = torch.as_tensor(loss_sum, dtype=torch.float64)
        if loss.numel() != 1:
            raise ValueError(f"`loss_sum` must be a scalar (the summed NLL), got shape {tuple(loss.shape)}")
        if not self._warned_nonfinite and not bool(torch.isfinite(loss)):
            self._warned_nonfinite = True
            _warn_nonfinite(tokens, tokens)
        self.nll_sum += loss.reshape(()).to(self.nll_sum.device)
        self.count += tokens

    def compute(self) -> Tensor:
        """``exp(nll_sum / count)`` in float64 over everything seen on every process."""
        if int(self.count) == 0 and not self._warned_empty:
            self._warned_empty = True
            warnings.warn(
                "DistributedPerplexity counted no token; compute() returns nan", DeterminismWarning, stacklevel=2
            )
        return _perplexity_compute(self.nll_sum, self.count)

    def _apply(self, fn: Callable, exclude_state: Sequence[str] = ()) -> torch.nn.Module:
        # Let torchmetrics move/cast everything else, then move the locked states without ever casting them:
        # a float64 -> bf16 -> float64 round trip would already have lost the sum.
        this = super()._apply(fn, exclude_state=tuple(exclude_state) + tuple(self._LOCKED_DTYPES))
        for name, dtype in self._LOCKED_DTYPES.items():
            setattr(this, name, getattr(this, name).to(device=this.device, dtype=dtype))
            this._defaults[name] = this._defaults[name].to(device=this.device, dtype=dtype)  # type: ignore[union-attr,index,operator,call-overload]
        return this

    def plot(self, val: Tensor | Sequence[Tensor] | None = None, ax: _AX_TYPE | None = None) -> _PLOT_OUT_TYPE:
        """Plot one value or a sequence of values (``compute()`` when ``val`` is None); needs matplotlib."""
        return self._plot(val, ax)


__all__ = ["DistributedPerplexity", "perplexity"]
