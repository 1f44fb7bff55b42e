"""SampleRecord: each evaluation sample's result and its batch, written for ``compare`` and ``diagnose``.

Two evaluations of the same weights that disagree (another eval batch size, another number of processes) leave the
user with two numbers. With this callback each run writes ``determinism_samples_<stage>.json`` beside its logger's
files (:mod:`~lightning_determinism.divergence.sample_record` has the format): every sample's result, bit for bit, and
the batch it was evaluated in (rank, companions, position). ``lightning-determinism compare`` on the two loggers'
directories, or ``diagnose`` on the two files, then says which samples differ and whether the batch composition is
the cause.

The step says what a sample's result is: ``validation_step`` (``test_step``, ``predict_step``) returns a mapping whose
``value_key`` entry holds one row per sample (a per-sample loss, the logits); the dataset indices come from the
mapping's or the batch's ``index_key`` entry.

Cost: one gather to rank 0 per pass (the indices and one short string per sample: the data's size, whatever the
number of processes) and one file on rank 0.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_determinism.checkpoints.atomic import write_atomically
from lightning_determinism.divergence.sample_record import FORMAT, KIND, samples_file
from lightning_determinism.errors import DeterminismWarning
from lightning_determinism.invariance.batch_invariant import batch_invariant_enabled
from lightning_determinism.seeding.rank_states import gather_to_zero


def encode_result(row: torch.Tensor) -> str:
    """One sample's result as text that keeps every bit: a float's hex form for one number, else a digest.

    Examples:
        >>> encode_result(torch.tensor(1.5))
        '0x1.8000000000000p+0'
        >>> encode_result(torch.tensor([1, 2])).split()[:2]
        ['torch.int64', '(2,)']
    """
    row = row.detach()
    if row.numel() == 1 and row.is_floating_point():
        return float(row.double().item()).hex()  # every float type widens to float64 exactly
    data = row.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes() if row.numel() else b""
    return f"{row.dtype} {tuple(row.shape)} {hashlib.sha256(data).hexdigest()[:16]}"


class SampleRecord(Callback):
    """Record every evaluation sample's result and batch, so that two evaluations can be compared sample by sample.

    Args:
        value_key: the key of the step's returned mapping that holds the per-sample results (first dimension: the
            batch).
        index_key: the key of the dataset indices, looked up in the step's returned mapping, then in the batch.
        dirpath: where to write the files; default: the first logger's ``log_dir``, else the Trainer's
            ``default_root_dir``.

    Raises:
        TypeError: if a key is not a string.

    The file of a stage is rewritten by each pass of it (validation during ``fit``: the last epoch's); the sanity
    check writes none.

    Examples:
        >>> SampleRecord(value_key="sample_loss").value_key
        'sample_loss'
    """

    def __init__(self, value_key: str = "sample_value", index_key: str = "index", dirpath: str | None = None) -> None:
        for name, value in (("value_key", value_key), ("index_key", index_key)):
            if not isinstance(value, str):
                raise TypeError(f"`{name}` must be a str, got {type(value).__name__} {value!r}")
        self.value_key = value_key
        self.index_key = index_key
        self.dirpath = dirpath
        self._batches: list[list[Any]] = []
        self._samples: dict[str, list[Any]] = {}
        self._invariant = False
        self._warned = False

    def _reset(self) -> None:
        self._batches, self._samples, self._invariant = [], {}, False

    def _collect(self, trainer: pl.Trainer, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int) -> None:
        if trainer.sanity_checking:
            return
        values = outputs.get(self.value_key) if isinstance(outputs, Mapping) else None
        indices = outputs.get(self.index_key) if isinstance(outputs, Mapping) else None
        if indices is None and isinstance(batch, Mapping):
            indices = batch.get(self.index_key)
        if values is None or indices is None:
            if not self._warned:
                self._warned = True
                rank_zero_warn(
                    f"SampleRecord: the step should return a mapping with `{self.value_key}` (one result per sample)"
                    f" and the batch or the mapping should hold `{self.index_key}` (dataset indices); got"
                    f" {type(outputs).__name__} output and {type(batch).__name__} batch: nothing is recorded for"
                    " such batches",
                    category=DeterminismWarning,
                )
            return
        indices = [int(i) for i in (indices.tolist() if isinstance(indices, torch.Tensor) else indices)]
        values = torch.as_tensor(values)
        if values.dim() == 0 or values.shape[0] != len(indices):
            raise ValueError(
                f"SampleRecord: `{self.value_key}` must have one row per sample ({len(indices)}), got shape"
                f" {tuple(values.shape)}"
            )
        self._invariant = self._invariant or batch_invariant_enabled()
        number = len(self._batches)
        self._batches.append([trainer.global_rank, dataloader_idx, batch_idx, indices])
        if values.dim() == 1 and values.is_floating_point():  # one number per sample: one transfer, not one per row
            results = [float(value).hex() for value in values.detach().double().cpu().tolist()]
        else:
            results = [encode_result(row) for row in values]
        for index, result in zip(indices, results, strict=True):
            self._samples[f"{dataloader_idx}/{index}"] = [result, number]

    def _write(self, trainer: pl.Trainer, stage: str) -> None:
        if trainer.sanity_checking:
            return
        parts = gather_to_zero((self._batches, self._samples, self._invariant))
        self._reset()
        if parts is None:  # not rank 0
            return
        batches: list[list[Any]] = []
        samples: dict[str, list[Any]] = {}
        for rank_batches, rank_samples, _ in parts:
            offset = len(batches)
            batches += rank_batches
            samples.update({key: [result, number + offset] for key, (result, number) in rank_samples.items()})
        record = {
            "kind": KIND,
            "format": FORMAT,
            "stage": stage,
            "epoch": trainer.current_epoch,
            "step": trainer.global_step,
            "world_size": trainer.world_size,
            "batch_invariant": any(part[2] for part in parts),
            "batches": batches,
            "samples": dict(sorted(samples.items(), key=lambda item: tuple(int(p) for p in item[0].split("/")))),
        }
        write_atomically(samples_file(self._directory(trainer), stage), json.dumps(record))

    def _directory(self, trainer: pl.Trainer) -> Path:
        if self.dirpath is not None:
            return Path(self.dirpath)
        for logger in trainer.loggers:
            if getattr(logger, "log_dir", None):
                return Path(logger.log_dir)  # type: ignore[arg-type]
        return Path(trainer.default_root_dir)

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()

    @override
    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self._collect(trainer, outputs, batch, batch_idx, dataloader_idx)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write(trainer, "validate")

    @override
    def on_test_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()

    @override
    def on_test_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self._collect(trainer, outputs, batch, batch_idx, dataloader_idx)

    @override
    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write(trainer, "test")

    @override
    def on_predict_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()

    @override
    def on_predict_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self._collect(trainer, outputs, batch, batch_idx, dataloader_idx)

    @override
    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write(trainer, "predict")
