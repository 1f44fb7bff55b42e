"""A tiny character-level language model, trained and validated reproducibly on 2 CPU processes.

It prints each rank's seeds, the validation loss and perplexity per epoch, and a sha256 fingerprint of the trained
weights. Run it twice: every figure is the same both times.

    python examples/tiny_lm.py                 # 2 processes (DDP over gloo), falls back to 1 on a 1-core machine
    python examples/tiny_lm.py --devices 1     # one process, same seeding contract
    python examples/tiny_lm.py --invariant --devices 1   # world-size-invariant training: the same fingerprint
    python examples/tiny_lm.py --invariant --devices 4   # on 1, 2 or 4 processes

The corpus is generated here from a small fixed grammar: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import random
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

# One intra-op thread per process: two ranks on two cores, and float sums whose order never changes.
torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402


def quiet_lightning_noise() -> None:
    """Keep two of Lightning's lines that say nothing about this run out of the output (every rank would print them).

    A FutureWarning from torch's pytree about Lightning's own use of ``LeafSpec`` (Lightning 2.6 with torch >= 2.10),
    and the "litlogger" advertisement printed by every Trainer. Everything else Lightning says is left alone.
    """
    import warnings

    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )

    class _NoAdvert(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "litlogger" not in record.getMessage()

    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_NoAdvert())


quiet_lightning_noise()  # at import: the popen launcher runs this file again for every rank

from lightning_determinism import (  # noqa: E402  (importing registers the strategies)
    DeterministicDDPStrategy,
    DeterministicSingleDeviceStrategy,
    DistributedMean,
    DistributedPerplexity,
    WorkerSeedCallback,
)

SUBJECTS = ["the cat", "a dog", "my friend", "the old sailor", "a small bird", "the teacher", "our neighbour"]
VERBS = ["sees", "likes", "follows", "draws", "finds", "remembers", "carries"]
OBJECTS = ["the moon", "a red ball", "the river", "an old map", "the garden", "a paper boat", "the last train"]
ENDINGS = [".", " today.", " at night.", " again.", " in the rain."]


def make_corpus(n_sentences: int = 1500, seed: int = 0) -> str:
    """Sentences from a fixed grammar, drawn from a private generator so the corpus never changes."""
    rng = random.Random(seed)
    sentences = [
        f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}{rng.choice(ENDINGS)}"
        for _ in range(n_sentences)
    ]
    return " ".join(sentences)


class CharWindows(Dataset):
    """Windows of ``length + 1`` characters: inputs are the first ``length``, targets the last ``length``.

    With ``random_crop`` the window starts at a random offset inside its slot: an augmentation drawn in the
    data-loader workers, which ``WorkerSeedCallback`` makes reproducible and distinct per rank, worker and epoch.
    """

    def __init__(self, ids: torch.Tensor, length: int, random_crop: bool = False) -> None:
        self.ids = ids
        self.length = length
        self.random_crop = random_crop

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.length - (1 if self.random_crop else 0)

    def limit(self, n: int) -> None:
        """Keep the first ``n`` windows."""
        self.ids = self.ids[: (n + (1 if self.random_crop else 0)) * self.length + 1]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start = i * self.length + (random.randrange(self.length) if self.random_crop else 0)
        chunk = self.ids[start : start + self.length + 1]
        return {"input_ids": chunk[:-1], "labels": chunk[1:]}


class TinyLM(L.LightningModule):
    """Embedding, dropout, a GRU and a linear head."""

    def __init__(self, vocab_size: int, dim: int = 64, hidden: int = 128, dropout: float = 0.2, lr: float = 3e-3):
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab_size, dim)
        self.drop = nn.Dropout(dropout)
        self.rnn = nn.GRU(dim, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab_size)
        # Exact sums and int64 token counts over all ranks; each validation window counted once.
        self.val_ppl = DistributedPerplexity()
        self.val_loss = DistributedMean()  # the true per-token mean, not Lightning's mean of per-rank means

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.drop(self.embed(input_ids)))
        return self.head(self.drop(out))

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self(batch["input_ids"])
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        logits = self(batch["input_ids"])
        labels = batch["labels"].flatten()
        per_token = nn.functional.cross_entropy(logits.flatten(0, 1), labels, reduction="none")
        self.val_loss.update(per_token, mask=labels != -100)  # padding (none here) would count for nothing
        self.log("val/loss", self.val_loss, on_epoch=True)
        self.val_ppl.update(logits, batch["labels"])
        self.log("val/ppl", self.val_ppl, on_epoch=True)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        metrics = self.trainer.callback_metrics
        if self.trainer.is_global_zero:
            print(
                f"epoch {self.current_epoch}: val/loss {metrics['val/loss'].item():.6f}"
                f" val/ppl {metrics['val/ppl'].item():.6f}",
                flush=True,
            )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def weights_fingerprint(module: nn.Module) -> str:
    """sha256 over every tensor of the state dict: names sorted, dtype, shape and bytes."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def build_data(length: int = 64, sentences: int = 1500) -> tuple[CharWindows, CharWindows, int]:
    text = make_corpus(sentences)
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    split = int(len(ids) * 0.9)
    return CharWindows(ids[:split], length, random_crop=True), CharWindows(ids[split:], length), len(vocab)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=min(2, os.cpu_count() or 1), help="CPU processes (default 2)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2, help="data-loader workers per process")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="checkpoint a run in the middle of an epoch, resume the checkpoint in a new process, compare the two",
    )
    parser.add_argument(
        "--invariant",
        action="store_true",
        help="world-size-invariant training: 4 micro-batches of --batch-size per step, the same bits on 1, 2 or 4"
        " processes",
    )
    parser.add_argument("--sentences", type=int, default=1500, help="size of the generated corpus (default 1500)")
    parser.add_argument("--ckpt-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--save-at-step", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--resume-from", default=None, help=argparse.SUPPRESS)
    # How the ranks start (the tests fork them: no interpreter to start per rank); the README's runs use popen.
    parser.add_argument("--start-method", default="popen", choices=("popen", "fork"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def script_command(script: str, args: argparse.Namespace) -> list[str]:
    """The command line that runs ``script`` again with the settings of ``args`` (for the resume demos)."""
    command = [sys.executable, script, "--epochs", str(args.epochs), "--seed", str(args.seed)]
    command += ["--devices", str(args.devices), "--workers", str(args.workers), "--batch-size", str(args.batch_size)]
    command += ["--sentences", str(args.sentences)]
    start_method = getattr(args, "start_method", "popen")  # the Fabric example's launch() starts popen ranks only
    return command + (["--start-method", start_method] if start_method != "popen" else [])


def straight_and_resumed(command: list[str], save: list[str], resume: list[str]) -> tuple[str, str]:
    """Fingerprints of an uninterrupted run that writes a checkpoint on its way (``save``), and of a run resumed from
    that checkpoint (``resume``) in a new process. The uninterrupted run's validation lines are printed."""
    import subprocess

    # Each run picks its own rendezvous port, not one inherited from this process.
    env = {key: value for key, value in os.environ.items() if key != "MASTER_PORT"}

    def run(extra: list[str], show_validation: bool = False) -> str:
        done = subprocess.run(command + extra, capture_output=True, text=True, env=env)
        if done.returncode:
            raise SystemExit(f"a phase of the resume demo failed:\n{done.stderr[-3000:]}")
        if show_validation:
            print("\n".join(line for line in done.stdout.splitlines() if line.startswith("epoch ")), flush=True)
        return [line for line in done.stdout.splitlines() if line.startswith("weights sha256:")][-1].split()[-1]

    straight = run(save, show_validation=True)
    return straight, run(resume)


def show_seed_lines() -> None:
    """Print the strategy's per-rank seed line (Lightning's own loggers are set up the same way)."""
    ldet_log = logging.getLogger("lightning_determinism")
    ldet_log.setLevel(logging.INFO)
    if not ldet_log.handlers:
        ldet_log.addHandler(logging.StreamHandler(sys.stdout))


def resume_demo(args: argparse.Namespace) -> None:
    """The uninterrupted run, checkpointing in the middle of an epoch, and the checkpoint resumed in a new process."""
    import math
    import tempfile

    train_set, _, _ = build_data(sentences=args.sentences)
    per_epoch = math.ceil(len(train_set) / args.devices / args.batch_size)
    stop = (args.epochs // 2) * per_epoch + per_epoch // 2  # the middle of an epoch
    with tempfile.TemporaryDirectory() as tmp:
        straight, resumed = straight_and_resumed(
            script_command(__file__, args),
            ["--ckpt-dir", tmp, "--save-at-step", str(stop)],
            ["--resume-from", os.path.join(tmp, f"step={stop}.ckpt")],
        )
    epoch, batch = divmod(stop, per_epoch)
    print(f"uninterrupted {_count(args.epochs, 'epoch')}:{'':33}{straight}")
    print(f"checkpoint at step {stop} (epoch {epoch}, batch {batch} of {per_epoch}), resumed: {resumed}")
    print("bitwise identical" if straight == resumed else "DIFFERENT")


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    if args.resume:
        resume_demo(args)
        return ""
    show_seed_lines()

    train_set, val_set, vocab_size = build_data(sentences=args.sentences)
    ddp = {"popen": "ddp_deterministic", "fork": "ddp_fork_deterministic"}[args.start_method]
    strategy: str | L.pytorch.strategies.Strategy = ddp if args.devices > 1 else "single_device_deterministic"
    if args.invariant:
        # One optimizer step = 4 micro-batches of --batch-size windows, wherever they run; the step must divide the
        # training set, so the windows of the last partial step are cut off.
        step = 4 * args.batch_size
        train_set.limit(len(train_set) // step * step)
        invariant = {"global_batch_size": step, "micro_batch_size": args.batch_size}
        strategy = (
            DeterministicDDPStrategy(start_method=args.start_method, **invariant)
            if args.devices > 1
            else DeterministicSingleDeviceStrategy(device="cpu", **invariant)
        )
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=args.devices,
        max_epochs=args.epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        # Seeds every (rank, worker, epoch) stream; per_sample: each crop depends on (seed, epoch, index) only,
        # so the result is the same for any --workers. (The strategy adds RNGStateCheckpoint by itself.)
        callbacks=[WorkerSeedCallback(per_sample=True)]
        + (
            [
                ModelCheckpoint(
                    dirpath=args.ckpt_dir,
                    filename="{step}",
                    save_top_k=-1,
                    every_n_train_steps=max(1, args.save_at_step),
                )
            ]  # fmt: skip
            if args.ckpt_dir
            else []
        ),
        enable_checkpointing=bool(args.ckpt_dir),
    )
    L.seed_everything(args.seed, verbose=False)  # the strategy takes this as its base seed
    model = TinyLM(vocab_size)  # built after seed_everything: the same initial weights in every process
    trainer.fit(
        model,
        train_dataloaders=DataLoader(
            train_set,
            batch_size=args.batch_size,
            shuffle=True,
            num_workers=args.workers,
            persistent_workers=args.workers > 0,  # resumable bitwise thanks to per_sample (see docs)
        ),
        val_dataloaders=DataLoader(val_set, batch_size=args.batch_size),
        ckpt_path=args.resume_from,
    )
    fingerprint = weights_fingerprint(model)
    if trainer.is_global_zero:
        print(f"weights sha256: {fingerprint}", flush=True)
    return fingerprint


if __name__ == "__main__":
    main()
