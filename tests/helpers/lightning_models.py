"""Small Lightning modules and callbacks for the strategy tests; importable, so the spawn path can pickle them."""

from __future__ import annotations

import hashlib
import json
import os
import random
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from tests.helpers.datasets import PlainBatches, StreamDataset, _uncollated, user_worker_init  # noqa: F401  (the tests')


def state_digest(module: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def draws() -> dict[str, Any]:
    """One draw from each global stream: python, numpy, torch."""
    return {
        "python": random.random(),
        "numpy": float(np.random.rand()),
        "torch": torch.rand(4).tolist(),
    }


def reference_draws(seed: int) -> dict[str, Any]:
    """What :func:`draws` returns right after seeding every stream with ``seed``, from private generators."""
    return {
        "python": random.Random(seed).random(),
        "numpy": float(np.random.RandomState(seed).rand()),
        "torch": torch.rand(4, generator=torch.Generator().manual_seed(seed)).tolist(),
    }


def build_net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 1))


class IndexDataset(Dataset):
    """Sample ``i`` is ``(i, x_i, y_i)`` with fixed features, so batches say which indices a rank saw."""

    def __init__(self, n: int = 32) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 8, generator=gen)
        self.y = torch.randn(n, 1, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


class RecordingModule(L.LightningModule):
    """Builds its network in ``configure_model`` and records, per rank, what the strategy tests check."""

    def __init__(
        self,
        out_dir: str,
        n: int = 32,
        batch_size: int = 4,
        record_draws: bool = True,
        metrics: bool = False,
        stream_workers: int = 0,
    ) -> None:
        super().__init__()
        self.record_draws = record_draws
        # with stream_workers, a second loader reads StreamDataset through that many workers, its samples recorded as
        # StreamModule records them: one fit then serves both kinds of test (the spawn path's, 4 new interpreters)
        self.stream_workers, self.samples = stream_workers, []
        if metrics:  # the package's metrics on the module: pickled by spawn launchers, forward() on grad logits
            from lightning_determinism import DistributedMean, DistributedPerplexity

            self.train_ppl = DistributedPerplexity()
            self.train_mean = DistributedMean()
        self.out_dir = out_dir
        self.n = n
        self.batch_size = batch_size
        self.net: nn.Module | None = None
        self.record: dict[str, Any] = {"indices": [], "dropout": []}

    def configure_model(self) -> None:
        if self.net is None:
            self.net = build_net()
            self.record["init_digest"] = state_digest(self.net)

    def on_fit_start(self) -> None:
        # The strategy's setup just ended: nothing has drawn from the global streams since.
        if self.record_draws:  # a resumed run must not draw here: the uninterrupted run did so before epoch 0
            self.record["draws"] = draws()
        self.record["digest_at_start"] = state_digest(self.net)
        self.record["flags"] = {
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        }
        self.record["rank"] = self.global_rank
        self.record["pl_global_seed"] = os.environ.get("PL_GLOBAL_SEED")
        self.record["base_seed"] = self.trainer.strategy.base_seed
        self.record["local_seed"] = self.trainer.strategy.local_seed

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.stream_workers:
            self.samples += [{**s, "epoch": self.current_epoch, "rank": self.global_rank} for s in batch["streams"]]
            batch = batch["fit"]
        idx, x, y = batch
        self.record["indices"].append(idx.tolist())
        loader = self.trainer.train_dataloader
        self.record["train_sampler"] = type((loader["fit"] if isinstance(loader, dict) else loader).sampler).__name__
        mask = nn.functional.dropout(torch.ones(8), 0.5, training=True)
        self.record["dropout"].append(mask.tolist())
        out = self.net(x)
        if hasattr(self, "train_ppl"):
            logits = torch.cat([out, -out], dim=-1)  # a two-class "language model" whose logits require grad
            # forward() on logits that require grad, its batch value logged, as users write it ...
            self.log("train/ppl_batch", self.train_ppl(logits, (y[:, 0] > 0).long()))
            self.train_mean((out - y).square().detach())
            # ... and the metric objects, which Lightning computes (and syncs) at the epoch's end.
            self.log("train/ppl", self.train_ppl, on_step=False, on_epoch=True)
            self.log("train/mean", self.train_mean, on_step=False, on_epoch=True)
        return nn.functional.mse_loss(out, y)

    def on_train_epoch_end(self) -> None:
        if hasattr(self, "train_ppl"):
            self.record["train_ppl"] = float(self.train_ppl.compute())
            self.record["train_mean"] = float(self.train_mean.compute())
            with self.train_ppl.sync_context():
                self.record["train_count"] = int(self.train_ppl.count)

    def on_fit_end(self) -> None:
        self.record["final_digest"] = state_digest(self.net)
        path = Path(self.out_dir) / f"rank{self.global_rank}.json"
        path.write_text(json.dumps(self.record))
        if self.stream_workers:
            (Path(self.out_dir) / f"samples-rank{self.global_rank}.json").write_text(json.dumps(self.samples))

    def train_dataloader(self) -> Any:
        loader = DataLoader(IndexDataset(self.n), batch_size=self.batch_size, shuffle=True)
        if not self.stream_workers:
            return loader
        streams = StreamDataset(self.n // 2)  # as many batches of 2 as the main loader has of 4
        workers = self.stream_workers
        return {
            "fit": loader,
            "streams": DataLoader(streams, 2, shuffle=True, num_workers=workers, collate_fn=_uncollated),
        }

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def read_records(out_dir: Path, world_size: int) -> list[dict[str, Any]]:
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def quiet_trainer(strategy: Any, devices: int = 2, **kwargs: Any) -> L.Trainer:
    """A CPU Trainer without logger, checkpoints, progress bar or model summary."""
    defaults = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
    return L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, enable_model_summary=False, **{**defaults, **kwargs}
    )


def fit(strategy: Any, out_dir: Path, devices: int = 2, max_epochs: int = 1, callbacks: Any = (), **module_kwargs: Any):
    """A quiet CPU fit of :class:`RecordingModule`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    trainer = quiet_trainer(strategy, devices, max_epochs=max_epochs, default_root_dir=str(out_dir),
                            callbacks=list(callbacks))  # fmt: skip
    trainer.fit(RecordingModule(str(out_dir), **module_kwargs))


class TokenDataset(Dataset):
    """``n`` fixed sequences of token ids (from a private generator) for perplexity tests."""

    def __init__(self, n: int = 7, length: int = 5, vocab: int = 11) -> None:
        gen = torch.Generator().manual_seed(4321)
        self.ids = torch.randint(vocab, (n, length + 1), generator=gen)
        self.vocab = vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:]}


class PerplexityModule(L.LightningModule):
    """A fixed bigram-ish model (weights from a private generator) that logs a perplexity metric per epoch."""

    def __init__(self, out_dir: str, metric_factory: Any, vocab: int = 11, n: int = 7) -> None:
        super().__init__()
        self.out_dir = out_dir
        self.n = n
        gen = torch.Generator().manual_seed(99)
        self.table = nn.Parameter(torch.randn(vocab, vocab, generator=gen) * 2)
        self.val_ppl = metric_factory()
        self.seen: list[int] = []

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.table[input_ids]

    def setup(self, stage: str) -> None:
        # Every warning this rank shows from here on (the loaders are built after setup), into its record.
        self._catcher = warnings.catch_warnings(record=True)
        self.warned = self._catcher.__enter__()
        warnings.filterwarnings("always", append=True)  # after the filters already there: they still decide first

    def teardown(self, stage: str) -> None:
        self._catcher.__exit__(None, None, None)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.seen.append(int(batch["input_ids"].shape[0]))
        self.val_ppl.update(self(batch["input_ids"]), batch["labels"])
        self.log("val/ppl", self.val_ppl, on_epoch=True)

    def on_validation_epoch_end(self) -> None:
        record = {
            "ppl": float(self.trainer.callback_metrics["val/ppl"]),
            "seen": self.seen,
            "dtypes": [str(self.val_ppl.nll_sum.dtype), str(getattr(self.val_ppl, "count", self.table).dtype)],
            "warnings": [str(w.message) for w in self.warned],
        }
        (Path(self.out_dir) / f"rank{self.global_rank}.json").write_text(json.dumps(record))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TokenDataset(self.n), batch_size=2)


class StreamModule(L.LightningModule):
    """Records every sample's worker and draws, per rank, epoch and loader."""

    def __init__(
        self,
        out_dir: str,
        n: int = 16,
        batch_size: int = 2,
        num_workers: int = 2,
        persistent_workers: bool = False,
        dropout: float = 0.0,
        shuffle: bool = True,
        user_init: bool = False,
        loaders: str = "single",
        worker_context: str | None = None,
    ) -> None:
        super().__init__()
        self.out_dir = out_dir
        self.n, self.batch_size, self.num_workers = n, batch_size, num_workers
        self.persistent_workers, self.shuffle, self.user_init, self.loaders = (
            persistent_workers,
            shuffle,
            user_init,
            loaders,
        )
        self.dropout = dropout
        self.worker_context = worker_context
        self.layer = nn.Linear(1, 1)
        self.samples: list[dict[str, Any]] = []

    def _loader(self, tag: int) -> DataLoader:
        return DataLoader(
            StreamDataset(self.n, tag),
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            num_workers=self.num_workers,
            persistent_workers=self.persistent_workers and self.num_workers > 0,
            worker_init_fn=user_worker_init if self.user_init else None,
            collate_fn=_uncollated,
            multiprocessing_context=_worker_context(self.worker_context) if self.num_workers > 0 else None,
        )

    def train_dataloader(self) -> Any:
        if self.loaders == "dict":
            return {"a": self._loader(0), "b": self._loader(1)}
        if self.loaders == "list-of-batches":
            return PlainBatches(StreamDataset(4))
        return self._loader(0)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        parts = batch.values() if isinstance(batch, dict) else [batch]
        for part in parts:
            for sample in part:
                self.samples.append({**sample, "epoch": self.current_epoch, "rank": self.global_rank})
        if self.dropout:
            nn.functional.dropout(torch.ones(64), self.dropout, training=True)  # consumes the global torch RNG
        return self.layer(torch.ones(1, 1)).sum()

    def on_fit_end(self) -> None:
        path = Path(self.out_dir) / f"samples-rank{self.global_rank}.json"
        path.write_text(json.dumps(self.samples))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _worker_context(name: str | None) -> Any:
    """A multiprocessing context for data-loader workers. A fork server imports what its workers unpickle before it
    forks them: the datasets (torch and NumPy only), and for ``forkserver+package`` this package (Lightning with it),
    which a ``worker_init_fn`` of the package's needs."""
    if name is None or not name.startswith("forkserver"):
        return name
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    package = ["lightning_determinism"] if name == "forkserver+package" else []
    context.set_forkserver_preload(["tests.helpers.datasets", *package])
    return context


def fit_streams(strategy: Any, out_dir: Path, callbacks: list[Any], devices: int = 2, epochs: int = 2, **kw: Any):
    """Fit :class:`StreamModule` and return every rank's recorded samples."""
    out_dir.mkdir(parents=True, exist_ok=True)
    trainer = quiet_trainer(strategy, devices, max_epochs=epochs, callbacks=callbacks)
    trainer.fit(StreamModule(str(out_dir), **kw))
    samples = []
    for rank in range(devices):
        samples.extend(json.loads((out_dir / f"samples-rank{rank}.json").read_text()))
    return samples, trainer


class NoisyPoints(Dataset):
    """Fixed points; every item adds noise drawn from the global RNG (an augmentation; per-sample seeded in tests)."""

    def __init__(self, n: int = 64) -> None:
        gen = torch.Generator().manual_seed(11)
        self.x = torch.randn(n, 8, generator=gen)
        self.y = torch.randn(n, 1, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(8), self.y[i]


class InvariantModule(L.LightningModule):
    """Dropout, shuffled data augmented in workers, Adam with a step scheduler; records what must not depend on W."""

    def __init__(
        self,
        out_dir: str,
        n: int = 64,
        micro_batch_size: int = 4,
        workers: int = 2,
        dropout: float = 0.2,
    ) -> None:
        super().__init__()
        from lightning_determinism import DistributedMean

        self.out_dir, self.n, self.micro_batch_size, self.workers = out_dir, n, micro_batch_size, workers
        self.dropout = dropout
        self.net = None
        self.train_loss = DistributedMean()
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.net is None:
            self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(self.dropout), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.train_loss.update(loss.detach(), weight=x.shape[0])
        return loss

    def on_train_epoch_end(self) -> None:
        self.losses.append(float(self.train_loss.compute()))  # exact, synced: the same bits on any world size
        self.train_loss.reset()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(NoisyPoints(self.n), batch_size=self.micro_batch_size, shuffle=True, num_workers=self.workers)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.7)}

    def on_train_end(self) -> None:
        if self.trainer.is_global_zero:
            state = {
                "params": self.net.state_dict(),
                "optimizer": self.trainer.optimizers[0].state_dict(),
                "scheduler": self.trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                "losses": [float(v).hex() for v in self.losses],
                "global_step": int(self.trainer.global_step),
            }
            torch.save(state, Path(self.out_dir) / "invariant.pt")
