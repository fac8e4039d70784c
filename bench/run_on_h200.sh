#!/usr/bin/env bash
# On the lent H200 (repo root, $OUT set): the sparse-decode GPU tests, then its benchmark.
# Usage: bash bench/run_on_h200.sh [benchmark args, e.g. --sweep]. Logs and JSON land in $OUT.
# Env: TEST_TIMEOUT, BENCH_TIMEOUT (s), PYTEST_K (a -k expression), PYTEST_ARGS.
set -uo pipefail
source "$(dirname "$0")/h200_package.sh"  # sets $repo, cd /tmp, PYTHONPATH
export TRITON_DEFAULT_FP_FUSION=1
wheel=$(ls "$repo"/.whl/sgl_flash_mla-*.whl 2>/dev/null | head -1)
if [ -n "$wheel" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheel" \
    && export PYTHONPATH=/tmp/p:/tmp/site
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
# A kernel whose partitions wait on each other hangs rather than fails when that goes wrong: bound it.
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -x -p no:cacheprovider --import-mode=importlib --rootdir="$repo" \
  "$repo"/tests/kernels/test_sparse_mla_decode*.py ${PYTEST_K:+-k "$PYTEST_K"} ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/tests.log"
tests_rc=${PIPESTATUS[0]}
timeout "${BENCH_TIMEOUT:-300}" python3 -m bench.kernels sparse_decode "$@" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
cp "$repo"/bench/results/sparse_decode.* "$OUT/" 2>/dev/null
echo "tests rc=$tests_rc bench rc=$bench_rc"
exit $(( tests_rc || bench_rc ))
