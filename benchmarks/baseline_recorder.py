"""NumericalBaseline across parallelisms: its cost per step, and the spread that justifies compare's tolerances.

1. Overhead (goal: <= 5 % of a tiny-LM step): the README's tiny LM (``examples/tiny_lm.py``) and the model of
   ``examples/compare_parallelisms.py`` in a Trainer with the callback recording all 41 steps, communication profiled
   one step in 10 (the default). On rank 0: each step's wall time from one ``on_train_batch_start`` to the next and
   the time spent inside the callback's hooks in it (steps 1-40; the recorder's share is hooks / (step - hooks), the
   median over the unprofiled steps, robust to a busy machine); a profiled step's extra time against the median
   step; and the end of the record once (the one all_gather that completes every step, the JSON, the atomic write).
2. Spread: the four runs of the example (1 process, DDP 2, FSDP2 2, tensor parallel 2) for 20 steps: the largest
   relative difference from the one-process run of the loss, of any parameter's gradient norm and of any parameter's
   norm, over all steps, and the smallest value compared (for atol).

    python benchmarks/baseline_recorder.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import lightning as L  # noqa: E402
from compare_parallelisms import RUNS, ParallelLM, record, trainer_for  # noqa: E402

from lightning_determinism import NumericalBaseline  # noqa: E402
from lightning_determinism.divergence.baseline_file import DEFAULT_ATOL, DEFAULT_RTOL, load_baseline  # noqa: E402
from lightning_determinism.divergence.step_costs import DEFAULT_EVERY  # noqa: E402

STEPS = 41
# (model, run of compare_parallelisms.RUNS, batch): the README's tiny LM at its batch of 16 and at 64, on 1 and 2
# processes; the comparison example's model (a tenth of the parameters, 16 tokens a sequence) on 1 and FSDP2 2.
CASES = (("tiny_lm", "one", 16), ("tiny_lm", "one", 64), ("tiny_lm", "ddp2", 16), ("compare", "one", 8),
         ("compare", "fsdp2", 8))  # fmt: skip


class TimedBaseline(NumericalBaseline):
    """NumericalBaseline that also times, on rank 0, each step (batch start to batch start) and its own hooks in it."""

    def __init__(self, path: Path, clock: Path, **kwargs) -> None:
        super().__init__(path, **kwargs)
        self.clock, self.starts, self.hooks, self._spent, self.write = clock, [], [], 0.0, 0.0

    def _timed(self, hook, *args):
        begin = time.perf_counter()
        hook(*args)
        self._spent += time.perf_counter() - begin

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        now = time.perf_counter()
        if self.starts:
            self.hooks.append(self._spent)
        self.starts.append(now)
        self._spent = 0.0
        self._timed(super().on_train_batch_start, trainer, pl_module, batch, batch_idx)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._timed(super().on_before_optimizer_step, trainer, pl_module, optimizer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._timed(super().on_train_batch_end, trainer, pl_module, outputs, batch, batch_idx)

    def on_train_end(self, trainer, pl_module):
        self.starts.append(time.perf_counter())
        self.hooks.append(self._spent)
        super().on_train_end(trainer, pl_module)
        if trainer.global_rank == 0:
            durations = [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)]
            self.clock.write_text(json.dumps({"durations": durations, "hooks": self.hooks, "write": self.write}))

    def _write(self):
        begin = time.perf_counter()
        super()._write()
        self.write = time.perf_counter() - begin


def _tiny_lm_fit(devices: int, batch: int, callbacks: list[L.Callback]) -> None:
    """``examples/tiny_lm.py``'s model (embedding, GRU, head; ``batch`` windows of 64 characters), no validation."""
    from tiny_lm import TinyLM, build_data
    from torch.utils.data import DataLoader

    from lightning_determinism import DeterministicDDPStrategy

    train_set, _, vocab = build_data(64, 1500)
    trainer = L.Trainer(
        strategy=DeterministicDDPStrategy(seed=7, start_method="fork"), accelerator="cpu", devices=devices,
        max_steps=STEPS, limit_val_batches=0, callbacks=callbacks, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(TinyLM(vocab), train_dataloaders=DataLoader(train_set, batch_size=batch, shuffle=True))


def _timed_run(model: str, run: str, batch: int, tmp: Path) -> dict[str, list[float]]:
    """Per step of one recorded run of ``model`` on ``run``: its duration and the recorder's share of it (rank 0)."""
    clock = tmp / f"clock-{model}-{run}-{batch}.json"
    baseline = TimedBaseline(tmp / f"{model}-{run}-{batch}.json", clock, steps=STEPS, comm_every=DEFAULT_EVERY)
    if model == "tiny_lm":
        _tiny_lm_fit(RUNS[run][0], batch, [baseline])
    else:
        trainer_for(run, STEPS, [baseline]).fit(ParallelLM(data_parallel=RUNS[run][1]))
    return json.loads(clock.read_text())


def overhead(repeats: int) -> None:
    """The recorder's time inside its hooks against the rest of the step, per step (medians: robust to a busy
    machine); a profiled step's extra time against the median unprofiled step, and both spread over the steps."""
    profiled = {k for k in range(STEPS) if k % DEFAULT_EVERY == 1}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for model, run, batch in CASES:
            ratios, compute, extras, writes = [], [], [], []
            for _ in range(repeats):
                timed = _timed_run(model, run, batch, tmp)
                writes.append(timed["write"])
                steps = list(zip(timed["durations"], timed["hooks"], strict=True))[1:]  # step 0: the warm-up
                plain = [(d, h) for k, (d, h) in enumerate(steps, start=1) if k not in profiled]
                ratios += [h / (d - h) for d, h in plain]
                compute += [d - h for d, h in plain]
                usual = statistics.median(d for d, _ in plain)
                extras += [steps[k - 1][0] - usual for k in sorted(profiled) if k <= len(steps)]
            step, ratio = statistics.median(compute), statistics.median(ratios)
            extra = statistics.median(extras)
            amortized = ratio + extra / step / DEFAULT_EVERY
            what = f"tiny_lm.py, batch {batch} x 64" if model == "tiny_lm" else "compare_parallelisms.py, batch 8 x 16"
            profiled_text = (
                f" a profiled step {extra * 1e3:+.1f} ms; with 1 in {DEFAULT_EVERY} profiled: {amortized:.1%};"
                if RUNS[run][0] > 1
                else " no step profiled (one process: nothing to communicate);"
            )
            print(
                f"{what} on {run}: step {step * 1e3:.2f} ms; recorder {ratio:.1%} of it per step (goal <= 5 %);"
                f"{profiled_text} the record's end {statistics.median(writes) * 1e3:.1f} ms once"
            )


def spread() -> None:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        names = list(RUNS)  # fsdp2xtp2: 4 processes on this machine's cores too
        data = {name: load_baseline(record(name, tmp / f"{name}.json", steps=20)) for name in names}
    reference = data["one"]["steps"]
    smallest = min(abs(v) for s in reference for g in ("grad_norms", "param_norms") for v in s[g].values())
    print(f"spread against one process over 20 steps (defaults: rtol={DEFAULT_RTOL:g}, atol={DEFAULT_ATOL:g}):")
    for name in names[1:]:
        worst = {"loss": 0.0, "grad_norms": 0.0, "param_norms": 0.0}
        for ref, cur in zip(reference, data[name]["steps"], strict=True):
            worst["loss"] = max(worst["loss"], abs(ref["loss"] - cur["loss"]) / abs(ref["loss"]))
            for group in ("grad_norms", "param_norms"):
                for key, value in ref[group].items():
                    rel = abs(value - cur[group][key]) / max(abs(value), abs(cur[group][key]))
                    worst[group] = max(worst[group], rel)
        print(f"  {name:<6} largest relative difference: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
    print(f"  smallest norm compared: {smallest:.3e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=("overhead", "spread"), default=None)
    args = parser.parse_args()
    if args.only != "spread":
        overhead(args.repeats)
    if args.only != "overhead":
        spread()


if __name__ == "__main__":
    main()
