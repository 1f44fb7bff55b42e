"""The tiny language model pretrained on streamed data: litdata's StreamingDataset over a local optimized directory.

The example writes the directory itself (character windows of a generated corpus, with ``litdata.optimize``; nothing
is downloaded), then trains one long epoch on 2 CPU processes with 2 loader workers each, reading it through a
``StreamingDataLoader``, and prints the validation loss and a sha256 fingerprint of the weights.

    python examples/streaming_lm.py              # needs: pip install -e ".[streaming]" && pip install --no-deps litdata
    python examples/streaming_lm.py --resume     # stopped in the middle of the epoch, resumed in a new process:
                                                 # both fingerprints, bitwise identical
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import sys
import tempfile
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from tiny_lm import (  # noqa: E402  (the model, the corpus, the demo's plumbing)
    TinyLM,
    build_data,
    make_corpus,
    show_seed_lines,
    straight_and_resumed,
    weights_fingerprint,
)
from torch.utils.data import DataLoader  # noqa: E402

import lightning_determinism  # noqa: E402, F401  (registers the strategies)

LENGTH = 64


SENTENCES = 1500


@functools.lru_cache(maxsize=1)
def corpus_ids(sentences: int) -> torch.Tensor:
    text = make_corpus(sentences)
    vocab = sorted(set(text))
    return torch.tensor([vocab.index(c) for c in text])


CHUNK = 32


def window_starts(sentences: int) -> list[int]:
    """Where the training windows start: the first 90 % of the corpus (tiny_lm validates on the rest).

    Whole groups of 8 chunks: litdata hands every (rank, worker) its own chunks, and DDP needs every rank to see as
    many batches (2 ranks x 2 workers, or 1 x 4, ... divide 8).
    """
    starts = list(range(0, int(len(corpus_ids(sentences)) * 0.9) - LENGTH - 1, LENGTH // 2))
    return starts[: len(starts) // (8 * CHUNK) * 8 * CHUNK]


def window(start: int) -> dict[str, object]:
    """One training sample: LENGTH + 1 characters of the corpus from ``start`` (litdata stores it as numpy)."""
    return {"ids": corpus_ids(SENTENCES)[start : start + LENGTH + 1].numpy()}


def write_dataset(directory: Path, sentences: int) -> None:
    """The training windows in litdata's chunked format (what `litdata.optimize` writes for a cloud bucket)."""
    from litdata import optimize

    method = multiprocessing.get_start_method(allow_none=True)
    optimize(
        fn=window,
        inputs=window_starts(sentences),
        output_dir=str(directory),
        chunk_size=CHUNK,
        num_workers=1,
        mode="overwrite",
        # Linux: its worker forked from this process, not spawned (which imports torch and Lightning again: seconds)
        start_method="fork" if sys.platform == "linux" else None,
    )
    multiprocessing.set_start_method(method, force=True)  # optimize leaves its start method set for the whole process


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--workers", type=int, default=2, help="loader workers per process")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--sentences", type=int, default=1500, help="size of the generated corpus")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--data-dir", default=None, help="where the optimized dataset goes (default: a temporary one)")
    parser.add_argument("--resume", action="store_true", help="checkpoint mid-epoch, resume in a new process, compare")
    parser.add_argument("--ckpt-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--save-at-step", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--resume-from", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def train(args: argparse.Namespace) -> str:
    show_seed_lines()
    _, val_set, vocab_size = build_data(sentences=args.sentences)
    checkpoints = [ModelCheckpoint(dirpath=args.ckpt_dir, filename="{step}", save_top_k=-1,
                                   every_n_train_steps=args.save_at_step)]  # fmt: skip
    trainer = L.Trainer(
        strategy="ddp_deterministic" if args.devices > 1 else "single_device_deterministic",
        accelerator="cpu",
        devices=args.devices,
        max_epochs=1,  # one long epoch, as in pretraining
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=checkpoints if args.ckpt_dir else [],
        enable_checkpointing=bool(args.ckpt_dir),
    )
    L.seed_everything(args.seed, verbose=False)
    model = StreamLM(vocab_size, args.data_dir, args.seed, args.batch_size, args.workers)
    trainer.fit(model, val_dataloaders=DataLoader(val_set, batch_size=args.batch_size), ckpt_path=args.resume_from)
    fingerprint = weights_fingerprint(model)
    if trainer.is_global_zero:
        print(f"weights sha256: {fingerprint}", flush=True)
    return fingerprint


class StreamLM(TinyLM):
    """TinyLM on litdata's samples: a window of LENGTH + 1 ids, inputs and next-character targets."""

    def __init__(self, vocab_size: int, data_dir: str, seed: int, batch_size: int, workers: int) -> None:
        super().__init__(vocab_size)
        self.data_dir, self.seed, self.batch_size, self.workers = data_dir, seed, batch_size, workers

    def train_dataloader(self) -> DataLoader:
        """Built here, once the ranks exist: litdata reads the world size when the dataset is created."""
        from litdata import StreamingDataLoader, StreamingDataset

        stream = StreamingDataset(self.data_dir, shuffle=True, seed=self.seed, drop_last=True)
        return StreamingDataLoader(stream, batch_size=self.batch_size, num_workers=self.workers)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch["ids"].long()
        return super().training_step({"input_ids": ids[:, :-1], "labels": ids[:, 1:]}, batch_idx)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    global SENTENCES
    SENTENCES = args.sentences
    with tempfile.TemporaryDirectory() as tmp:
        args.data_dir = args.data_dir or os.path.join(tmp, "optimized")
        if not os.path.exists(os.path.join(args.data_dir, "index.json")):
            write_dataset(Path(args.data_dir), args.sentences)
        if not args.resume:
            train(args)
            return
        # The demo: the same directory for both runs (each process reads it; none writes it again).
        command = [sys.executable, __file__, "--data-dir", args.data_dir, "--devices", str(args.devices)]
        command += ["--workers", str(args.workers), "--batch-size", str(args.batch_size), "--seed", str(args.seed)]
        command += ["--sentences", str(args.sentences)]
        steps = len(window_starts(args.sentences)) // (args.devices * args.batch_size)  # the epoch, per process
        stop = max(1, steps // 2 + 1)  # in the middle of the epoch, at a worker other than the first
        ckpts = os.path.join(tmp, "ckpts")
        straight, resumed = straight_and_resumed(
            command, ["--ckpt-dir", ckpts, "--save-at-step", str(stop)], ["--resume-from", f"{ckpts}/step={stop}.ckpt"]
        )
    print(f"uninterrupted epoch:{'':27}{straight}")
    print(f"checkpoint at step {stop} of {steps}, resumed: {resumed}")
    print("bitwise identical" if straight == resumed else "DIFFERENT")


if __name__ == "__main__":
    main()
