"""Import time of `import lightning_determinism` beside `import lightning` (what it must import anyway).

Budget: the package adds at most 15 % to `import lightning` (it imports torch, Lightning, torchmetrics and numpy,
which dominate, and registers its strategies). Each figure is the median wall time of a fresh interpreter doing only
that import (`python -c "import X"`), minus the median of an empty interpreter, over interleaved repeats.

    python benchmarks/import_time.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

STATEMENTS = {
    "python (nothing)": "pass",
    "import torch": "import torch",
    "import lightning": "import lightning",
    "import lightning_determinism": "import lightning_determinism",
}


def once(statement: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    for statement in STATEMENTS.values():  # warm the file cache
        once(statement)
    times: dict[str, list[float]] = {name: [] for name in STATEMENTS}
    for _ in range(args.repeats):  # interleaved: a busy machine slows every statement alike
        for name, statement in STATEMENTS.items():
            times[name].append(once(statement))
    empty = statistics.median(times["python (nothing)"])
    medians = {name: statistics.median(values) - empty for name, values in times.items()}
    print(f"{'statement':<30} {'seconds':>8}")
    for name, value in medians.items():
        if name != "python (nothing)":
            print(f"{name:<30} {value:>8.2f}")
    ratio = medians["import lightning_determinism"] / medians["import lightning"]
    print(f"lightning_determinism / lightning: {ratio:.2f}x (budget <= 1.15x)")


if __name__ == "__main__":
    main()
