"""What ``pyproject.toml`` claims about Python versions and the license, and the docs that repeat it, stay in step.

CI tests the oldest and newest Python of the classifiers (``scripts/compat.sh --python-ends``); these checks keep
``requires-python`` and docs/compatibility.md naming the same versions, so that neither can go stale.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = (ROOT / "pyproject.toml").read_text()  # no tomllib on Python 3.10


def _claimed_pythons() -> list[str]:
    found = re.findall(r'"Programming Language :: Python :: (3\.\d+)"', PYPROJECT)
    return sorted(found, key=lambda version: tuple(map(int, version.split("."))))


def test_requires_python_starts_at_the_oldest_classifier():
    claimed = _claimed_pythons()
    assert claimed, "no 'Programming Language :: Python :: 3.X' classifier: scripts/compat.sh --python-ends needs them"
    assert re.search(r'^requires-python = ">=(3\.\d+)"$', PYPROJECT, re.M).group(1) == claimed[0]


def test_the_compatibility_page_names_the_python_versions_ci_tests():
    oldest, newest = _claimed_pythons()[0], _claimed_pythons()[-1]
    page = " ".join((ROOT / "docs" / "compatibility.md").read_text().split())  # the lines are wrapped anywhere
    assert f"names Python {oldest} to {newest} in its classifiers" in page
    assert f"the oldest and newest Python of those classifiers ({oldest} and {newest})" in page


def test_the_license_file_is_the_one_pyproject_names():
    assert re.search(r'^license = "Apache-2.0"$', PYPROJECT, re.M)
    assert re.search(r'^license-files = \["LICENSE"\]$', PYPROJECT, re.M)
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n") and "Version 2.0, January 2004" in text
    assert "Copyright 2026 The lightning_determinism authors" in text
