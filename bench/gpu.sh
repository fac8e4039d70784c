#!/usr/bin/env bash
# The GPU runner: one suite of GPU tests and benchmarks on a GPU machine, from the repo root, with $OUT the folder
# whose files come back. The package is not installed there: /tmp/p/dsv4_cluster maps the repo-root folders as its
# subpackages, /tmp/p/tests and /tmp/p/bench are the checkout-only `tests` and `bench`, and the shell runs in /tmp
# (the repo root's dsv4_cluster/ would shadow the mapping). Wheels the image lacks are installed into /tmp/site,
# never system-wide. Logs, JSON and tables land in $OUT.
#
#   bash bench/gpu.sh SUITE [the benchmark's arguments]
#
# sparse_decode    sparse-decode GPU tests, then `bench.kernels sparse_decode ARGS` (e.g. --batches 8,128);
#                  sgl-flash-mla's wheel from .whl/ when there (FlashMLA's row)
# indexer          indexer + top-k GPU tests, then `bench.kernels indexer_topk ARGS`; DeepGEMM's wheels from
#                  .whl_dg/ when there
# sglang_decode    SGLang-adapter GPU tests, then `bench.kernels sglang_decode ARGS` (batches, e.g. 1,8,64); needs
#                  sgl-flash-mla (FLASH_MLA_WHEEL or .whl/). NCU_CASE="c4 128": Nsight Compute of ours and FlashMLA
#                  there; HOST_PROFILE="c4 8 16": where one eager call's host time goes
# sglang_backend   SGLang 0.5.23's own DeepSeek-V4 decode backend, stock vs plugin: CARRY = the folder
#                  `python -m bench.sglang_backend_carry WHEEL_DIR CARRY` wrote (site/ + wheels/). One process per
#                  mode (MODES, default "stock plugin"; MODE_TIMEOUT each) over CONTEXTS (default 131072,8192,1048576),
#                  then the report, then the GPU test on those runs (SKIP_TEST=1 skips it); ARGS go to each mode
#                  (e.g. --reps 3 --layer-ids 0,2,3 --batches 1,8,64; MODES=plugin ... --then-each-kind)
# sm120            the sm_90 Gluon tests unforced, then the forced-sm_120 tests and `bench.kernels sm120_decode`
#                  (DSV4_CLUSTER_GPU_CLASS=sm_120 DISABLE_MMA_V3=1; SGLANG_SRC = SGLang's package folder;
#                  SM120_SECTIONS picks the tables, `sweep` the launch-config sweep)
# gpu_suite        every kernel GPU test, then the forced-sm_120 tests when CARRY names the SGLang carry (for its
#                  sm_120 sources); sgl-flash-mla from FLASH_MLA_WHEEL, .whl/ or $CARRY/wheels
# engine           the CUDA engine's GPU tests, `bench.decode_step`, then `bench.e2e_context_tax ARGS`; the image
#                  lacks NIXL, FastAPI, pydantic, uvicorn: carry their cp312 wheels in .whl/ (pip download --no-deps
#                  --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 nixl-cu13 fastapi
#                  starlette pydantic pydantic_core uvicorn httptools orjson annotated-types typing-inspection
#                  annotated-doc opentelemetry-api typing_extensions httpx httpcore h11 anyio idna certifi sniffio
#                  prometheus_client click -d .whl; tree + wheels under 64 MiB). SKIP_TESTS, SKIP_STEP, SKIP_BENCH
# kv_transfer      `bench.kv_transfer ARGS` with the engine's wheels, e.g. --prefill-device cuda:0 --decode-device
#                  cuda:0 --pages fresh,churned,cache --sizes 1024,8192,32768,131072 --repeats 30 (two GPUs:
#                  --decode-device cuda:1); UCX's transport lines in ucx.txt
# ncu              Nsight Compute of the sparse-decode kernels `sparse_decode --profile` runs, at the batch sizes
#                  given (default 128): text report + .ncu-rep
#
# Env: TEST_TIMEOUT, BENCH_TIMEOUT (s), PYTEST_K (a -k expression). Exit status: the tests' or the benchmark's.
set -uo pipefail
: "${OUT:?OUT must name the folder whose files come back}"
suite=${1:?usage: bash bench/gpu.sh SUITE [args]; see the header}; shift
suites="sparse_decode indexer sglang_decode sglang_backend sm120 gpu_suite engine kv_transfer ncu"
if [[ " $suites " != *" $suite "* ]]; then echo "unknown suite $suite: one of $suites (see the header)" >&2; exit 2; fi
carry=${CARRY:+$(cd "$CARRY" && pwd)}
repo=$PWD
mkdir -p /tmp/p/dsv4_cluster
for d in kernels orchestrator router workers deploy; do ln -sfn "$repo/$d" "/tmp/p/dsv4_cluster/$d"; done
for d in tests bench; do ln -sfn "$repo/$d" "/tmp/p/$d"; done
cp "$repo"/dsv4_cluster/*.py /tmp/p/dsv4_cluster/
cd /tmp
export PYTHONPATH=/tmp/p:/tmp/site PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1

wheels() { [ $# -gt 0 ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$@"; }
flash_mla_wheel() { echo "${FLASH_MLA_WHEEL:-$(ls "$repo"/.whl/sgl_flash_mla-*.whl ${carry:+"$carry"/wheels/sgl_flash_mla-*.whl} 2>/dev/null | head -1)}"; }
versions() {
  { nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv
    python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } 2>&1 | tee "$OUT/env.txt"
}
# A kernel whose partitions wait on each other hangs rather than fails when that goes wrong: every step is bounded.
tests() { timeout "${TEST_TIMEOUT:-$1}" python3 -m pytest -q -p no:cacheprovider --import-mode=importlib --rootdir="$repo" \
  "${@:2}" ${PYTEST_K:+-k "$PYTEST_K"}; }
bench() { timeout "${BENCH_TIMEOUT:-$1}" python3 -m "${@:2}"; }
kt=$repo/tests/kernels

case $suite in
sparse_decode|indexer|sglang_decode)
  wheels $(flash_mla_wheel) $(ls "$repo"/.whl_dg/*.whl 2>/dev/null)
  versions
  case $suite in
    sparse_decode) files=("$kt"/test_sparse_mla_decode*.py); name=sparse_decode ;;
    indexer) files=("$kt"/test_indexer.py "$kt"/test_topk.py); name=indexer_topk ;;
    sglang_decode) files=("$kt"/test_sglang_adapters_gpu.py "$kt"/test_launch_cache.py "$kt"/test_sparse_mla_decode.py
                          "$kt"/test_sparse_mla_decode_gluon.py "$kt"/test_indexer.py "$kt"/test_topk.py); name=sglang_decode ;;
  esac
  tests 240 -x "${files[@]}" 2>&1 | tail -80 | tee "$OUT/tests.log"; tests_rc=${PIPESTATUS[0]}
  bench 300 bench.kernels "$name" "$@" 2>&1 | tee "$OUT/bench.log"; bench_rc=${PIPESTATUS[0]}
  cp "$repo"/bench/results/"$name".* "$OUT/" 2>/dev/null
  if [ "$suite" = sglang_decode ] && [ -n "${NCU_CASE:-}" ]; then
    timeout 60 ncu --clock-control none --kernel-name regex:'sparse|flash|mla' --launch-count 8 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
      --section LaunchStats --section SchedulerStats --export /tmp/ncu_sglang --force-overwrite \
      python3 -m bench.kernels sglang_decode --ncu $NCU_CASE > "$OUT/ncu_run.log" 2>&1
    ncu --import /tmp/ncu_sglang.ncu-rep --page details > "$OUT/ncu_details.txt" 2>&1
  fi
  if [ "$suite" = sglang_decode ] && [ -n "${HOST_PROFILE:-}" ]; then
    timeout 40 python3 -m bench.kernels sglang_decode --host $HOST_PROFILE 2>&1 | head -45 | tee "$OUT/host_profile.txt"
  fi
  ;;
sglang_backend)
  : "${CARRY:?CARRY must name the folder bench/sglang_backend_carry.py wrote}"
  wheels "$carry"/wheels/*.whl
  # a dist-info with our entry point, so that SGLang's load_plugins() finds the plugin
  mkdir -p /tmp/p/dsv4_cluster-0.0.dist-info
  printf 'Metadata-Version: 2.1\nName: dsv4-cluster\nVersion: 0.0\n' > /tmp/p/dsv4_cluster-0.0.dist-info/METADATA
  printf '[sglang.srt.plugins]\ndsv4_cluster = dsv4_cluster.kernels.sglang_plugin:register\n' \
    > /tmp/p/dsv4_cluster-0.0.dist-info/entry_points.txt
  export PYTHONPATH=$PYTHONPATH:$carry/site DSV4_CLUSTER_ATTEST_DIR=/tmp/attest
  python3 -c 'import importlib.metadata as m, torch, flash_mla; print("sglang", m.version("sglang"), "torch", torch.__version__)' \
    2>&1 | tee "$OUT/bench.log"
  runs=${BENCH_DIR:-/tmp/bench}; bench_rc=0
  for mode in ${MODES:-stock plugin}; do
    timeout "${MODE_TIMEOUT:-120}" python3 -m bench.sglang_backend mode "$mode" "$runs" \
      --contexts "${CONTEXTS:-131072,8192,1048576}" "$@" >> "$OUT/bench.log" 2>&1
    rc=$?; echo "$mode rc=$rc" | tee -a "$OUT/bench.log"; bench_rc=$(( bench_rc || rc ))
    cp "$runs/$mode.json" "$OUT/" 2>/dev/null
  done
  timeout 30 python3 -m bench.sglang_backend report "$runs" >> "$OUT/bench.log" 2>&1
  cp "$repo"/bench/results/sglang_backend.md "$repo"/bench/results/sglang_backend.json "$OUT/" 2>/dev/null
  tests_rc=0
  if [ "${SKIP_TEST:-0}" != 1 ]; then
    SGLANG_BACKEND_RUNS=$runs tests 120 -x "$kt"/test_sglang_backend_gpu.py > "$OUT/tests.log" 2>&1; tests_rc=$?
    tail -15 "$OUT/tests.log"
  fi
  grep -v '^{' "$OUT/bench.log" | tail -60
  ;;
sm120|gpu_suite)
  wheels $(flash_mla_wheel) ${carry:+$(ls "$carry"/wheels/*.whl 2>/dev/null)}
  export PYTHONPATH=$PYTHONPATH${carry:+:$carry/site}
  versions
  if [ "$suite" = sm120 ]; then
    tests 120 -x "$kt"/test_sparse_mla_decode_gluon.py -k "gpu and not trace" 2>&1 | tee "$OUT/sm90_tests.log"
  else
    tests 300 "$kt" --ignore="$kt"/test_sm120_path.py --ignore="$kt"/test_sglang_backend_gpu.py 2>&1 | tail -80 > "$OUT/tests.log"
  fi
  tests_rc=${PIPESTATUS[0]}; bench_rc=0
  if [ "$suite" = sm120 ] || [ -n "$carry" ]; then
    DSV4_CLUSTER_GPU_CLASS=sm_120 DISABLE_MMA_V3=1 tests 150 -x -s "$kt"/test_sm120_path.py 2>&1 | tail -40 | tee "$OUT/sm120_tests.log"
    tests_rc=$(( tests_rc || PIPESTATUS[0] ))
  fi
  if [ "$suite" = sm120 ]; then
    SM120_SECTIONS=${SM120_SECTIONS:-prefill_rows,decode,indexer,backends} DSV4_CLUSTER_GPU_CLASS=sm_120 DISABLE_MMA_V3=1 bench 360 bench.kernels sm120_decode "$OUT" 2>&1 | tee "$OUT/bench.log"
    bench_rc=${PIPESTATUS[0]}
  fi
  ;;
engine|kv_transfer)
  wheels "$repo"/.whl/*.whl
  logs=/tmp/dsv4-logs; mkdir -p "$logs/tests" "$logs/bench"
  versions; python3 -c 'import nixl_cu13, fastapi' 2>&1 | tee -a "$OUT/env.txt"
  tests_rc=0 bench_rc=0
  if [ "$suite" = engine ] && [ -z "${SKIP_TESTS:-}" ]; then
    DSV4_GPU_LOGS="$logs/tests" tests 300 -x -s "$repo"/tests/workers/test_cuda_engine.py "$repo"/tests/workers/test_two_gpus.py \
      "$repo"/tests/orchestrator/test_gpu_readback.py 2>&1 | tee "$OUT/tests.log"; tests_rc=${PIPESTATUS[0]}
  fi
  if [ "$suite" = engine ] && [ -z "${SKIP_STEP:-}" ]; then
    bench 240 bench.decode_step --out "$OUT/decode_step" 2>&1 | tee -a "$OUT/bench.log"; bench_rc=${PIPESTATUS[0]}
  fi
  name=$([ "$suite" = engine ] && echo e2e_context_tax || echo kv_transfer)
  if [ -z "${SKIP_BENCH:-}" ]; then
    bench 360 "bench.$name" --out "$OUT/$name" --logs "$logs/bench" "$@" 2>&1 | tee -a "$OUT/bench.log"
    bench_rc=$(( bench_rc || PIPESTATUS[0] ))
  fi
  grep -r -h -i -E "ucx|cuda_ipc|cuda_copy|rma_put|proto" "$logs" | head -n 600 > "$OUT/ucx.txt"
  tar -czf "$OUT/logs.tar.gz" -C "$logs" .
  ;;
ncu)
  # per batch size the profile mode runs bf16 then fp8, three times each: skip the first pair (compiles)
  timeout 400 ncu --clock-control none --kernel-name regex:sparse_decode --launch-skip 2 --launch-count 2 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
    --section LaunchStats --section MemoryWorkloadAnalysis --export "$OUT/ncu_sparse_decode" --force-overwrite \
    python3 -m bench.kernels sparse_decode --profile --batches "${1:-128}" > "$OUT/ncu_run.log" 2>&1
  bench_rc=$? tests_rc=0
  ncu --import "$OUT/ncu_sparse_decode.ncu-rep" --page details > "$OUT/ncu_details.txt" 2>&1
  ;;
esac
if [ -f "$OUT/ncu_details.txt" ]; then
  grep -E "^  [a-zA-Z_]|Duration|DRAM Throughput|Memory Throughput|L2 Hit|Compute \(SM\) Throughput|Achieved Occupancy|No Eligible|Issued Warp|Registers Per|Dynamic Shared" \
    "$OUT/ncu_details.txt" | head -90
fi
echo "$suite: tests rc=$tests_rc bench rc=$bench_rc"
exit $(( tests_rc || bench_rc ))
