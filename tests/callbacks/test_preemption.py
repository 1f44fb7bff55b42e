"""PreemptionCheckpoint in one process: the signal, the step boundary, the checkpoint, the exit, SLURM's requeue."""

import multiprocessing
import os
import signal

import lightning as L
import pytest
import torch

from lightning_determinism import DeterministicSingleDeviceStrategy, PreemptionCheckpoint
from tests.helpers.lightning_models import RecordingModule, quiet_trainer


class _SignalAt(RecordingModule):
    """Sends itself ``signum`` during the training step of batch ``at``."""

    def __init__(self, out_dir, signum, at):
        super().__init__(out_dir, n=24, record_draws=False)
        self.signum, self.at = signum, at

    def training_step(self, batch, batch_idx):
        if batch_idx == self.at:
            os.kill(os.getpid(), self.signum)  # delivered at once: the handler only sets a flag
        return super().training_step(batch, batch_idx)


def _fit(tmp_path, module, callbacks=(), **kwargs):
    callback = PreemptionCheckpoint(tmp_path)
    strategy = DeterministicSingleDeviceStrategy(seed=3)
    trainer = quiet_trainer(strategy, 1, max_epochs=2, callbacks=[callback, *callbacks], **kwargs)
    before = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as stop:
            trainer.fit(module)
        # Until the process has exited a repeated signal is ignored: it must not kill the clean exit.
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)
    return callback, trainer, stop.value.code


def test_sigterm_finishes_the_step_checkpoints_and_exits_cleanly(tmp_path):
    callback, trainer, code = _fit(tmp_path, _SignalAt(str(tmp_path), signal.SIGTERM, at=2))
    assert code == 0 and callback.preempted and callback.path == tmp_path / "preempted.ckpt"
    saved = torch.load(callback.path, weights_only=True)
    assert saved["global_step"] == 3  # the step of batch 2 completed, nothing after it
    assert trainer.global_step == 3


def test_with_accumulation_it_waits_for_the_optimizer_step(tmp_path):
    callback, _, _ = _fit(tmp_path, _SignalAt(str(tmp_path), signal.SIGTERM, at=2), accumulate_grad_batches=2)
    saved = torch.load(callback.path, weights_only=True)
    assert saved["global_step"] == 2  # micro-batches 2 and 3 make step 2: the signal in 2 stops after 3
    assert saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["processed"] == 4


def test_under_slurm_sigusr1_runs_lightnings_requeue_at_the_step_boundary(tmp_path, monkeypatch):
    from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

    for key, value in {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "7", "SLURM_NODELIST": "n1",
                       "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    calls = []

    def requeue(self, signum, frame):  # stands in for hpc_save + scontrol requeue
        calls.append((signum, self.trainer.global_step))
        self.trainer.save_checkpoint(self.trainer._checkpoint_connector.hpc_save_path(self.trainer.default_root_dir))

    monkeypatch.setattr(_SignalConnector, "_slurm_sigusr_handler_fn", requeue)
    callback, trainer, code = _fit(tmp_path, _SignalAt(str(tmp_path), signal.SIGUSR1, at=1), default_root_dir=tmp_path)
    assert calls == [(signal.SIGUSR1, 2)] and code == 0
    assert callback.path is not None and callback.path.exists() and "hpc_ckpt" in callback.path.name


def test_bad_arguments_name_themselves():
    with pytest.raises(TypeError, match="`filename` must be a non-empty str, got 3"):
        PreemptionCheckpoint(filename=3)
    with pytest.raises(TypeError, match="`exit_code` must be an int or 'signal', got '1'"):
        PreemptionCheckpoint(exit_code="1")


def test_exit_code_signal_is_128_plus_the_signal(tmp_path):
    module = _SignalAt(str(tmp_path), signal.SIGTERM, at=1)
    callback = PreemptionCheckpoint(tmp_path, exit_code="signal")
    trainer = quiet_trainer(DeterministicSingleDeviceStrategy(seed=3), 1, max_epochs=1, callbacks=[callback])
    before = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as stop:
            trainer.fit(module)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert stop.value.code == 128 + signal.SIGTERM == 143


def test_it_pickles_without_its_handlers():
    import pickle

    callback = PreemptionCheckpoint("x")
    callback._previous = {signal.SIGTERM: signal.getsignal(signal.SIGTERM)}
    assert pickle.loads(pickle.dumps(callback))._previous == {}


_SLURM = {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "7", "SLURM_NODELIST": "n1",
          "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}  # fmt: skip


@pytest.fixture
def fake_scontrol(tmp_path, monkeypatch):
    """SLURM as Lightning reads it, with an ``scontrol`` on the PATH that logs its arguments."""
    for key, value in _SLURM.items():
        monkeypatch.setenv(key, value)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol-calls.txt"
    script = bin_dir / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls


class _SignalInValidation(RecordingModule):
    """Sends itself ``signum`` in the first validation step (not the sanity check's)."""

    def __init__(self, out_dir, signum):
        super().__init__(out_dir, n=24, record_draws=False)
        self.signum = signum

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0 and not self.trainer.sanity_checking:
            os.kill(os.getpid(), self.signum)

    def val_dataloader(self):
        return self.train_dataloader()


def test_sigusr1_under_slurm_links_lightnings_hpc_checkpoint_as_last_and_requeues(tmp_path, fake_scontrol):
    # The real Lightning handler (its save, its scontrol call) at the step boundary; fit(ckpt_path="last") then finds
    # the HPC checkpoint just written, not an older last.ckpt.
    from lightning.pytorch.callbacks import ModelCheckpoint

    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True, every_n_train_steps=1)
    callback, trainer, code = _fit(tmp_path, _SignalAt(str(tmp_path), signal.SIGUSR1, at=1), default_root_dir=tmp_path,
                                   enable_checkpointing=True, callbacks=[checkpoints])  # fmt: skip
    assert code == 0 and fake_scontrol.read_text().split() == ["requeue", "7"]
    link = tmp_path / "ckpts" / "last-preempted.ckpt"
    assert callback.path.name == "hpc_ckpt_1.ckpt" and link.resolve() == callback.path.resolve()
    assert torch.load(link, weights_only=True)["global_step"] == 2


def test_sigusr1_during_validation_under_slurm_saves_and_requeues_the_job(tmp_path, fake_scontrol):
    module = _SignalInValidation(str(tmp_path), signal.SIGUSR1)
    callback, trainer, code = _fit(tmp_path, module, default_root_dir=tmp_path, val_check_interval=2)
    assert code == 0 and callback.path == tmp_path / "preempted.ckpt" and callback.path.exists()
    assert fake_scontrol.read_text().split() == ["requeue", "7"]  # the job comes back instead of just ending


def test_under_slurm_without_one_the_strategy_adds_it_so_sigusr1_saves_at_a_step_boundary(tmp_path, fake_scontrol):
    # No PreemptionCheckpoint given: Lightning's own SIGUSR1 handler would write its HPC checkpoint in the middle of
    # the step (here: before the forward of batch 1) and the run would go on; the resume would then differ.
    from lightning_determinism.callbacks.preemption import PreemptionCheckpoint as Added
    from tests.helpers.lightning_models import read_records

    def trainer(root):
        return quiet_trainer(DeterministicSingleDeviceStrategy(seed=3), 1, max_epochs=2, default_root_dir=root)

    (tmp_path / "straight").mkdir()
    trainer(tmp_path / "straight").fit(RecordingModule(str(tmp_path / "straight"), n=24, record_draws=False))
    preempted = trainer(tmp_path)
    before = signal.getsignal(signal.SIGUSR1)
    try:
        with pytest.raises(SystemExit) as stop:
            preempted.fit(_SignalAt(str(tmp_path), signal.SIGUSR1, at=1))
    finally:
        signal.signal(signal.SIGUSR1, before)
    added = [cb for cb in preempted.callbacks if isinstance(cb, Added)]
    assert stop.value.code == 0 and len(added) == 1 and added[0].signals == (signal.SIGUSR1,)
    assert fake_scontrol.read_text().split() == ["requeue", "7"]
    assert torch.load(tmp_path / "hpc_ckpt_1.ckpt", weights_only=True)["global_step"] == 2  # batch 1's step done
    (tmp_path / "resumed").mkdir()
    resumed = trainer(tmp_path)  # SLURM's auto-resume: ckpt_path=None finds hpc_ckpt_1.ckpt
    resumed.fit(RecordingModule(str(tmp_path / "resumed"), n=24, record_draws=False))
    [straight], [after] = read_records(tmp_path / "straight", 1), read_records(tmp_path / "resumed", 1)
    assert after["final_digest"] == straight["final_digest"]


def test_beside_on_exception_checkpoint_a_sigterm_saves_after_the_accumulation_window(tmp_path):
    # Lightning stops on SIGTERM after the batch, inside the window too, and OnExceptionCheckpoint saves there: the
    # gradients of the window's first micro-batch are lost on resume. The strategy adds a PreemptionCheckpoint for
    # SIGTERM, which stops at the window's end; OnExceptionCheckpoint then saves that state.
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    trainer = quiet_trainer(DeterministicSingleDeviceStrategy(seed=3), 1, max_epochs=1, accumulate_grad_batches=2,
                            callbacks=[OnExceptionCheckpoint(tmp_path)], enable_checkpointing=True)  # fmt: skip
    before = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit):
            trainer.fit(_SignalAt(str(tmp_path), signal.SIGTERM, at=2))
    finally:
        signal.signal(signal.SIGTERM, before)
    saved = torch.load(tmp_path / "on_exception.ckpt", weights_only=True)
    assert saved["global_step"] == 2  # micro-batches 2 and 3 make step 2: saved after 3, not after 2
    assert saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["processed"] == 4


class _SignalWithWorkers(L.LightningModule):
    """Loaders with 2 workers each; sends itself SIGTERM in training batch 3 or in the first validation batch."""

    def __init__(self, persistent: bool, where: str) -> None:
        super().__init__()
        self.net, self.persistent, self.where = torch.nn.Linear(4, 1), persistent, where

    def training_step(self, batch, batch_idx):
        if self.where == "training" and batch_idx == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return self.net(batch[0]).square().mean()

    def validation_step(self, batch, batch_idx):
        if self.where == "validation" and batch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)

    def _loader(self):
        data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=torch.Generator().manual_seed(0)))
        return torch.utils.data.DataLoader(data, batch_size=4, num_workers=2, persistent_workers=self.persistent)

    def train_dataloader(self):
        return self._loader()

    def val_dataloader(self):
        return self._loader()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("persistent", [False, True], ids=["workers", "persistent-workers"])
@pytest.mark.parametrize("where", ["training", "validation"])
def test_no_data_loader_worker_outlives_the_preemption_exit(tmp_path, persistent, where):
    # multiprocessing's exit handler joins every child; the SIGTERM it sends a leftover worker first runs the handler
    # the worker inherited (it only sets a flag), so a worker still running here would keep the process from exiting.
    callback, _, code = _fit(tmp_path, _SignalWithWorkers(persistent, where), num_sanity_val_steps=0)
    assert code == 0 and callback.path.exists()
    assert multiprocessing.active_children() == []
