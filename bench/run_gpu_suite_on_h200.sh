#!/usr/bin/env bash
# On the lent H200 (repo root, $OUT set): every test of the kernels (tests/kernels, GPU and host side: sparse decode
# Triton + Gluon, the SGLang adapters against FlashMLA, indexer, top-k, fast_launch / launch plans), then the
# forced-sm_120 tests (DSV4_CLUSTER_GPU_CLASS=sm_120) against SGLang's own sm_120 kernels. SGLang's own backend
# (tests/kernels/test_sglang_backend_gpu.py) runs in bench/run_sglang_backend_on_h200.sh, which installs our entry point.
# Needs sgl-flash-mla's wheel (FLASH_MLA_WHEEL, or .whl/, or among $CARRY/wheels) and, for the sm_120 tests,
# SGLang's files: CARRY = the folder bench/sglang_backend_carry.py wrote (its site/ on the path, its wheels installed).
# Env: TEST_TIMEOUT, SM120_TIMEOUT (s), PYTEST_K.
set -uo pipefail
carry=${CARRY:+$(cd "$CARRY" && pwd)}
source "$(dirname "$0")/h200_package.sh"  # sets $repo, cd /tmp, PYTHONPATH
wheel=${FLASH_MLA_WHEEL:-$(ls "$repo"/.whl/sgl_flash_mla-*.whl 2>/dev/null | head -1)}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ${wheel:+"$wheel"} ${carry:+"$carry"/wheels/*.whl}
export PYTHONPATH=/tmp/p:/tmp/site${carry:+:$carry/site} TRITON_DEFAULT_FP_FUSION=1
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, triton, flash_mla; print("torch", torch.__version__, "triton", triton.__version__)'
} 2>&1 | tee "$OUT/env.txt"
run_tests() { timeout "$1" python3 -m pytest -q -p no:cacheprovider --import-mode=importlib --rootdir="$repo" "${@:2}"; }
run_tests "${TEST_TIMEOUT:-300}" "$repo"/tests/kernels --ignore="$repo"/tests/kernels/test_sm120_path.py \
  --ignore="$repo"/tests/kernels/test_sglang_backend_gpu.py ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tail -80 > "$OUT/tests.log"
gpu_rc=${PIPESTATUS[0]}
sm120_rc=skipped
if [ -n "$carry" ]; then
  DSV4_CLUSTER_GPU_CLASS=sm_120 DISABLE_MMA_V3=1 run_tests "${SM120_TIMEOUT:-150}" "$repo"/tests/kernels/test_sm120_path.py \
    2>&1 | tail -40 > "$OUT/sm120_tests.log"
  sm120_rc=${PIPESTATUS[0]}
fi
echo "gpu tests rc=$gpu_rc sm120 tests rc=$sm120_rc"; tail -3 "$OUT/tests.log"; tail -3 "$OUT"/sm120_tests.log 2>/dev/null
