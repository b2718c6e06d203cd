//! ndarray views into the slice paths: shape checks and contiguity.

use ndarray::{ArrayView, Dimension};

use crate::error::{Error, Result};

/// The elements of `x` in logical (row-major) order as one slice: `x`'s own
/// memory when it is in standard layout (no copy), else a copy in `buf`.
pub(crate) fn contiguous<'b, 'a: 'b, T: Copy, D: Dimension>(
    x: &ArrayView<'a, T, D>,
    buf: &'b mut Vec<T>,
) -> &'b [T] {
    match x.to_slice() {
        Some(s) => s,
        None => {
            buf.clear();
            buf.extend(x.iter().copied());
            buf
        }
    }
}

/// Check that `shape` is `[tokens, tail…]`. `what` is the view and its
/// verb (`"keys have"`, `"the input has"`); `expected` names the
/// dimensions, e.g. `"[tokens, n_kv_heads, head_dim]"`.
pub(crate) fn check_tail(
    op: &'static str,
    what: &str,
    shape: &[usize],
    tail: &[usize],
    expected: &str,
) -> Result<()> {
    if shape.get(1..) == Some(tail) {
        return Ok(());
    }
    let want: Vec<String> = std::iter::once("tokens".to_string())
        .chain(tail.iter().map(usize::to_string))
        .collect();
    Err(Error::InvalidShape {
        op,
        what: format!(
            "{what} shape {shape:?}, expected [{}] = {expected}",
            want.join(", ")
        ),
    })
}

/// Check that keys and values hold the same number of tokens.
pub(crate) fn check_tokens(op: &'static str, k: &[usize], v: &[usize]) -> Result<()> {
    if k.first() == v.first() {
        return Ok(());
    }
    Err(Error::InvalidShape {
        op,
        what: format!("keys have shape {k:?} but values {v:?}: the numbers of tokens differ"),
    })
}
