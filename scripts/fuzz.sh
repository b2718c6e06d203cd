#!/usr/bin/env bash
# Every fuzz target of kvq-fuzz (fuzz/src/targets.rs) for ITERS executions
# each (default 10^6), in release. Findings (panics, hangs) are written to
# fuzz/artifacts/<target>/ and make the run exit non-zero; an allocation
# above 1 GiB aborts it.
#   bash scripts/fuzz.sh [ITERS] [SEED]
set -euo pipefail
cd "$(dirname "$0")/.."
iters=${1:-1000000}
seed=${2:-1}
# The allocator refuses single allocations above 1 GiB; cap the address
# space too, so a slow leak cannot take the machine down.
ulimit -v 8388608 2>/dev/null || true
cargo run --release -p kvq-fuzz -- all --iters "$iters" --seed "$seed"
