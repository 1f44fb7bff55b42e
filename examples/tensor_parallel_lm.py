"""A tiny language model under tensor parallelism (and FSDP2), reproducibly, on CPU processes.

Lightning's ModelParallelStrategy through `DeterministicModelParallelStrategy`: the model is built under the base seed
and parallelised in `configure_model` (column- and row-parallel MLP; with `--dp 2` also `fully_shard`), dropout on the
sharded activation draws from the tracker's fork, dropout on the replicated one from the default stream. It prints
each rank's mesh coordinates, the replica check (the tensors the tensor-parallel dimension replicates, by digest) and
the fingerprint of the gathered model. The corpus is generated here: nothing is downloaded.

    python examples/tensor_parallel_lm.py                  # tensor_parallel_size=2 on 2 processes
    python examples/tensor_parallel_lm.py --dp 2 --tp 2    # 2 x 2 on 4 processes
    python examples/tensor_parallel_lm.py --resume         # stop mid-epoch, resume in new processes: the same bits
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lightning_determinism import DeterministicModelParallelStrategy, ReplicaGuard, get_rng_tracker  # noqa: E402
from lightning_determinism.callbacks.replica_guard import replicated_digests  # noqa: E402

VOCAB, WIDTH, CONTEXT = 32, 32, 16


def corpus(n: int = 256) -> torch.Tensor:
    """Token sequences from a fixed rule with noise (a counter modulo the vocabulary, sometimes skipping)."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randint(VOCAB, (n, 1), generator=gen)
    steps = 1 + (torch.rand(n, CONTEXT + 1, generator=gen) < 0.2).long()
    return (start + steps.cumsum(1)) % VOCAB


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        u = torch.relu(self.up(h))  # column-parallel: a shard of the features on each tensor-parallel rank
        with get_rng_tracker().fork():
            u = nn.functional.dropout(u, 0.1, self.training)
        h = h + nn.functional.dropout(self.down(u), 0.1, self.training)  # row-parallel: replicated
        return self.head(self.norm(h))


def fingerprint(module: nn.Module) -> str:
    from torch.distributed.tensor import DTensor

    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        digest.update(name.encode())
        digest.update(full.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


class TinyLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model: Block | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from torch.distributed._composable.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        self.model = Block()
        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        if tp.size() > 1:
            parallelize_module(self.model, tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        if dp.size() > 1:
            fully_shard(self.model, mesh=dp)

    def on_train_start(self) -> None:
        dp, tp = self.device_mesh["data_parallel"], self.device_mesh["tensor_parallel"]
        print(f"rank {self.global_rank}: data_parallel={dp.get_local_rank()} tensor_parallel={tp.get_local_rank()}")

    def training_step(self, batch, batch_idx):
        tokens = batch[0]
        logits = self.model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        self.log("train/loss", loss, prog_bar=False)
        return loss

    def train_dataloader(self):
        return DataLoader(TensorDataset(corpus()), batch_size=16, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def on_train_end(self) -> None:
        digests = replicated_digests(self.model)
        summary = hashlib.sha256("".join(f"{k}={v}" for k, v in sorted(digests.items())).encode()).hexdigest()[:16]
        print(f"rank {self.global_rank}: replicated tensors {len(digests)}, digest {summary}")
        fp = fingerprint(self.model)  # every rank takes part in gathering the sharded tensors
        if self.global_rank == 0:
            print(f"fingerprint {fp}")


def trainer(args: argparse.Namespace, out: Path, max_steps: int = -1, callbacks=()) -> L.Trainer:
    strategy = DeterministicModelParallelStrategy(seed=args.seed, data_parallel_size=args.dp,
                                                  tensor_parallel_size=args.tp, start_method="fork")  # fmt: skip
    return L.Trainer(
        strategy=strategy, accelerator="cpu", devices=args.dp * args.tp, max_epochs=args.epochs, max_steps=max_steps,
        callbacks=[ReplicaGuard(every_n_train_steps=5), *callbacks], logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(out), enable_checkpointing=bool(callbacks),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=1, help="data_parallel_size")
    parser.add_argument("--tp", type=int, default=2, help="tensor_parallel_size")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--resume", action="store_true", help="stop mid-epoch, resume in new processes")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        if not args.resume:
            trainer(args, out).fit(TinyLM())
            return
        steps_per_epoch = len(corpus()) // 16 // args.dp
        stop = steps_per_epoch + steps_per_epoch // 2  # the middle of the second epoch
        print("== uninterrupted")
        trainer(args, out / "straight").fit(TinyLM())
        print(f"== stopped at step {stop}, in the middle of epoch 1 (a distributed checkpoint)")
        save = ModelCheckpoint(dirpath=out / "first", filename="stopped", every_n_train_steps=stop)
        trainer(args, out / "first", max_steps=stop, callbacks=[save]).fit(TinyLM())
        print("== resumed from it in new processes: the uninterrupted run's fingerprint")
        trainer(args, out / "resumed").fit(TinyLM(), ckpt_path=str(out / "first" / "stopped.ckpt"))


if __name__ == "__main__":
    main()
