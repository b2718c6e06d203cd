//! Integration tests of kvq's core: bit packing, the quantizer's error
//! budget, the fused kernels against the oracle (every backend), memory
//! accounting, errors, and the serialized format.
//!
//! Checks are written as functions that return `Err(String)` on the first
//! violation, so that a test can also feed them a deliberately broken block
//! or kernel and assert that they notice (see the `*_catches_*` tests).

#[path = "../common/mod.rs"]
mod common;

use common::{backends, Rng};
use half::{bf16, f16};
use kvq::kernels::{self, reference};
use kvq::pack::{pack, packed_len, unpack};
use kvq::{
    Axis, Backend, Element, Error, Group, KvQuantizer, Layout, Mode, PackedBlock, PackedHead,
    QuantScheme, ScaleFormat, UniformQuantizer,
};
use proptest::prelude::*;

mod accounting;
mod budget;
mod errors;
mod fused;
mod ggml;
mod helpers;
mod packing;
mod serialized;

use helpers::*;
