"""The compatibility module: every private name of Lightning, Fabric, torch and torchmetrics goes through it, and a
missing one fails with one clear error naming the piece and the installed versions (faked here by taking it away)."""

import ast
import importlib
import inspect
import pkgutil
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning
import pytest
import torch
import torchmetrics
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.utilities.combined_loader import CombinedLoader

import lightning_determinism
from lightning_determinism._compat import access as _access
from lightning_determinism._compat import checks as _compat
from lightning_determinism._compat import data as _compat_data
from lightning_determinism._compat.checks import PIECES, check_compat
from lightning_determinism.errors import IncompatibleVersionError
from tests.helpers import CHILD_TIMEOUT_S, child_env, warm

PACKAGE = Path(lightning_determinism.__file__).parent
FOREIGN = ("lightning", "pytorch_lightning", "torch", "torchmetrics")


def test_every_piece_is_present_in_the_installed_versions():
    assert [piece.name for piece in PIECES if not piece.present()] == []
    check_compat()


def _fails_naming(*fragments):
    with pytest.raises(IncompatibleVersionError) as caught:
        check_compat()
    message = str(caught.value)
    assert f"lightning {lightning.__version__}" in message
    assert f"torchmetrics {torchmetrics.__version__}" in message and f"torch {torch.__version__}" in message
    for fragment in fragments:
        assert fragment in message
    return message


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("lightning.pytorch.utilities.data", "_update_dataloader"),
        ("lightning.fabric.utilities.data", "_set_sampler_epoch"),
        ("lightning.fabric.utilities.distributed", "_suggested_max_num_threads"),
        ("torch.utils.data._utils.signal_handling", "_remove_worker_pids"),
        ("torch._dynamo.decorators", "mark_unbacked"),
        ("torch.nn.modules.batchnorm", "_BatchNorm"),
        ("torchmetrics.utilities.plot", "_PLOT_OUT_TYPE"),
    ],
)
def test_a_missing_module_level_name_is_named_with_the_versions(monkeypatch, module, name):
    monkeypatch.delattr(importlib.import_module(module), name)
    _fails_naming(name)


@pytest.mark.parametrize(
    ("owner", "hook"),
    [
        (DDPStrategy, "_register_ddp_hooks"),
        (DDPStrategy, "_configure_launcher"),
        (_MultiProcessingLauncher, "_wrapping_function"),
        (_MultiProcessingLauncher, "_recover_results_in_main_process"),
        (_FitLoop, "_should_accumulate"),
        (lightning.pytorch.Trainer, "_teardown"),
        (torchmetrics.Metric, "_wrap_update"),
    ],
)
def test_a_renamed_hook_the_package_overrides_or_calls_is_named(monkeypatch, owner, hook):
    for klass in owner.__mro__:  # wherever it is defined
        if hook in vars(klass):
            monkeypatch.delattr(klass, hook)
    _fails_naming(hook)


def test_a_changed_signature_is_named(monkeypatch):
    def reordered(self, trainer, process_idx, function, args, kwargs, return_queue):  # args[0] is no longer the rank
        pass

    monkeypatch.setattr(_MultiProcessingLauncher, "_wrapping_function", reordered)
    _fails_naming("_wrapping_function(process_idx, trainer")


def test_an_instance_attribute_no_longer_assigned_is_named(monkeypatch):
    original = CombinedLoader.__init__

    def init(self, iterables, mode="min_size"):  # a release that renamed `_mode`
        original(self, iterables, mode)
        self._iteration_mode = self.__dict__.pop("_mode")

    monkeypatch.setattr(CombinedLoader, "__init__", init)
    _fails_naming("CombinedLoader._mode")


def test_lightning_older_than_the_floor_is_refused(monkeypatch):
    monkeypatch.setattr(lightning, "__version__", "2.4.0")
    message = _fails_naming(
        f"lightning>={_compat.LIGHTNING_FLOOR}", "lightning 2.4.0", "replay an epoch's last batch on resume"
    )
    assert "docs/compatibility.md" in message


# Run in a warm child (tests/helpers/warm.py), which imported the package already: forget it, then import it again.
_IMPORT_WITHOUT_A_NAME = """import sys
for name in [name for name in sys.modules if name.split(".")[0] == "lightning_determinism"]:
    del sys.modules[name]
import lightning.pytorch.utilities.data as data
if sys.argv[1] == "gone":
    del data._update_dataloader
import lightning_determinism
print("imported")
"""


@pytest.mark.parametrize("name", ["gone", "present"])
def test_importing_the_package_fails_with_the_message_when_a_name_is_gone(tmp_path, name):
    script = tmp_path / "import_it.py"
    script.write_text(_IMPORT_WITHOUT_A_NAME)
    child = warm.start([sys.executable, str(script), name], env=child_env())
    out, err = child.communicate(timeout=CHILD_TIMEOUT_S)
    if name == "present":  # the same import again, nothing missing: it succeeds (the child can tell the two apart)
        assert child.returncode == 0 and out.strip() == "imported", err[-3000:]
        return
    assert child.returncode != 0 and "imported" not in out
    last = err.strip().splitlines()
    assert any(line.startswith("lightning_determinism.errors.IncompatibleVersionError") for line in last)
    assert f"installed lightning {lightning.__version__}" in err
    assert "_update_dataloader(dataloader, sampler)" in err


def test_an_attribute_missing_at_run_time_is_a_clear_error():
    with pytest.raises(IncompatibleVersionError, match=r"`object\._should_accumulate` \(read at run time\)") as caught:
        _access.should_accumulate(SimpleNamespace(fit_loop=object()))
    assert f"installed lightning {lightning.__version__}" in str(caught.value)
    with pytest.raises(IncompatibleVersionError, match=r"`SimpleNamespace\._accelerator_connector`"):
        _access.accelerator_connector(SimpleNamespace())


def test_the_accessors_read_what_lightning_and_torch_hold():
    from torch.utils.data import DataLoader

    assert _access.module_trainer(None) is None
    assert _access.module_trainer(lightning.LightningModule()) is None
    loader = DataLoader(range(6), batch_size=2)
    assert _compat_data.loader_iterator(loader) is None
    assert _compat_data.base_index_sampler(DataLoader, loader) is loader.batch_sampler
    iterator = iter(loader)
    indices = _compat_data.sampler_iter(iterator)
    assert next(indices) == [0, 1]
    _compat_data.set_sampler_iter(iterator, iter([[4, 5]]))
    assert next(iterator).tolist() == [4, 5]
    assert _compat_data.worker_processes(iterator) == []
    assert _access.fabric_inner_loader(loader) is loader and _access.fabric_iterations(loader) == 0


def _package_sources():
    return {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}


def _own_names(trees):
    own = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "this"):
                    own.add(node.attr)
            elif isinstance(node, ast.Assign):
                own.update(target.id for target in node.targets if isinstance(target, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                own.add(node.target.id)
    return own


def _private_uses(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FOREIGN:
            yield from (alias.name for alias in node.names if alias.name.startswith("_"))
        elif isinstance(node, ast.Attribute):
            yield node.attr
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "setattr", "hasattr"):
            if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                yield node.args[1].value


def test_no_module_but_the_compatibility_module_reaches_a_private_name():
    trees = _package_sources()
    own = _own_names(trees)
    listed = " ".join(piece.name for piece in PIECES)
    found = {}
    for path, tree in trees.items():
        if "_compat" in path.parts:  # the compatibility package: checks.py, access.py and data.py
            continue
        for name in _private_uses(tree):
            foreign = name.startswith("_") and not name.startswith(("__", "_ldet_")) and name not in own
            if foreign and name != "_exit":  # os._exit is public
                found.setdefault(name, set()).add(path.name)
    # Inherited private methods a metric calls on itself (super()/self) are listed in the checks instead.
    assert {name: where for name, where in found.items() if name not in listed} == {}
    assert set(found) <= {"_plot", "_wrap_update"}


def test_every_overridden_private_hook_is_checked():
    listed = " ".join(piece.name for piece in PIECES)
    overridden = {"_index_sampler"}  # ResumableLoaderMixin's methods are copied into a DataLoader subclass
    for info in pkgutil.walk_packages(lightning_determinism.__path__, "lightning_determinism."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if not cls.__module__.startswith("lightning_determinism"):
                continue
            ours = [klass for klass in cls.__mro__ if klass.__module__.startswith("lightning_determinism")]
            theirs = [klass for klass in cls.__mro__ if klass not in ours]
            for name in {name for klass in ours for name in vars(klass)}:
                if name.startswith("_") and not name.startswith(("__", "_ldet_", "_abc_")):  # not ABC machinery
                    if any(name in vars(base) for base in theirs):
                        overridden.add(name)
    assert {"_configure_launcher", "_register_ddp_hooks", "_wrapping_function", "_apply"} <= overridden
    assert sorted(name for name in overridden if name not in listed) == []


def test_the_oldest_pins_are_the_declared_lower_bounds():
    import re

    root = PACKAGE.parent
    block = re.search(r"^dependencies = \[(.*?)\]", (root / "pyproject.toml").read_text(), re.S | re.M).group(1)
    declared = dict(re.findall(r'"([A-Za-z_]+)>=([\d.]+)"', block))
    pins = dict(re.findall(r"^([A-Za-z_]+)==([\d.]+)$", (root / "requirements" / "oldest.txt").read_text(), re.M))
    assert set(declared) == set(pins)  # every dependency has its lower bound pinned, and nothing else is
    for name, bound in declared.items():
        assert pins[name].split(".")[: len(bound.split("."))] == bound.split("."), name
    assert pins["lightning"] == _compat.LIGHTNING_FLOOR
