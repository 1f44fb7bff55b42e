"""Evaluation of a GRU LM (examples/tiny_lm.py's TinyLM) and a small causal transformer, float32 and bf16 autocast,
over variable-length sequences padded per batch: what the batch-invariance tests evaluate on many layouts."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_determinism import DistributedMean, DistributedPerplexity, sample_streams

VOCAB = 29
MAX_LENGTH = 40
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str) -> Any:
    """A module of examples/ (imported once, under its own name; tiny_lm first, which the others import)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def tiny_lm_class() -> type:
    """examples/tiny_lm.py's TinyLM."""
    return example("tiny_lm").TinyLM


def TinyTransformer() -> nn.Module:  # noqa: N802 (a model, as the tests name it)
    """examples/batch_invariant_eval.py's causal transformer, for sequences up to MAX_LENGTH."""
    example("tiny_lm")
    return example("batch_invariant_eval").CausalTransformer(VOCAB, max_length=MAX_LENGTH)


class Sequences(Dataset):
    """``n`` token sequences of lengths 5 to MAX_LENGTH (a private generator), with their dataset index."""

    def __init__(self, n: int = 37, seed: int = 11) -> None:
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.randint(5, MAX_LENGTH, (n,), generator=gen)
        self.items = [torch.randint(VOCAB, (int(n_) + 1,), generator=gen) for n_ in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"index": i, "ids": self.items[i]}


def pad_collate(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Pad to the batch's longest sequence: inputs with token 0, labels with -100 (ignored)."""
    width = max(len(item["ids"]) for item in items) - 1
    ids = torch.zeros(len(items), width, dtype=torch.long)
    labels = torch.full((len(items), width), -100, dtype=torch.long)
    for row, item in enumerate(items):
        n = len(item["ids"]) - 1
        ids[row, :n], labels[row, :n] = item["ids"][:-1], item["ids"][1:]
    return {"index": torch.tensor([item["index"] for item in items]), "ids": ids, "labels": labels}


class Prompts(Dataset):
    """12 prompts of 6 tokens."""

    def __init__(self) -> None:
        self.ids = torch.randint(VOCAB, (12, 6), generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"index": i, "ids": self.ids[i]}


KINDS = ("gru/fp32", "gru/bf16", "transformer/fp32", "transformer/bf16")
BATCH_SIZES = (1, 4, 16)
NEW_TOKENS = 6


class EvalBench(L.LightningModule):
    """Both models; per eval loader (batch sizes 1, 4, 16) and kind: the perplexity, the mean loss (exact metrics)
    and each sample's per-token losses, written by rank 0 as ``<stage>.json`` in ``out_dir``."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir
        torch.manual_seed(3)
        self.nets = nn.ModuleDict({"gru": tiny_lm_class()(VOCAB, dim=32, hidden=64), "transformer": TinyTransformer()})
        self.ppl = nn.ModuleList(
            nn.ModuleDict({k.replace("/", "_"): DistributedPerplexity(ignore_index=-100) for k in KINDS})
            for _ in BATCH_SIZES
        )
        self.mean = nn.ModuleList(
            nn.ModuleDict({k.replace("/", "_"): DistributedMean() for k in KINDS}) for _ in BATCH_SIZES
        )
        self.samples: dict[str, dict[int, str]] = {}
        self.generated: dict[str, dict[int, list[int]]] = {}

    def logits(self, kind: str, ids: torch.Tensor) -> torch.Tensor:
        net, precision = kind.split("/")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            return self.nets[net](ids).float()

    def validation_step(
        self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> dict[str, torch.Tensor]:
        labels = batch["labels"]
        sums = []
        for kind in KINDS:
            logits = self.logits(kind, batch["ids"])
            per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
            key = kind.replace("/", "_")
            self.ppl[dataloader_idx][key].update(logits, labels)
            self.mean[dataloader_idx][key].update(per_token.flatten(), mask=labels.flatten() != -100)
            for row, index in enumerate(batch["index"].tolist()):
                kept = per_token[row][labels[row] != -100]
                self.samples.setdefault(f"{kind}/{dataloader_idx}", {})[index] = kept.numpy().tobytes().hex()
            # Each sample's own tokens summed: a sum over the padded row would depend on the padding's length.
            sums.append(torch.stack([row[keep].sum() for row, keep in zip(per_token, labels != -100, strict=True)]))
        # For SampleRecord: each sample's summed loss under the bf16 transformer (one number), the rest as a digest.
        return {"sample_value": sums[-1], "sample_all": torch.stack(sums, dim=1)}

    def on_validation_epoch_end(self) -> None:
        results: dict[str, Any] = {}
        for loader, size in enumerate(BATCH_SIZES):
            for kind in KINDS:
                key = kind.replace("/", "_")
                results[f"{kind}/ppl/{size}"] = float(self.ppl[loader][key].compute()).hex()
                results[f"{kind}/loss/{size}"] = float(self.mean[loader][key].compute()).hex()
        samples = _gather(self.samples)
        if self.trainer.is_global_zero:
            results["samples"] = {
                f"{key.split('/')[0]}/{key.split('/')[1]}/{BATCH_SIZES[int(key.split('/')[2])]}": rows
                for key, rows in samples.items()
            }
            Path(self.out_dir, f"validate-{self.trainer.world_size}.json").write_text(json.dumps(results))

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        size = (1, 4)[dataloader_idx]
        for kind in KINDS:
            ids = batch["ids"]
            with sample_streams(batch["index"]) as streams:
                for _ in range(NEW_TOKENS):
                    probs = torch.softmax(self.logits(kind, ids)[:, -1], dim=-1)
                    ids = torch.cat((ids, streams.multinomial(probs)), dim=1)
            stock = batch["ids"]
            for _ in range(NEW_TOKENS):  # the global generator (the rank's evaluation stream): the reference
                probs = torch.softmax(self.logits(kind, stock)[:, -1], dim=-1)
                stock = torch.cat((stock, torch.multinomial(probs, 1)), dim=1)
            for name, tokens in (("streams", ids), ("stock", stock)):
                rows = self.generated.setdefault(f"{kind}/{name}/{size}", {})
                for row, index in enumerate(batch["index"].tolist()):
                    rows[index] = tokens[row, -NEW_TOKENS:].tolist()
        return batch["index"]

    def on_predict_epoch_end(self) -> None:
        generated = _gather(self.generated)
        if self.trainer.is_global_zero:
            Path(self.out_dir, f"predict-{self.trainer.world_size}.json").write_text(json.dumps(generated))


def _gather(per_rank: dict[str, dict[int, Any]]) -> dict[str, dict[int, Any]]:
    """Every rank's entries merged (a sample is evaluated on one rank only)."""
    parts = [per_rank]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(parts, per_rank)
    merged: dict[str, dict[int, Any]] = {}
    for part in parts:
        for key, rows in part.items():
            merged.setdefault(key, {}).update({int(i): value for i, value in rows.items()})
    return merged


def loaders(kind: str) -> list[DataLoader]:
    if kind == "validate":
        return [DataLoader(Sequences(), batch_size=size, collate_fn=pad_collate) for size in BATCH_SIZES]
    return [DataLoader(Prompts(), batch_size=size) for size in (1, 4)]


def relative(a_hex: str, b_hex: str) -> float:
    a, b = float.fromhex(a_hex), float.fromhex(b_hex)
    return abs(a - b) / abs(b) if b else math.inf
