"""DistributedPerplexity: perplexity with the same bits on any world size, batch split and order of batches.

Two things make that hold (see docs/perplexity.md):

- each token's NLL does not depend on the rows that share its batch (:mod:`~lightning_determinism.metrics._nll`);
- the NLLs are summed as exact fixed-point integers (:mod:`~lightning_determinism.exact`), which add up to the same
  bits in any order and across processes, and the count is an int64.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lightning_determinism._compat.checks import AX_TYPE, PLOT_OUT_TYPE
from lightning_determinism.errors import DeterminismWarning
from lightning_determinism.exact import TERM_LIMIT, exact_mean, exact_sum, limbs_to_float, zero_limbs
from lightning_determinism.metrics._exact_metric import ExactMetric, count_nonfinite
from lightning_determinism.metrics._nll import KERNEL, token_nll, use_compiled
from lightning_determinism.metrics._portable import exp_float


class _PerplexityStats(NamedTuple):
    limbs: Tensor  # int64 [3]: the exact sum of the finite NLLs
    tokens: Tensor  # int64 scalar: counted tokens
    nonfinite: Tensor  # int64 [3]: counted tokens whose NLL is nan, +inf, -inf


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
    _check_ignore_index(ignore_index)


def _check_ignore_index(ignore_index: object) -> None:
    if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
        raise TypeError(f"`ignore_index` must be an int or None, got {ignore_index!r}")


def _check_compile(compile: object) -> None:
    if compile is not None and not isinstance(compile, bool):
        raise TypeError(f"`compile` must be True, False or None (automatic), got {compile!r}")


def _perplexity_update(
    preds: Tensor,
    target: Tensor,
    ignore_index: int | None = None,
    chunk_size: int | None = None,
    compile: bool | None = None,
) -> _PerplexityStats:
    """Exact sum of the per-token NLL, number of counted tokens and how many NLLs are not finite.

    Args:
        preds: logits ``[B, T, V]`` or ``[N, V]``, any float dtype (half types are upcast inside the kernel).
        target: token ids ``[B, T]`` or ``[N]``.
        ignore_index: a target value that is not counted.
        chunk_size: rows per chunk of the eager path; ``None`` picks about 2 MiB of float32 per chunk.
        compile: use the compiled kernel; ``None`` decides by device and vocabulary.

    Raises:
        TypeError: ``preds`` not floating point, ``target`` not integer.
        ValueError: mismatched shapes, a target outside ``[0, V)`` that is not ``ignore_index``, or a token NLL
            past the exact range (``2**42`` nats).
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
    compiled = use_compiled(compile, logits.device, vocab)
    nll = token_nll(logits, torch.where(keep, ids, torch.zeros_like(ids)), compiled, chunk_size)
    counted = nll[keep]
    finite = torch.isfinite(counted)
    values = counted[finite]
    if values.numel() and float(values.max()) >= TERM_LIMIT:
        raise ValueError(
            f"a token's NLL is {float(values.max()):.4g} nats, past the exact range of 2**42 nats: the logits of its"
            " row are further apart than any trained model's"
        )
    return _PerplexityStats(
        limbs=exact_sum(values) if values.numel() else zero_limbs(preds.device),
        tokens=keep.sum(dtype=torch.int64),
        nonfinite=count_nonfinite(counted),
    )


def _perplexity_compute(mean_nll: float, device: torch.device | None = None) -> Tensor:
    """``exp(mean NLL)`` as a float64 tensor (the same bits on every machine): ``inf`` on overflow, NaN stays NaN."""
    return torch.tensor(exp_float(mean_nll), dtype=torch.float64, device=device)


def _warn_nonfinite(nonfinite: int, count: int) -> None:
    warnings.warn(
        f"`preds` held non-finite logits: the NLL of {nonfinite} of {count} counted tokens is inf or nan, so the"
        " perplexity is not finite.",
        DeterminismWarning,
        stacklevel=4,
    )


def perplexity(
    preds: Tensor,
    target: Tensor,
    ignore_index: int | None = None,
    chunk_size: int | None = None,
    compile: bool | None = None,
) -> Tensor:
    """Perplexity of ``target`` under the logits ``preds``, as a float64 scalar (not differentiable).

    Args:
        preds: logits ``[B, T, V]`` or ``[N, V]`` in any float dtype; may require grad.
        target: token ids ``[B, T]`` or ``[N]``.
        ignore_index: a target value that is not counted (e.g. ``-100`` for padding).
        chunk_size: rows per chunk of the eager path; ``None`` chooses by memory (about 2 MiB of float32 on CPU).
        compile: ``True``/``False`` for the compiled kernel or the eager path; ``None`` decides by device and
            vocabulary (see docs/perplexity.md).

    Returns:
        ``exp(mean NLL)``; NaN with a warning when no token is counted.

    Examples:
        >>> _ = torch.manual_seed(0)
        >>> logits = torch.randn(2, 5, 4)
        >>> target = torch.randint(4, (2, 5))
        >>> target[1, 3:] = -100
        >>> ppl = perplexity(logits, target, ignore_index=-100)
        >>> ref = torch.nn.functional.cross_entropy(logits.double().flatten(0, 1), target.flatten(), ignore_index=-100)
        >>> bool(torch.isclose(ppl, ref.exp(), rtol=1e-6)), ppl.dtype  # float32 logits: ~1e-8 per token
        (True, torch.float64)
    """
    _check_compile(compile)
    stats = _perplexity_update(preds, target, ignore_index, chunk_size, compile)
    count = int(stats.tokens)
    nan, pos, _ = (int(v) for v in stats.nonfinite.tolist())
    if count == 0:
        warnings.warn(
            "perplexity counted no token (all ignored or empty); returning nan", DeterminismWarning, stacklevel=2
        )
        mean = math.nan
    elif nan or pos:
        _warn_nonfinite(nan + pos, count)
        mean = math.nan if nan else math.inf
    else:
        mean = exact_mean(stats.limbs, count)
    return _perplexity_compute(mean, preds.device)


class DistributedPerplexity(ExactMetric):
    """Perplexity summed exactly over batches and processes: the same bits on 1, 2 or 8 processes, any batch size.

    Each token's NLL is computed without depending on the other rows of its batch, with the same bits on every
    kernel and CPU (:mod:`~lightning_determinism.metrics._portable`), then added as an exact fixed-point number (64
    fractional bits) to int64 limbs; the token count is an int64. ``compute()`` sums the states over processes
    (integers: exact in any order), divides the exact sum by the count (rounded once) and returns its ``exp`` in
    float64 (within about 1 ulp, from IEEE operations alone: the same bits everywhere). Unlike
    ``torchmetrics.text.Perplexity`` (float32 states, ``softmax().log()``, an ``N x V`` probability matrix per
    update), the count stays exact past ``2**24`` tokens, the NLL is finite wherever the true value is, and an
    update needs no memory of the size of the logits. States are dtype-locked.

    Args:
        ignore_index: a target value that is not counted (e.g. ``-100``).
        chunk_size: rows per chunk of the eager path; ``None`` chooses by memory.
        compile: ``True``/``False`` for the compiled kernel or the eager path; ``None`` decides by device and
            vocabulary (CPU and ``V >= 4096`` compile). One metric keeps one path, whatever the batch.
        kwargs: passed to :class:`torchmetrics.Metric` (``process_group``, ``dist_sync_on_step``, ...).

    The attribute ``kernel`` names the path the last update took (``"C kernel (vector block, AVX2)"``,
    ``"C kernel (auto-vectorised, AVX-512)"``, ``"Inductor's kernel"``, ``"eager path"``, ``"compiled"`` on CUDA):
    its speed, never its value.

    Raises:
        TypeError: for an ``ignore_index`` that is not an int, or a ``compile`` that is not a bool or None.
        ValueError: for a ``chunk_size`` that is not a positive int.

    Examples:
        >>> _ = torch.manual_seed(0)
        >>> metric = DistributedPerplexity(ignore_index=-100)
        >>> logits, target = torch.randn(2, 6, 10), torch.randint(10, (2, 6))
        >>> metric.update(logits[:1], target[:1])
        >>> metric.update(logits[1:], target[1:])
        >>> torch.equal(metric.compute(), perplexity(logits, target))  # exact sums: any split, the same bits
        True
        >>> metric.count
        tensor(12)
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False
    plot_lower_bound = 1.0

    _LIMBS = "nll_limbs"
    _EXTRA_UPDATES = ("update_from_loss",)

    nll_limbs: Tensor

    def __init__(
        self,
        ignore_index: int | None = None,
        chunk_size: int | None = None,
        compile: bool | None = None,
        **kwargs: Any,
    ) -> None:
        _check_ignore_index(ignore_index)
        if chunk_size is not None and (
            isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
        ):
            raise ValueError(f"`chunk_size` must be a positive int or None, got {chunk_size!r}")
        _check_compile(compile)
        super().__init__(**kwargs)
        self.ignore_index = ignore_index
        self.chunk_size = chunk_size
        self.compile_kernel = compile  # not `self.compile`: nn.Module.compile is a method
        # The path the last update took, e.g. "C kernel (vector block, AVX2)", "eager path": the speed, not the value
        self.kernel: str | None = None
        self._warned_nonfinite = False
        self._warned_empty = False

    @property
    def nll_sum(self) -> Tensor:
        """The summed NLL of this process's states as float64 (correctly rounded from the exact value)."""
        return torch.tensor(limbs_to_float(self.nll_limbs), dtype=torch.float64, device=self.nll_limbs.device)

    def update(self, preds: Tensor, target: Tensor) -> None:  # type: ignore[override]
        """Add a batch of logits ``[B, T, V]`` (or ``[N, V]``) and token ids ``[B, T]`` (or ``[N]``)."""
        stats = _perplexity_update(preds, target, self.ignore_index, self.chunk_size, self.compile_kernel)
        compiled = use_compiled(self.compile_kernel, preds.device, int(preds.shape[-1]))
        self.kernel = (
            KERNEL.variant() if compiled and preds.device.type == "cpu" else ("compiled" if compiled else "eager path")
        )
        self._add_limbs(stats.limbs, stats.tokens, stats.nonfinite)
        bad = int(stats.nonfinite.sum())
        if bad and not self._warned_nonfinite:
            self._warned_nonfinite = True
            _warn_nonfinite(bad, int(stats.tokens))

    def update_from_loss(self, loss_sum: Tensor | float, num_tokens: Tensor | int) -> None:
        """Add an already summed NLL (e.g. a Hugging Face model's mean loss times its token count).

        Args:
            loss_sum: the *summed* NLL over ``num_tokens`` tokens, natural log: a number ``>= 0`` (``inf`` and NaN
                are counted like non-finite logits and make the perplexity ``inf``/NaN, with a warning).
            num_tokens: how many tokens it covers, a non-negative integer (``0`` only with ``loss_sum == 0``).

        Raises:
            TypeError: ``num_tokens`` not an integer, ``loss_sum`` not a real number.
            ValueError: ``num_tokens`` negative, ``loss_sum`` negative or not a scalar, or a positive ``loss_sum``
                over no token.
        """
        tokens = num_tokens.item() if isinstance(num_tokens, Tensor) and num_tokens.numel() == 1 else num_tokens
        if isinstance(tokens, bool) or not isinstance(tokens, int):
            raise TypeError(f"`num_tokens` must be a non-negative int (or integer tensor), got {num_tokens!r}")
        if tokens < 0:
            raise ValueError(f"`num_tokens` must be >= 0, got {tokens}")
        if isinstance(loss_sum, Tensor):
            if loss_sum.numel() != 1:
                raise ValueError(f"`loss_sum` must be a scalar (the summed NLL), got shape {tuple(loss_sum.shape)}")
            if not (loss_sum.is_floating_point() or loss_sum.dtype in (torch.int32, torch.int64)):
                raise TypeError(f"`loss_sum` must be a real number, got a {loss_sum.dtype} tensor")
            value = float(loss_sum.detach())
        elif isinstance(loss_sum, (int, float)) and not isinstance(loss_sum, bool):
            value = float(loss_sum)
        else:
            raise TypeError(f"`loss_sum` must be a real number or a scalar tensor, got {loss_sum!r}")
        if value < 0 or value == -math.inf:
            raise ValueError(f"`loss_sum` is a summed negative log-likelihood and cannot be negative, got {value!r}")
        if tokens == 0 and value != 0:
            raise ValueError(f"`loss_sum`={value!r} covers `num_tokens`=0 tokens: a non-zero sum needs tokens")
        if not math.isfinite(value):
            if not self._warned_nonfinite:
                self._warned_nonfinite = True
                result = "nan" if math.isnan(value) else "inf"
                warnings.warn(
                    f"update_from_loss got `loss_sum`={value!r}: the perplexity is {result}.",
                    DeterminismWarning,
                    stacklevel=3,
                )
            self._add_limbs(zero_limbs(), tokens, count_nonfinite(torch.tensor([value])))
            return
        self._add(torch.tensor([value], dtype=torch.float64), tokens)

    def compute(self) -> Tensor:
        """``exp(sum / count)`` in float64 over everything seen on every process."""
        if int(self.count) == 0 and not self._warned_empty:
            self._warned_empty = True
            warnings.warn(
                "DistributedPerplexity counted no token; compute() returns nan", DeterminismWarning, stacklevel=2
            )
        return _perplexity_compute(self._exact_mean(), self.nll_limbs.device)

    def plot(self, val: Tensor | Sequence[Tensor] | None = None, ax: AX_TYPE | None = None) -> PLOT_OUT_TYPE:
        """Plot one value or a sequence of values (``compute()`` when ``val`` is None); needs matplotlib."""
        return self._plot(val, ax)


__all__ = ["DistributedPerplexity", "perplexity"]
