"""Evaluation draws from streams of its own: what it draws never reaches training, and it is reproducible itself.

A validation pass that draws random numbers (test-time augmentation, Monte-Carlo dropout, a callback that picks
samples to log, a shuffled evaluation loader's workers) takes them from the same global generators as training, so
the trained weights depend on how often validation ran (Lightning #16827). :func:`evaluation_streams` is the cure
for any loop: on entry it saves every RNG state of the process (python, numpy, torch CPU and CUDA, the tracker, the
package's generators) and seeds the global generators from ``derive_seed(base, "evaluation", stage, epoch, step,
rank)``; on exit it puts the training states back, bit for bit. Evaluation is then reproducible (the same draws
for the same pass, run to run, different on each rank) and training never sees it.

:class:`EvaluationIsolation` applies it to a Trainer's evaluation loops (sanity check, validation during ``fit``,
``validate``, ``test``, ``predict``), and to ``LightningModule.load_from_checkpoint`` (which builds a module and so
draws initial weights, Lightning #20204); the deterministic strategies install it for the length of a run.

A checkpoint written during evaluation (``ModelCheckpoint`` saves at the end of a validation pass) must hold the
training streams, not evaluation's: :func:`training_rng_state` gives them.

A standalone pass (``trainer.validate``, ``test``, ``predict``) repeated at the same epoch and step in one process —
Monte-Carlo dropout collects samples so — is counted: call ``k`` draws from ``derive_seed(..., rank, "call", k)``
(the first call keeps the keys above), so every call draws new numbers and call ``k`` draws the same ones in every
run of the same script.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import numpy as np
import torch

from lightning_determinism.seeding.rng import (
    capture_rng_state,
    cuda_ready,
    get_rng_tracker,
    named_generator_states,
    restore_named_generators,
    restore_rng_state,
)
from lightning_determinism.seeding.seeds import _rank_and_world_size, current_seeds, derive_seed

_SAVED: list[dict[str, Any]] = []  # the training states, outermost first, while evaluation streams are active
_PASS: list[tuple[str, int, int]] = []  # (stage, epoch, step) of the evaluation pass under way
_PASS_KEYS: list[tuple[int, int]] = []  # (base seed, call) of the pass under way: call k of its (stage, epoch, step)
_LOAD_PATCH: dict[str, Any] = {"count": 0, "original": None}  # LightningModule.load_from_checkpoint while wrapped
_CALLS: dict[tuple[Any, ...], int] = {}  # the standalone passes (validate, test, predict) of this process, by key


def evaluation_seed(base_seed: int, stage: str, epoch: int, step: int, rank: int, call: int = 0) -> int:
    """The seed of one evaluation pass's streams on one rank (``call``: the how-manieth such pass in the process).

    Examples:
        >>> evaluation_seed(42, "validate", 0, 10, 0) == evaluation_seed(42, "validate", 0, 10, 0)
        True
        >>> evaluation_seed(42, "validate", 0, 10, 0) == evaluation_seed(42, "validate", 0, 10, 1)
        False
        >>> evaluation_seed(42, "predict", 0, 10, 0) == evaluation_seed(42, "predict", 0, 10, 0, call=1)
        False
    """
    if call == 0:  # the first call's keys are the ones of releases before `call`: its numbers stay the same
        return derive_seed(base_seed, "evaluation", stage, epoch, step, rank)
    return derive_seed(base_seed, "evaluation", stage, epoch, step, rank, "call", call)


@contextmanager
def evaluation_streams(
    stage: str, epoch: int, step: int, base_seed: int | None = None, rank: int | None = None, call: int = 0
) -> Iterator[int]:
    """Run a block on evaluation's own streams, then give training back exactly the states it had.

    Args:
        stage: what is evaluated, e.g. ``"validate"``, ``"test"``, ``"predict"``, ``"sanity_check"``.
        epoch: the training epoch the pass belongs to.
        step: the optimizer step the pass belongs to (``global_step``).
        base_seed: the run's base seed; default: the one the package seeded this process with.
        rank: this process's rank; default: the process group's, else 0.
        call: which pass of the same ``stage``, ``epoch`` and ``step`` this is in the process (0 for the first):
            repeated ``trainer.predict`` calls (Monte-Carlo dropout) each draw their own numbers.

    Yields:
        The seed the evaluation streams were seeded with.

    Raises:
        RuntimeError: if no base seed is given and the package has not seeded this process (``set_seed``, a
            deterministic strategy).

    A block inside another one keeps the outer block's streams (one pass, one stream).

    Examples:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> with evaluation_streams("validate", epoch=0, step=5, base_seed=42):
        ...     drawn = torch.rand(2)  # evaluation's own numbers
        >>> after = torch.rand(1)
        >>> _ = torch.manual_seed(0)
        >>> torch.equal(after, torch.rand(1))  # training continues as if nothing had been drawn
        True
        >>> with evaluation_streams("validate", epoch=0, step=5, base_seed=42):
        ...     torch.equal(drawn, torch.rand(2))  # and evaluation is reproducible
        True
    """
    if _SAVED:
        yield -1
        return
    if base_seed is None:
        base_seed = current_seeds()["base_seed"]
        if base_seed is None:
            raise RuntimeError(
                "evaluation_streams() needs the run's base seed: pass `base_seed`, or seed the process with set_seed()"
                " or a deterministic strategy first"
            )
    if rank is None:
        rank = _rank_and_world_size()[0]
    seed = evaluation_seed(base_seed, stage, epoch, step, rank, call)
    _SAVED.append(_save())
    _PASS.append((stage, int(epoch), int(step)))
    _PASS_KEYS.append((int(base_seed), int(call)))
    try:
        _seed(seed)
        yield seed
    finally:
        _PASS.pop()
        _PASS_KEYS.pop()
        _restore(_SAVED.pop())


def _save() -> dict[str, Any]:
    """Every RNG state of the process as the libraries hand it out (no conversion: a pass pays ~0.1 ms, not 1)."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if cuda_ready() else None,
        "tracker": get_rng_tracker().get_states(),
        "generators": named_generator_states(),
    }


def _restore(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state_all(state["cuda"])
    get_rng_tracker().set_states(state["tracker"])
    restore_named_generators(state["generators"])


def _seed(seed: int) -> None:
    """python, numpy and torch from ``seed``; torch's CPU generator directly (``torch.manual_seed`` costs ~0.5 ms)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.default_generator.manual_seed(seed)
    if cuda_ready():
        torch.cuda.manual_seed_all(seed)


def current_evaluation_pass() -> tuple[str, int, int] | None:
    """``(stage, epoch, step)`` of the :func:`evaluation_streams` block under way, or ``None`` outside one.

    Shuffled evaluation samplers take their order from it, so that every pass reads another order, the same on
    every rank and in every run.

    Examples:
        >>> with evaluation_streams("test", epoch=1, step=7, base_seed=0):
        ...     current_evaluation_pass()
        ('test', 1, 7)
        >>> current_evaluation_pass() is None
        True
    """
    return _PASS[-1] if _PASS else None


def current_evaluation_keys() -> tuple[int, int] | None:
    """``(base_seed, call)`` of the :func:`evaluation_streams` block under way, or ``None`` outside one.

    ``call`` is which pass of its stage, epoch and step in the process this is (0 for the first).

    Examples:
        >>> with evaluation_streams("predict", epoch=0, step=0, base_seed=5, call=2):
        ...     current_evaluation_keys()
        (5, 2)
    """
    return _PASS_KEYS[-1] if _PASS_KEYS else None


def training_rng_state() -> dict[str, Any]:
    """Every RNG state of training: the saved one inside :func:`evaluation_streams`, else the current one.

    Examples:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> with evaluation_streams("validate", epoch=0, step=0, base_seed=1):
        ...     inside = training_rng_state()
        >>> torch.equal(inside["torch"], torch.get_rng_state())
        True
    """
    if not _SAVED:
        return capture_rng_state()
    evaluation = _save()
    _restore(_SAVED[0])  # briefly put training's states back, to read them in the checkpoint's format
    try:
        return capture_rng_state()
    finally:
        _restore(evaluation)


def _stage_of(trainer: Any, default: str) -> str:
    return "sanity_check" if getattr(trainer, "sanity_checking", False) else default


class EvaluationIsolation:
    """Put a Trainer's evaluation loops and ``load_from_checkpoint`` on their own streams, for the length of a run.

    Args:
        seeds: an object whose ``base_seed`` attribute holds the run's base seed once the ranks are set up (the
            strategy's seeding steps; picklable, as spawn launchers need).
        around: a context manager factory every evaluation pass runs inside, after its streams are set (the
            strategies' ``batch_invariant=True`` gives :func:`~lightning_determinism.batch_invariant`); picklable.

    :meth:`attach` wraps the ``run`` method of the loops on the Trainer instance (nothing of Lightning's classes is
    changed), :meth:`detach` takes the wrappers off again. ``load_from_checkpoint`` is wrapped on the
    ``LightningModule`` class while at least one isolation is attached, and unwrapped after the last one.

    Examples:
        >>> from types import SimpleNamespace
        >>> isolation = EvaluationIsolation(SimpleNamespace(base_seed=42))
        >>> isolation.attached
        False
    """

    def __init__(self, seeds: Any, around: Callable[[], AbstractContextManager[Any]] | None = None) -> None:
        self._seeds = seeds
        self._around = around
        self._loops: list[Any] = []

    @property
    def attached(self) -> bool:
        """Whether the loops of a Trainer are wrapped now."""
        return bool(self._loops)

    def attach(self, trainer: Any) -> None:
        """Wrap the evaluation loops of ``trainer`` (idempotent) and ``load_from_checkpoint``."""
        if self._loops:
            return
        loops = {
            "validate": trainer.fit_loop.epoch_loop.val_loop,  # validation inside fit, and the sanity check
            "validate_only": trainer.validate_loop,
            "test": trainer.test_loop,
            "predict": trainer.predict_loop,
        }
        for stage, loop in loops.items():
            standalone = stage != "validate"  # trainer.validate/test/predict: a call may repeat at one step
            loop.run = self._isolated(loop.run, trainer, "validate" if stage == "validate_only" else stage, standalone)
            self._loops.append(loop)
        # A run resumed at the end of an epoch whose validation was due skips that pass by fast-forwarding the val
        # loop's counters, which sets up its loader and creates an iterator: a draw of the global generator (the
        # loader's base seed) that the uninterrupted run made inside its isolated pass.
        val_loop = loops["validate"]
        skip = getattr(val_loop, "increment_progress_to_evaluation_end", None)
        if skip is not None:
            val_loop.increment_progress_to_evaluation_end = self._isolated(skip, trainer, "validate")
        self._patch_load()

    def detach(self) -> None:
        """Take the wrappers off (the loops fall back to their class's ``run``)."""
        for loop in self._loops:
            loop.__dict__.pop("run", None)
            loop.__dict__.pop("increment_progress_to_evaluation_end", None)
        if self._loops:
            self._unpatch_load()
        self._loops = []

    def _isolated(self, run: Any, trainer: Any, stage: str, standalone: bool = False) -> Any:
        @functools.wraps(run)
        def isolated_run(*args: Any, **kwargs: Any) -> Any:
            key = (_stage_of(trainer, stage), int(trainer.current_epoch), int(trainer.global_step))
            base, rank = self._seeds.base_seed, int(trainer.global_rank)
            call = 0
            if standalone and not _SAVED:  # the k-th call of this pass in the process: its own, reproducible numbers
                call = _CALLS.get((*key, base, rank), 0)
                _CALLS[(*key, base, rank)] = call + 1
            with evaluation_streams(*key, base_seed=base, rank=rank, call=call):
                with self._around() if self._around is not None else nullcontext():
                    return run(*args, **kwargs)

        return isolated_run

    @staticmethod
    def _patch_load() -> None:
        import lightning.pytorch as pl

        if _LOAD_PATCH["count"] == 0:  # kept in a dict: a classmethod stored as a class attribute would bind
            _LOAD_PATCH["original"] = pl.LightningModule.__dict__["load_from_checkpoint"]
            pl.LightningModule.load_from_checkpoint = _StreamKeepingLoad(_LOAD_PATCH["original"])  # type: ignore[assignment]
        _LOAD_PATCH["count"] += 1

    @staticmethod
    def _unpatch_load() -> None:
        import lightning.pytorch as pl

        _LOAD_PATCH["count"] -= 1
        if _LOAD_PATCH["count"] == 0:
            pl.LightningModule.load_from_checkpoint = _LOAD_PATCH["original"]  # type: ignore[method-assign]
            _LOAD_PATCH["original"] = None


class _StreamKeepingLoad:
    """``load_from_checkpoint`` that leaves every RNG state as it found it (building the module draws weights)."""

    def __init__(self, original: Any) -> None:
        self.original = original

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        load = self.original.__get__(instance, owner)

        @functools.wraps(load)
        def stream_keeping_load(*args: Any, **kwargs: Any) -> Any:
            state = capture_rng_state()
            try:
                return load(*args, **kwargs)
            finally:
                restore_rng_state(state)

        return stream_keeping_load


__all__ = [
    "EvaluationIsolation",
    "current_evaluation_pass",
    "evaluation_seed",
    "evaluation_streams",
    "training_rng_state",
]
