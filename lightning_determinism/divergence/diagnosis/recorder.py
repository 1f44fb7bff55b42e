"""Record where a run's bits come from, step by step: the probe's core, usable from any loop.

Per recorded optimizer step and micro-batch: the batch's digest and its samples as a multiset, the random states at
its start, every module call's input, output and random state at entry and exit (and the torch functions it ran),
the loss, the gradients flowing back through each call's outputs, each parameter's gradient from this micro-batch
before any reduction; per step, the reduced gradients just before the optimizer step, the parameters and optimizer
states after it. Digests, not tensors (see :mod:`~lightning_determinism.divergence.diagnosis.digest`), and a norm beside
each.

:class:`ProbeRecorder` does it for a hand-written loop (plain PyTorch, Lightning Fabric)::

    probe = ProbeRecorder("probe.json", steps=3)
    for step, batch in enumerate(loader):
        probe.before_micro_batch(model, batch, step, optimizer)
        loss = model(batch).mean()
        probe.before_backward(loss)
        loss.backward()                           # or fabric.backward(loss)
        probe.after_backward()
        probe.before_optimizer_step(model)
        optimizer.step()
        optimizer.zero_grad()
        probe.after_optimizer_step(model, optimizer)
    probe.finish()

:class:`~lightning_determinism.DivergenceProbe` is the same thing as a Trainer callback. Every rank calls every
method; rank 0 gathers the ranks' micro-batches and writes the file (:mod:`~.probe_file`) after the last recorded step
(or in :meth:`~ProbeRecorder.finish`, for a run that ended earlier).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_determinism.checkpoints.atomic import write_atomically
from lightning_determinism.divergence.diagnosis.digest import (
    digest,
    norm,
    rng_digests,
    sample_summary,
    whole_digests,
    whole_norms,
)
from lightning_determinism.divergence.diagnosis.hooks import ModuleHooks
from lightning_determinism.divergence.diagnosis.probe_file import FORMAT, KIND
from lightning_determinism.seeding.backends import determinism_report
from lightning_determinism.seeding.rank_states import all_gather
from lightning_determinism.seeding.seeds import _rank_and_world_size


def check_steps(steps: object) -> tuple[int, ...]:
    """``steps`` as the sorted optimizer steps to record: an int ``n`` is the first ``n`` (``0 .. n-1``).

    Raises:
        TypeError: for neither an int nor a list of ints.
        ValueError: for a count below 1, an empty list or a negative step.

    Examples:
        >>> check_steps(3), check_steps([5, 2])
        ((0, 1, 2), (2, 5))
    """
    if isinstance(steps, int) and not isinstance(steps, bool):
        if steps < 1:
            raise ValueError(f"`steps` must be a positive int or a list of steps >= 0, got {steps!r}")
        return tuple(range(steps))
    if not isinstance(steps, Iterable) or isinstance(steps, (str, bytes)):
        raise TypeError(f"`steps` must be an int or a list of ints, got {type(steps).__name__}")
    values = list(steps)
    if not values or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in values):
        raise ValueError(f"`steps` must be a positive int or a non-empty list of ints >= 0, got {values!r}")
    return tuple(sorted(set(values)))


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside Fabric's and DDP's wrappers (whose parameter names carry a prefix)."""
    from lightning.fabric.wrappers import is_wrapped

    while True:
        inner = None
        if (is_wrapped(model) or isinstance(model, nn.parallel.DistributedDataParallel)) and hasattr(model, "module"):
            inner = model.module  # Fabric's public accessor of the module it wrapped, and DDP's
        if not isinstance(inner, nn.Module) or inner is model:
            return model
        model = inner


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        return float(value) if value.numel() == 1 else digest(value)
    return repr(value)


def _optimizer_record(optimizer: Any) -> dict[str, Any]:
    state = optimizer.state_dict()
    groups = [{k: _plain(v) for k, v in group.items() if k != "params"} for group in state.get("param_groups", [])]
    tensors = state.get("state", {})
    return {"digest": digest(tensors, whole_digests(tensors)), "groups": groups}


def _tensor_records(named: list[tuple[str, torch.Tensor]]) -> dict[str, dict[str, Any]]:
    """Digest and norm of each tensor, a ``DTensor``'s of the whole tensor.

    Parameters and gradients under FSDP2 and tensor parallel are recorded as one process holding them whole records
    them (two collectives for all), so a sharded run lines up with an unsharded one.
    """
    tensors = [t for _, t in named]
    whole, norms = whole_digests(tensors), whole_norms(tensors)
    return {name: {"digest": digest(t, whole), "norm": n} for (name, t), n in zip(named, norms, strict=True)}


def _exact_scale(accumulation: float) -> bool:
    k = int(accumulation)
    return k == accumulation and k > 0 and k & (k - 1) == 0


class ProbeRecorder:
    """Record the given optimizer steps of a run, module by module, into ``path`` (rank 0 writes it).

    Args:
        path: the JSON file to write.
        steps: an int ``n`` (the first ``n`` optimizer steps, counted from 0) or a list of steps.
        modules: the module paths to hook (``named_modules()`` names); ``None`` hooks every submodule (the model
            itself, ``""``, only when named).
        record_ops: log the torch functions each module call runs (the evidence of a diagnosis).

    Raises:
        TypeError, ValueError: for ``steps`` or ``modules`` that cannot be used (named in the message).

    Examples:
        >>> import tempfile
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 1))
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> probe = ProbeRecorder(Path(tempfile.mkdtemp()) / "probe.json", steps=1)
        >>> batch = torch.randn(8, 3)
        >>> probe.before_micro_batch(model, batch, step=0, optimizer=optimizer)
        >>> loss = model(batch).square().mean()
        >>> probe.before_backward(loss)
        >>> loss.backward()
        >>> probe.after_backward()
        >>> probe.before_optimizer_step(model)
        >>> optimizer.step()
        >>> probe.after_optimizer_step(model, optimizer)
        >>> [e["module"] for e in probe.records[0]["micro_batches"][0]["events"] if e["kind"] == "exit"]
        ['0', '1', '2']
        >>> probe.path.is_file()  # written after the last recorded step
        True
    """

    def __init__(
        self,
        path: str | Path,
        steps: int | Sequence[int] = 5,
        modules: Sequence[str] | None = None,
        record_ops: bool = True,
    ) -> None:
        self.steps = check_steps(steps)
        if modules is not None and (isinstance(modules, str) or not all(isinstance(m, str) for m in modules)):
            raise TypeError(f"`modules` must be None or a list of module paths (str), got {modules!r}")
        self.path = Path(path)
        self.modules = None if modules is None else list(modules)
        self.record_ops = bool(record_ops)
        self.invariant: dict[str, int] | None = None  # set by the strategy's callback in world-size-invariant mode
        self.records: list[dict[str, Any]] = []  # this rank's steps, micro-batches included
        self._wanted = set(self.steps)
        self._hooks: ModuleHooks | None = None
        self._model: nn.Module | None = None
        self._step: dict[str, Any] | None = None
        self._current: dict[str, Any] | None = None
        self._written = False

    def recording(self, step: int) -> bool:
        """Whether ``step`` is one of the steps to record."""
        return step in self._wanted

    def before_micro_batch(
        self,
        model: nn.Module,
        batch: Any,
        step: int,
        optimizer: Any = None,
        generators: Mapping[str, torch.Generator] | None = None,
    ) -> None:
        """Start a micro-batch of optimizer step ``step``: its data, the random states, the hooks.

        Args:
            model: the model (Fabric's and DDP's wrappers are looked through).
            batch: the micro-batch, as the model gets it.
            step: the optimizer step it belongs to, counted from 0.
            optimizer: the optimizer, or a list of them (their state where a recorded window starts).
            generators: the data loaders' generators by name, recorded with the random states.
        """
        if step not in self._wanted or self._written:
            return
        model = unwrap(model)
        if self._hooks is None or self._model is not model:
            if self._hooks is not None:
                self._hooks.remove()
            self._hooks, self._model = ModuleHooks(model, self.modules, self.record_ops), model
        self._hooks.install()
        if self._step is None or self._step["step"] != step:
            self._step = {"step": step, "micro_batches": []}
            if not self.records or self.records[-1]["step"] != step - 1:  # a recorded window starts here
                self._step["before"] = self._state(model, optimizer)
            self.records.append(self._step)
        events: list[dict[str, Any]] = []
        micro = {
            "rank": _rank_and_world_size()[0],
            "pass": len(self._step["micro_batches"]),
            "data": digest(batch),
            "samples": sample_summary(batch),
            "rng": rng_digests(generators),
            "events": events,
        }
        self._step["micro_batches"].append(micro)
        self._current = micro
        self._hooks.begin(events)

    def before_backward(self, loss: torch.Tensor, accumulation: int = 1) -> None:
        """The micro-batch's loss, as it goes into ``backward`` (divided by ``accumulation`` under accumulation)."""
        if self._current is None or self._hooks is None:
            return
        self._hooks.end_forward()
        exact = _exact_scale(accumulation)
        self._hooks.scale = float(accumulation) if exact else 1.0
        self._current.update({"scale": accumulation, "scale_exact": exact})
        scaled = self._hooks._scaled(loss.detach())
        self._current["events"].append(
            {"kind": "loss", "output": digest(scaled), "norm": norm(scaled), "rng": rng_digests()}
        )

    def after_backward(self) -> None:
        """The micro-batch's backward pass is over (before any reduction that runs after it)."""
        if self._current is None or self._hooks is None:
            return
        self._current["events"].append({"kind": "backward_end", "rng": rng_digests()})
        self._hooks.end()
        self._current = None

    def before_optimizer_step(self, model: nn.Module) -> None:
        """The reduced gradients, just before the optimizer step."""
        if self._step is None or "reduced" in self._step:
            return
        params = unwrap(model).named_parameters()
        self._step["reduced"] = _tensor_records([(name, p.grad) for name, p in params if p.grad is not None])

    def after_optimizer_step(self, model: nn.Module, optimizer: Any = None) -> None:
        """The parameters and optimizer state after the step; writes the file after the last recorded step."""
        if self._step is None:
            return
        if self._hooks is not None:
            self._hooks.end()
        self._step["after"] = self._state(unwrap(model), optimizer)
        if self._step["micro_batches"]:
            self._step["micro_batches"][-1]["step_end"] = rng_digests()
        done, self._step, self._current = self._step["step"], None, None
        if done + 1 not in self._wanted and self._hooks is not None:
            self._hooks.remove()  # nothing to pay until the next recorded step
        if done == self.steps[-1]:
            self._write()

    def finish(self) -> None:
        """Take the hooks off; write the file if the run ended before the last recorded step (every rank calls it)."""
        if self._hooks is not None:
            self._hooks.remove()
        self._step = self._current = None
        if not self._written and self.records:
            self._write()

    def _state(self, model: nn.Module, optimizer: Any) -> dict[str, Any]:
        optimizers = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer] if optimizer is not None else []
        return {
            "params": _tensor_records([(name, p.detach()) for name, p in model.named_parameters()]),
            "optimizers": [_optimizer_record(o) for o in optimizers],
        }

    def _write(self) -> None:
        self._written = True
        rank, world_size = _rank_and_world_size()
        gathered = all_gather(self.records) if dist.is_available() and dist.is_initialized() else [self.records]
        if rank != 0:
            return
        steps: list[dict[str, Any]] = []
        for i, step in enumerate(gathered[0]):
            micro: list[dict[str, Any]] = []
            per_rank = len(step["micro_batches"])
            for records in gathered:
                for mb in records[i]["micro_batches"] if i < len(records) else []:
                    micro.append({"index": mb["rank"] * per_rank + mb["pass"], **mb})
            micro.sort(key=lambda mb: mb["index"])
            steps.append({**step, "micro_batches_per_rank": per_rank, "micro_batches": micro})
        model = self._model
        payload = {
            "format": FORMAT,
            "kind": KIND,
            "world_size": world_size,
            "invariant": self.invariant,
            "modules": {} if self._hooks is None else {p: type(m).__name__ for p, m in self._hooks.modules.items()},
            "parameters": {} if model is None else {n: n.rpartition(".")[0] for n, _ in model.named_parameters()},
            "steps": steps,
            "report": determinism_report(),
        }
        write_atomically(self.path, json.dumps(payload, separators=(",", ":")))  # whole or not at all


__all__ = ["ProbeRecorder", "check_steps", "unwrap"]
