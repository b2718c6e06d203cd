#!/usr/bin/env python3
"""Cross-check the Rust tokenizers (eval/src/tokenizer.rs) against
independent implementations, on the first N characters of the corpora.

--model smollm (default): SmolLM2's byte-level BPE against the Hugging Face
`tokenizers` package. The reference tokenizer is assembled from the GGUF's
own vocabulary and merges with the SmolLM2 pipeline:
Digits(individual_digits=True) -> ByteLevel(add_prefix_space=False,
use_regex=True) -> BPE, ByteLevel decoder.

--model gemma: Gemma 3's SentencePiece BPE against the `sentencepiece`
package. The reference is a real SentencePiece model (ModelProto) built
from the GGUF's pieces, scores and token types: model_type BPE,
byte_fallback, identity normalizer, no dummy prefix unless the GGUF asks
for one, no whitespace removal, spaces escaped to U+2581. The GGUF
converter stores user-defined pieces with their U+2581 turned into spaces
("pre-normalize user-defined spaces"); they are turned back here, which is
the form the original tokenizer.model has and the only one SentencePiece
can match (it looks for user-defined pieces in the escaped text).

Requires: pip install gguf tokenizers            (smollm)
          pip install gguf sentencepiece protobuf (gemma)
          (one-off; not project dependencies)
Usage:    scripts/check_tokenizer.py [--model smollm|gemma] [--chars 20000] [corpus ...]
          (--chars 0: the whole corpus)
Runs `cargo run --release --example tokenize` for the Rust side (set
CARGO_TARGET_DIR as you like). Exits non-zero on any mismatch.
"""

import argparse
import os
import subprocess
import sys

from gguf import GGUFReader

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.environ.get("KVQ_ASSETS", os.path.join(ROOT, "assets"))
MODELS = {
    "smollm": os.path.join(ASSETS, "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma": os.path.join(ASSETS, "gemma-3-270m-q4_k_m.gguf"),
}
CORPORA = {"austen": "austen.txt", "code": "python-stdlib.txt"}


def string_array(reader, key):
    f = reader.fields[key]
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


def scalar_array(reader, key):
    f = reader.fields[key]
    return [f.parts[i][0].item() for i in f.data]


def scalar(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.parts[f.data[0]][0].item()


class HfBpe:
    """SmolLM2's pipeline in Hugging Face `tokenizers`."""

    def __init__(self, path):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        r = GGUFReader(path)
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
        self.tok = tok
        self.name = "hf"

    def encode(self, text):
        return self.tok.encode(text).ids

    def decode(self, ids):
        return self.tok.decode(ids)


class SentencePieceBpe:
    """A SentencePiece BPE model rebuilt from a GGUF's "llama" vocabulary."""

    def __init__(self, path):
        from sentencepiece import SentencePieceProcessor
        from sentencepiece import sentencepiece_model_pb2 as pb

        r = GGUFReader(path)
        model = bytes(r.fields["tokenizer.ggml.model"].parts[-1]).decode()
        if model != "llama":
            sys.exit(f"{path}: tokenizer.ggml.model is {model!r}, not 'llama'")
        tokens = string_array(r, "tokenizer.ggml.tokens")
        scores = scalar_array(r, "tokenizer.ggml.scores")
        types = scalar_array(r, "tokenizer.ggml.token_type")
        unk = scalar(r, "tokenizer.ggml.unknown_token_id")
        kind = pb.ModelProto.SentencePiece.Type
        # GGUF token types (llama.cpp's llama_token_type) -> SentencePiece's.
        gguf_to_spm = {
            1: kind.NORMAL,
            2: kind.UNKNOWN,
            3: kind.CONTROL,
            4: kind.USER_DEFINED,
            5: kind.UNUSED,
            6: kind.BYTE,
        }
        m = pb.ModelProto()
        for i, (piece, score, ty) in enumerate(zip(tokens, scores, types, strict=True)):
            p = m.pieces.add()
            p.type = gguf_to_spm[ty]
            # SentencePiece needs exactly one UNKNOWN piece; the GGUF marks
            # <unk> as CONTROL and names it by id.
            if i == unk:
                p.type = kind.UNKNOWN
            if p.type == kind.USER_DEFINED:
                piece = piece.replace(" ", "\u2581")
            p.piece = piece
            p.score = score
        ts = m.trainer_spec
        ts.model_type = pb.TrainerSpec.BPE
        ts.byte_fallback = True
        ts.unk_id = unk
        ts.bos_id = scalar(r, "tokenizer.ggml.bos_token_id", -1)
        ts.eos_id = scalar(r, "tokenizer.ggml.eos_token_id", -1)
        ts.pad_id = scalar(r, "tokenizer.ggml.padding_token_id", -1)
        ns = m.normalizer_spec
        ns.name = "identity"
        ns.add_dummy_prefix = bool(scalar(r, "tokenizer.ggml.add_space_prefix", True))
        ns.remove_extra_whitespaces = False
        ns.escape_whitespaces = True
        self.sp = SentencePieceProcessor(model_proto=m.SerializeToString())
        self.name = "sentencepiece"

    def encode(self, text):
        return self.sp.encode(text)

    def decode(self, ids):
        return self.sp.decode(ids)


def rust_ids(model_path, corpus, chars):
    cmd = ["cargo", "run", "--quiet", "--release", "--example", "tokenize", "--",
           "--model", model_path, "--corpus", corpus]
    if chars:
        cmd += ["--chars", str(chars)]
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=list(MODELS), default="smollm")
    ap.add_argument("--chars", type=int, default=20000, help="0: the whole corpus")
    ap.add_argument("corpora", nargs="*", default=list(CORPORA))
    args = ap.parse_args()
    path = MODELS[args.model]
    ref = SentencePieceBpe(path) if args.model == "gemma" else HfBpe(path)
    failed = False
    for name in args.corpora:
        with open(os.path.join(ASSETS, CORPORA.get(name, name)), encoding="utf-8") as f:
            text = f.read()
        if args.chars:
            text = text[: args.chars]
        want = ref.encode(text)
        got = rust_ids(path, name, args.chars)
        if got == want:
            ok_rt = ref.decode(want) == text
            print(f"{name}: first {len(text)} chars -> {len(want)} tokens, ids identical"
                  f" ({ref.name} decode round trip: {'exact' if ok_rt else 'DIFFERS'})")
        else:
            failed = True
            i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            print(f"{name}: MISMATCH at token {i}: rust {got[i:i + 8]} vs {ref.name} {want[i:i + 8]}"
                  f" (lengths {len(got)} vs {len(want)})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
