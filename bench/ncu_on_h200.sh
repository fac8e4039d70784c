#!/usr/bin/env bash
# Nsight Compute on the lent H200: the sparse-decode kernels that `sparse_decode --profile` runs (the
# default backend: Gluon on sm_90), at the batch sizes given (default 128). Text report + .ncu-rep in $OUT.
# Usage: bash bench/ncu_on_h200.sh [batches, e.g. 8,128]
set -uo pipefail
source "$(dirname "$0")/h200_package.sh"  # sets $repo, cd /tmp, PYTHONPATH
# Per batch size the profile mode runs bf16 then fp8, three times each: skip the first pair (compiles).
timeout 400 ncu --clock-control none --kernel-name regex:sparse_decode --launch-skip 2 --launch-count 2 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
  --section LaunchStats --section MemoryWorkloadAnalysis \
  --export "$OUT/ncu_sparse_decode" --force-overwrite \
  python3 -m bench.kernels sparse_decode --profile --batches "${1:-128}" > "$OUT/ncu_run.log" 2>&1
rc=$?
ncu --import "$OUT/ncu_sparse_decode.ncu-rep" --page details > "$OUT/ncu_details.txt" 2>&1
tail -5 "$OUT/ncu_run.log"
grep -E "^  [a-z_]+sparse|Duration|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|No Eligible|Issued Warp|Stall|Registers Per|Shared Memory Configuration Size|Dynamic Shared" "$OUT/ncu_details.txt" | head -60
exit $rc
