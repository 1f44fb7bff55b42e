"""The tree shows the architecture: the old flat module paths still import for a release, with a warning, as the
very modules of the new layout; the import contracts hold (CI runs import-linter: `lint-imports`)."""

import importlib
import sys
import warnings

import pytest

from lightning_determinism._moved import _NOT_ALIASED, MOVED


@pytest.mark.parametrize("old", sorted(set(MOVED) - set(_NOT_ALIASED)))
def test_an_old_module_path_is_the_new_module_with_a_deprecation_warning(old):
    sys.modules.pop(f"lightning_determinism.{old}", None)
    with pytest.warns(DeprecationWarning, match=rf"`lightning_determinism\.{old}` moved to"):
        module = importlib.import_module(f"lightning_determinism.{old}")
    assert module is importlib.import_module(f"lightning_determinism.{MOVED[old]}")


def test_a_submodule_of_a_moved_package_is_one_module():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = importlib.import_module("lightning_determinism.diagnosis.digest")
    assert old is importlib.import_module("lightning_determinism.divergence.diagnosis.digest")


def test_the_top_level_holds_the_face_and_concept_folders_only():
    from pathlib import Path

    import lightning_determinism

    root = Path(lightning_determinism.__file__).parent
    modules = sorted(p.name for p in root.glob("*.py"))
    # the face, and leaves used everywhere: exact sums, the process helper, the old paths' finder
    assert modules == [
        "__about__.py",
        "__init__.py",
        "__main__.py",
        "_moved.py",
        "_process.py",
        "errors.py",
        "exact.py",
    ]
    folders = sorted(p.name for p in root.iterdir() if (p / "__init__.py").exists())
    assert folders == ["_compat", "callbacks", "checkpoints", "data", "divergence", "invariance", "metrics", "parallel",
                       "seeding", "strategies"]  # fmt: skip


FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures" / "flat_layout"


def test_a_checkpoint_of_the_flat_layout_reports_and_resumes_to_the_same_bits(tmp_path, capsys):
    import json

    import torch

    import _lightning_determinism_cli as entry
    from lightning_determinism import fingerprint

    checkpoint = FIXTURES / "step=2.ckpt"
    torch.load(checkpoint, weights_only=True)
    assert entry.main(["report", str(checkpoint)]) == 0
    assert "1 rank(s): python, numpy, torch CPU" in capsys.readouterr().out
    make = _fixture_module()
    trainer = make.trainer_for(tmp_path, callbacks=[])
    trainer.fit(make.Net(), ckpt_path=checkpoint)  # mid-epoch, written before the move
    expected = json.loads((FIXTURES / "final.json").read_text())
    assert trainer.global_step == expected["global_step"]
    # final.json holds the fingerprint of that version: sha256 over names, dtypes, shapes and raw bytes
    assert _bytes_fingerprint(trainer.lightning_module) == expected["fingerprint"]
    assert fingerprint(trainer.lightning_module) != expected["fingerprint"]  # today's digests tensors by position


def _bytes_fingerprint(module):
    """The fingerprint of the version that wrote the fixtures, recomputed from its definition."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(name.encode())
        digest.update(f"|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def test_baseline_and_probe_files_of_the_flat_layout_load_and_compare_with_a_run_of_the_new_code(tmp_path):
    from lightning_determinism import DivergenceProbe, NumericalBaseline, compare_baselines, diagnose, load_baseline
    from lightning_determinism.divergence.diagnosis.probe_file import ProbeFileError

    make = _fixture_module()
    callbacks = [
        NumericalBaseline(tmp_path / "baseline.json", steps=3),
        DivergenceProbe(tmp_path / "probe.json", steps=2),
    ]
    make.trainer_for(tmp_path, callbacks=callbacks).fit(make.Net())
    old, new = load_baseline(FIXTURES / "baseline.json"), load_baseline(tmp_path / "baseline.json")
    result = compare_baselines(old, new, rtol=0.0, atol=0.0)
    assert result["first"] is None and len(result["rows"]) == 3  # the new code: the old run's bits, step by step
    # Probe files are format 2 since tensors are digested by position on their device: format 1 is refused, clearly.
    with pytest.raises(ProbeFileError, match=r"a probe file of format 1, this version reads format 2"):
        diagnose(FIXTURES / "probe.json", tmp_path / "probe.json")
    assert diagnose(tmp_path / "probe.json", tmp_path / "probe.json")["verdict"] == "same"


def _fixture_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("flat_layout_make", FIXTURES / "make.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_top_level_fingerprint_stays_the_function():
    import lightning_determinism

    assert callable(lightning_determinism.fingerprint)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("lightning_determinism.fingerprint.x")
