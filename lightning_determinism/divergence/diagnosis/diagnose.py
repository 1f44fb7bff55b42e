"""Diagnose two probe files: the first record whose output differs while its inputs matched, and its cause.

The records of both runs are walked in execution order (:mod:`~lightning_determinism.divergence.diagnosis.records`).
Everything before the first differing record matched, so that record's inputs matched too: it is the root. Its kind
names the phase, and the cause follows from what differs there:

- **data**: the batch differs while the random states at its start matched (another order, other samples); when
  those states differ too, the batch came from other random draws: **randomness**.
- **randomness**: a random state differs where the one before it matched: the code in between drew another number of
  random numbers or from another state (a module: between its entry and exit; ``module`` null: code outside the
  hooked modules, e.g. ``training_step``). Also a module that draws random numbers whose output differs while its
  input and its random state at entry *and exit* matched: the same draws used differently (e.g. another dropout
  probability).
- **kernel**: a module that draws no random number produced another output from the same input and random state
  (a nondeterministic kernel, another thread count, a value read from outside the seeds); in the backward pass, a
  gradient computed from matching gradients and activations.
- **reduction**: every micro-batch's local gradient matched (or, runs split differently, the step's samples did) and
  the reduced gradients differ (world size, reduction order).
- **optimizer**: the reduced gradients matched and the parameters or optimizer state after the step differ (learning
  rate, an optimizer state not restored), or the recorded window starts from other parameters.

This module is a leaf: plain Python over the JSON a probe writes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from lightning_determinism.divergence.diagnosis.probe_file import ProbeFileError, describe_probe, load_probe
from lightning_determinism.divergence.diagnosis.records import Record, alignment, per_rank, step_records, streams

PHASES = ("data", "forward", "backward", "reduction", "optimizer")
"""The phases a diagnosis names."""
CAUSES = ("data", "randomness", "kernel", "reduction", "optimizer")
"""The causes a diagnosis names."""


def _stream_diff(a: dict[str, Any], b: dict[str, Any], all_streams: bool) -> list[str]:
    sa, sb = streams(a.get("rng"), all_streams), streams(b.get("rng"), all_streams)
    return sorted(k for k in set(sa) & set(sb) if sa[k] != sb[k])


def _what_differs(ra: Record, rb: Record, all_streams: bool) -> tuple[str | None, list[str]]:
    """``(what, streams)``: ``"rng"``, ``"input"``, ``"output"`` or None, and the random states that differ."""
    ea, eb, kind = ra.entry, rb.entry, ra.kind
    if kind in ("enter", "exit", "loss", "rng_start", "step_end", "backward_end"):
        differing = _stream_diff(ea, eb, all_streams)
        if differing:
            return "rng", differing
    if kind == "enter":
        return ("input" if ea["input"] != eb["input"] else None), []
    if kind in ("exit", "loss", "grad", "param_grad"):
        return ("output" if ea["output"] != eb["output"] else None), []
    if kind == "data":
        return ("output" if ea["data"] != eb["data"] else None), []
    if kind in ("before_param", "after_param", "reduced"):
        return ("output" if ea["digest"] != eb["digest"] else None), []
    if kind == "before_opt":  # hyperparameters act in the step: compared after it, where they made a difference
        return ("output" if ea["digest"] != eb["digest"] else None), []
    if kind == "after_opt":
        return ("output" if ea != eb else None), []
    if kind == "samples":
        return ("output" if ea != eb else None), []
    return None, []


def _describe(record: Record | None, modules: dict[str, str]) -> str:
    if record is None:
        return "the start of the comparison"
    e = record.entry
    if record.kind in ("enter", "exit"):
        where = "entry" if record.kind == "enter" else "exit"
        return f"the {where} of `{e['module']}` ({modules.get(e['module'], '?')}, call {e['call']})"
    if record.kind == "grad":
        return f"the gradient at output {e['index']} of `{e['module']}` (call {e['call']})"
    if record.kind == "param_grad":
        return f"the local gradient of `{e['param']}`"
    names = {"data": "the batch", "rng_start": "the random states at the micro-batch's start", "loss": "the loss",
             "backward_end": "the random states after the backward pass", "samples": "the step's samples",
             "step_end": "the random states after the optimizer step", "before_opt": "the optimizer state before",
             "after_opt": "the optimizer state after the step"}  # fmt: skip
    if record.kind in names:
        return names[record.kind]
    return {"before_param": "parameter `{}` before the step", "after_param": "parameter `{}` after the step",
            "reduced": "the reduced gradient of `{}`"}[record.kind].format(record.key[-1])  # fmt: skip


def _find(events: list[dict[str, Any]], kind: str, module: str, call: int) -> dict[str, Any] | None:
    return next((e for e in events if e["kind"] == kind and e.get("module") == module and e.get("call") == call), None)


def _draws(record: Record, all_streams: bool) -> bool:
    """Whether the module call of an exit record drew random numbers (its states at entry and exit differ)."""
    e = record.entry
    enter = _find(record.context.get("events", []), "enter", e["module"], e["call"])
    return enter is not None and streams(enter.get("rng"), all_streams) != streams(e.get("rng"), all_streams)


def _consumer(record: Record) -> str | None:
    """The module whose backward produced the gradient at a call's output: the last call that took that output."""
    e = record.entry
    key = f"{e['module']}#{e['call']}"
    takers = [x for x in record.context.get("events", []) if x["kind"] == "enter" and key in (x.get("from") or [])]
    if takers:
        return str(takers[-1]["module"])
    enter = _find(record.context.get("events", []), "enter", e["module"], e["call"])
    parent = enter.get("parent") if enter else None
    return parent.rpartition("#")[0] if parent else None


def _groups_diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, (ga, gb) in enumerate(zip(a.get("groups", []), b.get("groups", []), strict=False)):
        out.update(
            {f"group {i}: {k}": [ga.get(k), gb.get(k)] for k in sorted(set(ga) | set(gb)) if ga.get(k) != gb.get(k)}
        )
    return out


_WHY = {
    "data_rng": "the batch differs and so do the random states at its start: shuffling or augmentation drew from"
    " other states",
    "data": "another batch from the same random states (another order or other samples{where})",
    "exit_rng": "`{module}` drew another number of random numbers, or from another state: the random states at its"
    " entry matched, at its exit they differ",
    "start_rng": "the runs enter the recorded steps with other random states (another seed, or a state not restored)",
    "between_rng": "{where} drew other random numbers between {previous} and {record}",
    "input": "the input of `{module}` differs while every record before it matched: it was computed {where}",
    "random_module": "`{module}` draws random numbers: from the same input and the same random states at entry and"
    " exit it made another output (the same draws used differently, e.g. another dropout probability)",
    "kernel": "`{module}` draws no random number: from the same input and random state it made another output (a"
    " nondeterministic kernel, another thread count, or a value from outside the seeds)",
    "loss": "the loss differs while every module's output matched: computed outside the hooked modules (training_step)",
    "grad": "{who} made another gradient at the output of `{module}` from matching activations and incoming gradients",
    "param_grad": "the backward of `{owner}` made another gradient of `{param}` from matching activations and"
    " incoming gradients",
    "late_rng": "other random numbers were drawn between {previous} and {record}",
    "samples": "the step's samples differ (as a multiset over all micro-batches and processes)",
    "reduced": "{how}, and the reduced gradient of `{param}` differs (another world size or reduction order)",
    "before": "the recorded steps start from other parameters or optimizer state (another initialisation, or a"
    " checkpoint not restored)",
    "after_param": "the reduced gradients matched and the optimizer made another `{param}` from them (another"
    " learning rate or optimizer state)",
    "after_opt": "the parameters after the step matched and the optimizer state differs",
}


def _parent(event: dict[str, Any]) -> str | None:
    return event["parent"].rpartition("#")[0] if event.get("parent") else None


def _classify(
    ra: Record, rb: Record, what: str, differing: list[str], previous: Record | None, ctx: dict[str, Any]
) -> tuple[str | None, str, str, dict[str, Any]]:
    """``(module, cause, explanation, evidence)`` of the root record."""
    kind, e, modules, params, all_streams = ra.kind, ra.entry, ctx["modules"], ctx["parameters"], ctx["all_streams"]
    evidence: dict[str, Any] = {}
    text = {"module": e.get("module"), "previous": _describe(previous, modules), "record": _describe(ra, modules)}
    if kind == "data":
        changed = _stream_diff({"rng": ra.context.get("rng_start")}, {"rng": rb.context.get("rng_start")}, all_streams)
        found = [f"step {s}, micro-batch {mb['index']}" for s, mb in ctx["b_batches"] if mb.get("data") == e["data"]]
        evidence.update({"samples_a": e.get("samples"), "samples_b": rb.entry.get("samples"), "a_batch_in_b": found})
        if changed:
            evidence["streams"] = changed
            return None, "randomness", _WHY["data_rng"], evidence
        where = f"; run A's batch is run B's at {found[0]}" if found else ""
        return None, "data", _WHY["data"].format(where=where), evidence
    if what == "rng":
        evidence["streams"] = differing
        if kind == "exit":
            return e["module"], "randomness", _WHY["exit_rng"].format(**text), evidence
        if kind == "rng_start" and previous is None:
            return None, "randomness", _WHY["start_rng"], evidence
        if kind in ("backward_end", "step_end"):
            return None, "randomness", _WHY["late_rng"].format(**text), evidence
        parent = _parent(e) if kind == "enter" else None
        where = f"code in `{parent}`'s forward" if parent is not None else "code outside the hooked modules"
        return parent, "randomness", _WHY["between_rng"].format(**text, where=where), evidence
    if kind == "enter":
        parent = _parent(e)
        where = f"by code in `{parent}`'s forward" if parent is not None else "outside the hooked modules"
        return parent, "kernel", _WHY["input"].format(**text | {"where": where}), evidence
    if kind == "exit":
        evidence.update({"module_type": modules.get(e["module"]), "ops": e.get("ops") or []})
        random_module = _draws(ra, all_streams) or _draws(rb, all_streams)
        cause = "randomness" if random_module else "kernel"
        return e["module"], cause, _WHY["random_module" if random_module else "kernel"].format(**text), evidence
    if kind == "loss":
        return None, "kernel", _WHY["loss"], evidence
    if kind == "grad":
        consumer = _consumer(ra)
        evidence["module_type"] = modules.get(consumer) if consumer is not None else None
        who = f"the backward of `{consumer}`" if consumer is not None else "the backward of code outside the modules"
        return consumer, "kernel", _WHY["grad"].format(**text, who=who), evidence
    if kind == "param_grad":
        owner = params.get(e["param"])
        evidence.update({"parameter": e["param"], "module_type": modules.get(owner)})
        return owner, "kernel", _WHY["param_grad"].format(owner=owner, param=e["param"]), evidence
    if kind == "samples":
        return None, "data", _WHY["samples"], {"samples_a": e, "samples_b": rb.entry}
    name = ra.key[-1] if kind in ("before_param", "after_param", "reduced") else None
    evidence["parameter"] = name
    owner = params.get(name) if name is not None else None
    if kind == "reduced":
        how = "every micro-batch's local gradient matched"
        if ctx["mode"] != "micro-batch":
            how = (f"the runs split the step differently ({ctx['split']}), so their micro-batches do not line up;"
                   " the step's samples and the parameters before it matched")  # fmt: skip
        return owner, "reduction", _WHY["reduced"].format(how=how, param=name), evidence
    if kind in ("before_param", "before_opt"):
        return owner, "optimizer", _WHY["before"], evidence
    evidence["hyperparameters"] = _groups_diff(*ctx["after_opts"]) if ctx["after_opts"] else {}
    if kind == "after_param":
        return owner, "optimizer", _WHY["after_param"].format(param=name), evidence
    return None, "optimizer", _WHY["after_opt"], evidence


def _rel(a: Any, b: Any) -> float | None:
    if (
        not isinstance(a, (int, float))
        or not isinstance(b, (int, float))
        or not (math.isfinite(a) and math.isfinite(b))
    ):
        return None
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale else 0.0


def diagnose(a: str | Path | dict[str, Any], b: str | Path | dict[str, Any]) -> dict[str, Any]:
    """Compare two probe files: ``verdict`` ``"same"`` or ``"diverged"``, and where and why.

    Args:
        a: run A's probe file (a path, or the loaded JSON).
        b: run B's.

    Returns:
        ``{"verdict", "step", "micro_batch", "module", "phase", "cause", "record", "explanation", "evidence",
        "alignment", "compared", "steps", "runs"}``; the location fields are None for ``"same"``. ``module`` is the
        path as the LightningModule's ``named_modules()`` names it (``""`` the module itself), None outside modules.

    Raises:
        ProbeFileError: for a file that cannot be read, or runs without a recorded step or parameter set in common.

    Examples:
        >>> after = {"params": {"w": {"digest": "2"}}, "optimizers": [{"digest": "3", "groups": [{"lr": 0.1}]}]}
        >>> step = {"step": 0, "micro_batches": [], "reduced": {"w": {"digest": "1"}}, "after": after}
        >>> run = {"world_size": 1, "invariant": None, "modules": {}, "parameters": {"w": ""}, "steps": [step]}
        >>> other = {**run, "steps": [{**step, "after": {"params": {"w": {"digest": "4"}},
        ...                                               "optimizers": [{"digest": "3", "groups": [{"lr": 0.2}]}]}}]}
        >>> diagnose(run, run)["verdict"]
        'same'
        >>> found = diagnose(run, other)
        >>> found["phase"], found["cause"], found["evidence"]["hyperparameters"]
        ('optimizer', 'optimizer', {'group 0: lr': [0.1, 0.2]})
    """
    data_a = load_probe(a) if not isinstance(a, dict) else a
    data_b = load_probe(b) if not isinstance(b, dict) else b
    if set(data_a["parameters"]) != set(data_b["parameters"]):
        only = sorted(set(data_a["parameters"]) ^ set(data_b["parameters"]))[:8]
        raise ProbeFileError(f"the runs have different parameters (another model?): {only}")
    by_a = {s["step"]: s for s in data_a["steps"]}
    by_b = {s["step"]: s for s in data_b["steps"]}
    common = sorted(set(by_a) & set(by_b))
    if not common:
        raise ProbeFileError(f"the runs recorded no step in common: A recorded {sorted(by_a)}, B {sorted(by_b)}")
    mode, all_streams = alignment(data_a, data_b, common)
    modules = {**data_b.get("modules", {}), **data_a.get("modules", {})}
    shared = set(data_a.get("modules", {})) & set(data_b.get("modules", {}))
    first = by_a[common[0]]
    ctx: dict[str, Any] = {
        "modules": modules, "parameters": data_a["parameters"], "all_streams": all_streams, "mode": mode,
        "split": f"{data_a.get('world_size')} process(es) x {per_rank(first)} micro-batch(es) against"
                 f" {data_b.get('world_size')} x {per_rank(by_b[common[0]])}",
        "b_batches": [(s["step"], mb) for s in data_b["steps"] for mb in s["micro_batches"]],
    }  # fmt: skip
    result: dict[str, Any] = {"verdict": "same", "step": None, "micro_batch": None, "module": None, "phase": None,
                              "cause": None, "record": None, "explanation": None, "evidence": {}, "alignment": mode,
                              "compared": 0, "steps": common,
                              "runs": {"a": describe_probe(data_a), "b": describe_probe(data_b)}}  # fmt: skip
    for s in common:
        records_a = step_records(by_a[s], mode, all_streams, shared)
        records_b = {r.key: r for r in step_records(by_b[s], mode, all_streams, shared)}
        opts = [(by[s].get("after") or {}).get("optimizers") or [None] for by in (by_a, by_b)]
        ctx["after_opts"] = (opts[0][0], opts[1][0]) if opts[0][0] and opts[1][0] else None
        previous: Record | None = None
        for record in records_a:
            other = records_b.pop(record.key, None)
            if other is None:
                result.update(_structural(s, record, "A", modules))
                return result
            result["compared"] += 1
            what, differing = _what_differs(record, other, all_streams)
            if what is not None:
                module, cause, explanation, evidence = _classify(record, other, what, differing, previous, ctx)
                for side, entry in (("a", record.entry), ("b", other.entry)):
                    for field in ("digest", "output", "input", "data"):
                        if isinstance(entry.get(field), str):
                            evidence.setdefault(f"{field}_{side}", entry[field])
                    if entry.get("norm") is not None:
                        evidence[f"norm_{side}"] = entry["norm"]
                if "norm_a" in evidence and "norm_b" in evidence:
                    evidence["norm_relative_difference"] = _rel(evidence["norm_a"], evidence["norm_b"])
                evidence["matched_before"] = _describe(previous, modules)
                result.update({"verdict": "diverged", "step": s, "micro_batch": record.micro_batch, "module": module,
                               "phase": record.phase, "cause": cause, "record": _describe(record, modules),
                               "explanation": explanation, "evidence": evidence})  # fmt: skip
                return result
            previous = record
        if records_b:
            result.update(_structural(s, next(iter(records_b.values())), "B", modules))
            return result
    return result


def _structural(step: int, record: Record, side: str, modules: dict[str, str]) -> dict[str, Any]:
    other = "B" if side == "A" else "A"
    return {"verdict": "diverged", "step": step, "micro_batch": record.micro_batch,
            "module": record.entry.get("module"), "phase": record.phase, "cause": "kernel",
            "record": _describe(record, modules),
            "explanation": f"run {side} has {_describe(record, modules)}, run {other} has not: they ran other code",
            "evidence": {"only_in": side}}  # fmt: skip


def format_diagnosis(result: dict[str, Any]) -> str:
    """A diagnosis as a person reads it: the verdict, where, why, and the evidence.

    Examples:
        >>> print(format_diagnosis({"verdict": "same", "compared": 12, "steps": [0, 1], "alignment": "micro-batch"}))
        same: 12 records over steps [0, 1] matched bit for bit (lined up by micro-batch)
    """
    lined_up = f"lined up by {result.get('alignment')}"
    if result["verdict"] == "same":
        return f"same: {result['compared']} records over steps {result['steps']} matched bit for bit ({lined_up})"
    module = result.get("module")
    where = f"step {result['step']}"
    if result.get("micro_batch") is not None:
        where += f", micro-batch {result['micro_batch']}"
    evidence = dict(result.get("evidence") or {})
    kind = f" ({evidence['module_type']})" if evidence.get("module_type") else ""
    lines = [
        f"diverged at {where}: {result['phase']} phase, module {'-' if module is None else f'`{module}`{kind}'}",
        f"cause: {result['cause']}: {result['explanation']}",
        f"first differing record: {result['record']}; everything up to {evidence.pop('matched_before', '?')} matched",
    ]
    for key in ("streams", "ops", "hyperparameters", "a_batch_in_b", "parameter"):
        if evidence.get(key):
            lines.append(f"  {key}: {evidence[key]}")
    if evidence.get("norm_a") is not None and evidence.get("norm_b") is not None:
        rel = evidence.get("norm_relative_difference")
        apart = f", {rel:.3e} relative" if isinstance(rel, float) else ""
        lines.append(f"  norm: {evidence['norm_a']!r} in A, {evidence['norm_b']!r} in B{apart}")
    lines.append(f"compared {result['compared']} records over steps {result['steps']} ({lined_up})")
    return "\n".join(lines)


__all__ = ["CAUSES", "PHASES", "diagnose", "format_diagnosis"]
