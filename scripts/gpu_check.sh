#!/usr/bin/env bash
# Every CUDA-only check, for the day a GPU is lent (one device is enough; about 2 minutes on an H200):
#   1. the tests marked `gpu` (tests/helpers.requires_cuda: the CUDA tracker and generators, DTensor's CUDA tracker,
#      FSDP1 on one device, fingerprints of CUDA tensors, DDP vs FSDP baselines, batch-invariant evaluation on CUDA);
#   2. scripts/gpu_determinism.py: backends, two training runs bitwise under cuDNN/cuBLAS, a CUDA fit resumed
#      mid-epoch bitwise, NCCL all-reduce and the perplexity synced over NCCL.
# Exits non-zero when any of them failed. Without CUDA the tests skip and the script says there is nothing to check.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python="${PYTHON:-python3}"
"$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"

pytest_args=(-m gpu -q -rs tests)
# A machine with the test extra missing (pytest-rerunfailures) cannot parse pyproject.toml's addopts: drop them.
"$python" -c "import pytest_rerunfailures" 2>/dev/null || pytest_args+=(-o "addopts=--strict-markers -p no:cacheprovider")
rc=0
"$python" -m pytest "${pytest_args[@]}" || rc=1
"$python" scripts/gpu_determinism.py || rc=1
exit "$rc"
