//! A small, defensive reader for GGUF files (versions 2 and 3).
//!
//! The whole file is read into memory. Parsing validates every length,
//! count and offset against the bytes that are actually there, so malformed
//! input (truncated anywhere, bad magic, absurd counts, tensors pointing past
//! the end, unknown value or tensor types) yields a [`GgufError`] and never a
//! panic or an oversized allocation.
//!
//! Layout (little-endian):
//!
//! ```text
//! magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
//! n_kv x      { string key | u32 value_type | value }
//! n_tensors x { string name | u32 n_dims | u64 dims[n_dims] | u32 ggml_type | u64 offset }
//! padding to `general.alignment` (default 32)
//! tensor data; each tensor at data_offset + offset
//! ```
//!
//! Strings are `u64 len | bytes` (UTF-8). Arrays are
//! `u32 elem_type | u64 count | elements` and may nest.
//!
//! Dequantization to `f32` is provided for `F32`, `F16`, `BF16`, `Q4_0`,
//! `Q4_1` and `Q8_0` tensors.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;

use half::{bf16, f16};

/// Maximum nesting depth of array values (arrays of arrays of ...).
const MAX_ARRAY_DEPTH: u32 = 8;
/// GGML supports at most four dimensions.
const MAX_DIMS: u32 = 4;
/// Default alignment of the tensor data section.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// Everything that can go wrong while reading a GGUF file.
#[derive(Debug)]
pub enum GgufError {
    /// The file could not be read.
    Io(std::io::Error),
    /// The first four bytes are not `GGUF`.
    BadMagic([u8; 4]),
    /// A version this reader does not handle (only 2 and 3 are supported).
    UnsupportedVersion(u32),
    /// The input ended while reading `what` at byte `offset`.
    Truncated {
        /// What was being read.
        what: &'static str,
        /// Byte offset where the read started.
        offset: usize,
    },
    /// A count or length that cannot fit in the remaining input.
    TooLarge {
        /// What was being read.
        what: &'static str,
        /// The declared value.
        value: u64,
    },
    /// A metadata value type id that is not part of the format.
    UnknownValueType(u32),
    /// A ggml tensor type id this reader does not know the layout of.
    UnknownTensorType(u32),
    /// A string that is not valid UTF-8, at byte `offset`.
    InvalidUtf8 {
        /// Byte offset of the string's payload.
        offset: usize,
    },
    /// Arrays nested deeper than the reader allows.
    TooDeep,
    /// A tensor has zero or more than four dimensions, or a zero-sized dimension
    /// product that overflows.
    BadShape(String),
    /// The tensor's row length is not a multiple of its type's block size.
    BadBlockShape(String),
    /// The tensor's data lies (partly) outside the file, or is misaligned.
    BadTensorOffset(String),
    /// `general.alignment` is zero, not a power of two, or not an integer.
    BadAlignment(u64),
    /// The same metadata key or tensor name appears twice.
    Duplicate(String),
    /// A metadata key that is required but missing.
    MissingKey(String),
    /// A metadata key whose value has an unexpected type.
    WrongType {
        /// The key.
        key: String,
        /// What was expected.
        expected: &'static str,
    },
    /// No tensor of that name.
    MissingTensor(String),
    /// Dequantization to f32 is not implemented for this tensor type.
    UnsupportedDequant {
        /// Tensor name.
        name: String,
        /// Its ggml type.
        ty: GgmlType,
    },
}

impl fmt::Display for GgufError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GgufError::Io(e) => write!(f, "i/o error: {e}"),
            GgufError::BadMagic(m) => write!(f, "not a GGUF file (magic {m:02x?})"),
            GgufError::UnsupportedVersion(v) => write!(f, "unsupported GGUF version {v}"),
            GgufError::Truncated { what, offset } => {
                write!(f, "truncated input while reading {what} at byte {offset}")
            }
            GgufError::TooLarge { what, value } => {
                write!(f, "{what} of {value} does not fit in the file")
            }
            GgufError::UnknownValueType(t) => write!(f, "unknown metadata value type {t}"),
            GgufError::UnknownTensorType(t) => write!(f, "unknown ggml tensor type {t}"),
            GgufError::InvalidUtf8 { offset } => {
                write!(f, "invalid UTF-8 in string at byte {offset}")
            }
            GgufError::TooDeep => write!(f, "metadata arrays nested too deeply"),
            GgufError::BadShape(n) => write!(f, "tensor {n:?} has an invalid shape"),
            GgufError::BadBlockShape(n) => {
                write!(
                    f,
                    "tensor {n:?}: row length is not a multiple of the block size"
                )
            }
            GgufError::BadTensorOffset(n) => {
                write!(f, "tensor {n:?}: data is misaligned or outside the file")
            }
            GgufError::BadAlignment(a) => write!(f, "invalid general.alignment {a}"),
            GgufError::Duplicate(k) => write!(f, "duplicate key or tensor {k:?}"),
            GgufError::MissingKey(k) => write!(f, "missing metadata key {k:?}"),
            GgufError::WrongType { key, expected } => {
                write!(f, "metadata key {key:?} is not {expected}")
            }
            GgufError::MissingTensor(n) => write!(f, "no tensor named {n:?}"),
            GgufError::UnsupportedDequant { name, ty } => {
                write!(
                    f,
                    "tensor {name:?}: dequantization of {ty:?} is not implemented"
                )
            }
        }
    }
}

impl std::error::Error for GgufError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            GgufError::Io(e) => Some(e),
            _ => None,
        }
    }
}

impl From<std::io::Error> for GgufError {
    fn from(e: std::io::Error) -> Self {
        GgufError::Io(e)
    }
}

/// Result alias for this module.
pub type Result<T> = std::result::Result<T, GgufError>;

/// Metadata value type ids of the GGUF format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum ValueType {
    /// `u8`
    U8 = 0,
    /// `i8`
    I8 = 1,
    /// `u16`
    U16 = 2,
    /// `i16`
    I16 = 3,
    /// `u32`
    U32 = 4,
    /// `i32`
    I32 = 5,
    /// `f32`
    F32 = 6,
    /// `bool` (one byte, 0 or 1)
    Bool = 7,
    /// length-prefixed UTF-8 string
    String = 8,
    /// typed, length-prefixed array
    Array = 9,
    /// `u64`
    U64 = 10,
    /// `i64`
    I64 = 11,
    /// `f64`
    F64 = 12,
}

impl ValueType {
    /// Decode a type id.
    pub fn from_u32(t: u32) -> Result<Self> {
        use ValueType::*;
        Ok(match t {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return Err(GgufError::UnknownValueType(t)),
        })
    }

    /// The smallest number of bytes one value of this type can occupy.
    fn min_size(self) -> usize {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `u8`
    U8(u8),
    /// `i8`
    I8(i8),
    /// `u16`
    U16(u16),
    /// `i16`
    I16(i16),
    /// `u32`
    U32(u32),
    /// `i32`
    I32(i32),
    /// `f32`
    F32(f32),
    /// `bool`
    Bool(bool),
    /// string
    String(String),
    /// array of values of one element type
    Array(ValueType, Vec<Value>),
    /// `u64`
    U64(u64),
    /// `i64`
    I64(i64),
    /// `f64`
    F64(f64),
}

impl Value {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is a float or an integer.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    /// The value as a string slice.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The elements, if this is an array.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(_, v) => Some(v),
            _ => None,
        }
    }
}

/// ggml tensor element types whose storage layout this reader knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(missing_docs, non_camel_case_types)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    I8,
    I16,
    I32,
    I64,
    F64,
    BF16,
}

impl GgmlType {
    /// Decode a ggml type id.
    pub fn from_u32(t: u32) -> Result<Self> {
        use GgmlType::*;
        Ok(match t {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2_K,
            11 => Q3_K,
            12 => Q4_K,
            13 => Q5_K,
            14 => Q6_K,
            15 => Q8_K,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            30 => BF16,
            _ => return Err(GgufError::UnknownTensorType(t)),
        })
    }

    /// The ggml type id.
    pub fn id(self) -> u32 {
        use GgmlType::*;
        match self {
            F32 => 0,
            F16 => 1,
            Q4_0 => 2,
            Q4_1 => 3,
            Q5_0 => 6,
            Q5_1 => 7,
            Q8_0 => 8,
            Q8_1 => 9,
            Q2_K => 10,
            Q3_K => 11,
            Q4_K => 12,
            Q5_K => 13,
            Q6_K => 14,
            Q8_K => 15,
            I8 => 24,
            I16 => 25,
            I32 => 26,
            I64 => 27,
            F64 => 28,
            BF16 => 30,
        }
    }

    /// `(elements per block, bytes per block)`.
    pub fn block_layout(self) -> (u64, u64) {
        use GgmlType::*;
        match self {
            F32 | I32 => (1, 4),
            F16 | BF16 | I16 => (1, 2),
            I8 => (1, 1),
            I64 | F64 => (1, 8),
            Q4_0 => (32, 18),
            Q4_1 => (32, 20),
            Q5_0 => (32, 22),
            Q5_1 => (32, 24),
            Q8_0 => (32, 34),
            Q8_1 => (32, 36),
            Q2_K => (256, 84),
            Q3_K => (256, 110),
            Q4_K => (256, 144),
            Q5_K => (256, 176),
            Q6_K => (256, 210),
            Q8_K => (256, 292),
        }
    }
}

/// Description of one tensor in the file.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// Tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions in ggml order: `dims[0]` is the contiguous (row) length.
    pub dims: Vec<u64>,
    /// Element type.
    pub ty: GgmlType,
    /// Offset of the data relative to the start of the data section.
    pub offset: u64,
    /// Size of the data in bytes.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Total number of elements.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Row length (`dims[0]`) and number of rows (product of the other dims).
    pub fn rows_cols(&self) -> (usize, usize) {
        let cols = self.dims[0] as usize;
        let rows = self.dims[1..].iter().product::<u64>() as usize;
        (rows, cols)
    }
}

/// A parsed GGUF file, holding its bytes.
#[derive(Debug)]
pub struct Gguf {
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata in file order.
    pub metadata: Vec<(String, Value)>,
    /// Tensor descriptions in file order.
    pub tensors: Vec<TensorInfo>,
    /// Alignment of the data section and of each tensor's data.
    pub alignment: u64,
    /// Absolute byte offset of the data section.
    pub data_offset: u64,
    meta_index: HashMap<String, usize>,
    tensor_index: HashMap<String, usize>,
    data: Vec<u8>,
}

/// Bounds-checked little-endian cursor over a byte slice.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(end) => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(GgufError::Truncated {
                what,
                offset: self.pos,
            }),
        }
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }

    fn u32(&mut self, what: &'static str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &'static str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count of items each at least `min_size` bytes long, checked against
    /// the remaining input so it can safely size an allocation.
    fn count(&mut self, what: &'static str, min_size: usize) -> Result<usize> {
        let n = self.u64(what)?;
        let fits = usize::try_from(n)
            .ok()
            .and_then(|n| n.checked_mul(min_size.max(1)))
            .is_some_and(|bytes| bytes <= self.remaining());
        if fits {
            Ok(n as usize)
        } else {
            Err(GgufError::TooLarge { what, value: n })
        }
    }

    fn string(&mut self, what: &'static str) -> Result<String> {
        let n = self.count(what, 1)?;
        let offset = self.pos;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::InvalidUtf8 { offset })
    }

    fn value(&mut self, ty: ValueType, depth: u32) -> Result<Value> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.array::<1>("u8")?[0]),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.array("i8")?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array("u16")?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array("i16")?)),
            ValueType::U32 => Value::U32(self.u32("u32")?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array("i32")?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array("f32")?)),
            ValueType::Bool => Value::Bool(self.array::<1>("bool")?[0] != 0),
            ValueType::String => Value::String(self.string("string")?),
            ValueType::U64 => Value::U64(self.u64("u64")?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array("i64")?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array("f64")?)),
            ValueType::Array => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::TooDeep);
                }
                let elem = ValueType::from_u32(self.u32("array element type")?)?;
                let n = self.count("array length", elem.min_size())?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem, depth + 1)?);
                }
                Value::Array(elem, items)
            }
        })
    }
}

impl Gguf {
    /// Read and parse a GGUF file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::parse(std::fs::read(path)?)
    }

    /// Parse GGUF bytes (taking ownership of the buffer).
    pub fn parse(data: Vec<u8>) -> Result<Self> {
        let mut c = Cursor { buf: &data, pos: 0 };
        let magic: [u8; 4] = c.array("magic")?;
        if &magic != b"GGUF" {
            return Err(GgufError::BadMagic(magic));
        }
        let version = c.u32("version")?;
        if version != 2 && version != 3 {
            return Err(GgufError::UnsupportedVersion(version));
        }
        // Minimal encoded sizes: a tensor info is >= 8+4+4+8 bytes, a kv >= 8+4+1.
        let n_tensors = c.count("tensor count", 24)?;
        let n_kv = c.count("metadata count", 13)?;

        let mut metadata = Vec::with_capacity(n_kv);
        let mut meta_index = HashMap::with_capacity(n_kv);
        for _ in 0..n_kv {
            let key = c.string("metadata key")?;
            let ty = ValueType::from_u32(c.u32("metadata value type")?)?;
            let value = c.value(ty, 0)?;
            if meta_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(GgufError::Duplicate(key));
            }
            metadata.push((key, value));
        }

        let alignment = match meta_index.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(&i) => {
                let v = &metadata[i].1;
                let a = v.as_u64().ok_or(GgufError::WrongType {
                    key: "general.alignment".into(),
                    expected: "an unsigned integer",
                })?;
                if a == 0 || !a.is_power_of_two() {
                    return Err(GgufError::BadAlignment(a));
                }
                a
            }
        };

        let mut tensors = Vec::with_capacity(n_tensors);
        let mut tensor_index = HashMap::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = c.string("tensor name")?;
            let n_dims = c.u32("tensor n_dims")?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(GgufError::BadShape(name));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(c.u64("tensor dim")?);
            }
            let ty = GgmlType::from_u32(c.u32("tensor type")?)?;
            let offset = c.u64("tensor offset")?;
            let n_elements = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| GgufError::BadShape(name.clone()))?;
            let (block, block_bytes) = ty.block_layout();
            if dims[0] % block != 0 {
                return Err(GgufError::BadBlockShape(name));
            }
            let n_bytes = (n_elements / block)
                .checked_mul(block_bytes)
                .ok_or_else(|| GgufError::BadShape(name.clone()))?;
            if tensor_index.insert(name.clone(), tensors.len()).is_some() {
                return Err(GgufError::Duplicate(name));
            }
            tensors.push(TensorInfo {
                name,
                dims,
                ty,
                offset,
                n_bytes,
            });
        }

        let data_offset = (c.pos as u64)
            .checked_next_multiple_of(alignment)
            .ok_or(GgufError::BadAlignment(alignment))?;
        let file_len = data.len() as u64;
        if data_offset > file_len && !tensors.is_empty() {
            return Err(GgufError::Truncated {
                what: "tensor data",
                offset: c.pos,
            });
        }
        for t in &tensors {
            let in_bounds = data_offset
                .checked_add(t.offset)
                .and_then(|start| start.checked_add(t.n_bytes))
                .is_some_and(|end| end <= file_len);
            if t.offset % alignment != 0 || !in_bounds {
                return Err(GgufError::BadTensorOffset(t.name.clone()));
            }
        }

        Ok(Gguf {
            version,
            metadata,
            tensors,
            alignment,
            data_offset,
            meta_index,
            tensor_index,
            data,
        })
    }

    /// A metadata value by key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn require(&self, key: &str) -> Result<&Value> {
        self.get(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))
    }

    /// A required non-negative integer metadata value (any integer width).
    pub fn get_usize(&self, key: &str) -> Result<usize> {
        self.require(key)?
            .as_u64()
            .and_then(|v| usize::try_from(v).ok())
            .ok_or_else(|| GgufError::WrongType {
                key: key.into(),
                expected: "a non-negative integer",
            })
    }

    /// A required numeric metadata value as `f64`.
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        self.require(key)?
            .as_f64()
            .ok_or_else(|| GgufError::WrongType {
                key: key.into(),
                expected: "a number",
            })
    }

    /// A required string metadata value.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        self.require(key)?
            .as_str()
            .ok_or_else(|| GgufError::WrongType {
                key: key.into(),
                expected: "a string",
            })
    }

    /// A required array-of-strings metadata value.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        let wrong = || GgufError::WrongType {
            key: key.into(),
            expected: "an array of strings",
        };
        self.require(key)?
            .as_array()
            .ok_or_else(wrong)?
            .iter()
            .map(|v| v.as_str().ok_or_else(wrong))
            .collect()
    }

    /// A required boolean metadata value.
    pub fn get_bool(&self, key: &str) -> Result<bool> {
        self.require(key)?
            .as_bool()
            .ok_or_else(|| GgufError::WrongType {
                key: key.into(),
                expected: "a bool",
            })
    }

    /// A required array-of-`f32` metadata value.
    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>> {
        self.typed_array(key, "an array of f32", |v| match *v {
            Value::F32(x) => Some(x),
            _ => None,
        })
    }

    /// A required array-of-`i32` metadata value.
    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>> {
        self.typed_array(key, "an array of i32", |v| match *v {
            Value::I32(x) => Some(x),
            _ => None,
        })
    }

    fn typed_array<T>(
        &self,
        key: &str,
        expected: &'static str,
        elem: impl Fn(&Value) -> Option<T>,
    ) -> Result<Vec<T>> {
        let wrong = || GgufError::WrongType {
            key: key.into(),
            expected,
        };
        self.require(key)?
            .as_array()
            .ok_or_else(wrong)?
            .iter()
            .map(|v| elem(v).ok_or_else(wrong))
            .collect()
    }

    /// A tensor description by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw bytes of a tensor (bounds were validated at parse time).
    pub fn tensor_bytes(&self, t: &TensorInfo) -> &[u8] {
        let start = (self.data_offset + t.offset) as usize;
        &self.data[start..start + t.n_bytes as usize]
    }

    /// Dequantize a tensor to `f32`, in storage order (row-major with `dims[0]`
    /// contiguous). Returns the info alongside the values.
    pub fn dequantize(&self, name: &str) -> Result<(&TensorInfo, Vec<f32>)> {
        let t = self
            .tensor(name)
            .ok_or_else(|| GgufError::MissingTensor(name.to_string()))?;
        let n = usize::try_from(t.n_elements()).map_err(|_| GgufError::BadShape(name.into()))?;
        let bytes = self.tensor_bytes(t);
        let mut out = Vec::with_capacity(n);
        match t.ty {
            GgmlType::F32 => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            ),
            GgmlType::F16 => out.extend(bytes.chunks_exact(2).map(|b| f16_at(b, 0))),
            GgmlType::BF16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()),
            ),
            GgmlType::Q8_0 => {
                for blk in bytes.chunks_exact(34) {
                    let d = f16_at(blk, 0);
                    out.extend(blk[2..].iter().map(|&q| f32::from(q as i8) * d));
                }
            }
            GgmlType::Q4_0 => {
                for blk in bytes.chunks_exact(18) {
                    let d = f16_at(blk, 0);
                    let qs = &blk[2..];
                    out.extend(qs.iter().map(|&q| (f32::from(q & 0x0f) - 8.0) * d));
                    out.extend(qs.iter().map(|&q| (f32::from(q >> 4) - 8.0) * d));
                }
            }
            GgmlType::Q4_1 => {
                for blk in bytes.chunks_exact(20) {
                    let d = f16_at(blk, 0);
                    let m = f16_at(blk, 2);
                    let qs = &blk[4..];
                    out.extend(qs.iter().map(|&q| f32::from(q & 0x0f) * d + m));
                    out.extend(qs.iter().map(|&q| f32::from(q >> 4) * d + m));
                }
            }
            GgmlType::Q5_0 => {
                for blk in bytes.chunks_exact(22) {
                    dequant_q5(blk, false, &mut out);
                }
            }
            GgmlType::Q5_1 => {
                for blk in bytes.chunks_exact(24) {
                    dequant_q5(blk, true, &mut out);
                }
            }
            GgmlType::Q4_K => {
                for blk in bytes.chunks_exact(144) {
                    dequant_q4_k(blk, &mut out);
                }
            }
            GgmlType::Q6_K => {
                for blk in bytes.chunks_exact(210) {
                    dequant_q6_k(blk, &mut out);
                }
            }
            ty => {
                return Err(GgufError::UnsupportedDequant {
                    name: name.into(),
                    ty,
                })
            }
        }
        debug_assert_eq!(out.len(), n);
        Ok((t, out))
    }
}

/// One `Q5_0` block (32 values, 22 bytes: `d`, 32 high bits, 16 bytes of
/// low nibbles; value = `d·(q − 16)`) or, with `min`, one `Q5_1` block (24
/// bytes: `d`, `m`, high bits, nibbles; value = `d·q + m`). Value `j < 16`
/// takes the low nibble of byte `j`, value `j + 16` its high nibble; bit
/// `j` of the high bits is bit 4 of value `j`.
pub fn dequant_q5(blk: &[u8], min: bool, out: &mut Vec<f32>) {
    let d = f16_at(blk, 0);
    let (m, o) = if min { (f16_at(blk, 2), 4) } else { (0.0, 2) };
    let qh = u32::from_le_bytes([blk[o], blk[o + 1], blk[o + 2], blk[o + 3]]);
    let qs = &blk[o + 4..o + 20];
    let bias = if min { 0.0 } else { 16.0 };
    let q5 = |j: usize, lo: u8| f32::from(lo | ((((qh >> j) & 1) as u8) << 4)) - bias;
    out.extend(qs.iter().enumerate().map(|(j, &q)| q5(j, q & 0x0f) * d + m));
    out.extend(
        qs.iter()
            .enumerate()
            .map(|(j, &q)| q5(j + 16, q >> 4) * d + m),
    );
}

/// One `Q4_K` super-block (256 values, 144 bytes): `d`, `dmin` (f16),
/// twelve bytes of 6-bit scales and mins for eight sub-blocks of 32, then
/// 128 bytes of 4-bit codes; value = `d·sc·q − dmin·m`. Sub-blocks `2i` and
/// `2i+1` share the 32 code bytes `32i..`: low nibbles, then high.
pub fn dequant_q4_k(blk: &[u8], out: &mut Vec<f32>) {
    let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
    let sc = &blk[4..16];
    let qs = &blk[16..144];
    // Sub-block j's 6-bit scale and min.
    let scale_min = |j: usize| -> (f32, f32) {
        let (s, m) = if j < 4 {
            (sc[j] & 63, sc[j + 4] & 63)
        } else {
            (
                (sc[j + 4] & 0x0f) | ((sc[j - 4] >> 6) << 4),
                (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4),
            )
        };
        (d * f32::from(s), dmin * f32::from(m))
    };
    for i in 0..4 {
        let q = &qs[32 * i..32 * (i + 1)];
        let (d1, m1) = scale_min(2 * i);
        let (d2, m2) = scale_min(2 * i + 1);
        out.extend(q.iter().map(|&b| d1 * f32::from(b & 0x0f) - m1));
        out.extend(q.iter().map(|&b| d2 * f32::from(b >> 4) - m2));
    }
}

/// One `Q6_K` super-block (256 values, 210 bytes): 128 bytes of low 4
/// bits, 64 of high 2 bits, sixteen `i8` scales (one per 16 values), then
/// `d` (f16); value = `d·scale·(q − 32)` with `q` of 6 bits.
pub fn dequant_q6_k(blk: &[u8], out: &mut Vec<f32>) {
    let d = f16_at(blk, 208);
    let mut y = [0f32; 256];
    for half in 0..2 {
        let ql = &blk[64 * half..64 * half + 64];
        let qh = &blk[128 + 32 * half..128 + 32 * half + 32];
        let sc = &blk[192 + 8 * half..192 + 8 * half + 8];
        let y = &mut y[128 * half..128 * (half + 1)];
        for l in 0..32 {
            let is = l / 16;
            let q = |lo: u8, shift: u32| f32::from((lo | (((qh[l] >> shift) & 3) << 4)) as i8 - 32);
            let s = |k: usize| d * f32::from(sc[is + k] as i8);
            y[l] = s(0) * q(ql[l] & 0x0f, 0);
            y[l + 32] = s(2) * q(ql[l + 32] & 0x0f, 2);
            y[l + 64] = s(4) * q(ql[l] >> 4, 4);
            y[l + 96] = s(6) * q(ql[l + 32] >> 4, 6);
        }
    }
    out.extend_from_slice(&y);
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}
