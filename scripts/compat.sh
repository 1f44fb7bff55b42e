#!/usr/bin/env bash
# The compatibility matrix: for each combination of pins (a pip constraints file under requirements/), a fresh virtual
# environment, the package with its test extra, then the README's test command. A summary table comes last.
#
#   bash scripts/compat.sh                          # every combination in requirements/*.txt
#   bash scripts/compat.sh requirements/oldest.txt  # some of them (CI runs the oldest this way)
#
# Environment: LDET_COMPAT_DIR (where the venvs and logs go; default a new temporary directory), PYTHON (the
# interpreter that creates the venvs; default python3), PYTEST_ADDOPTS (passed on to pytest as usual).
# Exit status: 0 when every combination installed and passed, else 1.
set -uo pipefail
cd "$(dirname "$0")/.."

if (($# == 0)); then
    set -- requirements/*.txt
fi
root="${LDET_COMPAT_DIR:-$(mktemp -d)}"
mkdir -p "$root"
python="${PYTHON:-python3}"
report="$root/report.md"
{
    echo "| combination | lightning | torchmetrics | torch | numpy | typing_extensions | result | install | suite |"
    echo "|---|---|---|---|---|---|---|---|---|"
} >"$report"
status=0

version() { "$1/bin/python" -c "import importlib.metadata as m; print(m.version('$2'))" 2>/dev/null || echo "?"; }

for pins in "$@"; do
    name="$(basename "$pins" .txt)"
    venv="$root/$name/venv"
    log="$root/$name/log.txt"
    rm -rf "${root:?}/$name" && mkdir -p "$root/$name"
    echo "== $name ($pins): installing into $venv"
    start=$SECONDS
    # torch first, from the pins: an unpinned torch would pull a multi-GB CUDA build.
    if ! { "$python" -m venv "$venv" &&
        "$venv/bin/pip" install -q -c "$pins" torch &&
        "$venv/bin/pip" install -q -c "$pins" -e ".[test]" &&
        "$venv/bin/python" -c "import torchmetrics.text, lightning_determinism"; } >"$log" 2>&1; then
        tail -n 20 "$log"
        echo "| $name | | | | | | install failed | $((SECONDS - start)) s | |" >>"$report"
        status=1
        continue
    fi
    installed=$((SECONDS - start))
    start=$SECONDS
    echo "== $name: python -m pytest -q"
    "$venv/bin/python" -m pytest -q >>"$log" 2>&1
    rc=$?
    summary="$(tail -n 1 "$log" | tr -d '=' | sed -e 's/^ *//' -e 's/ *$//')"
    echo "== $name: $summary (exit $rc)"
    ((rc == 0)) || status=1
    echo "| $name | $(version "$venv" lightning) | $(version "$venv" torchmetrics) | $(version "$venv" torch)" \
        "| $(version "$venv" numpy) | $(version "$venv" typing_extensions) | $summary | $installed s | $((SECONDS - start)) s |" >>"$report"
done

echo
cat "$report"
echo "(logs and venvs under $root)"
exit "$status"
