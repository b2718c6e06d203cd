//! The crate's one error type.

use thiserror::Error;

/// Everything a caller of `kvq` can get wrong, as a value.
///
/// Messages are lowercase, name the operation that failed and carry the
/// numbers involved, e.g. `append: expected 1024 values for keys, got 1000`.
/// The enum is `#[non_exhaustive]`: match with a wildcard arm.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum Error {
    /// A [`QuantScheme`](crate::QuantScheme) parameter is out of range.
    #[error("scheme: {what}")]
    InvalidScheme {
        /// What is wrong with it.
        what: String,
    },

    /// A scheme does not fit the shape it is used with (e.g. a group of 48
    /// channels with `head_dim = 64`).
    #[error("{op}: {what}")]
    SchemeShape {
        /// The operation that checked it.
        op: &'static str,
        /// What does not fit.
        what: String,
    },

    /// A configuration value is invalid (e.g. a non-finite softmax scale).
    #[error("{op}: {what}")]
    InvalidConfig {
        /// The operation that checked it.
        op: &'static str,
        /// What is wrong.
        what: String,
    },

    /// A shape parameter (heads, head dimension, window…) is invalid.
    #[error("{op}: {what}")]
    InvalidShape {
        /// The operation that checked it.
        op: &'static str,
        /// What is wrong.
        what: String,
    },

    /// A buffer has the wrong number of elements or bytes.
    #[error("{op}: expected {expected} {what}, got {got}")]
    Length {
        /// The operation that checked it.
        op: &'static str,
        /// What the buffer holds ("values for keys", "bytes of codes"…).
        what: &'static str,
        /// The length that was required.
        expected: usize,
        /// The length that was passed.
        got: usize,
    },

    /// An input value is NaN or infinite. kvq's rule: non-finite input is
    /// rejected, never quantized, and nothing of the call is kept.
    #[error("{op}: non-finite value {value} at token {token}, head {head}, channel {channel}")]
    NonFinite {
        /// The operation that rejected it.
        op: &'static str,
        /// Token index within the call's input.
        token: usize,
        /// KV head (or query head, for queries).
        head: usize,
        /// Channel within the head.
        channel: usize,
        /// The offending value.
        value: f32,
    },

    /// A scale or zero point does not fit the scheme's scale format (an f16
    /// scale for values beyond ±65504, say).
    #[error("{op}: {what} {value:e} does not fit the {format} scale format (token {token}, head {head}, group {group})")]
    ScaleOverflow {
        /// The operation that failed.
        op: &'static str,
        /// "scale" or "zero".
        what: &'static str,
        /// The value that overflowed.
        value: f32,
        /// The scale format's name.
        format: &'static str,
        /// Token (or first token of the group, per-channel).
        token: usize,
        /// KV head.
        head: usize,
        /// Group index within the row (per-token) or channel (per-channel).
        group: usize,
    },

    /// An argument that is neither a shape nor a scheme is out of range: a
    /// softmax scale that is not a positive number, `top_k = 0`, an empty
    /// list of candidate schemes, a bit budget that nothing fits in…
    #[error("{op}: {what}")]
    InvalidArgument {
        /// The operation that checked it.
        op: &'static str,
        /// What is wrong.
        what: String,
    },

    /// Reading or writing a stream failed (saving or loading a cache).
    #[error("{op}: i/o error ({kind:?}): {what}")]
    Io {
        /// The operation that used the stream.
        op: &'static str,
        /// The kind of the underlying `std::io::Error`.
        kind: std::io::ErrorKind,
        /// Its message.
        what: String,
    },

    /// A cache's [`PagePool`](crate::cache::PagePool) has no room for the
    /// pages a call needs; nothing was changed.
    #[error("{op}: the page pool is full: the call needs {need} bytes of pages, {free} are free")]
    PoolExhausted {
        /// The operation that needed the pages.
        op: &'static str,
        /// Bytes of whole pages the call needs.
        need: usize,
        /// Bytes the pool's capacity leaves.
        free: usize,
    },

    /// Bytes from outside (a serialized block or cache) are malformed.
    #[error("{op}: malformed bytes: {what}")]
    Malformed {
        /// The operation that read them.
        op: &'static str,
        /// What is wrong.
        what: String,
    },
}

/// `Result` with [`Error`](enum@Error).
pub type Result<T, E = Error> = std::result::Result<T, E>;
