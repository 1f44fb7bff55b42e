"""Soak: many consecutive 2-rank fork fits in one process, each with validation (a synced metric and a synced
per-epoch log), checkpoints and 2 data-loader workers per rank, each under a timeout.

A hang was reported once in about 27 such fits (rank 0 waiting in torchmetrics' ``gather_all_tensors`` at the end
of the sanity check, rank 1 never arriving). This script looks for it: a watchdog in the main process records
what every rank and data-loader worker of a fit that outlives the timeout is doing (kernel wait channel and, with
gdb, the C stacks), kills them and goes on. It prints the number of clean fits, the hangs and where each rank was.

    python benchmarks/soak_fork_fits.py [--runs 100] [--timeout 120] [--out soak-out]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_determinism import DeterministicDDPStrategy, DistributedPerplexity, WorkerSeedCallback  # noqa: E402


class Tokens(Dataset):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(50, (n, 9), generator=torch.Generator().manual_seed(n))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> torch.Tensor:
        ids = self.ids[i].clone()
        if torch.rand(()) < 0.2:  # a random augmentation, drawn in the worker
            ids[0] = 0
        return ids


class LM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 50)
        self.val_ppl = DistributedPerplexity()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self(batch[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        logits = self(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        self.log("val/loss", loss, sync_dist=True)
        self.val_ppl.update(logits, batch[:, 1:])
        self.log("val/ppl", self.val_ppl)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Tokens(40), batch_size=4, shuffle=True, num_workers=2)

    def val_dataloader(self) -> DataLoader:
        # 7 and 6 samples per rank: uneven batches
        return DataLoader(Tokens(13), batch_size=4, num_workers=2)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _stack(pid: int) -> str:
    """What a process is doing: its parent, kernel wait channel and, where gdb is installed, its C stacks.

    (faulthandler's timer is not used: a process forked while the timer thread runs inherits its lock, and a
    data-loader worker that touches faulthandler then deadlocks; that would be a hang of the soak's own making.)
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        head = f"pid {pid} ppid {stat[1]} state {stat[0]} wchan {Path(f'/proc/{pid}/wchan').read_text()}"
    except OSError:
        return f"pid {pid}: gone"
    if shutil.which("gdb") is None:
        return head
    trace = subprocess.run(
        ["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 20"], capture_output=True, text=True, timeout=60
    ).stdout
    return head + "\n" + "\n".join(line for line in trace.splitlines() if line.startswith(("#", "Thread")))


def one_fit(run: int, out: Path, timeout: float) -> tuple[str, float]:
    dump = out / f"run{run:04d}"
    dump.mkdir(parents=True, exist_ok=True)
    trainer = L.Trainer(
        strategy=DeterministicDDPStrategy(seed=run, start_method="fork"),
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[WorkerSeedCallback(), ModelCheckpoint(dirpath=dump / "ckpt", save_last=True)],
    )
    hung = threading.Event()

    def watchdog() -> None:
        if finished.wait(timeout):
            return
        hung.set()
        pids = _descendants(os.getpid())  # the ranks and their data-loader workers
        for pid in pids:
            (dump / f"stack-{pid}.txt").write_text(_stack(pid))
        for pid in pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass

    finished = threading.Event()
    threading.Thread(target=watchdog, daemon=True).start()
    start = time.perf_counter()
    sys.stderr.flush()
    saved_stderr = os.dup(2)
    log = open(dump / "stderr.txt", "w")  # noqa: SIM115  (the ranks' stderr too: they inherit file descriptor 2)
    os.dup2(log.fileno(), 2)
    try:
        trainer.fit(LM())
        outcome = "clean"
    except Exception as err:  # noqa: BLE001  (a soak records every way a fit can end)
        outcome = "hung" if hung.is_set() else f"failed: {type(err).__name__}: {str(err)[-600:]}"
    finally:
        finished.set()
        sys.stderr.flush()
        os.dup2(saved_stderr, 2)
        os.close(saved_stderr)
        log.close()
    return outcome, time.perf_counter() - start


def _restarted_workers(out: Path) -> int:
    """How many times the package forked workers again (its warning is on stderr, which the caller may capture)."""
    return sum(p.read_text().count("did not start within") for p in out.glob("run*/stderr.txt"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--out", default="soak-out")
    args = parser.parse_args()
    out = Path(args.out)
    results: dict[str, int] = {}
    durations = []
    for run in range(args.runs):
        outcome, seconds = one_fit(run, out, args.timeout)
        durations.append(seconds)
        key = outcome if not outcome.startswith("failed") else outcome
        results[key] = results.get(key, 0) + 1
        if outcome != "clean":
            dumps = sorted((out / f"run{run:04d}").glob("*.txt"))
            stacks = "\n".join(f"== {p.name}\n{p.read_text()[-4000:]}" for p in dumps if p.stat().st_size)
            print(f"run {run}: {outcome}\n{stacks}", flush=True)
        elif run % 10 == 9:
            print(f"{run + 1} fits, {results.get('clean', 0)} clean", flush=True)
    print(f"\n{args.runs} consecutive 2-rank fork fits (validation, checkpoints, 2 workers per rank):")
    restarts = _restarted_workers(out)
    print(f"  data-loader worker sets forked again after a stuck worker (CPython gh-112275): {restarts}")
    for outcome, count in sorted(results.items()):
        print(f"  {outcome}: {count}")
    print(f"  median fit {sorted(durations)[len(durations) // 2]:.2f} s, slowest {max(durations):.2f} s")
    sys.exit(0 if results.get("clean", 0) == args.runs else 1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")
    main()
