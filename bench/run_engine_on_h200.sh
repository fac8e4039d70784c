#!/usr/bin/env bash
# On the lent H200 (repo root as cwd, $OUT set): the CUDA engine's GPU tests, then bench/e2e_context_tax.py
# (or, with BENCH=kv_transfer, bench/kv_transfer.py in its place: SKIP_TESTS=1 SKIP_STEP=1 BENCH=kv_transfer
#  bash bench/run_engine_on_h200.sh --prefill-device cuda:0 --decode-device cuda:0 --pages fresh,churned,cache
#  --sizes 1024,8192,32768,131072 --repeats 30 (two GPUs: --decode-device cuda:1); a few minutes).
# Usage: bash bench/run_engine_on_h200.sh [the benchmark's args]. Logs, JSON and tables land in $OUT.
# The image has torch and Triton but not NIXL, FastAPI, pydantic or uvicorn: carry their cp312 wheels in .whl/
# (pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64
#  nixl-cu13 fastapi starlette pydantic pydantic_core uvicorn httptools orjson annotated-types
#  typing-inspection annotated-doc opentelemetry-api typing_extensions httpx httpcore h11 anyio idna certifi sniffio
#  prometheus_client click -d .whl; FastAPI 0.165 imports opentelemetry). The tree plus wheels must stay under
#  the device's 64 MiB: carry only the wheels (e.g. in an ignored .i17/.whl) and copy them into .whl/ there.
# Env: TEST_TIMEOUT, STEP_TIMEOUT, BENCH_TIMEOUT (s), PYTEST_K, SKIP_TESTS, SKIP_STEP, SKIP_BENCH, BENCH.
set -uo pipefail
source "$(dirname "$0")/h200_package.sh"  # sets $repo, cd /tmp, PYTHONPATH (the package, mapped)
if ls "$repo"/.whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$repo"/.whl/*.whl \
    && export PYTHONPATH=/tmp/p:/tmp/site
fi
# $OUT brings back at most 8 files: tests.log, bench.log (the GPU and versions first), the two benchmarks' .json and
# .md (decode_step: the engine alone, in one process; e2e_context_tax: through the router), ucx.txt (the UCX lines
# of every worker log: which transport carried the KV) and logs.tar.gz (every log). SKIP_STEP skips decode_step.
logs=/tmp/dsv4-logs; mkdir -p "$logs/tests" "$logs/bench"
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv
  python3 -c 'import torch, triton, nixl_cu13, fastapi; print("torch", torch.__version__, "triton", triton.__version__)'
} 2>&1 | tee "$OUT/bench.log"
tests_rc=0 bench_rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  DSV4_GPU_LOGS="$logs/tests" timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -x -s -p no:cacheprovider \
    --import-mode=importlib --rootdir="$repo" "$repo"/tests/test_cuda_engine.py "$repo"/tests/test_two_gpus.py "$repo"/tests/test_gpu_readback.py ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 \
    | tee "$OUT/tests.log"
  tests_rc=${PIPESTATUS[0]}
fi
if [ -z "${SKIP_STEP:-}" ]; then
  timeout "${STEP_TIMEOUT:-240}" python3 -m bench.decode_step --out "$OUT/decode_step" 2>&1 \
    | tee -a "$OUT/bench.log"
  bench_rc=${PIPESTATUS[0]}
fi
bench=${BENCH:-e2e_context_tax}
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout "${BENCH_TIMEOUT:-360}" python3 -m "bench.$bench" --out "$OUT/$bench" \
    --logs "$logs/bench" "$@" 2>&1 | tee -a "$OUT/bench.log"
  bench_rc=$(( bench_rc || PIPESTATUS[0] ))
fi
grep -r -h -i -E "ucx|cuda_ipc|cuda_copy|rma_put|proto" "$logs" | head -n 600 > "$OUT/ucx.txt"
tar -czf "$OUT/logs.tar.gz" -C "$logs" .
echo "tests rc=$tests_rc bench rc=$bench_rc"
exit $(( tests_rc || bench_rc ))
