#!/usr/bin/env python3
"""Cross-check the Rust tokenizer (eval/src/tokenizer.rs) against the
Hugging Face `tokenizers` package.

The reference tokenizer is assembled from the GGUF's own vocabulary and
merges with the SmolLM2 pipeline: Digits(individual_digits=True) ->
ByteLevel(add_prefix_space=False, use_regex=True) -> BPE, ByteLevel decoder.

Requires: pip install gguf tokenizers   (one-off; not a project dependency)
Usage:    scripts/check_tokenizer.py [--chars 20000] [corpus ...]
Runs `cargo run --release --example tokenize` for the Rust side (set
CARGO_TARGET_DIR as you like). Exits non-zero on any mismatch.
"""

import argparse
import os
import subprocess
import sys

from gguf import GGUFReader
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.environ.get("KVQ_ASSETS", os.path.join(ROOT, "assets"))
MODEL = os.path.join(ASSETS, "SmolLM2-135M-Instruct.Q4_1.gguf")
CORPORA = {"austen": "austen.txt", "code": "python-stdlib.txt"}


def string_array(reader, key):
    f = reader.fields[key]
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


def reference_tokenizer():
    r = GGUFReader(MODEL)
    tokens = string_array(r, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in string_array(r, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def rust_ids(corpus, chars):
    cmd = ["cargo", "run", "--quiet", "--release", "--example", "tokenize", "--",
           "--corpus", corpus, "--chars", str(chars)]
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chars", type=int, default=20000)
    ap.add_argument("corpora", nargs="*", default=list(CORPORA))
    args = ap.parse_args()
    ref = reference_tokenizer()
    failed = False
    for name in args.corpora:
        with open(os.path.join(ASSETS, CORPORA.get(name, name)), encoding="utf-8") as f:
            text = f.read()[: args.chars]
        want = ref.encode(text).ids
        got = rust_ids(name, args.chars)
        if got == want:
            ok_rt = ref.decode(want) == text
            print(f"{name}: first {len(text)} chars -> {len(want)} tokens, ids identical"
                  f" (HF decode round trip: {'exact' if ok_rt else 'DIFFERS'})")
        else:
            failed = True
            i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            print(f"{name}: MISMATCH at token {i}: rust {got[i:i + 8]} vs hf {want[i:i + 8]}"
                  f" (lengths {len(got)} vs {len(want)})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
