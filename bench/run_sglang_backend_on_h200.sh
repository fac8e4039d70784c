#!/usr/bin/env bash
# On the lent H200 (repo root, $OUT set): SGLang 0.5.23's own DeepSeek-V4 decode backend, stock vs plugin.
# Needs the folder bench/sglang_backend_carry.py wrote, as $CARRY (site/ + wheels/). Nothing is pip-installed
# system-wide: the wheels go to /tmp/site, our package is mapped by h200_package.sh, and a dist-info with our
# entry point is written under /tmp/p so SGLang's load_plugins() finds it.
set -uo pipefail
: "${CARRY:?CARRY must name the folder bench/sglang_backend_carry.py wrote}"
carry=$(cd "$CARRY" && pwd)
source "$(dirname "$0")/h200_package.sh"  # sets $repo, cd /tmp, PYTHONPATH=/tmp/p
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$carry"/wheels/*.whl
mkdir -p /tmp/p/dsv4_cluster-0.0.dist-info
printf 'Metadata-Version: 2.1\nName: dsv4-cluster\nVersion: 0.0\n' > /tmp/p/dsv4_cluster-0.0.dist-info/METADATA
printf '[sglang.srt.plugins]\ndsv4_cluster = dsv4_cluster.kernels.sglang_plugin:register\n' \
  > /tmp/p/dsv4_cluster-0.0.dist-info/entry_points.txt
export PYTHONPATH=/tmp/p:/tmp/site:$carry/site
python3 -c 'import importlib.metadata as m, torch, flash_mla; print("sglang", m.version("sglang"), "torch", torch.__version__)' \
  2>&1 | tee "$OUT/env.txt"
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider --import-mode=importlib --rootdir="$repo" \
  "$repo"/tests/kernels/test_sglang_backend_gpu.py 2>&1 | tail -40 | tee "$OUT/tests.log"
for mode in stock plugin; do
  timeout "${MODE_TIMEOUT:-150}" python3 -m dsv4_cluster.bench.sglang_backend mode $mode "$OUT/bench" "$@" \
    > "$OUT/bench_$mode.log" 2>&1; echo "$mode rc=$?" | tee -a "$OUT/bench_rc.txt"; tail -25 "$OUT/bench_$mode.log"
done
python3 -m dsv4_cluster.bench.sglang_backend report "$OUT/bench" > "$OUT/report.log" 2>&1; tail -40 "$OUT/report.log"
cp "$repo"/bench/results/sglang_backend.* "$OUT/" 2>/dev/null
