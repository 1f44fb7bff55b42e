"""How two probe files line up: the records of one step in execution order, with keys both runs share.

Two runs line up **by micro-batch** when micro-batch ``j`` of a step is the same computation in both: the same world
size and accumulation (every random stream compared), or world-size-invariant mode with the same global and
micro-batch sizes on any world sizes (only torch's streams compared, which that mode reseeds per micro-batch;
python's and numpy's follow the rank by design). Otherwise they line up **by step**: the step's samples as a multiset,
the parameters before it, the reduced gradients and what the optimizer made of them.

A step's records in order: the state a recorded window starts from; per micro-batch, its data, the random states at
its start, its forward (module entries and exits, the loss), its backward (gradients at module outputs and of the
parameters, in the order they were computed), the random states after the step; then the reduced gradients, the
parameters and optimizer states after the step.

This module is a leaf: plain Python over the JSON a probe writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_MASK = (1 << 64) - 1


@dataclass
class Record:
    """One comparable record: its key, its phase, what kind it is, and the file's entry for it."""

    key: tuple[Any, ...]
    phase: str
    kind: str
    entry: dict[str, Any]
    micro_batch: int | None = None
    context: dict[str, Any] = field(default_factory=dict)


def per_rank(step: dict[str, Any]) -> int:
    """Micro-batches per process in a step entry."""
    return int(step.get("micro_batches_per_rank") or len(step.get("micro_batches", [])))


def alignment(a: dict[str, Any], b: dict[str, Any], steps: list[int]) -> tuple[str, bool]:
    """How two runs line up: ``(mode, all_streams)``.

    ``("micro-batch", True)`` for the same layout, ``("micro-batch", False)`` for invariant runs on other world sizes
    (torch's streams only), ``("step", False)`` otherwise.

    Examples:
        >>> one = {"world_size": 1, "invariant": {"global_batch_size": 8, "micro_batch_size": 4},
        ...        "steps": [{"step": 0, "micro_batches_per_rank": 2, "micro_batches": []}]}
        >>> two = {**one, "world_size": 2, "steps": [{"step": 0, "micro_batches_per_rank": 1, "micro_batches": []}]}
        >>> alignment(one, one, [0]), alignment(one, two, [0]), alignment({**one, "invariant": None}, two, [0])
        (('micro-batch', True), ('micro-batch', False), ('step', False))
    """
    by_a = {s["step"]: s for s in a["steps"]}
    by_b = {s["step"]: s for s in b["steps"]}
    same_split = all(per_rank(by_a[s]) == per_rank(by_b[s]) for s in steps)
    if a.get("world_size") == b.get("world_size") and same_split and a.get("invariant") == b.get("invariant"):
        return "micro-batch", True
    if a.get("invariant") and a.get("invariant") == b.get("invariant"):
        return "micro-batch", False
    return "step", False


def streams(rng: dict[str, str] | None, all_streams: bool) -> dict[str, str]:
    """The random states that line up: every one, or torch's (CPU and CUDA) only.

    Examples:
        >>> streams({"python": "a", "torch": "b", "cuda:0": "c"}, all_streams=False)
        {'torch': 'b', 'cuda:0': 'c'}
    """
    if not rng:
        return {}
    return {k: v for k, v in rng.items() if all_streams or k == "torch" or k.startswith("cuda:")}


def step_samples(step: dict[str, Any]) -> dict[str, Any]:
    """A step's samples over all its micro-batches and processes, as one multiset summary.

    Examples:
        >>> micro = [{"samples": {"count": 2, "sum": "01"}}, {"samples": {"count": 1, "sum": "ff"}}]
        >>> step_samples({"micro_batches": micro})
        {'count': 3, 'sum': '0000000000000100'}
    """
    summaries = [mb.get("samples") or {"count": 0, "sum": "0"} for mb in step.get("micro_batches", [])]
    total = sum(int(s["sum"], 16) for s in summaries) & _MASK
    return {"count": sum(int(s["count"]) for s in summaries), "sum": f"{total:016x}"}


def _event_key(event: dict[str, Any]) -> tuple[Any, ...]:
    kind = event["kind"]
    if kind in ("enter", "exit"):
        return (kind, event["module"], event["call"])
    if kind == "grad":
        return (kind, event["module"], event["call"], event["index"])
    if kind == "param_grad":
        return (kind, event["param"])
    return (kind,)


_EVENT_PHASE = {"enter": "forward", "exit": "forward", "loss": "forward", "grad": "backward",
                "param_grad": "backward", "backward_end": "backward"}  # fmt: skip


def step_records(step: dict[str, Any], mode: str, all_streams: bool, modules: set[str]) -> list[Record]:
    """The records of one step entry in execution order (see the module's docstring).

    Args:
        step: a step entry of a probe file.
        mode: ``"micro-batch"`` or ``"step"`` (:func:`alignment`).
        all_streams: whether every random state lines up, or torch's only.
        modules: the module paths hooked in both runs (events of other modules are left out).
    """
    out: list[Record] = []
    before = step.get("before") or {}
    out += [Record(("before", n), "optimizer", "before_param", r) for n, r in before.get("params", {}).items()]
    out += [Record(("before_opt", i), "optimizer", "before_opt", r) for i, r in enumerate(before.get("optimizers", []))]
    if mode == "step":
        out.append(Record(("samples",), "data", "samples", step_samples(step)))
    else:
        for mb in step.get("micro_batches", []):
            j = int(mb["index"])
            context = {"events": mb.get("events", []), "rng_start": mb.get("rng")}
            out.append(Record(("data", j), "data", "data", mb, j, context))
            if all_streams:
                out.append(Record(("rng_start", j), "data", "rng_start", {"rng": mb.get("rng")}, j, context))
            for event in mb.get("events", []):
                if event.get("module", "") not in modules and event["kind"] in ("enter", "exit", "grad"):
                    continue
                key = ("event", j, *_event_key(event))
                out.append(Record(key, _EVENT_PHASE.get(event["kind"], "forward"), event["kind"], event, j, context))
            if all_streams and mb.get("step_end") is not None:
                out.append(Record(("step_end", j), "optimizer", "step_end", {"rng": mb["step_end"]}, j, context))
    out += [Record(("reduced", n), "reduction", "reduced", r) for n, r in (step.get("reduced") or {}).items()]
    after = step.get("after") or {}
    out += [Record(("after", n), "optimizer", "after_param", r) for n, r in after.get("params", {}).items()]
    out += [Record(("after_opt", i), "optimizer", "after_opt", r) for i, r in enumerate(after.get("optimizers", []))]
    return out


__all__ = ["Record", "alignment", "per_rank", "step_records", "step_samples", "streams"]
