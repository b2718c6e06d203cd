#!/usr/bin/env python3
"""Independent numpy forward pass of the GGUF model, compared with the logits
written by `cargo run --release --example dump_logits`.

The GGUF file is read with the `gguf` PyPI package (its own dequantizers);
the transformer (RMSNorm, adjacent-pair RoPE as required by GGUF llama Q/K
weights, GQA, SwiGLU, tied output head) is written here from scratch in
float64. Only the token ids are taken from the Rust dump.

Requires: pip install numpy gguf   (one-off; not a project dependency)
Usage:    scripts/crosscheck.py [results/logits.bin] [--rope halves]
`--rope halves` runs the (wrong, for llama GGUF) rotate-half variant to show
that the RoPE convention matters.
"""

import argparse
import os
import struct
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.environ.get("KVQ_ASSETS", os.path.join(ROOT, "assets"))
MODEL = os.path.join(ASSETS, "SmolLM2-135M-Instruct.Q4_1.gguf")


def read_dump(path):
    with open(path, "rb") as f:
        if f.read(8) != b"KVQLOG01":
            raise SystemExit(f"{path}: bad magic")
        n, vocab = struct.unpack("<II", f.read(8))
        tokens = np.frombuffer(f.read(4 * n), dtype="<u4").astype(np.int64)
        logits = np.frombuffer(f.read(4 * n * vocab), dtype="<f4").reshape(n, vocab)
    return tokens, logits


class Weights:
    def __init__(self, path):
        self.r = GGUFReader(path)
        self.t = {t.name: t for t in self.r.tensors}

    def field(self, key):
        return self.r.fields[key].contents()

    def get(self, name):
        t = self.t[name]
        w = dequantize(t.data, t.tensor_type)
        # gguf lists dims fastest-first; numpy wants (rows, cols).
        shape = tuple(int(d) for d in reversed(t.shape))
        return np.asarray(w, dtype=np.float64).reshape(shape)


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, pos, base, style):
    # x: [n, heads, hd]
    hd = x.shape[-1]
    inv = base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)  # [hd/2]
    ang = pos[:, None] * inv[None, :]  # [n, hd/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    if style == "adjacent":
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., : hd // 2], x[..., hd // 2 :]
    ra, rb = a * cos - b * sin, a * sin + b * cos
    out = np.empty_like(x)
    if style == "adjacent":
        out[..., 0::2], out[..., 1::2] = ra, rb
    else:
        out[..., : hd // 2], out[..., hd // 2 :] = ra, rb
    return out


def forward(W, tokens, style):
    arch = W.field("general.architecture")
    cfg = lambda k: W.field(f"{arch}.{k}")  # noqa: E731
    n_layers, d = cfg("block_count"), cfg("embedding_length")
    nh, nkv = cfg("attention.head_count"), cfg("attention.head_count_kv")
    hd = d // nh
    eps, base = cfg("attention.layer_norm_rms_epsilon"), cfg("rope.freq_base")
    emb = W.get("token_embd.weight")
    x = emb[tokens]
    n = len(tokens)
    pos = np.arange(n, dtype=np.float64)
    mask = np.triu(np.full((n, n), -np.inf), k=1)
    for l in range(n_layers):
        p = lambda s: W.get(f"blk.{l}.{s}.weight")  # noqa: E731
        h = rms_norm(x, p("attn_norm"), eps)
        q = (h @ p("attn_q").T).reshape(n, nh, hd)
        k = (h @ p("attn_k").T).reshape(n, nkv, hd)
        v = (h @ p("attn_v").T).reshape(n, nkv, hd)
        q, k = rope(q, pos, base, style), rope(k, pos, base, style)
        rep = nh // nkv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        s /= s.sum(axis=-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", s, v).reshape(n, nh * hd)
        x = x + o @ p("attn_output").T
        h = rms_norm(x, p("ffn_norm"), eps)
        g, u = h @ p("ffn_gate").T, h @ p("ffn_up").T
        x = x + (g / (1 + np.exp(-g)) * u) @ p("ffn_down").T
    x = rms_norm(x, W.get("output_norm.weight"), eps)
    head = W.get("output.weight") if "output.weight" in W.t else emb
    return x @ head.T


def mean_nll(logits, tokens):
    lg = logits[:-1].astype(np.float64)
    m = lg.max(axis=1, keepdims=True)
    lse = np.log(np.exp(lg - m).sum(axis=1)) + m[:, 0]
    return float(np.mean(lse - lg[np.arange(len(lg)), tokens[1:]]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dump", nargs="?", default=os.path.join(ROOT, "results", "logits.bin"))
    ap.add_argument("--rope", choices=["adjacent", "halves"], default="adjacent")
    args = ap.parse_args()
    tokens, rust = read_dump(args.dump)
    ref = forward(Weights(MODEL), tokens, args.rope)
    diff = np.abs(rust - ref)
    row_rel = np.linalg.norm(rust - ref, axis=1) / np.linalg.norm(ref, axis=1)
    max_rel = diff.max() / np.abs(ref).max()
    argmax_agree = float(np.mean(rust.argmax(1) == ref.argmax(1)))
    print(f"tokens: {len(tokens)}, vocab: {ref.shape[1]}, rope: {args.rope}")
    print(f"max |rust - numpy|            = {diff.max():.3e}  (max |logit| {np.abs(ref).max():.2f})")
    print(f"max abs diff / max |logit|    = {max_rel:.3e}")
    print(f"max per-position rel L2 error = {row_rel.max():.3e}  (mean {row_rel.mean():.3e})")
    print(f"argmax agreement              = {argmax_agree:.4f}")
    print(f"mean NLL rust {mean_nll(rust, tokens):.6f}  numpy {mean_nll(ref, tokens):.6f}")
    ok = max_rel < 1e-3 and row_rel.max() < 1e-3
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
