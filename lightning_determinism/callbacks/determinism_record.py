"""DeterminismRecord: the run's seeds, backends, versions and fingerprints in the experiment logger, where users look.

At the start of fit, rank 0 logs the record (:mod:`~lightning_determinism.callbacks._record_entries`) through every
logger's ``log_hyperparams``: flat ``determinism/...`` keys, so CSV's ``hparams.yaml``, TensorBoard's HParams tab,
MLflow's parameters and W&B's config show them as they are. At every checkpoint save and at the end of fit it takes
the model's fingerprint (:func:`~lightning_determinism.fingerprint`; the whole model's under FSDP2 and tensor
parallel) and logs it — as a text where the logger has texts (TensorBoard), else as one more hyperparameter
(``determinism/fingerprint/step_<n>``, ``determinism/fingerprint/final``) — and writes it into the checkpoint under
``"lightning_determinism_fingerprint"``. ``lightning-determinism compare`` reads the record back from the loggers'
directories (docs/record.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_determinism._compat.access import logs_hyperparameters
from lightning_determinism.callbacks._record_entries import (
    build_record,
    gather_streams,
    model_fingerprint,
    needs_every_rank,
    run_entries,
)
from lightning_determinism.callbacks.run_identity import run_identity
from lightning_determinism.divergence.logger_record import HPARAMS_FILE
from lightning_determinism.divergence.run_record import (
    CHECKPOINT_KEY,
    FINAL_FINGERPRINT,
    FINGERPRINT_PREFIX,
    fingerprint_key,
)
from lightning_determinism.errors import DeterminismWarning


def _text_writer(logger: Any) -> Callable[..., Any] | None:
    """The logger's ``add_text`` (TensorBoard's ``SummaryWriter``), or ``None`` for a logger without texts."""
    experiment = getattr(logger, "experiment", None)
    add_text = getattr(experiment, "add_text", None)
    return add_text if callable(add_text) else None


STAGE_KEY = "determinism/run/stage"
"""An evaluation run's stage (``validate``, ``test``, ``predict``); a fit's record has none."""
RESUME_PREFIX = "determinism/resume_"
"""Where a fit logs the record's values a logger refuses to change: ``determinism/resume_<n>/...``."""
_MOST_RESUMES = 64


def _log_hyperparams(logger: Any, params: dict[str, Any]) -> None:
    """``logger.log_hyperparams(params)``; Fabric's ``CSVLogger``, which has none, gets them in ``hparams.yaml``.

    The file is the one the Trainer's ``CSVLogger`` writes in its ``log_dir``, so ``compare`` reads both alike. A
    logger that refuses the call (MLflow refuses to change a run's parameter: a requeued job resuming into its run
    with other stream digests or ``max_epochs``) gets what it takes (:func:`_log_what_it_takes`): the record never
    stops training.
    """
    try:
        logger.log_hyperparams(params)
    except NotImplementedError:
        _write_hparams_file(logger, params)
    except Exception as error:
        _log_what_it_takes(logger, params, error)


def _log_what_it_takes(logger: Any, params: dict[str, Any], error: Exception) -> None:
    """Log ``params`` one by one; the record's keys the logger refused go under the first free ``resume_<n>``.

    A value the logger already holds is accepted again (MLflow takes an unchanged parameter): only what changed
    since the run's earlier fits is renamed, ``determinism/run/max_epochs`` to ``determinism/resume_1/run/max_epochs``
    at the first resume, ``determinism/resume_2/...`` at the next (the fit's later entries, its final fingerprint,
    under the same ``n``). Renaming is tried where the refusal is about a change (some entries taken, or the logger
    says so), not for a logger that takes nothing; whatever is still refused is said in one warning.
    """
    refused: dict[str, Any] = {}
    for key, value in params.items():
        try:
            logger.log_hyperparams({key: value})
        except Exception as refusal:
            refused[key], error = value, refusal
    ours = {key: value for key, value in refused.items() if key.startswith("determinism/")}
    known = getattr(logger, "_ldet_resume_number", None)
    if ours and (len(refused) < len(params) or "chang" in str(error).lower() or known is not None):
        for number in range(known or 1, _MOST_RESUMES + 1):
            renamed = {f"{RESUME_PREFIX}{number}/{key.removeprefix('determinism/')}": v for key, v in ours.items()}
            try:
                logger.log_hyperparams(renamed)
            except Exception as refusal:
                error = refusal
                continue
            if known is None:
                rank_zero_info(
                    f"{type(logger).__name__} keeps a run's parameters as first logged: {len(ours)} value(s) of the"
                    f" determinism record that changed since are logged under {RESUME_PREFIX}{number}/"
                )
            logger._ldet_resume_number = number
            refused = {key: value for key, value in refused.items() if key not in ours}
            break
    if refused:
        rank_zero_warn(
            f"{type(logger).__name__} refused {len(refused)} entr(y/ies) of the determinism record ({error}); training"
            " goes on, and the checkpoints keep the record's fingerprints",
            category=DeterminismWarning,
        )


def _write_hparams_file(logger: Any, params: dict[str, Any]) -> None:
    import yaml

    if getattr(logger, "log_dir", None) is None:  # a logger of no directory and no hyperparameters: nowhere
        return
    _ = logger.experiment  # made first: it warns of a directory that already holds files
    path = Path(logger.log_dir) / HPARAMS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    saved = yaml.safe_load(path.read_text()) if path.is_file() else None
    path.write_text(yaml.safe_dump({**(saved or {}), **params}))


def log_record(loggers: Iterable[Any], record: dict[str, Any], user: dict[str, Any] | None = None) -> None:
    """Log ``record`` through each logger's ``log_hyperparams`` (rank 0 only), the user's own entries kept.

    ``user`` are the hyperparameters Lightning is about to log: logged in the same call, unchanged, so TensorBoard's
    HParams tab (which shows a run's first set) shows both; a user's key equal to one of the record's wins.
    """
    user = dict(user or {})
    params = {**{key: value for key, value in record.items() if key not in user}, **user}
    for logger in loggers:
        _log_hyperparams(logger, params)
        logger.save()


def log_fingerprint(loggers: Iterable[Any], key: str, value: str, step: int) -> None:
    """Log one fingerprint (rank 0 only): a text where the logger has texts, else a hyperparameter ``key``."""
    for logger in loggers:
        add_text = _text_writer(logger)
        if add_text is not None:  # the checkpoints' fingerprints as one text series, by step
            add_text(FINGERPRINT_PREFIX.rstrip("/") if key == fingerprint_key(step) else key, value, global_step=step)
        else:
            _log_hyperparams(logger, {key: value})
        logger.save()


def user_hyperparameters(trainer: pl.Trainer) -> dict[str, Any]:
    """What Lightning's own ``log_hyperparams`` call logs right after ``on_fit_start`` (module, then datamodule)."""
    out: dict[str, Any] = {}
    module = trainer.lightning_module
    if logs_hyperparameters(module):
        out.update(module.hparams_initial)
    datamodule = getattr(trainer, "datamodule", None)
    if datamodule is not None and logs_hyperparameters(datamodule):
        out.update(datamodule.hparams_initial)
    out.pop("_class_path", None)  # LightningCLI's, which Lightning does not log
    return out


class DeterminismRecord(Callback):
    """Log the run's determinism record and the model's fingerprints through the trainer's loggers.

    The deterministic strategies add one unless the trainer has one already or they are given ``log_record=False``.
    Every rank takes part (the ranks' streams are gathered in one collective at the start of fit; a sharded model's
    fingerprint is a collective); rank 0 logs. Nothing is drawn from any random stream.

    Examples:
        >>> import lightning as L
        >>> trainer = L.Trainer(callbacks=[DeterminismRecord()], logger=False, enable_progress_bar=False)
        >>> any(isinstance(cb, DeterminismRecord) for cb in trainer.callbacks)
        True
    """

    def __init__(self) -> None:
        self._logged: set[str] = set()
        self._by_step: dict[int, list[str]] = {}
        # ((global_step, training), value) of the weights' last fingerprint: a second save of one step (a top-k
        # file beside last.ckpt, a save during validation) reuses it instead of digesting the whole model again.
        self._fingerprint_at: tuple[tuple[int, bool], str | None] | None = None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log_record(trainer)

    def _log_record(self, trainer: pl.Trainer, extra: dict[str, Any] | None = None) -> None:
        self._logged, self._by_step, self._fingerprint_at = set(), {}, None
        if not trainer.loggers:  # the same on every rank: no collective either
            return
        ranks = gather_streams()
        if not trainer.is_global_zero:
            return
        record = {**build_record(trainer.strategy, ranks, run_identity(trainer), trainer.precision), **(extra or {})}
        user = user_hyperparameters(trainer)
        self._logged = set(record)
        log_record(trainer.loggers, record, user)

    def _evaluation_record(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """``validate``/``test``/``predict`` on their own: the record, its stage, the evaluated weights' fingerprint.

        Evaluation is half of what users compare: ``compare`` reads an evaluation run's record as a fit's, the
        fingerprint of the weights it evaluated as the run's final one (nothing trains), and names the stage when it
        differs (``determinism/run/stage``).
        """
        self._log_record(trainer, {STAGE_KEY: getattr(trainer.state.fn, "value", None)})
        if trainer.loggers:
            value = self._fingerprint(trainer, pl_module)  # a collective for a sharded model: every rank
            if value is not None:
                log_fingerprint(trainer.loggers, FINAL_FINGERPRINT, value, int(trainer.global_step))

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._evaluation_record(trainer, pl_module)

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._evaluation_record(trainer, pl_module)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The data's length is known once the fit loop has set up its loaders: logged now, if it was not then.
        if not trainer.is_global_zero or not trainer.loggers:
            return
        late = {key: value for key, value in run_entries(run_identity(trainer)).items() if key not in self._logged}
        if late:
            self._logged.update(late)
            for logger in trainer.loggers:
                _log_hyperparams(logger, late)
                logger.save()

    def _fingerprint(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> str | None:
        when = (int(trainer.global_step), bool(trainer.training))
        if self._fingerprint_at is not None and self._fingerprint_at[0] == when:  # the same on every rank
            return self._fingerprint_at[1]
        strategy = trainer.strategy
        state_dict = strategy.lightning_module_state_dict if isinstance(strategy, FSDPStrategy) else None
        value = model_fingerprint(pl_module, trainer.global_rank, state_dict)
        self._fingerprint_at = (when, value)
        return value

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A PreemptionCheckpoint may save during this pass on rank 0 alone: a sharded model's fingerprint (a
        # collective) is taken now, on every rank, for it. The pass changes no weight.
        from lightning_determinism.callbacks.preemption import PreemptionCheckpoint

        if trainer.state.fn == TrainerFn.VALIDATING:  # Trainer.validate on its own
            self._evaluation_record(trainer, pl_module)
            return
        if trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking or not needs_every_rank(pl_module):
            return  # a model without shards is fingerprinted by rank 0 alone, at the save
        if any(isinstance(cb, PreemptionCheckpoint) for cb in trainer.callbacks):  # type: ignore[attr-defined]
            self._fingerprint(trainer, pl_module)  # kept for the pass's saves (the weights do not change in it)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._fingerprint_at = None  # this batch's step may change the weights

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        value = self._fingerprint(trainer, pl_module)
        if value is None:  # not rank 0: rank 0 writes the checkpoint (a distributed one's metadata too)
            return
        step = int(trainer.global_step)
        checkpoint[CHECKPOINT_KEY] = {"fingerprint": value, "global_step": step}
        seen = self._by_step.setdefault(step, [])
        if value in seen:  # the same weights saved again at this step (last.ckpt beside a top-k file)
            return
        seen.append(value)
        log_fingerprint(trainer.loggers, fingerprint_key(step, len(seen) - 1), value, step)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.loggers:
            return
        self._fingerprint_at = None  # taken anew: a callback may change the weights at the end (SWA's average)
        value = self._fingerprint(trainer, pl_module)
        if value is not None:
            log_fingerprint(trainer.loggers, FINAL_FINGERPRINT, value, int(trainer.global_step))


__all__ = ["DeterminismRecord", "log_fingerprint", "log_record", "user_hyperparameters"]
