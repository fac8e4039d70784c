#!/usr/bin/env bash
# On the lent H200 (repo root, $OUT set): SGLang 0.5.23's own DeepSeek-V4 decode backend, stock vs plugin.
# Needs the folder bench/sglang_backend_carry.py wrote, as $CARRY (site/ + wheels/); check it first on the CPU
# with bench/sglang_backend_import_check.py. Nothing is pip-installed system-wide: the wheels go to /tmp/site,
# our package is mapped by h200_package.sh, and a dist-info with our entry point is written under /tmp/p so
# SGLang's load_plugins() finds it. One bench process per mode (stock, then plugin; MODE_TIMEOUT each) over
# every context in CONTEXTS (default 128K, which holds the equality case the GPU test checks, then 8K and 1M),
# rows written as they come; then the report, then the GPU test on those two mode results (SGLANG_BACKEND_RUNS:
# no second SGLang import and JIT compile per mode). Extra arguments go to the bench (e.g. --reps 3
# --layer-ids 0,2,3 --batches 1,8,64). MODES (default "stock plugin") picks the modes.
set -uo pipefail
: "${CARRY:?CARRY must name the folder bench/sglang_backend_carry.py wrote}"
carry=$(cd "$CARRY" && pwd)
source "$(dirname "$0")/h200_package.sh"  # sets $repo, cd /tmp, PYTHONPATH=/tmp/p
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$carry"/wheels/*.whl
mkdir -p /tmp/p/dsv4_cluster-0.0.dist-info
printf 'Metadata-Version: 2.1\nName: dsv4-cluster\nVersion: 0.0\n' > /tmp/p/dsv4_cluster-0.0.dist-info/METADATA
printf '[sglang.srt.plugins]\ndsv4_cluster = dsv4_cluster.kernels.sglang_plugin:register\n' \
  > /tmp/p/dsv4_cluster-0.0.dist-info/entry_points.txt
export PYTHONPATH=/tmp/p:/tmp/site:$carry/site DSV4_CLUSTER_ATTEST_DIR=/tmp/attest
python3 -c 'import importlib.metadata as m, torch, flash_mla; print("sglang", m.version("sglang"), "torch", torch.__version__)' \
  2>&1 | tee "$OUT/bench.log"  # $OUT returns 8 files at most: logs go to bench.log and tests.log
contexts=${CONTEXTS:-131072,8192,1048576}
bench_dir=${BENCH_DIR:-/tmp/bench}  # the mode results; a second run in the same call wants its own
for mode in ${MODES:-stock plugin}; do
  timeout "${MODE_TIMEOUT:-120}" python3 -m bench.sglang_backend mode $mode $bench_dir \
    --contexts "$contexts" "$@" >> "$OUT/bench.log" 2>&1
  echo "$mode rc=$?" | tee -a "$OUT/bench.log"
  cp $bench_dir/$mode.json "$OUT/" 2>/dev/null
done
timeout 30 python3 -m bench.sglang_backend report $bench_dir >> "$OUT/bench.log" 2>&1
cp "$repo"/bench/results/sglang_backend.md "$repo"/bench/results/sglang_backend.json "$OUT/" 2>/dev/null
if [ "${SKIP_TEST:-0}" != 1 ]; then
  SGLANG_BACKEND_RUNS=$bench_dir timeout "${TEST_TIMEOUT:-120}" python3 -m pytest -q -x -p no:cacheprovider \
    --import-mode=importlib --rootdir="$repo" "$repo"/tests/kernels/test_sglang_backend_gpu.py > "$OUT/tests.log" 2>&1
  echo "gpu test rc=$?" | tee -a "$OUT/tests.log"; tail -15 "$OUT/tests.log"
fi
grep -v '^{' "$OUT/bench.log" | tail -60
