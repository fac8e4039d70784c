#!/usr/bin/env bash
# Indexer + top-k on the lent H200: GPU tests, then the benchmark; logs and JSON under $OUT.
# The package is not installed there: links inside this copy's dsv4_cluster/ make the repo-root
# folders its subpackages (the repo root is first on sys.path for pytest and `python -m`, which also finds the
# top-level `tests` and `bench` there).
set -o pipefail
for d in kernels; do ln -sfn "$PWD/$d" "dsv4_cluster/$d"; done
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)'
# A kernel whose programs wait for each other hangs rather than fails when that goes wrong: bound it.
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_indexer.py tests/kernels/test_topk.py 2>&1 \
  | tee "$OUT/pytest.log"
if ls .whl_dg/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dg .whl_dg/*.whl && export PYTHONPATH="$PWD:/tmp/dg"
fi
timeout 330 python3 -m bench.kernels indexer_topk "$@" 2>&1 | tee "$OUT/bench.log"
cp bench/results/indexer_topk.json bench/results/indexer_topk.md "$OUT/"
