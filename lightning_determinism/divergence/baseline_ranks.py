"""What every rank contributes to a baseline step: a row of int64 words, completed by the rows of all ranks.

A step's record needs every rank: its loss is the mean over all ranks' micro-batches, a sharded parameter's norm and
digest are sums over its shards, and a parameter held whole on several ranks (DDP's replicas, what tensor parallel
leaves replicated) is checked across them. Each rank puts its part of a step into one :class:`StepRow` (no
communication but the reduction of a ``DTensor`` left ``Partial``; a plain tensor's norm and digest are final at
once), and the rows of all ranks complete the record
(:meth:`StepRow.complete`). The recorder gathers them with :func:`gather_rows`: in record mode the rows of all its
steps once, when it writes the file (none during the steps), in compare mode each step's (one a step).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from lightning_determinism._compat.access import foreach_norms
from lightning_determinism.divergence.tensor_digest import (
    combine,
    float_word,
    gather_words,
    hex_digest,
    is_dtensor,
    local_digest_lanes,
    local_square_sums,
    mesh_ranks,
    signed_word,
    word_float,
)
from lightning_determinism.exact import TOTAL_LIMIT, fixed_mean, fixed_total, int_limbs
from lightning_determinism.seeding.seeds import _rank_and_world_size


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return _rank_and_world_size()[0]


def device_of(module: torch.nn.Module) -> torch.device:
    """Where a module's first parameter lives (CPU for a module without parameters)."""
    first = next(iter(module.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def plain_norms(tensors: list[torch.Tensor]) -> list[float]:
    """Each tensor's ``float(tensor.double().norm())`` (format 1's bits, tested), in one ``_foreach_norm``.

    No float64 copy (the norm upcasts as it reads), one call and one copy to the host for all tensors.
    """
    if not tensors:
        return []
    norms = foreach_norms([t.detach() for t in tensors])
    return torch.stack(norms).tolist()  # type: ignore[no-any-return]


class StepRow:
    """This rank's part of one baseline step, as int64 words (:attr:`words`), and how the ranks' words complete it.

    :meth:`norms` and :meth:`digests` return what is final on this rank (a plain tensor's value; ``None`` for a
    ``DTensor``'s, which :meth:`complete` fills in), :meth:`loss` takes the step's exact loss sum.

    Examples:
        >>> row = StepRow()
        >>> row.norms("grad_norms", [("w", torch.tensor([3.0, 4.0])), ("b", None)])
        {'w': 5.0}
        >>> row.loss(3 << 64, 2, 0)  # a sum of 3.0 over 2 terms
        >>> record = {"grad_norms": {"w": 5.0}}
        >>> row.complete(record, [row.words])  # one rank: nothing differs
        {}
        >>> record["loss"]
        1.5
    """

    def __init__(self) -> None:
        self.words: list[int] = []
        self._loss: int | None = None  # the first of its 5 words: limbs (3), count, unusable
        self._replicas: list[tuple[str, int]] = []  # (key, word): a plain tensor's norm, the same bits on every rank
        self._shared: list[tuple[str, str, int, list[int]]] = []  # (group, name, word, mesh ranks): a DTensor's

    def norms(self, group: str, named: Sequence[tuple[str, torch.Tensor | None]]) -> dict[str, float | None]:
        """Each present tensor's 2-norm in float64, by name (``None`` for a ``DTensor``'s, until :meth:`complete`)."""
        sharded = [t for _, t in named if t is not None and is_dtensor(t)]
        squares = iter(local_square_sums(sharded))
        plain = iter(plain_norms([t for _, t in named if t is not None and not is_dtensor(t)]))
        values: dict[str, float | None] = {}
        for name, tensor in named:
            if tensor is not None and is_dtensor(tensor):
                self._shared.append((group, name, len(self.words), mesh_ranks(tensor)))
                self.words.append(float_word(next(squares)))
                values[name] = None
                continue
            value = None if tensor is None else next(plain)
            self._replicas.append((f"{group}[{name}]", len(self.words)))
            self.words.append(float_word(math.nan if value is None else value))
            if value is not None:
                values[name] = value
        return values

    def digests(self, named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, str | None]:
        """Each tensor's digest, by name (``None`` for a ``DTensor``'s, until :meth:`complete`)."""
        values: dict[str, str | None] = {}
        for (name, tensor), lanes in zip(named, local_digest_lanes([t for _, t in named]), strict=True):
            if is_dtensor(tensor):
                self._shared.append(("param_digests", name, len(self.words), mesh_ranks(tensor)))
                self.words += [signed_word(lanes[0]), signed_word(lanes[1])]
                values[name] = None
            else:
                values[name] = hex_digest(lanes)
        return values

    def loss(self, total: int, count: int, unusable: int) -> None:
        """The step's loss terms on this rank: their exact sum in units of ``2**-64``, how many, how many unusable."""
        limbs = int_limbs(total)
        if not -TOTAL_LIMIT < limbs[0] < TOTAL_LIMIT:  # past int64's headroom over the ranks: not exact any more
            limbs, unusable = [0, 0, 0], unusable + 1
        self._loss = len(self.words)
        self.words += [*limbs, count, unusable]

    def complete(self, record: dict[str, Any], rows: list[list[int]]) -> dict[str, list[float | None]]:
        """Fill in ``record``'s loss and ``DTensor`` values from every rank's words; return the replicas' disagreements.

        ``rows[r]``: global rank ``r``'s words. The disagreements: every rank's value where the ranks' bits differ.

        The loss: the mean of every rank's terms from their exact sums (the same bits on any world size); NaN when
        there was no term, or one that was not finite or too large for the exact sum.
        """
        if self._loss is not None:
            units, high, low, count, unusable = (sum(row[self._loss + k] for row in rows) for k in range(5))
            record["loss"] = math.nan if unusable else fixed_mean(fixed_total(units, high, low), count)
        for group, name, word, ranks in self._shared:
            if group == "param_digests":
                lanes = [(rows[r][word], rows[r][word + 1]) for r in ranks]
                record[group][name] = hex_digest(combine(lanes))
            elif name in record[group]:
                record[group][name] = math.sqrt(math.fsum(word_float(rows[r][word]) for r in ranks))
        by_rank: dict[str, list[float | None]] = {}
        for key, word in self._replicas:
            if any(row[word] != rows[0][word] for row in rows):  # the bits differ: a skipped all-reduce
                values = [word_float(row[word]) for row in rows]
                by_rank[key] = [None if math.isnan(v) else v for v in values]
        return by_rank


def gather_rows(rows: list[list[int]]) -> list[list[list[int]]]:
    """Every rank's rows (the same number of words each), by global rank: one ``all_gather`` (none on one process).

    Raises:
        RuntimeError: if this rank's rows are not all of one width (the model changed its parameters mid-record).
    """
    widths = {len(row) for row in rows}
    if len(widths) > 1:
        raise RuntimeError(f"a baseline's steps must have one layout of words, got widths {sorted(widths)}")
    return gather_words(rows, widths.pop() if widths else 0)


__all__ = ["StepRow", "device_of", "gather_rows", "plain_norms", "rank"]
