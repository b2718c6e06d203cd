"""Sum and sum of squares (f64) of the first tensor of each type in a GGUF
file, dequantized by the `gguf` PyPI package (an implementation
independent of kvq-eval's): the figures tests/gemma_assets.rs pins.

    python3 -m pip install gguf==0.19.0
    python3 scripts/gguf_sums.py assets/gemma-3-270m-q4_k_m.gguf
"""
import sys

import gguf
import numpy as np

reader = gguf.GGUFReader(sys.argv[1])
seen = set()
for t in reader.tensors:
    ty = t.tensor_type.name
    if ty in seen:
        continue
    seen.add(ty)
    x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).ravel()
    print(f"{ty:5} {t.name:28} {x.size:>10} sum {x.sum():.6f} sum_sq {(x * x).sum():.6f}")
