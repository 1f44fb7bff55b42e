"""Two "identical" runs of the tiny LM disagree: record both with DivergenceProbe, and let `diagnose` say where and why.

Run B differs from run A in one way that nobody would see in the code under review:

    python examples/diagnose_two_runs.py                    # B logs a random sample from step 2 on (a callback's draw)
    python examples/diagnose_two_runs.py --fault dropout    # B's dropout probability is 0.25, not 0.2
    python examples/diagnose_two_runs.py --fault lr         # B's learning rate is 3.3e-3, not 3e-3
    python examples/diagnose_two_runs.py --fault none       # no difference: "same", exit status 0

It prints the diagnosis and the command that gives it again from the two files; the exit status is the command's
(0 same, 1 diverged).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lightning as L  # noqa: E402
from tiny_lm import TinyLM, build_data  # noqa: E402  (sets one intra-op thread, quiets Lightning)

from lightning_determinism import DeterministicSingleDeviceStrategy, DivergenceProbe, diagnose  # noqa: E402
from lightning_determinism.divergence.diagnosis import format_diagnosis  # noqa: E402

STEPS = 4


class LogRandomSample(L.Callback):
    """Picks a random sample of the batch to log, from step 2 on: a draw from the training stream nobody notices."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step >= 2:
            torch.randint(len(batch["input_ids"]), (1,))


def record(path: Path, fault: str | None) -> None:
    train_set, _, vocab_size = build_data(sentences=300)
    L.seed_everything(42, verbose=False)  # TinyLM builds its layers in __init__, before the strategy seeds
    model = TinyLM(vocab_size, dropout=0.25 if fault == "dropout" else 0.2, lr=3.3e-3 if fault == "lr" else 3e-3)
    callbacks: list[L.Callback] = [DivergenceProbe(path, steps=STEPS)]
    if fault == "callback":
        callbacks.append(LogRandomSample())  # after the probe: it draws once the probe has taken the step's states
    trainer = L.Trainer(
        strategy=DeterministicSingleDeviceStrategy(seed=42, device="cpu"), accelerator="cpu", devices=1,
        max_steps=STEPS, callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(model, DataLoader(train_set, batch_size=16, shuffle=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fault", choices=["callback", "dropout", "lr", "none"], default="callback")
    parser.add_argument("--out", default=None, help="where the two probe files go (default: a temporary directory)")
    args = parser.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp())
    a, b = out / "a.json", out / "b.json"
    record(a, None)
    record(b, None if args.fault == "none" else args.fault)
    result = diagnose(a, b)
    print(format_diagnosis(result))
    print(f"\nthe same from the files: lightning-determinism diagnose {a} {b} [--json]")
    return 0 if result["verdict"] == "same" else 1


if __name__ == "__main__":
    sys.exit(main())
