"""The compiled kernels' cache on a machine shared by several users: nothing another user could have written is loaded.

Another user is played by uid 65534 (``nobody``): the tests ``chown`` to it, so they need root (CI runs as root) and
skip elsewhere. The planted library's constructor writes a marker file when it is loaded: the marker must never appear.
"""

import os
import stat
import subprocess
import sys
import tempfile
import warnings

import pytest
import torch

from lightning_determinism.errors import DeterminismWarning
from lightning_determinism.metrics import _kernel_cache, _native

OTHER_UID = 65534
needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown needs root")
needs_compiler = pytest.mark.skipif(_native.find_compiler() is None, reason="no C compiler")
pytestmark = [needs_root, needs_compiler]

PLANTED = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen("%s", "w");
    if (f) { fputs("ran", f); fclose(f); }
}
void ldet_row_sums(void) {}
"""


@pytest.fixture(autouse=True)
def _fresh_cache_choice(monkeypatch, tmp_path):
    monkeypatch.setattr(_kernel_cache, "_CACHE", {})  # the directory a process chose is remembered: forget it per test
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # replacement directories land in the test's own


def _plant(directory, marker, owner=OTHER_UID, mode=0o755):
    """A library under the name every flag set's kernel would have in ``directory``, owned by ``owner``."""
    compiler = _native.find_compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    source = directory.parent / f"{directory.name}-planted.c"
    source.write_text(PLANTED % marker)
    paths = []
    for flags in _native._flag_sets():
        name = os.path.basename(_native.library_path(compiler, version, flags))
        target = directory / name
        subprocess.run([compiler, "-shared", "-fPIC", "-x", "c", str(source), "-o", str(target)], check=True)
        os.chown(target, owner, owner)
        os.chmod(target, mode)
        paths.append(target)
    return paths


def _row_stats_of_a_fresh_kernel():
    gen = torch.Generator().manual_seed(0)
    logits, ids = torch.randn(6, 8192, generator=gen), torch.randint(8192, (6,), generator=gen)
    got = _native.NativeKernel()(logits, ids)  # a new kernel object: it builds (or loads) now
    assert got is not None, "the kernel did not build"
    top, sum_hi, sum_lo, picked = got
    # The reference: the row max and target logit exactly, the sum against float64 exponentials.
    assert torch.equal(top, logits.max(dim=1).values) and torch.equal(picked, logits[torch.arange(6), ids])
    sums = (sum_hi.double() * 2.0**32 + sum_lo.double()) * 2.0**-52
    want = torch.exp(logits.double() - top.double()[:, None]).sum(dim=1)
    assert torch.allclose(sums, want, rtol=1e-8, atol=0)
    return got


def test_a_library_planted_in_a_directory_another_user_made_first_never_runs(monkeypatch, tmp_path):
    planted_dir = tmp_path / "lightning_determinism-victim"
    planted_dir.mkdir(mode=0o777)
    os.chmod(planted_dir, 0o777)
    marker = tmp_path / "planted-code-ran"
    _plant(planted_dir, marker)
    os.chown(planted_dir, OTHER_UID, OTHER_UID)
    monkeypatch.setenv(_native.CACHE_ENV, str(planted_dir))
    with pytest.warns(DeterminismWarning, match=r"is owned by uid 65534, not by this user") as caught:
        _row_stats_of_a_fresh_kernel()
    assert not marker.exists()
    message = str(caught[0].message)
    assert str(planted_dir) in message and _native.CACHE_ENV in message
    used = _native.cache_dir()
    assert used != str(planted_dir) and stat.S_IMODE(os.stat(used).st_mode) == 0o700
    assert os.stat(used).st_uid == os.getuid() and any(name.endswith(".so") for name in os.listdir(used))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeterminismWarning)
        assert _native.cache_dir() == used  # said once: the same replacement after


def test_a_directory_of_ours_that_others_can_write_is_not_used(monkeypatch, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # ours, but anyone could have put a library in it
    marker = tmp_path / "planted-code-ran"
    _plant(shared, marker, owner=os.getuid(), mode=0o777)
    monkeypatch.setenv(_native.CACHE_ENV, str(shared))
    with pytest.warns(DeterminismWarning, match=r"can be written by other users \(mode 777\)"):
        _row_stats_of_a_fresh_kernel()
    assert not marker.exists()


def test_a_library_of_another_user_in_our_private_directory_is_built_again(monkeypatch, tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    marker = tmp_path / "planted-code-ran"
    planted = _plant(private, marker)
    monkeypatch.setenv(_native.CACHE_ENV, str(private))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeterminismWarning)  # the directory is fine: nothing to say
        _row_stats_of_a_fresh_kernel()
    assert not marker.exists()
    # The flag set that built was compiled again, by us; a later one, never looked at, still holds the planted file.
    assert any(path.exists() and os.stat(path).st_uid == os.getuid() for path in planted)


def test_a_link_in_place_of_the_directory_is_not_followed(monkeypatch, tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    link = tmp_path / "cache-link"
    link.symlink_to(target)
    monkeypatch.setenv(_native.CACHE_ENV, str(link))
    with pytest.warns(DeterminismWarning, match=r"is a link or not a directory"):
        assert _native.cache_dir() != str(link)


def test_the_default_directory_is_created_private(monkeypatch, tmp_path):
    monkeypatch.delenv(_native.CACHE_ENV, raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeterminismWarning)
        made = _native.cache_dir()
    assert os.path.dirname(made) == str(tmp_path) and os.path.basename(made).startswith("lightning_determinism-")
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o700


def test_untrusted_names_the_reason():
    assert _native.untrusted("/nonexistent/ldet", directory=True).startswith("cannot be read")
    assert _native.untrusted("/", directory=False) == "is a link or not a regular file"


def test_a_replacement_directory_is_removed_when_its_process_exits(tmp_path):
    hijacked = tmp_path / "hijacked"
    hijacked.mkdir(mode=0o777)
    os.chown(hijacked, OTHER_UID, OTHER_UID)
    script = (
        "import warnings; warnings.simplefilter('ignore')\n"
        "from lightning_determinism.metrics import _kernel_cache\n"
        "print(_kernel_cache.cache_dir())\n"
    )
    env = {**os.environ, _native.CACHE_ENV: str(hijacked), "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    replacement = done.stdout.strip().splitlines()[-1]
    assert replacement.startswith(str(tmp_path)) and replacement != str(hijacked)
    assert not os.path.exists(replacement)  # made private for the process, removed at its exit
