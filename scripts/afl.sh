#!/usr/bin/env bash
# Coverage-guided fuzzing of kvq-fuzz's targets under AFL++ (cargo-afl,
# stable Rust): EXECS executions per target (default 10^6), one target
# after another on one core. The harness is fuzz/afl/ (its own workspace);
# the seeds are fuzz/corpus/<target>/; the output is fuzz/afl/out/<target>/
# (queue/, crashes/, hangs/, fuzzer_stats; the previous run's output is
# kept as fuzz/afl/out/<target>.prev/). Prints per target the executions,
# the queue size and the saved crashes and hangs, and exits non-zero if
# any crash or hang was saved.
#   bash scripts/afl.sh [EXECS] [TARGETS...]
# Environment: KVQ_AFL_TIMEOUT_MS (1000: a slower call is a hang),
# KVQ_AFL_MEM_MB (8192: the target's address-space limit),
# KVQ_AFL_MAX_SECONDS (7200: a cap on each target's fuzzing time).
set -euo pipefail
cd "$(dirname "$0")/.."

CARGO_AFL_VERSION=0.18.2
all_targets=(block load config ops gguf)
execs=${1:-1000000}
shift $(($# > 0 ? 1 : 0))
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=("${all_targets[@]}")
for t in "${targets[@]}"; do
    case " ${all_targets[*]} " in
    *" $t "*) ;;
    *) echo "unknown target $t; one of ${all_targets[*]}" >&2; exit 2 ;;
    esac
done
timeout_ms=${KVQ_AFL_TIMEOUT_MS:-1000}
mem_mb=${KVQ_AFL_MEM_MB:-8192}
max_seconds=${KVQ_AFL_MAX_SECONDS:-7200}

# cargo-afl, pinned; AFL++ itself (built without LLVM plugins, which need
# nightly).
version() { cargo afl --version 2>/dev/null || true; }
if [[ "$(version)" != "cargo-afl $CARGO_AFL_VERSION"* ]]; then
    cargo install --locked cargo-afl --version "$CARGO_AFL_VERSION"
fi
if [[ "$(version)" != *"AFL++ version"* ]]; then
    cargo afl config --build || cargo afl config --build --force
fi

# afl-fuzz runs without a terminal; no cpufreq governor to check in a VM or
# container; a core_pattern that pipes core dumps to a helper delays crash
# reports, which AFL++ refuses unless told it is fine.
export AFL_NO_UI=1 AFL_SKIP_CPUFREQ=1
if [[ "$(cat /proc/sys/kernel/core_pattern 2>/dev/null)" == "|"* ]]; then
    export AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1
fi

(cd fuzz/afl && cargo afl build --release)

# -E (stop after EXECS executions) where afl-fuzz has it, else -V alone.
if [[ "$(cargo afl fuzz -h 2>&1 || true)" == *"-E execs"* ]]; then
    stop=(-E "$execs" -V "$max_seconds")
else
    echo "afl-fuzz has no -E; stopping each target after $max_seconds s" >&2
    stop=(-V "$max_seconds")
fi

stat() { sed -n "s/^$1 *: *//p" "$2"; }

mkdir -p fuzz/afl/out
found=0
for t in "${targets[@]}"; do
    out=fuzz/afl/out/$t
    if [ -e "$out" ]; then
        rm -rf "$out.prev"
        mv "$out" "$out.prev"
    fi
    log=$out.log
    echo "== $t: afl-fuzz, log $log"
    start=$(date +%s)
    if ! cargo afl fuzz -i "fuzz/corpus/$t" -o "$out" "${stop[@]}" \
        -t "$timeout_ms" -m "$mem_mb" "fuzz/afl/target/release/$t" >"$log" 2>&1; then
        tail -n 30 "$log" >&2
        echo "$t: afl-fuzz failed (log $log)" >&2
        exit 1
    fi
    wall=$(($(date +%s) - start))
    s=$out/default/fuzzer_stats
    done_=$(stat execs_done "$s")
    run=$(stat run_time "$s")
    crashes=$(stat saved_crashes "$s")
    hangs=$(stat saved_hangs "$s")
    printf '%-7s %10s execs  %5s s fuzzing (%s s wall)  %6s execs/s  queue %5s  stability %s  %s crashes  %s hangs\n' \
        "$t" "$done_" "$run" "$wall" "$(stat execs_per_sec "$s" | cut -d. -f1)" \
        "$(stat corpus_count "$s")" "$(stat stability "$s")" "$crashes" "$hangs"
    if [ "$crashes" != 0 ] || [ "$hangs" != 0 ]; then
        echo "$t: findings in $out/default/crashes/ and $out/default/hangs/;" \
            "replay: cargo run --release -p kvq-fuzz -- replay $t <file>" >&2
        found=1
    fi
done
exit "$found"
