#!/usr/bin/env bash
# The kernel, core, cache, sequence, codebook and pre-RoPE tests under valgrind memcheck, on
# the portable and AVX2 backends. Valgrind does not decode AVX-512 and
# hides it from CPUID, so the tests' backend lists skip it there (the
# AVX-512 kernels are checked against the oracle by `cargo test`).
#   bash scripts/valgrind.sh          # every test of those binaries
#   bash scripts/valgrind.sh quick    # the kernel parity, codebook and pre-RoPE tests (CI)
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v valgrind >/dev/null; then
    echo "installing valgrind (apt)"
    sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get install -y valgrind >/dev/null 2>&1 ||
        { $sudo apt-get update >/dev/null && $sudo apt-get install -y valgrind >/dev/null; }
fi
valgrind --version
if [ "${1:-}" = quick ]; then
    tests=(kernels_backends codebook pre_rope)
else
    tests=(kernels_backends core cache sequences codebook pre_rope)
fi
args=()
for t in "${tests[@]}"; do args+=(--test "$t"); done
bins=$(cargo test --no-run "${args[@]}" 2>&1 | sed -n 's/.*Executable .*(\(.*\))$/\1/p')
status=0
log=$(mktemp)
for b in $bins; do
    echo "== valgrind $b"
    # Memory errors make valgrind exit 99; a failing test exits 101.
    set +e
    valgrind -q --error-exitcode=99 --leak-check=no "$b" --test-threads 2 >"$log" 2>&1
    s=$?
    set -e
    # The AVX-512 skips are expected here; everything else is shown.
    grep -v '^SKIPPED: backend avx512' "$log" | grep -E 'test result|FAILED|panicked|==[0-9]+==' || true
    [ "$s" = 0 ] || { echo "valgrind run failed: exit $s"; status=1; }
done
rm -f "$log"
exit $status
