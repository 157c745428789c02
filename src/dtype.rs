//! Element types and reduction operations.

use crate::error::{Error, Result};

/// The element type of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum DType {
    /// IEEE 754 binary32.
    f32,
    /// IEEE 754 binary64.
    f64,
    /// IEEE 754 binary16.
    f16,
    /// bfloat16.
    bf16,
    /// Signed 8-bit integer (wrapping).
    i8,
    /// Unsigned 8-bit integer (wrapping).
    u8,
    /// Signed 32-bit integer (wrapping).
    i32,
    /// Unsigned 32-bit integer (wrapping).
    u32,
    /// Signed 64-bit integer (wrapping).
    i64,
    /// Unsigned 64-bit integer (wrapping).
    u64,
}

impl DType {
    /// Every dtype, for tests and tools.
    pub const ALL: [DType; 10] = [
        DType::f32,
        DType::f64,
        DType::f16,
        DType::bf16,
        DType::i8,
        DType::u8,
        DType::i32,
        DType::u32,
        DType::i64,
        DType::u64,
    ];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::i8 | DType::u8 => 1,
            DType::f16 | DType::bf16 => 2,
            DType::f32 | DType::i32 | DType::u32 => 4,
            DType::f64 | DType::i64 | DType::u64 => 8,
        }
    }

    /// Whether this is a floating-point type.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::f32 | DType::f64 | DType::f16 | DType::bf16)
    }

    /// The lower-case name (`"f32"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::f32 => "f32",
            DType::f64 => "f64",
            DType::f16 => "f16",
            DType::bf16 => "bf16",
            DType::i8 => "i8",
            DType::u8 => "u8",
            DType::i32 => "i32",
            DType::u32 => "u32",
            DType::i64 => "i64",
            DType::u64 => "u64",
        }
    }

    /// Parses a name as printed by [`DType::name`] (also `float`, `half`, `double`, `int`).
    pub fn parse(s: &str) -> Result<DType> {
        Ok(match s {
            "f32" | "float" | "float32" => DType::f32,
            "f64" | "double" | "float64" => DType::f64,
            "f16" | "half" | "float16" => DType::f16,
            "bf16" | "bfloat16" => DType::bf16,
            "i8" | "int8" => DType::i8,
            "u8" | "uint8" => DType::u8,
            "i32" | "int" | "int32" => DType::i32,
            "u32" | "uint32" => DType::u32,
            "i64" | "int64" => DType::i64,
            "u64" | "uint64" => DType::u64,
            _ => return Err(Error::InvalidArgument(format!("unknown dtype {s:?}"))),
        })
    }

    /// Checks that `len` bytes hold whole elements of this dtype.
    #[inline]
    pub fn check_len(self, len: usize, what: &str) -> Result<usize> {
        // Sizes are powers of two: a mask and a shift, not a division, on every call.
        let shift = self.size().trailing_zeros();
        if len & (self.size() - 1) != 0 {
            return Err(self.not_whole(len, what));
        }
        Ok(len >> shift)
    }

    #[cold]
    fn not_whole(self, len: usize, what: &str) -> Error {
        Error::InvalidArgument(format!(
            "{what} has {len} bytes, not a multiple of the {} element size {}",
            self.name(),
            self.size()
        ))
    }
}

/// An element type with a [`DType`] (the typed API's slices: [`crate::Group`]).
pub trait Element: bytemuck::Pod {
    /// Its dtype.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),*) => {$( impl Element for $t { const DTYPE: DType = DType::$d; } )*};
}
element!(f32 => f32, f64 => f64, half::f16 => f16, half::bf16 => bf16, i8 => i8, u8 => u8, i32 => i32,
    u32 => u32, i64 => i64, u64 => u64);

/// The reduction of an all_reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AllReduce {
    /// Sum (wrapping for integers).
    Sum,
    /// Product (wrapping for integers).
    Prod,
    /// Minimum (a NaN operand gives NaN).
    Min,
    /// Maximum (a NaN operand gives NaN).
    Max,
}

impl AllReduce {
    /// Every op, for tests and tools.
    pub const ALL: [AllReduce; 4] = [
        AllReduce::Sum,
        AllReduce::Prod,
        AllReduce::Min,
        AllReduce::Max,
    ];

    /// The lower-case name (`"sum"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            AllReduce::Sum => "sum",
            AllReduce::Prod => "prod",
            AllReduce::Min => "min",
            AllReduce::Max => "max",
        }
    }

    /// Parses a name as printed by [`AllReduce::name`].
    pub fn parse(s: &str) -> Result<AllReduce> {
        Ok(match s {
            "sum" => AllReduce::Sum,
            "prod" => AllReduce::Prod,
            "min" => AllReduce::Min,
            "max" => AllReduce::Max,
            _ => return Err(Error::InvalidArgument(format!("unknown reduction {s:?}"))),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The mask-and-shift check against division, for every dtype and length.
    #[test]
    fn check_len_agrees_with_division() {
        for d in DType::ALL {
            for len in 0..67 {
                match d.check_len(len, "buffer") {
                    Ok(n) => assert!(len % d.size() == 0 && n == len / d.size(), "{d:?} {len}"),
                    Err(e) => {
                        assert!(len % d.size() != 0, "{d:?} {len}");
                        assert!(e.to_string().contains(&format!("{len} bytes")));
                    }
                }
            }
        }
    }
}
