import json
import os
import warnings

import pytest
import torch

from lightning_determinism import DeterminismWarning, configure_determinism, determinism_report, set_seed
from lightning_determinism.seeding.backends import debug_mode_name, normalize_debug_mode


@pytest.mark.parametrize(
    ("mode", "expected"), [(None, None), ("default", 0), (0, 0), ("warn", 1), (1, 1), ("error", 2), (2, 2)]
)
def test_normalize_debug_mode(mode, expected):
    assert normalize_debug_mode(mode) == expected


@pytest.mark.parametrize("mode", ["strict", "ERROR", 3, -1, True, 1.0, "1"])
def test_unknown_debug_mode_lists_accepted_values(mode):
    with pytest.raises(
        ValueError, match=rf"`debug_mode` must be one of None, 'default', 'warn', 'error', 0, 1, 2, got {mode!r}"
    ):
        configure_determinism(mode)


@pytest.mark.parametrize(("mode", "warn_only", "torch_mode"), [("warn", True, 1), ("error", False, 2)])
def test_deterministic_modes_set_every_flag(monkeypatch, mode, warn_only, torch_mode):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    assert configure_determinism(mode) == torch_mode
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.is_deterministic_algorithms_warn_only_enabled() is warn_only
    assert torch.get_deterministic_debug_mode() == torch_mode  # agrees with torch's own notion
    assert torch.backends.cudnn.deterministic is True
    assert torch.backends.cudnn.benchmark is False
    assert torch.backends.cuda.matmul.allow_tf32 is False
    assert torch.backends.cudnn.allow_tf32 is False
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_default_mode_turns_determinism_off_and_benchmark_on():
    configure_determinism("error")
    assert configure_determinism("default") == 0
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.get_deterministic_debug_mode() == 0
    assert torch.backends.cudnn.deterministic is False
    assert torch.backends.cudnn.benchmark is True


def test_users_small_cublas_workspace_is_kept(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    configure_determinism("error")
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_nondeterministic_cublas_workspace_is_replaced(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    configure_determinism("warn")
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_warns_when_cublas_setting_comes_after_cuda_init(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.warns(DeterminismWarning, match="after CUDA was initialised"):
        configure_determinism("error")


def test_no_warning_when_cuda_not_initialised(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeterminismWarning)
        configure_determinism("error")


def test_none_mode_changes_nothing():
    torch.backends.cudnn.benchmark = True
    assert configure_determinism(None) is None
    assert torch.backends.cudnn.benchmark is True
    assert not torch.are_deterministic_algorithms_enabled()


def test_debug_mode_name():
    assert [debug_mode_name(m) for m in (None, 0, "warn", 2)] == ["None", "default", "warn", "error"]


def test_report_is_json_and_follows_the_flags():
    configure_determinism("warn")
    base = set_seed(1234)
    report = determinism_report()
    assert json.loads(json.dumps(report)) == report
    assert report["deterministic_algorithms"] is True
    assert report["deterministic_warn_only"] is True
    assert report["cudnn_deterministic"] is True and report["cudnn_benchmark"] is False
    assert report["cublas_workspace_config"] == ":4096:8"
    assert (report["base_seed"], report["local_seed"], report["rank"], report["world_size"]) == (base, base, 0, 1)
    assert report["torch"] == torch.__version__
    configure_determinism("default")
    assert determinism_report()["cudnn_benchmark"] is True
    assert determinism_report()["deterministic_algorithms"] is False


def test_report_lists_every_documented_key():
    expected = {
        "python", "torch", "lightning", "numpy", "torchmetrics", "lightning_determinism",
        "deterministic_algorithms", "deterministic_warn_only", "deterministic_debug_mode", "fill_uninitialized_memory",
        "cudnn_available", "cudnn_version", "cudnn_deterministic", "cudnn_benchmark", "cuda_matmul_allow_tf32",
        "cudnn_allow_tf32", "float32_matmul_precision", "cublas_workspace_config", "pl_global_seed", "cuda_available",
        "cuda_device_count", "num_threads", "base_seed", "local_seed", "rank", "world_size",
    }  # fmt: skip
    assert set(determinism_report()) == expected
