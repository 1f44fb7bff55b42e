"""The work of the ``lightning-determinism`` command's subcommands: ``report``, ``compare``, ``diagnose``.

The command line is parsed by the light entry module ``_lightning_determinism_cli`` (standard library only, so that
``--help`` and a bad argument answer at once), which then hands the parsed arguments to :func:`run`. This module
imports torch only where a subcommand needs it (reading a checkpoint, reporting this process's flags), and nothing of
the entry module: the entry imports it, not the other way round (:mod:`lightning_determinism.divergence.cli` puts the
two together for ``python -m`` and the released import path).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from lightning_determinism.divergence.baseline_file import (
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    BaselineFileError,
    describe_baseline,
    load_baseline,
)
from lightning_determinism.divergence.baseline_runs import compare_runs
from lightning_determinism.divergence.compare_text import print_runs, print_steps
from lightning_determinism.divergence.logger_record import RecordError
from lightning_determinism.divergence.record_compare import compare_records, is_record_path, report_record
from lightning_determinism.divergence.run_record import CHECKPOINT_KEY as FINGERPRINT_KEY
from lightning_determinism.divergence.sample_record import (
    SampleRecordError,
    compare_samples,
    format_samples,
    is_sample_record,
    load_samples,
)

PROG = "lightning-determinism"
"""The command's name in its error lines (``_lightning_determinism_cli.PROG``, written out: a test keeps them equal)."""


class _BadInput(Exception):
    """Anything the user gave that cannot be used: printed as one line, exit status 2."""


def verdicts(report: dict[str, Any]) -> dict[str, str]:
    """A short judgement for each flag that can make a run nondeterministic.

    Examples:
        >>> verdicts({"cudnn_benchmark": True})["cudnn_benchmark"]
        'nondeterministic: cuDNN benchmark is on'
    """
    out = {}
    cuda = bool(report.get("cuda_available"))
    if "deterministic_algorithms" in report:
        out["deterministic_algorithms"] = (
            "ok" if report["deterministic_algorithms"] else "nondeterministic: deterministic algorithms are off"
        )
    if report.get("cudnn_benchmark"):
        out["cudnn_benchmark"] = "nondeterministic: cuDNN benchmark is on"
    elif "cudnn_benchmark" in report:
        out["cudnn_benchmark"] = "ok"
    if cuda and not report.get("cudnn_deterministic"):
        out["cudnn_deterministic"] = "nondeterministic: cuDNN may pick nondeterministic kernels"
    for key in ("cuda_matmul_allow_tf32", "cudnn_allow_tf32"):
        if report.get(key) and cuda:
            out[key] = "differs from float32: TF32 rounds matmul inputs to 10 bits"
    if cuda and report.get("cublas_workspace_config") not in (":4096:8", ":16:8"):
        out["cublas_workspace_config"] = "nondeterministic: cuBLAS needs CUBLAS_WORKSPACE_CONFIG=:4096:8"
    if report.get("base_seed") is None and report.get("pl_global_seed") is None:
        out["base_seed"] = "unseeded: neither set_seed, a deterministic strategy nor seed_everything ran"
    return out


def _print_flags(report: dict[str, Any]) -> None:
    judged = verdicts(report)
    width = max(len(key) for key in report)
    for key, value in report.items():
        note = judged.get(key, "")
        print(f"{key:<{width}}  {value!s:<24}  {note}".rstrip())
    bad = [k for k, v in judged.items() if v != "ok"]
    print(f"\n{len(bad)} setting(s) to look at" if bad else "\nnothing found that breaks reproducibility")


def _unreadable(path: Path, err: Exception) -> _BadInput:
    """One line for a file ``torch.load(weights_only=True)`` cannot read, instead of torch's page of advice."""
    from lightning_determinism.checkpoints.file import is_torch_file, load_failure_message

    damaged = load_failure_message(path, err)  # what the plugin's load and the check before a launch say too
    if damaged is not None:
        return _BadInput(damaged)
    expected = "a Lightning checkpoint (.ckpt) or a NumericalBaseline file (.json)"
    if not is_torch_file(path):
        return _BadInput(f"{path}: not a checkpoint or baseline file (expected {expected})")
    lines = [line.strip() for line in str(err).splitlines()]
    refused = next((line for line in lines if line.startswith("WeightsUnpickler error")), None)
    first = lines[0] if lines and lines[0] else type(err).__name__  # EOFError has no message
    why = refused.split(". ")[0] if refused else first[:120]
    return _BadInput(
        f"{path}: a torch file that torch.load(weights_only=True) cannot read ({why}); expected {expected}"
    )


def _rng_contents(ranks: list[Any]) -> str:
    """What the saved RNG entry holds, e.g. ``1 rank(s): python, numpy, torch CPU`` (CUDA only when it was saved)."""
    states = [entry.get("rng") or {} for entry in ranks if isinstance(entry, dict)]
    parts = [
        key if key != "torch" else "torch CPU" for key in ("python", "numpy", "torch") if all(key in s for s in states)
    ]
    devices = max((len(s.get("cuda") or []) for s in states), default=0)
    if devices:
        parts.append(f"CUDA ({devices} device(s))")
    streams = sorted({name for s in states for name in (s.get("tracker") or {})})
    if streams:
        parts.append(f"tracker streams {streams}")
    generators = sorted({name for s in states for name in (s.get("generators") or {})})
    if generators:
        parts.append(f"generators {generators}")
    return f"{len(ranks)} rank(s): {', '.join(parts) or 'nothing'}"


def describe_checkpoint(path: Path) -> dict[str, Any]:
    """What a Lightning checkpoint says about the run that wrote it (seeds, world size, position, flags).

    Raises:
        _BadInput: if the file cannot be read as a checkpoint.
    """
    import torch

    from lightning_determinism.checkpoints.file import DamagedCheckpointError
    from lightning_determinism.checkpoints.integrity import describe_digest, verify_digest
    from lightning_determinism.seeding.rank_states import CHECKPOINT_KEY

    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001  (any unpickling or I/O problem is the file's)
        raise _unreadable(path, err) from None
    if not isinstance(checkpoint, dict):
        raise _BadInput(f"{path}: not a Lightning checkpoint (a {type(checkpoint).__name__}, not a dict)")
    digest = describe_digest(checkpoint)
    try:
        verify_digest(path, checkpoint)  # as the plugin's load says it
    except DamagedCheckpointError as err:
        raise _BadInput(str(err)) from None
    saved = checkpoint.get(CHECKPOINT_KEY)
    description: dict[str, Any] = {
        "kind": "Lightning checkpoint",
        "lightning_version": checkpoint.get("pytorch-lightning_version"),
        "epoch": checkpoint.get("epoch"),
        "global_step": checkpoint.get("global_step"),
        "parameters": len(checkpoint.get("state_dict", {})),
        "optimizers": len(checkpoint.get("optimizer_states", [])),
        "lr_schedulers": len(checkpoint.get("lr_schedulers", [])),
        "digest": digest,
    }
    recorded = checkpoint.get(FINGERPRINT_KEY)
    if isinstance(recorded, dict) and "fingerprint" in recorded:  # DeterminismRecord's: the model's, as logged
        description["fingerprint"] = recorded["fingerprint"]
    if not isinstance(saved, dict):
        description["rng_state"] = "none (written without RNGStateCheckpoint: a resume is not bitwise)"
        return description
    ranks = saved.get("ranks") or []
    description.update(
        {
            "world_size": saved.get("world_size"),
            "base_seed": saved.get("base_seed"),
            "rng_state": _rng_contents(ranks),
            "loader_generators": sorted((ranks[0].get("loaders") or {}) if ranks else {}),
            "identity": saved.get("identity"),  # the run's configuration (seed, batch sizes, optimizer, data, limits)
            "report": saved.get("report"),
        }
    )
    return description


def describe_distributed_checkpoint(path: Path) -> dict[str, Any]:
    """What a Lightning distributed checkpoint directory (``ModelParallelStrategy``, FSDP) holds.

    Rank 0's ``meta.pt`` (the RNG states of every rank, the loops, the report) lies beside the shard files of the
    weights and optimizer states.

    Raises:
        _BadInput: if a file is missing or cut short (``meta.pt``, the index, a shard), or ``meta.pt`` cannot be read
            as a checkpoint.
    """
    from lightning_determinism.checkpoints.distributed import check_distributed_checkpoint
    from lightning_determinism.checkpoints.file import DamagedCheckpointError

    try:
        check_distributed_checkpoint(path)  # a missing or cut shard, a missing index: said, not "nothing found"
    except DamagedCheckpointError as err:
        raise _BadInput(str(err)) from None
    description = describe_checkpoint(path / "meta.pt")
    description["kind"] = "Lightning distributed checkpoint (a directory: rank 0's meta.pt and the shards)"
    description.pop("parameters", None)  # the weights are in the shards, not in meta.pt
    description.pop("optimizers", None)
    description["shard_files"] = len(list(path.glob("*.distcp")))
    return description


def _report(args: argparse.Namespace) -> int:
    if args.path is not None and is_record_path(args.path):
        return report_record(args.path, args.json)
    if args.path is None:
        from lightning_determinism.seeding.backends import determinism_report

        report = determinism_report()
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            _print_flags(report)
        return 0
    path = Path(args.path)
    if path.is_dir() and (path / "meta.pt").is_file():
        description = describe_distributed_checkpoint(path)
    elif path.is_dir():
        raise _BadInput(f"{path}: is a directory, not a checkpoint or baseline file")
    elif not path.is_file():
        raise _BadInput(f"{path}: no such file")
    else:
        description = describe_baseline(load_baseline(path)) if path.suffix == ".json" else describe_checkpoint(path)
    if args.json:
        print(json.dumps(description, indent=2))
        return 0
    recorded = description.pop("report", None)
    print(f"{path}: {description.pop('kind')}")
    width = max(len(key) for key in description)
    for key, value in description.items():
        if isinstance(value, dict) and value:  # a baseline's run: one line per entry
            print(f"  {key}")
            inner = max(len(k) for k in value)
            for k, v in value.items():
                print(f"    {k:<{inner}}  {v}")
        else:
            print(f"  {key:<{width}}  {value}")
    if recorded:
        print("\nrecorded when it was written:")
        _print_flags(recorded)
    else:
        print("\nno determinism report recorded (written by an older version or without the package)")
    return 0


def _compare_records(args: argparse.Namespace) -> int:
    """``compare`` on loggers' directories: their determinism records (docs/record.md)."""
    baselines = [path for path in args.files if not is_record_path(path)]
    if baselines:
        raise _BadInput(
            f"compare takes either baseline files or loggers' directories, not both: {baselines[0]} is a baseline"
            f" file, {next(p for p in args.files if is_record_path(p))} a logger's output"
        )
    given = [f"--{name}" for name in ("plot", "rtol", "atol") if getattr(args, name) is not None]
    given += ["--nonfinite-equal"] if args.nonfinite_equal else []
    if given:
        raise _BadInput(f"{given[0]} applies to baseline files; loggers' records are compared entry by entry")
    return compare_records(args.files, args.json)


def _compare_sample_files(paths: list[str], as_json: bool) -> int:
    """``compare`` on per-sample records (SampleRecord's files): the samples of each file against the first's."""
    reference = load_samples(paths[0])
    results = {path: compare_samples(reference, load_samples(path)) for path in paths[1:]}
    if as_json:
        print(json.dumps({"reference": paths[0], "runs": results}, indent=2))
    else:
        for path, result in results.items():
            print(f"{paths[0]} vs {path}:")
            print("\n".join(format_samples(result, reference.get("stage", "?"))))
    return 1 if any(result["differing"] for result in results.values()) else 0


def _compare(args: argparse.Namespace) -> int:
    if all(is_sample_record(path) for path in args.files):
        return _compare_sample_files(args.files, args.json)
    if any(is_record_path(path) for path in args.files):
        return _compare_records(args)
    if args.plot:
        from lightning_determinism.divergence._compare_plot import PlotError, check_plot_path

        try:
            check_plot_path(args.plot)  # before any work: a bad path must not cost a comparison
        except PlotError as err:
            raise _BadInput(str(err)) from None
    rtol = DEFAULT_RTOL if args.rtol is None else args.rtol
    atol = DEFAULT_ATOL if args.atol is None else args.atol
    loaded = [(path, load_baseline(path)) for path in args.files]
    table = compare_runs(loaded, rtol, atol, args.nonfinite_equal)
    comparisons = table.pop("comparisons")
    if args.plot:
        from lightning_determinism.divergence._compare_plot import draw, draw_runs

        if len(args.files) == 2:
            draw(comparisons[0], args.files[0], args.files[1], args.plot, rtol, atol)
        else:
            draw_runs(table, comparisons, args.plot)
    if args.json:
        print(json.dumps(table, indent=2))
        return 1 if table["diverged"] else 0
    tolerance = f"rtol={rtol:g}, atol={atol:g}"
    if len(args.files) == 2:
        result = comparisons[0]
        print_steps(result)
        for entry in result["nonfinite"]:
            print(f"non-finite: step {entry['step']}, {entry['name']}: {entry['a']!r} in A, {entry['b']!r} in B")
        print()
    else:
        for row in table["runs"][1:]:
            for entry in row["nonfinite"]:
                print(f"non-finite: {row['name']}, step {entry['step']}, {entry['name']}: {entry['a']!r}"
                      f" in the reference, {entry['b']!r} in the run")  # fmt: skip
    print_runs(table)
    if args.plot:
        print(f"plot written to {args.plot}")
    if len(args.files) > 2:
        others = len(args.files) - 1
        if table["diverged"]:
            print(f"{table['diverged']} of {others} runs diverge from {table['reference']} ({tolerance})")
            return 1
        print(f"all {others} runs within {tolerance} of {table['reference']}")
        return 0
    result = comparisons[0]
    first = result["first"]
    if first is None:
        identical = all(r["max_abs"] == 0.0 and r["bitwise_params"] for r in result["rows"])
        steps = len(result["rows"])
        if identical and not result["nonfinite"]:
            print(f"bitwise identical: {steps} steps, {result['compared']} quantities")
        else:
            print(f"equal within {tolerance}: {steps} steps, {result['compared']} quantities")
        return 0
    why = (
        f"difference {first['diff']:.3e}; {tolerance}"
        if math.isfinite(first["diff"])
        else "a non-finite value is never equal; --nonfinite-equal accepts identical ones"
    )
    print(f"first divergence: step {first['step']}, {first['name']}: {first['a']!r} vs {first['b']!r} ({why})")
    causes = run_differences(loaded[0][1], loaded[1][1])
    if causes:
        shown = "; ".join(f"{key} {a!r} vs {b!r}" for key, (a, b) in causes.items())
        print(f"the runs that wrote them differ in: {shown} (a cause of the divergence: diagnose says where it starts)")
    return 1


# What in a baseline's "run" entry changes the numbers (versions and costs' bookkeeping aside).
_CAUSES = ("batch_shape", "world_size", "seed", "precision", "device", "mesh", "strategy", "torch")


def run_differences(a: dict[str, Any], b: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The entries of two baselines' ``"run"`` that differ and change the numbers, in the order of :data:`_CAUSES`.

    Examples:
        >>> a, b = {"run": {"batch_shape": [[4, 8]], "seed": 1}}, {"run": {"batch_shape": [[2, 8]], "seed": 1}}
        >>> run_differences(a, b)
        {'batch_shape': ([[4, 8]], [[2, 8]])}
    """
    ra, rb = a.get("run") or {}, b.get("run") or {}
    return {key: (ra.get(key), rb.get(key)) for key in _CAUSES if key in ra and key in rb and ra[key] != rb[key]}


def _diagnose(args: argparse.Namespace) -> int:
    from lightning_determinism.divergence.diagnosis.diagnose import diagnose, format_diagnosis

    if is_sample_record(args.a) or is_sample_record(args.b):  # two evaluations, sample by sample
        return _compare_sample_files([args.a, args.b], args.json)
    result = diagnose(args.a, args.b)
    print(json.dumps(result, indent=2) if args.json else format_diagnosis(result))
    return 0 if result["verdict"] == "same" else 1


def run(args: argparse.Namespace) -> int:
    """Do the work of a command line parsed by ``_lightning_determinism_cli.build_parser``; returns the exit status.

    Bad input found while working (a missing or unreadable file, a plot path that cannot be written) is printed as
    one line on stderr and returns 2.
    """
    from lightning_determinism.divergence.diagnosis.probe_file import ProbeFileError

    command = {"report": _report, "compare": _compare, "diagnose": _diagnose}[args.command]
    try:
        return int(command(args))
    except (_BadInput, BaselineFileError, ProbeFileError, RecordError, SampleRecordError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2


__all__ = ["PROG", "describe_checkpoint", "run", "verdicts"]
