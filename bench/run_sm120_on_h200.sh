#!/usr/bin/env bash
# On the lent H200 (repo root, $OUT set, SGLANG_SRC = SGLang 0.5.23's package folder from its wheel): the sm_90
# Gluon tests unforced (the plugin's sm_90 path unchanged), then the forced-sm_120 GPU tests and bench/sm120_decode.
set -uo pipefail
source "$(dirname "$0")/h200_package.sh"  # sets $repo, cd /tmp, PYTHONPATH
export TRITON_DEFAULT_FP_FUSION=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
run_tests() { timeout "$1" python3 -m pytest -q -x -p no:cacheprovider --import-mode=importlib --rootdir="$repo" "${@:2}"; }
run_tests "${SM90_TIMEOUT:-120}" "$repo"/tests/kernels/test_sparse_mla_decode_gluon.py -k "gpu and not trace" 2>&1 | tee "$OUT/sm90_tests.log"
sm90_rc=${PIPESTATUS[0]}
export DSV4_CLUSTER_GPU_CLASS=sm_120 DISABLE_MMA_V3=1
run_tests "${TEST_TIMEOUT:-150}" -s "$repo"/tests/kernels/test_sm120_path.py 2>&1 | tee "$OUT/sm120_tests.log"
tests_rc=${PIPESTATUS[0]}
timeout "${BENCH_TIMEOUT:-240}" python3 -m bench.sm120_decode "$OUT" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "sm90 rc=$sm90_rc sm120 tests rc=$tests_rc bench rc=$bench_rc"
