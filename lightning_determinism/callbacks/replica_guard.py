"""ReplicaGuard: what the tensor-parallel dimension replicates stays bitwise equal across it, checked every n steps.

Under tensor parallelism every parameter or buffer that is not sharded along the tensor-parallel dimension (a
LayerNorm, a head, a plain tensor, a ``Replicate`` DTensor placement) is held by every tensor-parallel peer and must
stay equal there: nothing synchronises it again. Other dropout masks on a replicated activation, another intra-op
thread count (a reduction summed in another order) or a kernel that is not deterministic make the copies drift apart
silently. The guard compares sha256 digests (never the tensors) across the tensor-parallel group after the first
optimizer step, every ``every_n_train_steps`` steps, before every checkpoint is written and at the end of fit, and
raises one error naming the step, the first parameter that differs and the ranks: no run ends, and no checkpoint is
saved, with drifted replicas unsaid, however short.
"""

from __future__ import annotations

import hashlib
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_determinism._compat.access import device_mesh_of, should_accumulate

TP_DIM = "tensor_parallel"


def _replicated_on(tensor: torch.Tensor, dim: str) -> torch.Tensor | None:
    """The local tensor if ``tensor`` is replicated along mesh dimension ``dim`` (plain tensors are), else ``None``."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(tensor, DTensor):
        return tensor
    names = tensor.device_mesh.mesh_dim_names or ()
    if dim not in names:
        return tensor.to_local()  # a mesh without that dimension: every peer along it holds the same DTensor
    return tensor.to_local() if isinstance(tensor.placements[names.index(dim)], Replicate) else None


def replicated_digests(module: torch.nn.Module, dim: str = TP_DIM) -> dict[str, str]:
    """sha256 of every parameter and buffer of ``module`` that mesh dimension ``dim`` replicates, by name.

    Examples:
        >>> _ = torch.manual_seed(0)
        >>> sorted(replicated_digests(torch.nn.Linear(2, 1)))
        ['bias', 'weight']
    """
    out = {}
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        local = _replicated_on(tensor.detach(), dim)
        if local is not None:
            data = local.contiguous().cpu()
            out[name] = hashlib.sha256(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest()
    return out


class ReplicaGuard(Callback):
    """Check that tensor-parallel peers hold bitwise-equal replicated tensors, so no run ends with them drifted.

    The check runs after the first optimizer step, every ``every_n_train_steps`` steps, whenever a checkpoint is
    saved (before it is written: a drifted state is never saved as if it were sound) and at the end of fit; a step
    is checked once. ``DeterministicModelParallelStrategy`` adds one (every 100 steps) unless the trainer has one; on a
    strategy without a ``"tensor_parallel"`` mesh dimension (or of size 1) it does nothing.

    Args:
        every_n_train_steps: how often, in optimizer steps, besides the first step, the saves and the end; ``0``
            turns the guard off.

    Raises:
        ValueError: for ``every_n_train_steps`` that is not a non-negative int.

    Examples:
        >>> ReplicaGuard(every_n_train_steps=10).every_n_train_steps
        10
    """

    def __init__(self, every_n_train_steps: int = 100) -> None:
        if isinstance(every_n_train_steps, bool) or not isinstance(every_n_train_steps, int) or every_n_train_steps < 0:
            raise ValueError(f"`every_n_train_steps` must be an int >= 0, got {every_n_train_steps!r}")
        self.every_n_train_steps = every_n_train_steps
        self.checks = 0
        self._checked_step = -1

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        n, step = self.every_n_train_steps, trainer.global_step
        if n and not should_accumulate(trainer) and (step % n == 0 or step == 1):
            self._check_once(trainer, pl_module)

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self.every_n_train_steps:  # every rank saves (Lightning's contract): the collective pairs up
            self._check_once(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.every_n_train_steps:
            self._check_once(trainer, pl_module)

    def _check_once(self, trainer: pl.Trainer, module: torch.nn.Module) -> None:
        if trainer.global_step != self._checked_step:
            self.check(trainer, module)
            self._checked_step = trainer.global_step

    def check(self, trainer: pl.Trainer, module: torch.nn.Module) -> None:
        """Compare the digests across the tensor-parallel group (collective within it); raise on the first mismatch.

        Raises:
            RuntimeError: naming the step, the first parameter or buffer that differs, and the two ranks.
        """
        mesh = device_mesh_of(trainer.strategy)
        names = getattr(mesh, "mesh_dim_names", None) or ()
        if mesh is None or TP_DIM not in names or mesh[TP_DIM].size() < 2:
            return
        group = mesh[TP_DIM].get_group()
        mine = replicated_digests(module)
        peers: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(peers, (dist.get_rank(), mine), group=group)
        self.checks += 1
        first_rank, first = peers[0]
        for rank, theirs in peers[1:]:
            for name in sorted(set(first) | set(theirs)):
                if first.get(name) != theirs.get(name):
                    coordinate = mesh.get_coordinate()
                    raise RuntimeError(
                        f"[rank: {dist.get_rank()}] step {trainer.global_step}: `{name}`, replicated along"
                        f" tensor_parallel, differs between ranks {first_rank} and {rank} (data_parallel coordinate"
                        f" {coordinate[0] if coordinate else '?'}): tensor-parallel peers drew other random numbers,"
                        " computed with other thread counts or ran a kernel that is not deterministic"
                        " (docs/model-parallel.md)"
                    )


__all__ = ["ReplicaGuard", "replicated_digests"]
