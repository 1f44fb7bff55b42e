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
from lightning_determinism._compat import features as _features
from lightning_determinism._compat import pieces as _pieces
from lightning_determinism._compat.checks import PIECES, check_compat
from lightning_determinism.errors import IncompatibleVersionError
from tests.helpers import CHILD_TIMEOUT_S, child_env, warm

PACKAGE = Path(lightning_determinism.__file__).parent
FOREIGN = ("lightning", "pytorch_lightning", "torch", "torchmetrics")


def _newer_than_installed(feature):
    """A feature :data:`NEWER_TORCH` says needs a torch newer than the installed one."""
    needed = _features.NEWER_TORCH.get(feature)
    return needed is not None and _pieces._release(torch.__version__)[:2] < _pieces._release(needed)[:2]


def test_every_piece_is_present_in_the_installed_versions():
    missing = [piece for piece in PIECES if not piece.present()]
    assert [piece.name for piece in missing if not _newer_than_installed(piece.feature)] == []
    if not missing:
        check_compat()


def test_a_feature_that_needs_a_newer_torch_refuses_on_an_older_one_only():
    for feature in _features.NEWER_TORCH:
        assert _compat.available(feature) is not _newer_than_installed(feature), feature


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
        ("torch._dynamo.decorators", "maybe_mark_dynamic"),
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


# Run in a warm child (tests/helpers/warm.py), which imported the package already: forget it, take a private name
# away, then import it again and use what does not need the name, then what does.
_IMPORT_WITHOUT_A_NAME = """import sys
for name in [name for name in sys.modules if name.split(".")[0] == "lightning_determinism"]:
    del sys.modules[name]
import torch
import lightning.pytorch.utilities.data as data
import torch.utils.checkpoint as checkpointing
import torch.distributed._composable.checkpoint_activation as composable
gone = sys.argv[1]
if gone == "update_dataloader":
    del data._update_dataloader
elif gone == "checkpoint_generator":  # what the non-reentrant replay wraps, under both names it had
    for module in (checkpointing, composable):
        for attr in ("_checkpoint_without_reentrant_generator", "_checkpoint_without_reentrant_generator_impl"):
            if hasattr(module, attr):
                delattr(module, attr)
import lightning_determinism as ld
print("imported yes", flush=True)
_ = torch.manual_seed(0)
seed = ld.set_seed(5)
ppl = ld.DistributedPerplexity()
ppl.update(torch.randn(2, 3, 7), torch.randint(0, 7, (2, 3)))
print("core", seed, float(ppl.compute()) > 1, flush=True)
def attempt(what, fn):
    try:
        fn()
        print(what, "ok", flush=True)
    except ld.IncompatibleVersionError as error:
        print(what, "refused", str(error).replace(chr(10), " | "), flush=True)
attempt("strategy", lambda: ld.DeterministicDDPStrategy(seed=1))
attempt("callback", lambda: ld.WorkerSeedCallback())
tracker = ld.get_rng_tracker()
tracker.add("ldet-test", 17)
layer = torch.nn.Linear(4, 4)
def block(x):
    with tracker.fork("ldet-test"):
        return torch.nn.functional.dropout(layer(x), 0.5)
x = torch.ones(3, 4, requires_grad=True)
attempt("plain", lambda: block(x).sum().backward())
attempt("recomputed", lambda: checkpointing.checkpoint(block, x, use_reentrant=True).sum().backward())
"""


def _import_without(tmp_path, gone):
    script = tmp_path / "import_it.py"
    script.write_text(_IMPORT_WITHOUT_A_NAME)
    child = warm.start([sys.executable, str(script), gone], env=child_env())
    out, err = child.communicate(timeout=CHILD_TIMEOUT_S)
    assert child.returncode == 0, err[-3000:]
    return dict(line.split(" ", 1) for line in out.strip().splitlines())


def test_a_missing_name_leaves_the_import_and_other_features_and_refuses_its_feature_in_one_line(tmp_path):
    said = _import_without(tmp_path, "update_dataloader")
    assert said["imported"] == "yes"
    assert said["core"] == "5 True"  # seeding and the exact metric need none of it
    assert said["callback"] == "ok" and said["plain"] == "ok" and said["recomputed"] == "ok"
    refusal = said["strategy"]
    assert refusal.startswith("refused ") and " | " not in refusal  # one line
    assert _features.TRAINER in refusal and "_update_dataloader" in refusal
    assert f"torch {torch.__version__}" in refusal and f"lightning {lightning.__version__}" in refusal
    assert _compat.FEATURES[_features.TRAINER] in refusal  # where it works


def test_without_the_replay_a_recomputed_draw_from_a_package_stream_is_refused(tmp_path):
    said = _import_without(tmp_path, "checkpoint_generator")
    assert said["core"] == "5 True" and said["strategy"] == "ok" and said["plain"] == "ok"
    refusal = said["recomputed"]
    assert refusal.startswith("refused ") and " | " not in refusal
    assert "'ldet-test'" in refusal and _features.RECOMPUTE in refusal and f"torch {torch.__version__}" in refusal


def test_the_same_child_with_nothing_missing_replays_instead(tmp_path):
    said = _import_without(tmp_path, "nothing")
    assert said["strategy"] == said["recomputed"] == said["callback"] == "ok"


def test_require_refuses_only_the_feature_whose_piece_is_gone(monkeypatch):
    monkeypatch.setattr(_compat, "_REQUIRED", set())
    monkeypatch.delattr(importlib.import_module("torch"), "_foreach_norm")
    with pytest.raises(IncompatibleVersionError, match="numerical baselines") as caught:
        _compat.require(_features.BASELINE)
    assert "\n" not in str(caught.value) and "torch._foreach_norm" in str(caught.value)
    assert not _compat.available(_features.BASELINE)
    for feature in set(_compat.FEATURES) - {_features.BASELINE}:
        assert _compat.available(feature) is not _newer_than_installed(feature), feature
    with pytest.raises(ValueError, match="`feature` must be one of"):
        _compat.missing("no such feature")


def test_every_piece_belongs_to_a_feature_and_every_feature_says_where_it_works():
    assert {piece.feature for piece in PIECES} <= set(_compat.FEATURES)
    assert all("torch" in where or "torchmetrics" in where for where in _compat.FEATURES.values())


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
