//! Random numbers, byte mutations, and choices read from bytes.

/// xorshift64*: fast, and the same seed repeats the same run.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.max(1))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
}

const INTERESTING_INTS: &[u64] = &[
    0,
    1,
    2,
    3,
    7,
    8,
    16,
    31,
    32,
    33,
    64,
    127,
    128,
    255,
    256,
    0xffff,
    0x1_0000,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    1 << 32,
    1 << 40,
    1 << 62,
    u64::MAX,
];

const INTERESTING_F32: &[f32] = &[
    f32::NAN,
    f32::INFINITY,
    f32::NEG_INFINITY,
    0.0,
    -0.0,
    1e-40,
    1e38,
    -1e38,
    65504.0,
    70000.0,
    1.0,
];

/// One corpus entry under 1–4 mutations.
pub fn mutate(rng: &mut Rng, corpus: &[Vec<u8>]) -> Vec<u8> {
    let mut x = corpus[rng.below(corpus.len())].clone();
    let n = 1 + rng.below(4);
    for _ in 0..n {
        let len = x.len();
        match rng.below(10) {
            0 | 1 if len > 0 => {
                let i = rng.below(len);
                x[i] ^= 1 << rng.below(8);
            }
            2 if len > 0 => {
                let i = rng.below(len);
                x[i] = [0, 1, 0x7f, 0x80, 0xff, rng.next_u64() as u8][rng.below(6)];
            }
            3 | 4 if len >= 8 => {
                let v = INTERESTING_INTS[rng.below(INTERESTING_INTS.len())];
                let v = if rng.below(4) == 0 {
                    v.wrapping_add(len as u64)
                } else {
                    v
                };
                let w = [1, 2, 4, 8][rng.below(4)];
                let i = rng.below(len - w + 1);
                x[i..i + w].copy_from_slice(&v.to_le_bytes()[..w]);
            }
            5 if len >= 4 => {
                let v = INTERESTING_F32[rng.below(INTERESTING_F32.len())];
                let i = rng.below(len - 3);
                x[i..i + 4].copy_from_slice(&v.to_le_bytes());
            }
            6 if len > 0 => {
                let a = rng.below(len);
                let b = (a + 1 + rng.below(16)).min(len);
                x.drain(a..b);
            }
            7 => {
                let at = rng.below(len + 1);
                let k = 1 + rng.below(16);
                let ins: Vec<u8> = (0..k).map(|_| rng.next_u64() as u8).collect();
                x.splice(at..at, ins);
            }
            8 if len > 0 => {
                x.truncate(rng.below(len));
            }
            _ => {
                // Splice: the head of this entry, the tail of another.
                let o = &corpus[rng.below(corpus.len())];
                let a = rng.below(x.len() + 1);
                let b = rng.below(o.len() + 1);
                x.truncate(a);
                x.extend_from_slice(&o[b..]);
            }
        }
    }
    x
}

/// Choices read from bytes, zero once they run out (so every input is a
/// valid sequence of choices).
pub struct Choices<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Choices<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Choices { data, pos: 0 }
    }
    pub fn exhausted(&self) -> bool {
        self.pos >= self.data.len()
    }
    pub fn u8(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        b
    }
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }
    pub fn u64(&mut self) -> u64 {
        (self.u32() as u64) | ((self.u32() as u64) << 32)
    }
    /// One of `xs`.
    pub fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.u8() as usize % xs.len()]
    }
    /// Below `n` (`n ≥ 1`).
    pub fn below(&mut self, n: usize) -> usize {
        self.u32() as usize % n.max(1)
    }
    /// Usually a small count below `small`, sometimes anything.
    pub fn count(&mut self, small: usize) -> usize {
        match self.u8() {
            0..=239 => self.below(small),
            240..=247 => INTERESTING_INTS[self.below(INTERESTING_INTS.len())] as usize,
            _ => self.u64() as usize,
        }
    }
    /// A value: mostly in [−2, 2], sometimes from the awkward palette.
    pub fn value(&mut self) -> f32 {
        match self.u8() {
            0..=223 => (self.u8() as f32 - 128.0) / 64.0,
            224..=247 => INTERESTING_F32[self.below(INTERESTING_F32.len())],
            _ => f32::from_bits(self.u32()),
        }
    }
}
