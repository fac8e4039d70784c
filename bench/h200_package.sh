# Sourced by bench/run_on_h200.sh and bench/ncu_on_h200.sh on the lent H200 (repo root as cwd, $OUT set).
# The package is not installed there: /tmp/p/dsv4_cluster maps the repo-root folders as its subpackages, and
# /tmp/p/tests, /tmp/p/bench are the checkout-only top-level `tests` and `bench`.
# Leaves $repo at the repo root and the shell in /tmp: the repo root holds a dsv4_cluster/ folder without
# the mapped subpackages, which would shadow /tmp/p on sys.path.
: "${OUT:?OUT must name the folder whose files come back}"
repo=$PWD
mkdir -p /tmp/p/dsv4_cluster
for d in kernels orchestrator router workers deploy; do ln -sfn "$repo/$d" "/tmp/p/dsv4_cluster/$d"; done
for d in tests bench; do ln -sfn "$repo/$d" "/tmp/p/$d"; done
cp dsv4_cluster/*.py /tmp/p/dsv4_cluster/
cd /tmp
export PYTHONPATH=/tmp/p PYTHONUNBUFFERED=1
