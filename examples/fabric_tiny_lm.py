"""The tiny LM of examples/tiny_lm.py as a Lightning Fabric loop, trained and validated reproducibly.

It prints each rank's seeds, the validation loss and perplexity per epoch and a sha256 fingerprint of the trained
weights; run it twice and every figure is the same. The corpus is generated here: nothing is downloaded.

    python examples/fabric_tiny_lm.py                # 2 processes (DDP over gloo), 1 on a 1-core machine
    python examples/fabric_tiny_lm.py --devices 1
    python examples/fabric_tiny_lm.py --resume       # save mid-epoch, resume in a new process, compare
    python examples/fabric_tiny_lm.py --record-baseline b.json    # then --compare-baseline b.json
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from torch import nn
from torch.utils.data import DataLoader

torch.set_num_threads(1)  # one intra-op thread per process: two ranks on two cores

import lightning as L  # noqa: E402
from tiny_lm import (  # noqa: E402  (the same corpus, fingerprint and demo helpers)
    build_data,
    script_command,
    show_seed_lines,
    straight_and_resumed,
    weights_fingerprint,
)

from lightning_determinism import (  # noqa: E402
    BaselineRecorder,
    DeterministicFabricDDPStrategy,
    DeterministicFabricSingleDeviceStrategy,
    DistributedMean,
    DistributedPerplexity,
    FabricRNGState,
    UnpaddedDistributedSampler,
)


class TinyLMNet(nn.Module):
    """The Trainer example's network: embedding, dropout, a GRU and a linear head."""

    def __init__(self, vocab_size: int, dim: int = 64, hidden: int = 128, dropout: float = 0.2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.drop = nn.Dropout(dropout)
        self.rnn = nn.GRU(dim, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.drop(self.embed(input_ids)))
        return self.head(self.drop(out))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=min(2, os.cpu_count() or 1), help="CPU processes (default 2)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2, help="data-loader workers per process")
    parser.add_argument("--sentences", type=int, default=1500, help="size of the generated corpus (default 1500)")
    parser.add_argument("--resume", action="store_true", help="save mid-epoch, resume in a new process, compare")
    parser.add_argument("--record-baseline", default=None, help="record the first steps' numbers into this file")
    parser.add_argument("--compare-baseline", default=None, help="check the first steps against this file")
    parser.add_argument("--save", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--save-in-epoch", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--resume-from", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def train(args: argparse.Namespace) -> str:
    strategy = (
        DeterministicFabricDDPStrategy(per_sample=True, start_method="popen")
        if args.devices > 1
        else DeterministicFabricSingleDeviceStrategy(per_sample=True, device="cpu")
    )  # per_sample: each random crop depends on (seed, epoch, index) only, not on the worker that makes it
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(args.seed)  # Fabric's usual place, after launch(): it becomes the strategy's base seed

    train_set, val_set, vocab_size = build_data(sentences=args.sentences)
    with fabric.init_module():
        model = TinyLMNet(vocab_size)  # under the base seed: the same weights on every rank
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)  # from here on each rank draws from seed + rank
    train_loader = fabric.setup_dataloaders(
        DataLoader(
            train_set, args.batch_size, shuffle=True, num_workers=args.workers, persistent_workers=args.workers > 0
        )  # fmt: skip
    )
    # Evaluation: every window once (Fabric's DistributedSampler would pad with repeats), exact sums over ranks.
    val_sampler = UnpaddedDistributedSampler(val_set, num_replicas=fabric.world_size, rank=fabric.global_rank)
    val_loader = fabric.setup_dataloaders(
        DataLoader(val_set, args.batch_size, sampler=val_sampler), use_distributed_sampler=False
    )
    val_loss, val_ppl = DistributedMean().to(fabric.device), DistributedPerplexity().to(fabric.device)

    rng = FabricRNGState(train_loader)  # every rank's RNG state and the loader's position: epoch, batches drawn
    state = {"model": model, "optimizer": optimizer, "rng": rng, "epoch": 0, "step": 0}
    if args.resume_from:
        fabric.load(args.resume_from, state)
    baseline = args.record_baseline or args.compare_baseline
    recorder = BaselineRecorder(baseline, steps=5, mode="record" if args.record_baseline else "compare", rtol=0.0,
                                atol=0.0) if baseline else None  # fmt: skip

    for epoch in range(state["epoch"], args.epochs):
        model.train()
        for batch in train_loader:  # resumed mid-epoch: the rest of the interrupted epoch
            logits = model(batch["input_ids"])
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
            optimizer.zero_grad()
            fabric.backward(loss)
            if recorder:
                recorder.before_optimizer_step(model)
            optimizer.step()
            if recorder:
                recorder.after_optimizer_step(model, loss)
            state["step"] += 1
            half_way = state["step"] % len(train_loader) == len(train_loader) // 2
            if args.save and epoch == args.save_in_epoch and half_way:
                fabric.save(args.save, state)  # in the middle of the epoch, and go on: the uninterrupted run
        model.eval()
        with torch.no_grad():
            for batch in val_loader:
                logits = model(batch["input_ids"])
                labels = batch["labels"].flatten()
                per_token = nn.functional.cross_entropy(logits.flatten(0, 1), labels, reduction="none")
                val_loss.update(per_token, mask=labels != -100)  # padding would count for nothing
                val_ppl.update(logits, batch["labels"])
        fabric.print(f"epoch {epoch}: val/loss {val_loss.compute().item():.6f} val/ppl {val_ppl.compute().item():.6f}")
        val_loss.reset()
        val_ppl.reset()
        state["epoch"] = epoch + 1
    if recorder:
        recorder.finish()
    fingerprint = weights_fingerprint(model)
    fabric.print(f"weights sha256: {fingerprint}")
    return fingerprint


def resume_demo(args: argparse.Namespace) -> None:
    """The uninterrupted run, which saves in the middle of an epoch, and that checkpoint resumed in a new process."""
    stop = args.epochs // 2
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "state.ckpt")
        straight, resumed = straight_and_resumed(
            script_command(__file__, args), ["--save", path, "--save-in-epoch", str(stop)], ["--resume-from", path]
        )
    print(f"{f'uninterrupted {args.epochs} epochs:':<44} {straight}")
    print(f"{f'saved half-way into epoch {stop}, resumed:':<44} {resumed}")
    print("bitwise identical" if straight == resumed else "DIFFERENT")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.resume:
        resume_demo(args)
        return
    show_seed_lines()  # each rank's seed line
    train(args)


if __name__ == "__main__":
    main()
