"""The recipe large language models are trained with, reproducibly, on 2 CPU processes.

A small GPT (attention and MLP blocks) trained the way torchtitan applies its parallelisms, in its order: tensor
parallel (column-/row-parallel attention and MLP) -> activation checkpointing (`checkpoint_wrapper` per block) ->
`torch.compile` per block -> FSDP2 (`fully_shard` per block), in bf16 autocast with gradient clipping, under
`DeterministicModelParallelStrategy`. Dropout on the sharded activations (attention heads, MLP features) draws from
the tracker's fork, which the recomputation of a checkpointed block draws again; dropout on the replicated residual
stream from the default one. It prints each rank's mesh coordinates and the fingerprint of the gathered model. The
corpus is generated here: nothing is downloaded.

    python examples/llm_recipe.py                  # tensor_parallel_size=2 on 2 processes
    python examples/llm_recipe.py --dp 2 --tp 1    # FSDP2 over 2 processes
    python examples/llm_recipe.py --resume         # stop mid-epoch, resume in new processes: the same fingerprint
    python examples/llm_recipe.py --no-compile     # eager blocks (the same fingerprint: see docs/recipes.md)
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

from lightning_determinism import DeterministicModelParallelStrategy, get_rng_tracker  # noqa: E402

VOCAB, WIDTH, HEADS, CONTEXT, LAYERS = 32, 32, 4, 16, 2


def corpus(n: int = 128) -> torch.Tensor:
    """Token sequences from a fixed rule with noise (a counter modulo the vocabulary, sometimes skipping)."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randint(VOCAB, (n, 1), generator=gen)
    steps = 1 + (torch.rand(n, CONTEXT + 1, generator=gen) < 0.2).long()
    return (start + steps.cumsum(1)) % VOCAB


class Block(nn.Module):
    """Pre-norm attention and MLP; the projections are split by the tensor-parallel plan (heads, features)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        batch, length, _ = h.shape
        x = self.norm1(h)
        q, k, v = (proj(x).view(batch, length, -1, WIDTH // HEADS).transpose(1, 2) for proj in (self.q, self.k, self.v))
        scores = (q @ k.transpose(-2, -1)) / (WIDTH // HEADS) ** 0.5
        mask = torch.ones(length, length, dtype=torch.bool, device=h.device).tril()
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        with get_rng_tracker().fork():  # this rank's heads: a stream of its own
            probs = nn.functional.dropout(probs, 0.1, self.training)
        attended = (probs @ v).transpose(1, 2).reshape(batch, length, -1)
        h = h + nn.functional.dropout(self.o(attended), 0.1, self.training)  # replicated: the default stream
        u = nn.functional.gelu(self.up(self.norm2(h)))
        with get_rng_tracker().fork():  # this rank's MLP features
            u = nn.functional.dropout(u, 0.1, self.training)
        return h + nn.functional.dropout(self.down(u), 0.1, self.training)


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def parallelize(model: GPT, tp_mesh, dp_mesh, compile_blocks: bool) -> None:
    """The recipe's order: tensor parallel, activation checkpointing, compile, FSDP2."""
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel(),
            "up": ColwiseParallel(), "down": RowwiseParallel()}  # fmt: skip
    for i, block in enumerate(model.blocks):
        if tp_mesh.size() > 1:
            parallelize_module(block, tp_mesh, plan)
        block = checkpoint_wrapper(block)
        if compile_blocks:  # in place: torch.compile(block) would rename the state-dict keys, which a distributed
            block.compile()  # checkpoint written under the clean names then cannot be loaded into
        model.blocks[i] = block
    # FSDP2 even over one data-parallel rank, as torchtitan does: every parameter is then a DTensor, which clipping's
    # norm needs (plain and tensor-parallel parameters side by side are refused by torch's foreach norm)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)


def fingerprint(module: nn.Module) -> str:
    from torch.distributed.tensor import DTensor

    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        digest.update(name.encode())
        digest.update(full.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


class TinyGPT(L.LightningModule):
    def __init__(self, compile_blocks: bool = True) -> None:
        super().__init__()
        self.model: GPT | None = None
        self.compile_blocks = compile_blocks

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPT()  # under the base seed on every rank: the one-process initialisation
            parallelize(self.model, self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"],
                        self.compile_blocks)  # fmt: skip

    def on_train_start(self) -> None:
        dp, tp = self.device_mesh["data_parallel"], self.device_mesh["tensor_parallel"]
        print(f"rank {self.global_rank}: data_parallel={dp.get_local_rank()} tensor_parallel={tp.get_local_rank()}")

    def training_step(self, batch, batch_idx):
        tokens = batch[0]
        logits = self.model(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))

    def train_dataloader(self):
        return DataLoader(TensorDataset(corpus()), batch_size=16, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def on_train_end(self) -> None:
        fp = fingerprint(self.model)  # every rank takes part in gathering the sharded tensors
        if self.global_rank == 0:
            print(f"fingerprint {fp}")


def trainer(args: argparse.Namespace, out: Path, max_steps: int = -1, callbacks=()) -> L.Trainer:
    strategy = DeterministicModelParallelStrategy(seed=args.seed, data_parallel_size=args.dp,
                                                  tensor_parallel_size=args.tp, start_method="fork")  # fmt: skip
    return L.Trainer(
        strategy=strategy, accelerator="cpu", devices=args.dp * args.tp, max_epochs=args.epochs, max_steps=max_steps,
        precision="bf16-mixed", gradient_clip_val=1.0, callbacks=list(callbacks), logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(out),
        enable_checkpointing=bool(callbacks),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=1, help="data_parallel_size")
    parser.add_argument("--tp", type=int, default=2, help="tensor_parallel_size")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--resume", action="store_true", help="stop mid-epoch, resume in new processes")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="eager blocks")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        if not args.resume:
            trainer(args, out).fit(TinyGPT(args.compile))
            return
        steps_per_epoch = len(corpus()) // 16 // args.dp
        stop = steps_per_epoch * (args.epochs - 1) + steps_per_epoch // 2  # the middle of the last epoch
        print("== uninterrupted")
        trainer(args, out / "straight").fit(TinyGPT(args.compile))
        print(f"== stopped at step {stop}, in the middle of epoch {args.epochs - 1} (a distributed checkpoint)")
        save = ModelCheckpoint(dirpath=out / "first", filename="stopped", every_n_train_steps=stop)
        trainer(args, out / "first", max_steps=stop, callbacks=[save]).fit(TinyGPT(args.compile))
        print("== resumed from it in new processes: the uninterrupted run's fingerprint")
        trainer(args, out / "resumed").fit(TinyGPT(args.compile), ckpt_path=str(out / "first" / "stopped.ckpt"))


if __name__ == "__main__":
    main()
