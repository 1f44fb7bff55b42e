"""PreemptionCheckpoint: on SIGTERM, finish the step, checkpoint every rank's state, and exit cleanly.

Clusters preempt jobs by sending ``SIGTERM`` (SLURM also sends ``SIGUSR1`` ahead of time when asked to). Lightning's
own handler stops at the start of the next step with a ``SIGTERMException`` and no checkpoint, unless
``OnExceptionCheckpoint`` is configured. This callback instead lets the current optimizer step finish (the whole
accumulation window), has all ranks agree that a signal arrived (one may have received it and the others not), writes
a checkpoint with every rank's RNG and data position (so a resumed run is bitwise the uninterrupted one), and
leaves through ``SystemExit``: teardown runs, no traceback is printed, the process exits with ``exit_code``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_determinism._compat import loops
from lightning_determinism._compat.access import (
    accelerator_connector,
    keep_ignored_after_teardown,
    should_accumulate,
    slurm_requeue,
)
from lightning_determinism._compat.checks import require
from lightning_determinism._compat.features import PREEMPTION
from lightning_determinism.callbacks._evaluation_stop import EvaluationStop
from lightning_determinism.errors import DeterminismWarning

log = logging.getLogger("lightning_determinism.callbacks")


class PreemptionCheckpoint(Callback):
    """Checkpoint at the next step boundary after a preemption signal, then exit.

    Args:
        dirpath: where the checkpoint goes; ``None`` takes the first ``ModelCheckpoint``'s directory, else
            ``trainer.default_root_dir``.
        filename: the checkpoint's name, without ``.ckpt``.
        exit_code: the status the processes exit with after the checkpoint: an int (``0``, the default: a clean
            stop, what SLURM's requeue expects), or ``"signal"``: ``128 + signum`` (143 for ``SIGTERM``), what a
            shell reports for death by that signal, for schedulers that restart only failed processes (a Kubernetes
            Job's pod, TorchElastic's ``--max-restarts``). See docs/preemption.md.
        signals: the signals that mean "preempted"; ``None`` is ``SIGTERM``, plus the requeue signal (``SIGUSR1``)
            when Lightning's SLURM environment requeues the job (``auto_requeue``). Then Lightning's requeue runs at
            the step boundary too. The deterministic strategies add one for that signal alone under SLURM's
            auto-requeue when the trainer has none (:func:`preemption_needed`).

    Raises:
        TypeError: for a ``filename`` that is not a string or an ``exit_code`` that is not an int.

    Examples:
        >>> import lightning as L
        >>> trainer = L.Trainer(callbacks=[PreemptionCheckpoint("ckpts")], logger=False, enable_progress_bar=False)
        >>> trainer.callbacks[0].filename
        'preempted'
    """

    def __init__(
        self,
        dirpath: str | Path | None = None,
        filename: str = "preempted",
        exit_code: int | str = 0,
        signals: tuple[int, ...] | None = None,
    ) -> None:
        require(PREEMPTION)
        if not isinstance(filename, str) or not filename:
            raise TypeError(f"`filename` must be a non-empty str, got {filename!r}")
        if exit_code != "signal" and (isinstance(exit_code, bool) or not isinstance(exit_code, int)):
            raise TypeError(f"`exit_code` must be an int or 'signal', got {exit_code!r}")
        self.dirpath = None if dirpath is None else Path(dirpath)
        self.filename = filename
        self.exit_code = exit_code
        self.signals = signals
        self.received: int | None = None  # the signal received, on this rank
        self.preempted = False
        self.path: Path | None = None
        self._previous: dict[int, Any] = {}
        self._requeue = False
        self._requeue_signal: int = signal.SIGUSR1  # SLURMEnvironment(requeue_signal=...) may name another
        self._evaluation = EvaluationStop()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_previous"] = {}  # signal handlers are this process's
        return state

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: a signal handler must not take locks or run collectives.
        self.received = signum

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)

    def _install(self, trainer: pl.Trainer) -> None:
        # After Lightning registered its own handlers (in Trainer._run, before the sanity check): this one takes their
        # place until the end of training, so Lightning's SIGTERM handler does not stop the run before the step is
        # complete.
        if self._previous:
            return
        self._requeue, self._requeue_signal = _slurm_requeue_signal(trainer)
        signals = self.signals
        if signals is None:
            signals = (signal.SIGTERM,) + ((self._requeue_signal,) if self._requeue else ())
        for signum in signals:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handler)
        saves_its_own = any(not (self._requeue and signum == self._requeue_signal) for signum in signals)
        if saves_its_own and not any(isinstance(cb, ModelCheckpoint) for cb in trainer.checkpoint_callbacks):
            rank_zero_warn(
                "PreemptionCheckpoint: the trainer has no ModelCheckpoint, so a requeued run's"
                f" fit(ckpt_path='last') will not find the preemption checkpoint; resume it with"
                f" ckpt_path='{self._target(trainer)}'.",
                category=DeterminismWarning,
            )

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_handlers()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.preempted:
            return  # our own SystemExit: the signals stay ignored until the process has exited
        self._restore_handlers()

    def _ignore_from_now_on(self, trainer: pl.Trainer) -> None:
        """After the checkpoint: a repeated signal (SLURM, a user's second ``kill``) must not kill the clean exit."""
        for signum in self._previous:
            signal.signal(signum, signal.SIG_IGN)
        keep_ignored_after_teardown(trainer, list(self._previous))  # Lightning's teardown restores its originals
        self._previous = {}

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and self._previous:
            self._evaluation.start(trainer)

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if trainer.state.fn != TrainerFn.FITTING or not self._previous:
            return
        if not self._evaluation.should_stop(self.received or 0):
            return
        self.preempted = True
        signum = self.received or signal.SIGTERM  # a rank told by another one through the store
        if trainer.sanity_checking:
            self.path = None  # nothing trained since the run (re)started: the requeued job starts where this one did
            rank_zero_info(f"Preempted by signal {signum} during the sanity check: nothing to save.")
        else:
            self.path = self._target(trainer)
            self._evaluation.save(trainer, self.path, _link_as_last)  # rank 0 alone; no collective mid-pass
            rank_zero_info(
                f"Preempted by signal {signum} during validation: the training state at step {trainer.global_step}"
                f" written to {self.path} (the validation pass runs again after the resume)."
            )
        if self._requeue and signum == self._requeue_signal and trainer.is_global_zero:
            requeue_slurm_job()  # Lightning requeues only from its own handler, which saves with every rank
        # Lightning's teardown stops the validation loader's workers, not the training loader's: they would keep the
        # process from exiting (multiprocessing joins them, and the SIGTERM it sends them runs this callback's handler,
        # which a forked worker inherited).
        loops.shut_down_training_workers(trainer)
        self._exit(trainer, signum)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if should_accumulate(trainer):
            return  # the optimizer step is not done yet: stop at the end of the accumulation window
        signum = _agree(self.received or 0, trainer)
        if not signum:
            return
        self.preempted = True
        if self._requeue and signum == self._requeue_signal:
            # Lightning's requeue: it saves its HPC checkpoint (now at a step boundary) and requeues the job. Linked as
            # "last" too: a requeued job started with fit(ckpt_path="last") resumes it, not an older last.ckpt.
            self.path = Path(slurm_requeue(trainer, signum))
            _link_as_last(trainer, self.path)
        else:
            self.path = self._target(trainer)
            trainer.save_checkpoint(self.path, weights_only=False)  # every rank takes part; rank 0 writes
            _link_as_last(trainer, self.path)
        rank_zero_info(
            f"Preempted by signal {signum}: checkpoint at step {trainer.global_step} written to {self.path};"
            f" resume with trainer.fit(..., ckpt_path={str(self.path)!r}) or ckpt_path='last'."
        )
        self._exit(trainer, signum)

    def _exit(self, trainer: pl.Trainer, signum: int) -> None:
        code = 128 + signum if self.exit_code == "signal" else int(self.exit_code)
        rank_zero_info(f"Exiting with status {code}.")
        self._ignore_from_now_on(trainer)
        raise SystemExit(code)

    def _target(self, trainer: pl.Trainer) -> Path:
        dirpath = self.dirpath
        if dirpath is None:
            checkpoint_dir = getattr(trainer.checkpoint_callback, "dirpath", None)
            dirpath = Path(checkpoint_dir) if checkpoint_dir else Path(trainer.default_root_dir)
        return dirpath / f"{self.filename}.ckpt"


def _slurm_requeue_signal(trainer: pl.Trainer) -> tuple[bool, int]:
    """Whether Lightning requeues this SLURM job itself (``auto_requeue``), and on which signal (``SIGUSR1``)."""
    environment = accelerator_connector(trainer).cluster_environment
    requeue = isinstance(environment, SLURMEnvironment) and environment.auto_requeue
    signum = getattr(environment, "requeue_signal", None) if requeue else None
    return requeue, int(signum) if signum is not None else signal.SIGUSR1


def preemption_needed(trainer: pl.Trainer) -> PreemptionCheckpoint | None:
    """The :class:`PreemptionCheckpoint` a deterministic strategy adds where Lightning would save in mid-step.

    Lightning's own handlers save on a signal in two cases, wherever the step stands: under SLURM's auto-requeue its
    ``SIGUSR1`` handler writes the HPC checkpoint from inside the signal handler (mid forward, mid backward, mid
    optimizer step), and an ``OnExceptionCheckpoint`` saves when ``SIGTERM`` stops the run after the batch (inside
    an accumulation window too): either way the resumed run is silently another one. Then a ``PreemptionCheckpoint``
    for those signals alone is returned (saying so once), which saves at the next optimizer-step boundary; ``None``
    where the trainer has one of its own, or where nothing saves on a signal.
    """
    callbacks = list(trainer.callbacks)  # type: ignore[attr-defined]
    if any(isinstance(callback, PreemptionCheckpoint) for callback in callbacks):
        return None
    requeue, requeue_signal = _slurm_requeue_signal(trainer)
    signals: list[int] = [requeue_signal] if requeue else []
    if any(isinstance(callback, OnExceptionCheckpoint) for callback in callbacks):
        signals.append(signal.SIGTERM)
    if not signals:
        return None
    names = " and ".join(signal.Signals(signum).name for signum in signals)
    why = "SLURM's auto-requeue" if requeue else "OnExceptionCheckpoint"
    rank_zero_info(
        f"PreemptionCheckpoint(signals=({names},)) added: under {why} Lightning would save in the middle of a"
        " step on that signal, and the resumed run would differ; it saves at the next step boundary instead"
        " (pass a PreemptionCheckpoint of your own to choose otherwise)."
    )
    return PreemptionCheckpoint(signals=tuple(signals))


LAST_LINK = "last-preempted.ckpt"
"""The link to the preemption checkpoint in each ``ModelCheckpoint`` directory: ``ckpt_path="last"`` considers it."""


def _link_as_last(trainer: pl.Trainer, path: Path, barrier: bool = True) -> None:
    """Make ``fit(ckpt_path="last")`` find ``path``: Lightning takes the newest ``last*.ckpt`` of its checkpoint dirs.

    A link named ``last-preempted.ckpt`` in the directory of every ``ModelCheckpoint`` (Lightning's own convention
    for ``save_last="link"``: a relative symlink, a copy where links are not allowed), replaced atomically.
    """
    if trainer.is_global_zero:
        for callback in trainer.checkpoint_callbacks:
            dirpath = getattr(callback, "dirpath", None)
            if not isinstance(callback, ModelCheckpoint) or not dirpath:
                continue
            link = Path(dirpath) / LAST_LINK
            if link.resolve() == path.resolve() or (
                path.parent.resolve() == link.parent.resolve()
                and path.stem.startswith(ModelCheckpoint.CHECKPOINT_NAME_LAST)
            ):
                continue  # it is found as it is
            link.parent.mkdir(parents=True, exist_ok=True)
            temporary = link.with_name(f".{link.name.replace('_', '-')}.{os.getpid()}.tmp")  # no "ckpt_": see atomic
            try:
                temporary.unlink(missing_ok=True)
                temporary.symlink_to(os.path.relpath(path, link.parent))
            except OSError:
                shutil.copyfile(path, temporary)
            os.replace(temporary, link)
    if barrier:
        trainer.strategy.barrier("ldet-preemption-link")


def requeue_slurm_job() -> int:
    """``scontrol requeue`` this SLURM job (an array task as ``ARRAYID_TASKID``), as Lightning's SIGUSR1 handler does.

    Returns:
        ``scontrol``'s exit status (a failure is logged as a warning, as Lightning logs it).
    """
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
    if not re.fullmatch(r"[0-9_-]+", job):
        raise RuntimeError(f"the SLURM job id to requeue must be digits (an array task: ID_TASK), got {job!r}")
    try:
        result = subprocess.call(["scontrol", "requeue", job])
    except FileNotFoundError:
        result = 127
    if result == 0:
        rank_zero_info(f"Requeued SLURM job {job}.")
    else:
        log.warning(f"Requeuing SLURM job {job} failed with exit status {result}")
    return result


def _agree(signum: int, trainer: pl.Trainer) -> int:
    """The largest signal number any rank received (0: none): every rank stops at the same step, or none does."""
    if not (dist.is_available() and dist.is_initialized() and trainer.world_size > 1):
        return signum
    flag = torch.tensor([signum], dtype=torch.int64, device=trainer.strategy.root_device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


__all__ = ["LAST_LINK", "PreemptionCheckpoint", "preemption_needed"]
