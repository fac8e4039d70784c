#!/usr/bin/env bash
# On the lent H200 (repo root, $OUT set): the SGLang-adapter GPU tests, then bench/sglang_decode.py.
# Usage: bash bench/run_sglang_on_h200.sh [batches, e.g. 1,8,64]. Logs, JSON and table land in $OUT.
set -uo pipefail
source "$(dirname "$0")/h200_package.sh"  # sets $repo, cd /tmp, PYTHONPATH
wheel=${FLASH_MLA_WHEEL:-$(ls "$repo"/.whl/sgl_flash_mla-*.whl 2>/dev/null | head -1)}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$wheel" && export PYTHONPATH=/tmp/p:/tmp/site
python3 -c 'import torch, triton, flash_mla; print("torch", torch.__version__, "triton", triton.__version__)' 2>&1 | tee "$OUT/env.txt"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider --import-mode=importlib --rootdir="$repo" \
  "$repo"/tests/kernels/test_sglang_adapters_gpu.py "$repo"/tests/kernels/test_launch_cache.py "$repo"/tests/kernels/test_sparse_mla_decode.py \
  "$repo"/tests/kernels/test_sparse_mla_decode_gluon.py "$repo"/tests/kernels/test_indexer.py "$repo"/tests/kernels/test_topk.py \
  ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tail -60 | tee "$OUT/tests.log"
timeout "${BENCH_TIMEOUT:-280}" python3 -m bench.kernels sglang_decode "$@" 2>&1 | tee "$OUT/bench.log"
cp "$repo"/bench/results/sglang_decode.* "$OUT/" 2>/dev/null
if [ -n "${NCU_CASE:-}" ]; then  # e.g. "c4 128": Nsight Compute on ours and FlashMLA at that case (--clock-control none)
  timeout "${NCU_TIMEOUT:-60}" ncu --clock-control none --kernel-name regex:'sparse|flash|mla' --launch-count 8 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
    --section LaunchStats --section SchedulerStats --export /tmp/ncu_sglang --force-overwrite \
    python3 -m bench.kernels sglang_decode --ncu $NCU_CASE > "$OUT/ncu_run.log" 2>&1
  ncu --import /tmp/ncu_sglang.ncu-rep --page details > "$OUT/ncu_details.txt" 2>&1
  grep -E "^  [a-zA-Z_]|Duration|DRAM Throughput|Memory Throughput|L2 Hit|L1/TEX Hit|Compute \(SM\) Throughput|Achieved Occupancy|Theoretical Occ|No Eligible|Issued Warp|Registers Per|Grid Size|Block Size|Dynamic Shared|Mem Busy|Max Bandwidth" "$OUT/ncu_details.txt" | head -90
fi
if [ -n "${HOST_PROFILE:-}" ]; then  # e.g. "c4 8 16": where the host time of one eager call goes
  timeout 40 python3 -m bench.host_profile $HOST_PROFILE 2>&1 | head -45 | tee "$OUT/host_profile.txt"
fi
