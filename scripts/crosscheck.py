#!/usr/bin/env python3
"""Independent numpy forward pass of a GGUF model, compared with the logits
written by `cargo run --release --example dump_logits`, or run on its own.

The GGUF file is read with the `gguf` PyPI package (its own dequantizers);
the transformer is written here from scratch in float64. Only the token ids
are taken from the Rust dump. Two architectures, picked from the GGUF's
`general.architecture` (override with --arch):

* llama (SmolLM2): RMSNorm, adjacent-pair RoPE as required by GGUF llama Q/K
  weights, GQA, SwiGLU, tied output head.
* gemma3 (Gemma 3 270M), as llama.cpp's src/models/gemma3.cpp and HF's
  modeling_gemma3.py: x = embd * sqrt(d_model); per block pre-norm, Q/K/V,
  per-head RMSNorm of Q and K (GGUF norm weights already hold Gemma's +1),
  NEOX (rotate-half) RoPE with base rope.freq_base (1e6) on global layers and
  10000 on sliding ones, sliding layers il % 6 < 5 (global 5, 11, 17),
  scale 1/sqrt(head_dim), causal mask and on sliding layers only keys with
  i - j < sliding_window (512), post-attention RMSNorm, residual, pre-FFN
  norm, down(gelu_tanh(gate) * up), post-FFN RMSNorm, residual; final norm,
  tied token embedding as the head, no logit soft-capping.

Requires: pip install numpy gguf   (+ sentencepiece protobuf for --text)
Usage:
  scripts/crosscheck.py [DUMP] [--model NAME|PATH] [--rope adjacent|halves]
      Compare with a Rust dump (default results/logits.bin). The model
      defaults by the dump's vocabulary size (49152 smollm2, 262144 gemma3).
  scripts/crosscheck.py --model gemma3 --text "The capital of France is"
  scripts/crosscheck.py --model gemma3 --text-file assets/austen.txt \\
      --tokens 700 --window-effect
  scripts/crosscheck.py --model gemma3 --ids 2,818,5279,529,7001,563
      Standalone (model default gemma3): top-5 next tokens at the last
      positions and the perplexity over the ids.
      --ids takes a comma/space separated list or @FILE; --text/--text-file
      tokenize with a SentencePiece model built from the GGUF vocabulary and
      prepend BOS (gemma3 only). --window N overrides the sliding window
      (0: no window mask; sliding layers keep RoPE base 1e4); --window-effect
      reruns with the window ignored and prints how much the logits move.
`--rope` swaps the RoPE pairing (default: the right one for the arch) to
show that the convention matters; `--embed-scale bf16` uses HF's
bf16-rounded sqrt(d_model) (25.25 for 640) instead of llama.cpp's f32 one.
"""

import argparse
import math
import os
import struct
import sys
import time

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.environ.get("KVQ_ASSETS", os.path.join(ROOT, "assets"))
MODELS = {
    "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3": "gemma-3-270m-q4_k_m.gguf",
}
VOCAB_TO_MODEL = {49152: "smollm2", 262144: "gemma3"}


def model_path(name):
    if name in MODELS:
        return os.path.join(ASSETS, MODELS[name])
    return name


def read_dump(path):
    with open(path, "rb") as f:
        if f.read(8) != b"KVQLOG01":
            raise SystemExit(f"{path}: bad magic")
        n, vocab = struct.unpack("<II", f.read(8))
        tokens = np.frombuffer(f.read(4 * n), dtype="<u4").astype(np.int64)
        logits = np.frombuffer(f.read(4 * n * vocab), dtype="<f4").reshape(n, vocab)
    return tokens, logits


def write_dump(path, tokens, logits):
    with open(path, "wb") as f:
        f.write(b"KVQLOG01")
        f.write(struct.pack("<II", len(tokens), logits.shape[1]))
        f.write(np.asarray(tokens, dtype="<u4").tobytes())
        f.write(np.asarray(logits, dtype="<f4").tobytes())


class Weights:
    def __init__(self, path):
        self.r = GGUFReader(path)
        self.t = {t.name: t for t in self.r.tensors}
        self.cache = {}
        self.arch = self.field("general.architecture")

    def field(self, key, default=None):
        if key not in self.r.fields:
            if default is not None:
                return default
            raise KeyError(key)
        return self.r.fields[key].contents()

    def cfg(self, key, default=None):
        return self.field(f"{self.arch}.{key}", default)

    def get(self, name):
        if name not in self.cache:
            t = self.t[name]
            w = dequantize(t.data, t.tensor_type)
            # gguf lists dims fastest-first; numpy wants (rows, cols).
            shape = tuple(int(d) for d in reversed(t.shape))
            self.cache[name] = np.asarray(w, dtype=np.float64).reshape(shape)
        return self.cache[name]

    def tokens(self):
        f = self.r.fields["tokenizer.ggml.tokens"]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


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


def attention(q, k, v, scale, mask):
    # q: [n, nh, hd], k/v: [n, nkv, hd]; GQA by repeating K/V heads.
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) * scale + mask
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    s /= s.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", s, v).reshape(q.shape[0], -1)


def causal_mask(n, window=0):
    """0 where query i may see key j, -inf elsewhere: j <= i and, with a
    window, i - j < window (llama.cpp is_masked_swa STANDARD masks
    p1 - p0 >= n_swa; HF sliding_window_overlay keeps kv > q - window)."""
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    ok = j <= i
    if window > 0:
        ok &= (i - j) < window
    return np.where(ok, 0.0, -np.inf)


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def forward_llama(W, tokens, opts):
    style = opts.rope or "adjacent"
    n_layers, d = W.cfg("block_count"), W.cfg("embedding_length")
    nh, nkv = W.cfg("attention.head_count"), W.cfg("attention.head_count_kv")
    hd = d // nh
    eps, base = W.cfg("attention.layer_norm_rms_epsilon"), W.cfg("rope.freq_base")
    emb = W.get("token_embd.weight")
    x = emb[tokens]
    n = len(tokens)
    pos = np.arange(n, dtype=np.float64)
    mask = causal_mask(n)
    for l in range(n_layers):
        p = lambda s: W.get(f"blk.{l}.{s}.weight")  # noqa: E731
        h = rms_norm(x, p("attn_norm"), eps)
        q = (h @ p("attn_q").T).reshape(n, nh, hd)
        k = (h @ p("attn_k").T).reshape(n, nkv, hd)
        v = (h @ p("attn_v").T).reshape(n, nkv, hd)
        q, k = rope(q, pos, base, style), rope(k, pos, base, style)
        o = attention(q, k, v, 1.0 / np.sqrt(hd), mask)
        x = x + o @ p("attn_output").T
        h = rms_norm(x, p("ffn_norm"), eps)
        g, u = h @ p("ffn_gate").T, h @ p("ffn_up").T
        x = x + (g / (1 + np.exp(-g)) * u) @ p("ffn_down").T
    x = rms_norm(x, W.get("output_norm.weight"), eps)
    head = W.get("output.weight") if "output.weight" in W.t else emb
    return x, head


def gemma3_layout(W, window_override=None):
    """Per-layer (is_sliding, rope_base), window, attention scale, as
    llama.cpp llama_load_hparams_gemma3 / llm_build_gemma3<iswa=true>."""
    n_layers = W.cfg("block_count")
    d, nh = W.cfg("embedding_length"), W.cfg("attention.head_count")
    hd = W.cfg("attention.key_length", d // nh)
    window = W.cfg("attention.sliding_window", 0)
    gguf_has_swa = window > 0
    if window_override is not None:
        window = window_override
    # llama.cpp: set_swa_pattern(6) unless the GGUF carries a pattern
    # (newer converters: per-layer bool array or an int period).
    pat = W.cfg("attention.sliding_window_pattern", 6)
    if isinstance(pat, list):
        sliding = [bool(b) for b in pat]
    else:
        sliding = [pat == 0 or (il % pat < pat - 1) for il in range(n_layers)]
    if not gguf_has_swa:
        # llama.cpp: no sliding_window key -> LLAMA_SWA_TYPE_NONE, every layer
        # global (and llm_build_gemma3<false>, which also soft-caps logits:
        # not implemented here, the 270M GGUF has a window).
        sliding = [False] * n_layers
    # An override <= 0 (--window 0) only drops the mask: sliding layers keep
    # their RoPE base, so that the run isolates the effect of the window.
    base_global = W.cfg("rope.freq_base")
    base_local = 10000.0  # llama.cpp rope_freq_base_train_swa; HF rope_local_base_freq
    # llama.cpp f_attention_scale: 1/sqrt(d_model/n_head) for 27B (62 layers),
    # else 1/sqrt(head_dim); HF query_pre_attn_scalar**-0.5 (256 for 270M).
    scale = 1.0 / math.sqrt(d / nh if n_layers == 62 else hd)
    layers = [(s, base_local if s else base_global) for s in sliding]
    return layers, window, scale, hd


def forward_gemma3(W, tokens, opts):
    style = opts.rope or "halves"
    d = W.cfg("embedding_length")
    nh, nkv = W.cfg("attention.head_count"), W.cfg("attention.head_count_kv")
    eps = W.cfg("attention.layer_norm_rms_epsilon")
    layers, window, scale, hd = gemma3_layout(W, opts.window)
    if opts.embed_scale == "bf16":
        # HF: sqrt(hidden_size) cast to the weights' dtype (bf16) -> 25.25.
        u = int(np.array([math.sqrt(d)], dtype=np.float32).view(np.uint32)[0])
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000  # round to nearest even
        embed_scale = float(np.array([u], dtype=np.uint32).view(np.float32)[0])
    else:
        embed_scale = float(np.float32(math.sqrt(d)))  # llama.cpp sqrtf(n_embd)
    emb = W.get("token_embd.weight")
    x = emb[tokens] * embed_scale
    n = len(tokens)
    pos = np.arange(n, dtype=np.float64)
    masks = {False: causal_mask(n), True: causal_mask(n, max(window, 0))}
    for l, (sliding, base) in enumerate(layers):
        p = lambda s: W.get(f"blk.{l}.{s}.weight")  # noqa: E731
        h = rms_norm(x, p("attn_norm"), eps)
        q = (h @ p("attn_q").T).reshape(n, nh, hd)
        k = (h @ p("attn_k").T).reshape(n, nkv, hd)
        v = (h @ p("attn_v").T).reshape(n, nkv, hd)
        q = rms_norm(q, p("attn_q_norm"), eps)
        k = rms_norm(k, p("attn_k_norm"), eps)
        q, k = rope(q, pos, base, style), rope(k, pos, base, style)
        o = attention(q, k, v, scale, masks[sliding]) @ p("attn_output").T
        x = x + rms_norm(o, p("post_attention_norm"), eps)
        h = rms_norm(x, p("ffn_norm"), eps)
        f = (gelu_tanh(h @ p("ffn_gate").T) * (h @ p("ffn_up").T)) @ p("ffn_down").T
        x = x + rms_norm(f, p("post_ffw_norm"), eps)
    x = rms_norm(x, W.get("output_norm.weight"), eps)
    head = W.get("output.weight") if "output.weight" in W.t else emb
    return x, head


FORWARD = {"llama": forward_llama, "gemma3": forward_gemma3}


def forward(W, tokens, opts):
    """Final hidden states [n, d] and the output head [vocab, d]."""
    arch = opts.arch or W.arch
    if arch not in FORWARD:
        raise SystemExit(f"architecture {arch!r} not supported (have {sorted(FORWARD)})")
    return FORWARD[arch](W, np.asarray(tokens, dtype=np.int64), opts)


def logits_of(hidden, head):
    return hidden @ head.T


def nll_rows(lg, targets):
    """Per-row -log p(target) from float64 logits."""
    lg = lg.astype(np.float64)
    m = lg.max(axis=1, keepdims=True)
    lse = np.log(np.exp(lg - m).sum(axis=1)) + m[:, 0]
    return lse - lg[np.arange(len(lg)), targets]


def mean_nll(logits, tokens):
    return float(np.mean(nll_rows(logits[:-1], tokens[1:])))


# ---------------------------------------------------------------- tokenizer


def sentencepiece_from_gguf(W):
    """A SentencePiece BPE model filled from the GGUF vocabulary (tokens,
    scores, types), byte fallback, identity normalizer, no dummy prefix."""
    if W.field("tokenizer.ggml.model") != "llama":
        raise SystemExit("--text needs a SentencePiece ('llama') GGUF vocabulary; use --ids")
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    toks = W.tokens()
    scores = W.field("tokenizer.ggml.scores")
    types = W.field("tokenizer.ggml.token_type")
    unk = W.field("tokenizer.ggml.unknown_token_id", 3)
    m = pb.ModelProto()
    for i, (t, s, ty) in enumerate(zip(toks, scores, types)):
        piece = m.pieces.add()
        piece.piece, piece.score = t, float(s)
        # GGUF token types use SentencePiece's numbering (1 normal, 2 unknown,
        # 3 control, 4 user defined, 5 unused, 6 byte).
        piece.type = 2 if i == unk else int(ty)
    ts = m.trainer_spec
    ts.model_type = pb.TrainerSpec.BPE
    ts.vocab_size = len(toks)
    ts.byte_fallback = True
    ts.unk_id = unk
    ts.bos_id = W.field("tokenizer.ggml.bos_token_id")
    ts.eos_id = W.field("tokenizer.ggml.eos_token_id")
    ts.pad_id = W.field("tokenizer.ggml.padding_token_id", 0)
    ns = m.normalizer_spec
    ns.name = "identity"
    ns.add_dummy_prefix = False
    ns.remove_extra_whitespaces = False
    ns.escape_whitespaces = True
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(m.SerializeToString())
    return sp


def encode_text(W, text):
    ids = list(sentencepiece_from_gguf(W).encode(text))
    if W.field("tokenizer.ggml.add_bos_token", False):
        ids = [int(W.field("tokenizer.ggml.bos_token_id"))] + ids
    return ids


def parse_ids(spec):
    if spec.startswith("@"):
        with open(spec[1:]) as f:
            spec = f.read()
    return [int(x) for x in spec.replace(",", " ").split()]


# --------------------------------------------------------------- modes


def compare(args):
    tokens, rust = read_dump(args.dump)
    name = args.model or VOCAB_TO_MODEL.get(rust.shape[1], "smollm2")
    W = Weights(model_path(name))
    t0 = time.time()
    hidden, head = forward(W, tokens, args)
    ref = logits_of(hidden, head)
    elapsed = time.time() - t0
    delta = rust - ref
    row_rel = np.linalg.norm(delta, axis=1) / np.linalg.norm(ref, axis=1)
    diff = np.abs(delta, out=delta)
    max_rel = diff.max() / np.abs(ref).max()
    argmax_agree = float(np.mean(rust.argmax(1) == ref.argmax(1)))
    nll_r, nll_n = mean_nll(rust, tokens), mean_nll(ref, tokens)
    print(f"model: {os.path.basename(model_path(name))} ({args.arch or W.arch}), "
          f"tokens: {len(tokens)}, vocab: {ref.shape[1]}, rope: {args.rope or 'default'}, "
          f"numpy forward {elapsed:.1f} s")
    print(f"max |rust - numpy|            = {diff.max():.3e}  (max |logit| {np.abs(ref).max():.2f})")
    print(f"max abs diff / max |logit|    = {max_rel:.3e}")
    print(f"max per-position rel L2 error = {row_rel.max():.3e}  (mean {row_rel.mean():.3e})")
    print(f"argmax agreement              = {argmax_agree:.4f}")
    print(f"mean NLL rust {nll_r:.6f}  numpy {nll_n:.6f}")
    print(f"perplexity rust {math.exp(nll_r):.4f}  numpy {math.exp(nll_n):.4f}")
    ok = max_rel < 1e-3 and row_rel.max() < 1e-3
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def _byte_decoder():
    # Inverse of GPT-2's bytes_to_unicode, for byte-level BPE vocabularies.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, k = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + k)
            k += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def display_vocab(W):
    """Token strings for printing: SentencePiece '\u2581' -> ' ', byte-level
    BPE pieces -> their bytes."""
    toks = W.tokens()
    if W.field("tokenizer.ggml.model") == "gpt2":
        dec = _byte_decoder()
        toks = [bytes(dec.get(c, 63) for c in t).decode("utf-8", "replace") for t in toks]
    else:
        toks = [t.replace("\u2581", " ") for t in toks]
    return toks


def show(s):
    return s.encode("unicode_escape").decode("ascii")


def standalone(args):
    name = args.model or "gemma3"
    W = Weights(model_path(name))
    if args.ids is not None:
        tokens = parse_ids(args.ids)
    else:
        text = args.text
        if text is None:
            with open(args.text_file, encoding="utf-8") as f:
                text = f.read(max(args.tokens or 0, 1) * 16 if args.tokens else None)
        tokens = encode_text(W, text)
    if args.tokens:
        tokens = tokens[: args.tokens]
    tokens = np.asarray(tokens, dtype=np.int64)
    vocab = display_vocab(W)
    arch = args.arch or W.arch
    print(f"model: {os.path.basename(model_path(name))} ({arch}), tokens: {len(tokens)}")
    if arch == "gemma3":
        layers, window, scale, hd = gemma3_layout(W, args.window)
        glob = [l for l, (s, _) in enumerate(layers) if not s]
        print(f"gemma3: head_dim {hd}, scale 1/{1 / scale:g}, sliding window {window}, "
              f"global layers {glob}, embed scale {args.embed_scale}")
    if len(tokens) <= 40:
        print("ids:", ",".join(map(str, tokens)))
        print("text:", "".join(show(vocab[t]) for t in tokens))
    t0 = time.time()
    hidden, head = forward(W, tokens, args)
    nll = np.empty(len(tokens) - 1)
    chunk = 128
    for a in range(0, len(tokens) - 1, chunk):
        b = min(a + chunk, len(tokens) - 1)
        nll[a:b] = nll_rows(logits_of(hidden[a:b], head), tokens[a + 1 : b + 1])
    elapsed = time.time() - t0
    last = logits_of(hidden[-args.show :], head)
    for r, lg in enumerate(last):
        i = len(tokens) - args.show + r
        if i < 0:
            continue
        ctx = "".join(show(vocab[t]) for t in tokens[max(0, i - 7) : i + 1])
        pr = np.exp(lg - lg.max())
        pr /= pr.sum()
        top = np.argsort(-lg)[: args.top]
        nxt = f"  (actual next {show(vocab[tokens[i + 1]])!r} p={pr[tokens[i + 1]]:.3f})" \
            if i + 1 < len(tokens) else ""
        print(f"pos {i:4d} ...{ctx!r}{nxt}")
        print("          top: " + ", ".join(f"{show(vocab[t])!r} {pr[t]:.3f}" for t in top))
    if len(nll):
        print(f"perplexity over {len(nll)} predictions: {math.exp(nll.mean()):.4f}"
              f"  (mean NLL {nll.mean():.6f})")
        h = len(nll) // 2
        if h:
            print(f"  2nd half ({len(nll) - h}): {math.exp(nll[h:].mean()):.4f}")
    print(f"numpy forward: {elapsed:.1f} s")
    if args.save:
        write_dump(args.save, tokens, logits_of(hidden, head))
        print(f"wrote {args.save}")
    if args.window_effect:
        if arch != "gemma3":
            raise SystemExit("--window-effect is for gemma3")
        _, window, _, _ = gemma3_layout(W, args.window)
        saved = args.window
        args.window = 0
        t0 = time.time()
        hidden0, _ = forward(W, tokens, args)
        args.window = saved
        lg_w = logits_of(hidden[-1:], head)[0]
        lg_0 = logits_of(hidden0[-1:], head)[0]
        d = np.abs(lg_w - lg_0)
        p_w = np.exp(lg_w - lg_w.max()); p_w /= p_w.sum()
        p_0 = np.exp(lg_0 - lg_0.max()); p_0 /= p_0.sum()
        kl = float(np.sum(p_w * (np.log(p_w + 1e-300) - np.log(p_0 + 1e-300))))
        nll0 = np.empty(len(tokens) - 1)
        for a in range(0, len(tokens) - 1, chunk):
            b = min(a + chunk, len(tokens) - 1)
            nll0[a:b] = nll_rows(logits_of(hidden0[a:b], head), tokens[a + 1 : b + 1])
        beyond = slice(window, None)  # predictions from positions >= window
        diff_all = np.abs(hidden - hidden0).max(axis=1)
        print(f"window ignored (full causal on every layer), {time.time() - t0:.1f} s:")
        print(f"  last position: max |Δlogit| {d.max():.4f}, mean |Δlogit| {d.mean():.4f}, "
              f"KL(window||no window) {kl:.3e}, top-1 {show(vocab[lg_w.argmax()])!r} vs "
              f"{show(vocab[lg_0.argmax()])!r}")
        print(f"  positions < {window}: max |Δhidden| {diff_all[:window].max():.3e} "
              f"(must be 0: the window only bites past it)")
        print(f"  perplexity with window {math.exp(nll.mean()):.4f}, without {math.exp(nll0.mean()):.4f}")
        if len(nll) > window:
            print(f"  over the {len(nll[beyond])} predictions from positions >= {window}: "
                  f"{math.exp(nll[beyond].mean()):.4f} vs {math.exp(nll0[beyond].mean()):.4f}")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dump", nargs="?", default=os.path.join(ROOT, "results", "logits.bin"))
    ap.add_argument("--model", help=f"GGUF path or one of {sorted(MODELS)}")
    ap.add_argument("--arch", choices=sorted(FORWARD), help="default: general.architecture")
    ap.add_argument("--rope", choices=["adjacent", "halves"],
                    help="RoPE pairing (default: adjacent for llama, halves/NEOX for gemma3)")
    ap.add_argument("--window", type=int, help="gemma3 sliding window (default: the GGUF's; 0 = no window mask)")
    ap.add_argument("--embed-scale", choices=["f32", "bf16"], default="f32",
                    help="gemma3 sqrt(d_model): llama.cpp f32 (default) or HF bf16-rounded")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--ids", help="standalone: token ids, comma/space separated, or @FILE")
    g.add_argument("--text", help="standalone: text to tokenize (BOS prepended)")
    g.add_argument("--text-file", help="standalone: file to tokenize (BOS prepended)")
    ap.add_argument("--tokens", type=int, help="standalone: keep the first N ids")
    ap.add_argument("--show", type=int, default=3, help="standalone: last positions to show")
    ap.add_argument("--top", type=int, default=5, help="standalone: next tokens per position")
    ap.add_argument("--window-effect", action="store_true",
                    help="standalone: rerun with the sliding window ignored and print the change")
    ap.add_argument("--save", help="standalone: write the numpy logits as a KVQLOG01 dump")
    args = ap.parse_args()
    if args.ids is not None or args.text is not None or args.text_file is not None:
        return standalone(args)
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
