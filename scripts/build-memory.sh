#!/usr/bin/env bash
# Compile the library from scratch (dev profile, what `cargo test` builds)
# and fail if rustc's peak resident memory exceeds the budget.
#
#   bash scripts/build-memory.sh [BUDGET_MB]     (default 4096)
#
# The generic SIMD kernels expand into large bodies before
# monomorphization, and rustc's MIR passes need memory that grows with the
# square of a body's size: a careless unrolled loop once took this build
# to 24 GB and out of memory on a 2-core CI machine while it measures
# about 1.2 GB. The budget keeps that from creeping back unnoticed.
set -euo pipefail
cd "$(dirname "$0")/.."
budget_mb=${1:-4096}

if [ ! -x /usr/bin/time ]; then
    echo "build-memory: installing GNU time (apt-get install time)"
    apt-get install -y time >/dev/null 2>&1 || { apt-get update >/dev/null && apt-get install -y time >/dev/null; }
fi

# kvq's own dependencies (half, ndarray, bytemuck, thiserror) compile in
# well under the budget, so they may build inside the measurement.
cargo clean -p kvq --quiet
log=$(mktemp)
trap 'rm -f "$log"' EXIT
start=$(date +%s)
/usr/bin/time -f '%M' -o "$log" cargo build --lib -p kvq --quiet
secs=$(($(date +%s) - start))
peak_kb=$(tail -n 1 "$log")
peak_mb=$((peak_kb / 1024))
echo "build-memory: cargo build --lib -p kvq (kvq from scratch) took ${secs} s, peak ${peak_mb} MB (budget ${budget_mb} MB)"
if [ "$peak_mb" -gt "$budget_mb" ]; then
    echo "build-memory: over budget; see docs/perf/records/2026-12-05-zen5-build.md for how to find the body responsible" >&2
    exit 1
fi
