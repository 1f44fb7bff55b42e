#!/usr/bin/env bash
# The compatibility matrix: for each combination of pins (a pip constraints file under requirements/), a fresh virtual
# environment, the package with its test extra, then the README's test command. A summary table comes last.
#
#   bash scripts/compat.sh                          # every combination in requirements/*.txt
#   bash scripts/compat.sh requirements/oldest.txt  # some of them (CI runs the oldest this way)
#   bash scripts/compat.sh --python-ends            # the oldest and newest claimed Python: a fast subset (CI runs it)
#
# --python-ends reads the oldest and newest "Programming Language :: Python :: 3.X" classifier of pyproject.toml, finds
# that interpreter (python3.X on PATH, else under pyenv's versions/), and runs the fast subset of the suite there with
# the newest pins (requirements/newest.txt): the whole suite runs on one Python only, it takes minutes per run. An
# interpreter that is not found is skipped with a message, and does not fail the run.
#
# Environment: LDET_COMPAT_DIR (where the venvs and logs go, kept; default a new temporary directory, whose venvs are
# removed after their tests: LDET_COMPAT_KEEP=1 keeps them), PYTHON (the
# interpreter that creates the venvs of the combinations; default python3), LDET_COMPAT_FAST_TESTS (the pytest
# arguments of --python-ends; default below), LDET_COMPAT_EXTRAS (the extras installed with the package; default
# test), PYTEST_ADDOPTS (passed on to pytest as usual).
# Exit status: 0 when every combination (every interpreter found) installed and passed, else 1.
set -uo pipefail
cd "$(dirname "$0")/.."
# Each combination pins its torch, so a machine-wide pip cap on torch (these machines cap it at 2.14.1) must not
# refuse the newest release: the pins file decides.
export PIP_CONSTRAINT=/dev/null

# Seeding, the RNG streams, the command line, the private-name checks, the strategies and their 2-rank fits (fork and
# spawn): about half a minute of tests on 2 cores, after 1.5 minutes of installing.
fast_tests="${LDET_COMPAT_FAST_TESTS:-tests/seeding/test_seeding.py tests/seeding/test_rng.py tests/divergence/test_cli.py tests/_compat/test_compat.py
    tests/strategies/test_strategies.py tests/strategies/test_strategy_fit.py}"

root="${LDET_COMPAT_DIR:-$(mktemp -d)}"
# A CUDA build of torch makes a venv of 5.5-7 GB: in a directory of its own making the script removes each venv once
# its tests ran (the logs stay); under LDET_COMPAT_DIR it keeps them (LDET_COMPAT_KEEP=0 removes them there too).
keep="${LDET_COMPAT_KEEP:-$([[ -n "${LDET_COMPAT_DIR:-}" ]] && echo 1 || echo 0)}"
mkdir -p "$root"
report="$root/report.md"
{
    echo "| combination | python | lightning | torchmetrics | torch | numpy | typing_extensions | result | install | tests |"
    echo "|---|---|---|---|---|---|---|---|---|---|"
} >"$report"
status=0

version() { "$1/bin/python" -c "import importlib.metadata as m; print(m.version('$2'))" 2>/dev/null || echo "?"; }

# One combination: name, pins file, the interpreter that creates its venv, then pytest's arguments (none: the suite).
combination() {
    local name="$1" pins="$2" python="$3"
    shift 3
    local venv="$root/$name/venv" log="$root/$name/log.txt" start=$SECONDS installed rc summary
    rm -rf "${root:?}/$name" && mkdir -p "$root/$name"
    echo "== $name ($pins, $python): installing into $venv"
    # torch first, from the pins: an unpinned torch would pull a multi-GB CUDA build.
    if ! { "$python" -m venv "$venv" &&
        "$venv/bin/pip" install -q -c "$pins" torch &&
        "$venv/bin/pip" install -q -c "$pins" -e ".[${LDET_COMPAT_EXTRAS:-test}]" &&
        "$venv/bin/python" -c "import torchmetrics.text, lightning_determinism"; } >"$log" 2>&1; then
        tail -n 20 "$log"
        echo "| $name | $("$python" -V 2>&1) | | | | | | install failed | $((SECONDS - start)) s | |" >>"$report"
        status=1
        [[ "$keep" == 1 ]] || rm -rf "$venv"
        return
    fi
    installed=$((SECONDS - start))
    start=$SECONDS
    echo "== $name: python -m pytest -q $*"
    "$venv/bin/python" -m pytest -q "$@" >>"$log" 2>&1
    rc=$?
    # pytest's closing line (not the log's last: torch 2.15 prints a nanobind leak report at exit, after it)
    summary="$(grep -E '[0-9]+ (passed|failed|errors?)|no tests ran' "$log" | tail -n 1 | tr -d '=' | sed -e 's/^ *//' -e 's/ *$//')"
    [[ -n "$summary" ]] || summary="$(tail -n 1 "$log")"
    echo "== $name: $summary (exit $rc)"
    ((rc == 0)) || status=1
    echo "| $name | $("$venv/bin/python" -c 'import platform; print(platform.python_version())')" \
        "| $(version "$venv" lightning) | $(version "$venv" torchmetrics) | $(version "$venv" torch)" \
        "| $(version "$venv" numpy) | $(version "$venv" typing_extensions) | $summary | $installed s" \
        "| $((SECONDS - start)) s |" >>"$report"
    [[ "$keep" == 1 ]] || rm -rf "$venv"
}

# The oldest and newest X.Y of pyproject.toml's Python classifiers, one a line.
claimed_pythons() {
    grep -o '"Programming Language :: Python :: 3\.[0-9]*"' pyproject.toml | grep -o '3\.[0-9]*' | sort -V | sed -n '1p;$p'
}

# An interpreter of version $1 that runs (a pyenv shim on PATH may not), or nothing.
find_python() {
    local candidate
    for candidate in "$(command -v "python$1")" "${PYENV_ROOT:-$HOME/.pyenv}/versions/$1".*/bin/"python$1"; do
        if [[ -x "$candidate" ]] &&
            [[ "$("$candidate" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" == "$1" ]]; then
            echo "$candidate"
            return
        fi
    done
}

if [[ "${1:-}" == "--python-ends" ]]; then
    versions="$(claimed_pythons)"
    if [[ -z "$versions" ]]; then
        echo "pyproject.toml has no 'Programming Language :: Python :: 3.X' classifier" >&2
        exit 1
    fi
    for v in $versions; do
        interpreter="$(find_python "$v")"
        if [[ -z "$interpreter" ]]; then
            echo "== python$v: not found (neither on PATH nor under ${PYENV_ROOT:-$HOME/.pyenv}/versions): skipped"
            echo "| python$v | not found | | | | | | skipped | | |" >>"$report"
            continue
        fi
        # shellcheck disable=SC2086  # the subset is a list of pytest arguments
        combination "python$v" requirements/newest.txt "$interpreter" $fast_tests
    done
else
    (($# > 0)) || set -- requirements/*.txt
    for pins in "$@"; do
        combination "$(basename "$pins" .txt)" "$pins" "${PYTHON:-python3}"
    done
fi

echo
cat "$report"
echo "(logs and venvs under $root)"
exit "$status"
