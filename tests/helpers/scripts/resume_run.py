"""Phases of the resume acceptance tests, each in its own process.

python resume_run.py straight OUT              # the whole run, ModelCheckpoint(every_n_train_steps=1): step=K.ckpt
python resume_run.py resume OUT CKPT...        # for each CKPT in turn: a new Trainer resumes it to the end
python resume_run.py both OUT K...             # OUT/straight, then OUT/straight/step=K.ckpt resumed into OUT/resumed
python resume_run.py preempt OUT               # the whole run under PreemptionCheckpoint; the test sends SIGTERM
                                               # once every rank wrote OUT/ready<rank> at PREEMPT_AT_STEP, where
                                               # the ranks wait for the signal: no race with the end of the run
                                               # (HOLD=1: after the checkpoint, wait for a second signal)
python resume_run.py requeue OUT               # the requeued job: the same callbacks, fit(ckpt_path="last")

Environment: DEVICES (1, 2 or 4 gloo ranks, fork), WORKERS (0 or 2), SHUFFLE (1 or 0), PERSIST (persistent workers),
PERSAMPLE (1: WorkerSeedCallback(per_sample=True), 0: per_sample=False; unset: no WorkerSeedCallback),
ACCUM (accumulate_grad_batches), OWN_SAMPLER (the user's sampler, use_distributed_sampler=False), EPOCHS.
Every run records, on rank 0, the synced training loss of every step and a fingerprint of the final parameters,
optimizer and LR-scheduler state (OneCycleLR, sized by `trainer.estimated_stepping_batches`: Lightning issue #20550).
"""

import json
import os
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler  # noqa: E402

from lightning_determinism import (  # noqa: E402
    DeterministicDDPStrategy,
    DeterministicSingleDeviceStrategy,
    PreemptionCheckpoint,
    WorkerSeedCallback,
    fingerprint,
)

DEVICES = int(os.environ.get("DEVICES", "2"))
WORKERS = int(os.environ.get("WORKERS", "0"))
EPOCHS = int(os.environ.get("EPOCHS", "3"))
ACCUM = int(os.environ.get("ACCUM", "1"))
VALIDATE = bool(os.environ.get("VALIDATE"))  # a validation pass after each epoch (4 batches per rank)
OWN_SAMPLER = bool(os.environ.get("OWN_SAMPLER"))  # Trainer(use_distributed_sampler=False), a sampler of the user's


class Noisy(Dataset):
    """Fixed features; every item adds random noise (an augmentation, drawn in a worker or in the main process)."""

    def __init__(self, n: int = 24) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=gen)
        self.y = torch.randn(n, 1, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i] + 0.1 * torch.randn(8), self.y[i]


class Net(L.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        self.net = None
        self.losses: dict[int, str] = {}
        self.val: dict[int, str] = {}  # per epoch: the synced validation loss (VALIDATE=1)

    def configure_model(self) -> None:
        if self.net is None:  # built here: the same weights on every rank and in every process
            self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        synced = self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")
        self.log("train/loss", synced)
        if not self.trainer.fit_loop._should_accumulate():
            self.losses[int(self.trainer.global_step) + 1] = float(synced).hex()  # the step this batch completes
        if os.environ.get("PREEMPT_AT_STEP") and self.trainer.global_step == int(os.environ["PREEMPT_AT_STEP"]):
            self._wait_for_the_signal()
        return loss

    def _wait_for_the_signal(self) -> None:
        """The hand-shake with the test: say this rank reached the step, then hold it there until SIGTERM arrived."""
        import time

        preemption = next(cb for cb in self.trainer.callbacks if isinstance(cb, PreemptionCheckpoint))
        ready = Path(self.out) / f"ready{self.global_rank}"
        ready.with_suffix(".tmp").write_text(str(os.getpid()))
        ready.with_suffix(".tmp").replace(ready)  # appears whole
        deadline = time.monotonic() + 300
        while preemption.received is None:  # set by the callback's signal handler
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {self.global_rank}: no signal within 300 s of reaching the step")
            time.sleep(0.01)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("val/loss", loss, on_epoch=True, sync_dist=True)
        at = os.environ.get("PREEMPT_IN_VALIDATION")  # the epoch in whose validation pass the ranks wait (batch 1)
        if at and not self.trainer.sanity_checking and self.current_epoch == int(at) and batch_idx == 1:
            self._wait_for_the_signal()

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self.val[int(self.current_epoch)] = float(self.trainer.callback_metrics["val/loss"]).hex()

    def val_dataloader(self):
        return DataLoader(Noisy(16), batch_size=2) if VALIDATE else []

    def train_dataloader(self):
        persist = bool(os.environ.get("PERSIST")) and WORKERS > 0
        shuffle = os.environ.get("SHUFFLE", "1") == "1"
        if OWN_SAMPLER:  # the user's own sampler, which the Trainer is told to leave alone
            sampler = DistributedSampler(Noisy(), shuffle=shuffle, seed=3) if DEVICES > 1 else RandomSampler(Noisy())
            return DataLoader(Noisy(), batch_size=4, sampler=sampler, num_workers=WORKERS, persistent_workers=persist)
        return DataLoader(Noisy(), batch_size=4, shuffle=shuffle, num_workers=WORKERS, persistent_workers=persist)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
        total = self.trainer.estimated_stepping_batches  # builds the train loader early (Lightning #20550)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=2e-2, total_steps=int(total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_end(self) -> None:
        if self.trainer.is_global_zero:
            schedulers = [config.scheduler.state_dict() for config in self.trainer.lr_scheduler_configs]
            state = {
                "params": fingerprint(self.net),
                "optimizer": fingerprint(self.trainer.optimizers[0]),
                "scheduler": fingerprint(schedulers),
                "global_step": int(self.trainer.global_step),
                "losses": self.losses,
                "val": self.val,
            }
            (Path(self.out) / "result.json").write_text(json.dumps(state))


class HoldAfterCheckpoint(Callback):
    """The hand-shake for a repeated signal: once the ranks stopped after the preemption checkpoint, the main process
    (the launcher's; Lightning calls `on_exception` there with the ranks' SystemExit) writes OUT/exiting and waits
    until the test has signalled again and written OUT/released."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_exception(self, trainer, pl_module, exception) -> None:
        import multiprocessing
        import time

        if not isinstance(exception, SystemExit) or multiprocessing.parent_process() is not None:
            return  # only the main process, not a forked rank
        (self.out / "exiting.tmp").write_text(str(os.getpid()))
        (self.out / "exiting.tmp").replace(self.out / "exiting")
        deadline = time.monotonic() + 300
        while not (self.out / "released").exists():
            if time.monotonic() > deadline:
                raise RuntimeError("the main process was not released within 300 s")
            time.sleep(0.01)


def trainer(out: Path, callbacks: list[Callback]) -> L.Trainer:
    if DEVICES > 1:
        strategy = DeterministicDDPStrategy(seed=17, start_method="fork")
    else:
        strategy = DeterministicSingleDeviceStrategy(seed=17, device="cpu")
    if os.environ.get("PERSAMPLE"):  # "1": per-sample seeds; "0": per-worker seeds (replayed on resume)
        callbacks = [WorkerSeedCallback(per_sample=os.environ["PERSAMPLE"] == "1"), *callbacks]
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=DEVICES,
        max_epochs=EPOCHS,
        accumulate_grad_batches=ACCUM,
        use_distributed_sampler=not OWN_SAMPLER,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(out),
    )


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    if mode == "straight":
        every_step = ModelCheckpoint(dirpath=out, every_n_train_steps=1, save_top_k=-1, filename="{step}")
        trainer(out, [every_step]).fit(Net(str(out)))
    elif mode in ("resume", "both"):
        if mode == "both":  # the straight run first, in this process: resume_run.py both OUT K...
            straight = out / "straight"
            straight.mkdir(parents=True, exist_ok=True)
            every_step = ModelCheckpoint(dirpath=straight, every_n_train_steps=1, save_top_k=-1, filename="{step}")
            trainer(straight, [every_step]).fit(Net(str(straight)))
            out = out / "resumed"
        ckpts = [out.parent / "straight" / f"step={k}.ckpt" for k in sys.argv[3:]] if mode == "both" else sys.argv[3:]
        for ckpt in ckpts:
            target = out / Path(ckpt).stem
            target.mkdir(parents=True, exist_ok=True)
            # The resumed run checkpoints as the docs recommend: with accumulation its first micro-batches leave
            # global_step at the resumed step, where Lightning's callback would save that step again, mid-window.
            again = ModelCheckpoint(dirpath=target, every_n_train_steps=1, save_top_k=-1, filename="{step}")
            trainer(target, [again]).fit(Net(str(target)), ckpt_path=ckpt)
    elif mode in ("preempt", "requeue"):
        # A job's callbacks as on a preemptible cluster: periodic checkpoints (no save_last) in their own directory,
        # the preemption checkpoint beside them in OUT; a requeued job resumes with ckpt_path="last".
        periodic = ModelCheckpoint(dirpath=out / "periodic", every_n_train_steps=2, save_top_k=-1, filename="{step}")
        callbacks = [
            periodic,
            PreemptionCheckpoint(out),
            *([HoldAfterCheckpoint(out)] if os.environ.get("HOLD") else []),
        ]
        trainer(out, callbacks).fit(Net(str(out)), ckpt_path="last" if mode == "requeue" else None)
    else:
        raise SystemExit(f"unknown mode {mode}")
