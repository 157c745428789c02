//! Element-wise reduction kernels for every [`DType`] x [`AllReduce`].
//!
//! `acc[i] = op(acc[i], src[i])`. The loops are written so LLVM vectorizes them; each is compiled
//! twice, for the x86-64 baseline (SSE2) and for AVX2+FMA, and the AVX2 copy is chosen at run time
//! when the CPU has it (no `-C target-cpu=native` needed). f16 and bf16 are widened to f32, combined,
//! and rounded back to nearest-even. Floats: a NaN operand gives NaN for every op. Integers wrap.

use crate::dtype::{AllReduce, DType};
use crate::error::{Error, Result};
use half::{bf16, f16, slice::HalfFloatSliceExt};

/// One element type's combine rules.
trait Elem: Copy + bytemuck::Pod {
    fn sum(a: Self, b: Self) -> Self;
    fn prod(a: Self, b: Self) -> Self;
    fn min(a: Self, b: Self) -> Self;
    fn max(a: Self, b: Self) -> Self;
}

macro_rules! int_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            #[inline(always)] fn sum(a: Self, b: Self) -> Self { a.wrapping_add(b) }
            #[inline(always)] fn prod(a: Self, b: Self) -> Self { a.wrapping_mul(b) }
            #[inline(always)] fn min(a: Self, b: Self) -> Self { if b < a { b } else { a } }
            #[inline(always)] fn max(a: Self, b: Self) -> Self { if b > a { b } else { a } }
        }
    )*};
}
int_elem!(i8, u8, i32, u32, i64, u64);

macro_rules! float_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            #[inline(always)] fn sum(a: Self, b: Self) -> Self { a + b }
            #[inline(always)] fn prod(a: Self, b: Self) -> Self { a * b }
            // NaN in a: a; NaN in b: the comparison is false, so b.
            #[allow(clippy::eq_op)]
            #[inline(always)] fn min(a: Self, b: Self) -> Self { if a != a || a < b { a } else { b } }
            #[allow(clippy::eq_op)]
            #[inline(always)] fn max(a: Self, b: Self) -> Self { if a != a || a > b { a } else { b } }
        }
    )*};
}
float_elem!(f32, f64);

#[inline(always)]
fn combine<T: Elem>(op: AllReduce, acc: &mut [T], src: &[T]) {
    // Written as four loops with the op inlined so each vectorizes.
    match op {
        AllReduce::Sum => acc
            .iter_mut()
            .zip(src)
            .for_each(|(a, b)| *a = T::sum(*a, *b)),
        AllReduce::Prod => acc
            .iter_mut()
            .zip(src)
            .for_each(|(a, b)| *a = T::prod(*a, *b)),
        AllReduce::Min => acc
            .iter_mut()
            .zip(src)
            .for_each(|(a, b)| *a = T::min(*a, *b)),
        AllReduce::Max => acc
            .iter_mut()
            .zip(src)
            .for_each(|(a, b)| *a = T::max(*a, *b)),
    }
}

/// bf16 -> f32 (exact).
#[inline(always)]
fn bf16_bits_to_f32(x: u16) -> f32 {
    f32::from_bits((x as u32) << 16)
}

/// f32 -> bf16, round to nearest even; NaN stays NaN (quiet).
#[inline(always)]
fn f32_to_bf16_bits(f: f32) -> u16 {
    let b = f.to_bits();
    let nan = (b & 0x7fff_ffff) > 0x7f80_0000;
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    if nan {
        ((b >> 16) | 0x40) as u16
    } else {
        rounded
    }
}

#[inline(always)]
fn combine_bf16(op: AllReduce, acc: &mut [u16], src: &[u16]) {
    const BLOCK: usize = 512;
    let mut a32 = [0f32; BLOCK];
    let mut b32 = [0f32; BLOCK];
    for (ac, sc) in acc.chunks_mut(BLOCK).zip(src.chunks(BLOCK)) {
        let n = ac.len();
        let (a32, b32) = (&mut a32[..n], &mut b32[..n]);
        a32.iter_mut()
            .zip(ac.iter())
            .for_each(|(d, &x)| *d = bf16_bits_to_f32(x));
        b32.iter_mut()
            .zip(sc.iter())
            .for_each(|(d, &x)| *d = bf16_bits_to_f32(x));
        combine::<f32>(op, a32, b32);
        ac.iter_mut()
            .zip(a32.iter())
            .for_each(|(d, &x)| *d = f32_to_bf16_bits(x));
    }
}

#[inline(always)]
fn combine_f16(op: AllReduce, acc: &mut [f16], src: &[f16]) {
    const BLOCK: usize = 512;
    let mut a32 = [0f32; BLOCK];
    let mut b32 = [0f32; BLOCK];
    for (ac, sc) in acc.chunks_mut(BLOCK).zip(src.chunks(BLOCK)) {
        let n = ac.len();
        ac.convert_to_f32_slice(&mut a32[..n]);
        sc.convert_to_f32_slice(&mut b32[..n]);
        combine::<f32>(op, &mut a32[..n], &b32[..n]);
        ac.convert_from_f32_slice(&a32[..n]);
    }
}

/// Dispatches on dtype over aligned, equal-length byte slices.
#[inline(always)]
fn combine_bytes(op: AllReduce, dtype: DType, acc: &mut [u8], src: &[u8]) {
    use bytemuck::{cast_slice as c, cast_slice_mut as m};
    match dtype {
        DType::f32 => combine::<f32>(op, m(acc), c(src)),
        DType::f64 => combine::<f64>(op, m(acc), c(src)),
        DType::f16 => combine_f16(op, m(acc), c(src)),
        DType::bf16 => combine_bf16(op, m(acc), c(src)),
        DType::i8 => combine::<i8>(op, m(acc), c(src)),
        DType::u8 => combine::<u8>(op, acc, src),
        DType::i32 => combine::<i32>(op, m(acc), c(src)),
        DType::u32 => combine::<u32>(op, m(acc), c(src)),
        DType::i64 => combine::<i64>(op, m(acc), c(src)),
        DType::u64 => combine::<u64>(op, m(acc), c(src)),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn combine_bytes_avx2(op: AllReduce, dtype: DType, acc: &mut [u8], src: &[u8]) {
    if dtype == DType::f16 || dtype == DType::bf16 {
        // u8 -> u16, checked by bytemuck.
        let (a, b) = (bytemuck::cast_slice_mut(acc), bytemuck::cast_slice(src));
        // SAFETY: same CPU features as this function.
        return unsafe {
            if dtype == DType::bf16 {
                half_avx2::<true>(op, a, b)
            } else {
                half_avx2::<false>(op, a, b)
            }
        };
    }
    combine_bytes(op, dtype, acc, src)
}

/// f16 (F16C) or bf16 (shifts): 8 lanes widened to f32, combined, rounded back to nearest even.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn half_avx2<const BF: bool>(op: AllReduce, acc: &mut [u16], src: &[u16]) {
    use std::arch::x86_64::*;
    let bf = BF;
    let widen = |p: *const u16| -> __m256 {
        // SAFETY: the caller passes a pointer with 8 readable u16 (unaligned load).
        unsafe {
            let h = _mm_loadu_si128(p as *const __m128i);
            if bf {
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            } else {
                _mm256_cvtph_ps(h)
            }
        }
    };
    let narrow = |r: __m256| -> __m128i {
        if !bf {
            return _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(r);
        }
        let bits = _mm256_castps_si256(r);
        let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(1));
        let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(
            bits,
            _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)),
        ));
        let quiet = _mm256_or_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(0x40));
        let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(r, r));
        let v = _mm256_blendv_epi8(rounded, quiet, nan);
        // 8 x u32 (< 2^16) -> 8 x u16: pack within lanes, then gather the two halves.
        let packed = _mm256_permute4x64_epi64::<0b1000>(_mm256_packus_epi32(v, v));
        _mm256_castsi256_si128(packed)
    };
    let n8 = acc.len() / 8 * 8;
    let (ap, sp) = (acc.as_mut_ptr(), src.as_ptr());
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= len for both slices (equal lengths); unaligned loads and stores.
        unsafe {
            let a = widen(ap.add(i));
            let b = widen(sp.add(i));
            let r = match op {
                AllReduce::Sum => _mm256_add_ps(a, b),
                AllReduce::Prod => _mm256_mul_ps(a, b),
                // a if a is NaN or a < b (resp. a > b), else b: the scalar rule.
                AllReduce::Min => {
                    let m = _mm256_or_ps(
                        _mm256_cmp_ps::<_CMP_UNORD_Q>(a, a),
                        _mm256_cmp_ps::<_CMP_LT_OQ>(a, b),
                    );
                    _mm256_blendv_ps(b, a, m)
                }
                AllReduce::Max => {
                    let m = _mm256_or_ps(
                        _mm256_cmp_ps::<_CMP_UNORD_Q>(a, a),
                        _mm256_cmp_ps::<_CMP_GT_OQ>(a, b),
                    );
                    _mm256_blendv_ps(b, a, m)
                }
            };
            _mm_storeu_si128(ap.add(i) as *mut __m128i, narrow(r));
        }
        i += 8;
    }
    if bf {
        combine_bf16(op, &mut acc[n8..], &src[n8..]);
    } else {
        combine_f16(
            op,
            bytemuck::cast_slice_mut(&mut acc[n8..]),
            bytemuck::cast_slice(&src[n8..]),
        );
    }
}

fn combine_dispatch(op: AllReduce, dtype: DType, acc: &mut [u8], src: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    if simd_level() == SimdLevel::Avx2 {
        // SAFETY: simd_level() verified at run time that this CPU has AVX2, FMA and F16C.
        unsafe { combine_bytes_avx2(op, dtype, acc, src) };
        return;
    }
    combine_bytes(op, dtype, acc, src)
}

/// `out = op(a, b)`, and `a = out` where `keep`, element by element in one loop: the same
/// combine on the same operands as [`combine`], so the same bits.
#[inline(always)]
fn combine3<T: Elem>(op: AllReduce, out: &mut [T], a: &mut [T], b: &[T], keep: bool) {
    #[inline(always)]
    fn go<T: Copy>(out: &mut [T], a: &mut [T], b: &[T], keep: bool, f: impl Fn(T, T) -> T) {
        if keep {
            for ((o, x), y) in out.iter_mut().zip(a.iter_mut()).zip(b) {
                let r = f(*x, *y);
                *o = r;
                *x = r;
            }
        } else {
            for ((o, x), y) in out.iter_mut().zip(a.iter()).zip(b) {
                *o = f(*x, *y);
            }
        }
    }
    match op {
        AllReduce::Sum => go(out, a, b, keep, T::sum),
        AllReduce::Prod => go(out, a, b, keep, T::prod),
        AllReduce::Min => go(out, a, b, keep, T::min),
        AllReduce::Max => go(out, a, b, keep, T::max),
    }
}

/// [`combine3`] on aligned byte slices of `dtype`; false for the half types (widened in blocks
/// instead, by the caller).
#[inline(always)]
fn combine3_bytes(
    op: AllReduce,
    dtype: DType,
    out: &mut [u8],
    a: &mut [u8],
    b: &[u8],
    keep: bool,
) -> bool {
    use bytemuck::{cast_slice as c, cast_slice_mut as m};
    match dtype {
        DType::f32 => combine3::<f32>(op, m(out), m(a), c(b), keep),
        DType::f64 => combine3::<f64>(op, m(out), m(a), c(b), keep),
        DType::i8 => combine3::<i8>(op, m(out), m(a), c(b), keep),
        DType::u8 => combine3::<u8>(op, out, a, b, keep),
        DType::i32 => combine3::<i32>(op, m(out), m(a), c(b), keep),
        DType::u32 => combine3::<u32>(op, m(out), m(a), c(b), keep),
        DType::i64 => combine3::<i64>(op, m(out), m(a), c(b), keep),
        DType::u64 => combine3::<u64>(op, m(out), m(a), c(b), keep),
        DType::f16 | DType::bf16 => return false,
    }
    true
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn combine3_bytes_avx2(
    op: AllReduce,
    dtype: DType,
    out: &mut [u8],
    a: &mut [u8],
    b: &[u8],
    keep: bool,
) -> bool {
    combine3_bytes(op, dtype, out, a, b, keep)
}

/// `out = op(a, b)` (and `a = out` where `keep`) on the calling thread: one loop where the
/// slices are aligned for `dtype`, else (and for f16 and bf16) block by block through L1.
fn reduce3_serial(op: AllReduce, dtype: DType, out: &mut [u8], a: &mut [u8], b: &[u8], keep: bool) {
    let al = dtype.size();
    if [out.as_ptr(), a.as_ptr(), b.as_ptr()]
        .iter()
        .all(|p| (*p as usize) % al == 0)
    {
        #[cfg(target_arch = "x86_64")]
        if simd_level() == SimdLevel::Avx2 {
            // SAFETY: simd_level() verified at run time that this CPU has AVX2, FMA and F16C.
            if unsafe { combine3_bytes_avx2(op, dtype, out, a, b, keep) } {
                return;
            }
        }
        if simd_level() != SimdLevel::Avx2 && combine3_bytes(op, dtype, out, a, b, keep) {
            return;
        }
    }
    let blocks = out.chunks_mut(FUSED_BLOCK).zip(a.chunks_mut(FUSED_BLOCK));
    for ((o, x), y) in blocks.zip(b.chunks(FUSED_BLOCK)) {
        o.copy_from_slice(x);
        reduce_serial(op, dtype, o, y);
        if keep {
            x.copy_from_slice(o);
        }
    }
}

/// The instruction set the kernels use on this CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimdLevel {
    /// The architecture's baseline (SSE2 on x86-64).
    Baseline,
    /// AVX2 with FMA and F16C.
    Avx2,
}

static LEVEL: std::sync::OnceLock<SimdLevel> = std::sync::OnceLock::new();

/// Chooses the kernels once per process (the first communicator does, from its
/// [`crate::Config::simd_baseline`], `RDMACOMM_SIMD=baseline`): `baseline` forces the portable
/// ones, else the best this CPU runs. Later calls keep the first choice, which is returned.
pub fn choose_simd(baseline: bool) -> SimdLevel {
    *LEVEL.get_or_init(|| {
        if baseline {
            return SimdLevel::Baseline;
        }
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            return SimdLevel::Avx2;
        }
        SimdLevel::Baseline
    })
}

/// The kernels chosen before, if anything chose them.
pub fn chosen() -> Option<SimdLevel> {
    LEVEL.get().copied()
}

/// The kernels in use ([`choose_simd`], detected from the CPU if nothing chose before).
pub fn simd_level() -> SimdLevel {
    choose_simd(false)
}

/// `acc = op(acc, src)` element-wise (for the tests and `unstable`). Lengths must be equal and whole elements of `dtype`.
/// Either slice may be unaligned for the dtype (then it is staged through an aligned buffer).
#[cfg_attr(not(feature = "unstable"), allow(dead_code))]
pub fn reduce_into(op: AllReduce, dtype: DType, acc: &mut [u8], src: &[u8]) -> Result<()> {
    if acc.len() != src.len() {
        return Err(Error::InvalidArgument(format!(
            "reduce: accumulator has {} bytes but source has {}",
            acc.len(),
            src.len()
        )));
    }
    dtype.check_len(acc.len(), "reduce buffer")?;
    reduce_unchecked(op, dtype, acc, src);
    Ok(())
}

/// [`reduce_into`] without the checks, for the collectives' hot path (lengths already validated).
pub(crate) fn reduce_unchecked(op: AllReduce, dtype: DType, acc: &mut [u8], src: &[u8]) {
    crate::workers::split2(acc, src, |a, s| reduce_serial(op, dtype, a, s));
}

/// [`reduce_unchecked`] on the calling thread alone.
fn reduce_serial(op: AllReduce, dtype: DType, acc: &mut [u8], src: &[u8]) {
    debug_assert_eq!(acc.len(), src.len());
    let align = dtype.size();
    if (acc.as_ptr() as usize) % align == 0 && (src.as_ptr() as usize) % align == 0 {
        combine_dispatch(op, dtype, acc, src);
        return;
    }
    // Unaligned: stage through aligned blocks.
    const BLOCK: usize = 4096;
    let mut a = [0u64; BLOCK / 8];
    let mut b = [0u64; BLOCK / 8];
    for (ac, sc) in acc.chunks_mut(BLOCK).zip(src.chunks(BLOCK)) {
        let n = ac.len();
        let ab = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut a)[..n];
        let bb = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut b)[..n];
        ab.copy_from_slice(ac);
        bb.copy_from_slice(sc);
        combine_dispatch(op, dtype, ab, bb);
        ac.copy_from_slice(ab);
    }
}

/// Bytes a fused pass works on at a time: small enough that the block it wrote is still in the
/// first-level cache when it is reduced or written again, so that memory sees one pass.
const FUSED_BLOCK: usize = 4096;

/// `out = op(a, b)` element-wise, and also `a = out` where `keep`: one sweep over memory (a, b
/// read once, each output written once). The same combine as [`reduce_unchecked`] with the
/// same operands, so the same bits.
pub(crate) fn reduce_to(
    op: AllReduce,
    dtype: DType,
    out: &mut [u8],
    a: &mut [u8],
    b: &[u8],
    keep: bool,
) {
    debug_assert!(out.len() == a.len() && a.len() == b.len());
    crate::workers::split3(out, a, b, |out, a, b| {
        reduce3_serial(op, dtype, out, a, b, keep)
    });
}

/// `out = src` and `a = src`: one read of `src`, block by block, for two places.
pub(crate) fn copy_twice(out: &mut [u8], a: &mut [u8], src: &[u8]) {
    debug_assert!(out.len() == a.len() && a.len() == src.len());
    crate::workers::split3(out, a, src, |out, a, src| {
        // One loop, two stores per load (vectorized by the compiler).
        for ((o, x), y) in out.iter_mut().zip(a.iter_mut()).zip(src) {
            *o = *y;
            *x = *y;
        }
    });
}

/// The scalar reference of one combine, element by element (used by tests and `-c` checks):
/// independent of the vector kernels (bf16/f16 rounding by the `half` crate).
#[cfg_attr(not(feature = "unstable"), allow(dead_code))]
pub mod reference {
    use super::*;

    macro_rules! scalar_ops {
        ($name:ident, $t:ty, float) => {
            /// Scalar combine for this type.
            pub fn $name(op: AllReduce, a: $t, b: $t) -> $t {
                if a.is_nan() || b.is_nan() {
                    return <$t>::NAN;
                }
                match op {
                    AllReduce::Sum => a + b,
                    AllReduce::Prod => a * b,
                    AllReduce::Min => a.min(b),
                    AllReduce::Max => a.max(b),
                }
            }
        };
        ($name:ident, $t:ty, int) => {
            /// Scalar combine for this type.
            pub fn $name(op: AllReduce, a: $t, b: $t) -> $t {
                match op {
                    AllReduce::Sum => a.wrapping_add(b),
                    AllReduce::Prod => a.wrapping_mul(b),
                    AllReduce::Min => std::cmp::min(a, b),
                    AllReduce::Max => std::cmp::max(a, b),
                }
            }
        };
    }
    scalar_ops!(f32_op, f32, float);
    scalar_ops!(f64_op, f64, float);
    scalar_ops!(i8_op, i8, int);
    scalar_ops!(u8_op, u8, int);
    scalar_ops!(i32_op, i32, int);
    scalar_ops!(u32_op, u32, int);
    scalar_ops!(i64_op, i64, int);
    scalar_ops!(u64_op, u64, int);

    /// f16 combine: in f32, rounded by `half`.
    pub fn f16_op(op: AllReduce, a: f16, b: f16) -> f16 {
        f16::from_f32(f32_op(op, a.to_f32(), b.to_f32()))
    }

    /// bf16 combine: in f32, rounded by `half`.
    pub fn bf16_op(op: AllReduce, a: bf16, b: bf16) -> bf16 {
        bf16::from_f32(f32_op(op, a.to_f32(), b.to_f32()))
    }
}

#[cfg(test)]
mod fused_tests {
    use super::*;

    /// Bytes of every kind: NaNs, infinities, subnormals and ordinary values alike.
    fn noise(seed: u64, len: usize) -> Vec<u8> {
        let mut x = seed | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// The fused reduction into a slot gives, for every dtype, op, length and alignment, the
    /// bits of a copy followed by the in-place reduction; with `keep`, in both places.
    #[test]
    fn fused_reduction_is_the_in_place_one() {
        for dtype in DType::ALL {
            for op in [
                AllReduce::Sum,
                AllReduce::Prod,
                AllReduce::Min,
                AllReduce::Max,
            ] {
                for elems in [0, 1, 7, 8, 1023, 4099] {
                    for shift in [0, 1] {
                        let len = elems * dtype.size();
                        let (a0, b0) = (noise(3 + elems as u64, len + 1), noise(5, len + 1));
                        let (a0, b) = (&a0[shift..shift + len], &b0[1 - shift..1 - shift + len]);
                        let mut want = a0.to_vec();
                        reduce_unchecked(op, dtype, &mut want, b);
                        for keep in [false, true] {
                            let mut a = a0.to_vec();
                            let mut out = vec![0u8; len + 1];
                            let out = &mut out[shift..shift + len];
                            reduce_to(op, dtype, out, &mut a, b, keep);
                            let what = format!("{dtype:?} {op:?} x{elems} shift {shift}");
                            assert!(out == &want[..], "{what}: out");
                            assert!(a == if keep { &want[..] } else { a0 }, "{what}: kept");
                        }
                    }
                }
            }
        }
    }
}
