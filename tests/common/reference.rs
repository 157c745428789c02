//! Independent references for collective results: each rank's contribution, the expected
//! reduction in f64 or exact (i128) integer arithmetic, and checks against them.
#![allow(dead_code)]

use half::{bf16, f16};
use rdmacomm::{AllReduce, DType};

/// The value rank `r` contributes at element `i`, as f64 (exact in every float dtype), or as
/// raw integer bits for integer dtypes.
pub fn float_val(op: AllReduce, r: usize, i: usize) -> f64 {
    let h = (i.wrapping_mul(2654435761) ^ r.wrapping_mul(40503)) >> 3;
    match op {
        // Powers of two keep products exact: 2^-1..2^1, so that every partial product of up
        // to 8 ranks (2^-8..2^8) is exact in f16 and bf16 too (2^16 overflows f16).
        AllReduce::Prod => {
            let k = (h % 3) as i32 - 1;
            let s = if (h >> 4) % 2 == 0 { 1.0 } else { -1.0 };
            s * 2f64.powi(k)
        }
        _ => ((h % 17) as f64 - 8.0) * 0.5,
    }
}

pub fn int_val(r: usize, i: usize) -> u64 {
    let mut x = (i as u64) ^ ((r as u64 + 1) << 40);
    x = x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^ (x >> 29)
}

pub fn fill(dtype: DType, op: AllReduce, r: usize, elems: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(elems * dtype.size());
    for i in 0..elems {
        let f = float_val(op, r, i);
        let u = int_val(r, i);
        match dtype {
            DType::f32 => out.extend_from_slice(&(f as f32).to_le_bytes()),
            DType::f64 => out.extend_from_slice(&f.to_le_bytes()),
            DType::f16 => out.extend_from_slice(&f16::from_f64(f).to_le_bytes()),
            DType::bf16 => out.extend_from_slice(&bf16::from_f64(f).to_le_bytes()),
            _ => out.extend_from_slice(&u.to_le_bytes()[..dtype.size()]),
        }
    }
    out
}

pub fn float_ref(op: AllReduce, n: usize, i: usize) -> f64 {
    let vals = (0..n).map(|r| float_val(op, r, i));
    match op {
        AllReduce::Sum => vals.sum(),
        AllReduce::Prod => vals.product(),
        AllReduce::Min => vals.fold(f64::INFINITY, f64::min),
        AllReduce::Max => vals.fold(f64::NEG_INFINITY, f64::max),
    }
}

/// Exact integer reference in i128 arithmetic, wrapped to the dtype's width at the end
/// (sum and product wrap modulo 2^bits in any order).
pub fn int_ref(dtype: DType, op: AllReduce, n: usize, i: usize) -> u64 {
    let bits = dtype.size() * 8;
    let signed = matches!(dtype, DType::i8 | DType::i32 | DType::i64);
    let mask: u128 = if bits == 64 {
        u64::MAX as u128
    } else {
        (1u128 << bits) - 1
    };
    let as_val = |u: u64| -> i128 {
        let m = (u as u128) & mask;
        if signed && (m >> (bits - 1)) & 1 == 1 {
            m as i128 - (1i128 << bits)
        } else {
            m as i128
        }
    };
    let vals: Vec<i128> = (0..n).map(|r| as_val(int_val(r, i))).collect();
    let res: u128 = match op {
        AllReduce::Sum => vals
            .iter()
            .fold(0u128, |a, &v| a.wrapping_add(v as u128) & mask),
        AllReduce::Prod => vals
            .iter()
            .fold(1u128, |a, &v| a.wrapping_mul(v as u128) & mask),
        AllReduce::Min => (*vals.iter().min().unwrap() as u128) & mask,
        AllReduce::Max => (*vals.iter().max().unwrap() as u128) & mask,
    };
    res as u64
}

pub fn read_elem(dtype: DType, b: &[u8]) -> f64 {
    match dtype {
        DType::f32 => f32::from_le_bytes(b.try_into().unwrap()) as f64,
        DType::f64 => f64::from_le_bytes(b.try_into().unwrap()),
        DType::f16 => f16::from_le_bytes(b.try_into().unwrap()).to_f64(),
        DType::bf16 => bf16::from_le_bytes(b.try_into().unwrap()).to_f64(),
        _ => unreachable!(),
    }
}

pub fn read_int(dtype: DType, b: &[u8]) -> u64 {
    let mut x = [0u8; 8];
    x[..dtype.size()].copy_from_slice(b);
    u64::from_le_bytes(x)
}

pub fn check_all_reduce(dtype: DType, op: AllReduce, n: usize, data: &[u8]) -> Result<(), String> {
    check_reduced_from(dtype, op, n, 0, data)
}

/// Checks `data` as elements `first..` of the reduction of every rank's [`fill`].
pub fn check_reduced_from(
    dtype: DType,
    op: AllReduce,
    n: usize,
    first: usize,
    data: &[u8],
) -> Result<(), String> {
    for (i, b) in data.chunks(dtype.size()).enumerate() {
        let i = first + i;
        if dtype.is_float() {
            let (got, want) = (read_elem(dtype, b), float_ref(op, n, i));
            if got != want {
                return Err(format!(
                    "{} {}: element {i} is {got}, reference {want}",
                    dtype.name(),
                    op.name()
                ));
            }
        } else {
            let (got, want) = (read_int(dtype, b), int_ref(dtype, op, n, i));
            if got != want {
                return Err(format!(
                    "{} {}: element {i} is {got:#x}, reference {want:#x}",
                    dtype.name(),
                    op.name()
                ));
            }
        }
    }
    Ok(())
}

/// FNV-1a over the result: equal hashes on every rank means the same bits (up to collision).
pub fn hash(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x100_0000_01b3)
    })
}
