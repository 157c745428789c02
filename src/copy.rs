//! The copy kernel: moving bytes between user buffers and the transports' slots.
//!
//! libc's `memcpy` is the right copy almost everywhere, but not on every CPU: glibc copies
//! mid-sized buffers (a few KiB up to its non-temporal threshold) with `rep movsb`, which some
//! CPUs run slowly (an emulated CPU byte by byte, as in the soft-RoCE VM; AMD Zen parts at some
//! sizes and alignments, where glibc has narrowed its use; measured: docs/DESIGN.md).
//! Where AVX2 exists, both are timed on this CPU once, when the first communicator is made, and
//! the faster is kept (as the Linux kernel picks its RAID xor routine at boot);
//! `RDMACOMM_COPY=libc|simd` overrides (read by [`crate::Config`], applied by [`choose`]).

use std::sync::OnceLock;

/// Copies below this many bytes always use libc (its small-copy paths are fine everywhere).
pub const SIMD_MIN: usize = 4096;

/// Which copy kernel moves 4 KiB or more (`RDMACOMM_COPY`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyKernel {
    /// libc's `memcpy` (`copy_from_slice`).
    Libc,
    /// 128 bytes per turn through AVX2 registers, stores aligned to 32 bytes.
    Simd,
}

/// `dst.copy_from_slice(src)` through this CPU's faster copy kernel. Panics if the lengths
/// differ, as `copy_from_slice` does.
#[inline]
pub fn copy(dst: &mut [u8], src: &[u8]) {
    assert_eq!(
        dst.len(),
        src.len(),
        "copy between slices of different lengths"
    );
    crate::workers::split2(dst, src, copy_serial);
}

/// [`copy`] on the calling thread alone.
fn copy_serial(dst: &mut [u8], src: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    if dst.len() >= SIMD_MIN && kernel() == CopyKernel::Simd {
        // SAFETY: kernel() returns Simd only after simd_level() found AVX2 on this CPU.
        unsafe { copy_avx2(dst, src) };
        return;
    }
    dst.copy_from_slice(src);
}

/// Parses a copy-kernel setting (`RDMACOMM_COPY`, read by [`crate::Config`]): `None` for `auto`
/// or empty; any other value than `libc` and `simd` is an error that names it.
pub fn parse(v: &str) -> crate::Result<Option<CopyKernel>> {
    match v.trim() {
        "" | "auto" => Ok(None),
        "libc" => Ok(Some(CopyKernel::Libc)),
        "simd" => Ok(Some(CopyKernel::Simd)),
        v => Err(crate::Error::Config(format!(
            "RDMACOMM_COPY={v:?}: use libc, simd or auto"
        ))),
    }
}

static KERNEL: OnceLock<CopyKernel> = OnceLock::new();

/// Chooses the copy kernel once per process (the first communicator does, from its
/// [`crate::Config::copy`]): `requested` (`simd` only where the CPU has AVX2), else the faster of
/// the two measured on this CPU; libc without AVX2. Later calls keep the first choice, which is
/// returned.
pub fn choose(requested: Option<CopyKernel>) -> CopyKernel {
    *KERNEL.get_or_init(|| {
        let simd = crate::reduce::simd_level() == crate::reduce::SimdLevel::Avx2;
        match requested {
            Some(CopyKernel::Libc) => CopyKernel::Libc,
            Some(CopyKernel::Simd) if simd => CopyKernel::Simd,
            _ if simd => calibrate(),
            _ => CopyKernel::Libc,
        }
    })
}

/// The copy kernel chosen before, if anything chose one.
pub fn chosen() -> Option<CopyKernel> {
    KERNEL.get().copied()
}

/// The copy kernel in use (the faster one here unless `RDMACOMM_COPY` chose).
pub fn kernel() -> CopyKernel {
    choose(None)
}

/// Times both kernels on 256 KiB (inside the range where `rep movsb` is used), alternating,
/// best of five each; SIMD only if it is clearly faster (by a fifth), libc on a near tie.
#[cfg(target_arch = "x86_64")]
fn calibrate() -> CopyKernel {
    use std::time::{Duration, Instant};
    const LEN: usize = 256 << 10;
    let src = vec![0x5au8; LEN];
    let mut dst = vec![0u8; LEN];
    let time = |f: &mut dyn FnMut()| {
        let t = Instant::now();
        f();
        t.elapsed()
    };
    let (mut libc, mut simd) = (Duration::MAX, Duration::MAX);
    for _ in 0..5 {
        libc = libc.min(time(&mut || {
            dst.copy_from_slice(std::hint::black_box(&src));
        }));
        // SAFETY: called only when simd_level() found AVX2 (see kernel()).
        simd = simd.min(time(&mut || unsafe {
            copy_avx2(&mut dst, std::hint::black_box(&src))
        }));
    }
    std::hint::black_box(&dst);
    if simd.as_secs_f64() < 0.8 * libc.as_secs_f64() {
        CopyKernel::Simd
    } else {
        CopyKernel::Libc
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn calibrate() -> CopyKernel {
    CopyKernel::Libc
}

/// The AVX2 copy: libc for the bytes up to `dst`'s 32-byte alignment and for the tail, 128-byte
/// turns of unaligned loads and aligned stores between.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn copy_avx2(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_store_si256};
    let n = dst.len().min(src.len());
    let head = ((dst.as_ptr() as usize).wrapping_neg() & 31).min(n);
    dst[..head].copy_from_slice(&src[..head]);
    let body = (n - head) / 128 * 128;
    let d = dst[head..head + body].as_mut_ptr();
    let s = src[head..head + body].as_ptr();
    let mut i = 0;
    while i < body {
        // SAFETY: i + 128 <= body, so every load reads inside `src[head..head + body]` and every
        // store writes inside `dst[head..head + body]`, which starts 32-byte aligned (head).
        unsafe {
            let a = _mm256_loadu_si256(s.add(i) as *const __m256i);
            let b = _mm256_loadu_si256(s.add(i + 32) as *const __m256i);
            let c = _mm256_loadu_si256(s.add(i + 64) as *const __m256i);
            let e = _mm256_loadu_si256(s.add(i + 96) as *const __m256i);
            _mm256_store_si256(d.add(i) as *mut __m256i, a);
            _mm256_store_si256(d.add(i + 32) as *mut __m256i, b);
            _mm256_store_si256(d.add(i + 64) as *mut __m256i, c);
            _mm256_store_si256(d.add(i + 96) as *mut __m256i, e);
            // An empty asm statement (which might touch memory, as far as the compiler knows)
            // keeps LLVM from recognizing this loop as a copy and calling memcpy instead.
            std::arch::asm!("", options(nostack, preserves_flags));
        }
        i += 128;
    }
    dst[head + body..n].copy_from_slice(&src[head + body..n]);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(n: usize, seed: usize) -> Vec<u8> {
        (0..n)
            .map(|i| (i.wrapping_mul(131) ^ (i >> 7) ^ seed) as u8)
            .collect()
    }

    /// Every length around the kernel's edges, at every alignment of source and destination
    /// within 32 bytes, against a byte-by-byte copy; bytes outside the target range untouched.
    #[test]
    fn simd_copy_matches_a_bytewise_copy() {
        if crate::reduce::simd_level() != crate::reduce::SimdLevel::Avx2 {
            println!("SKIPPED: no AVX2 here");
            return;
        }
        let lens = [0, 1, 31, 32, 33, 127, 128, 129, 255, 4096, 4097, 65536 + 77];
        for &n in &lens {
            for so in 0..32 {
                for d_o in [0, 1, 7, 16, 31] {
                    let src = pattern(n + so, n);
                    let mut dst = vec![0xeeu8; n + d_o + 8];
                    // SAFETY: AVX2 checked above.
                    unsafe { copy_avx2(&mut dst[d_o..d_o + n], &src[so..so + n]) };
                    for i in 0..n {
                        assert_eq!(
                            dst[d_o + i],
                            src[so + i],
                            "len {n}, src +{so}, dst +{d_o}, byte {i}"
                        );
                    }
                    assert!(
                        dst[..d_o].iter().all(|&b| b == 0xee),
                        "bytes before the range written"
                    );
                    assert!(
                        dst[d_o + n..].iter().all(|&b| b == 0xee),
                        "bytes after the range written"
                    );
                }
            }
        }
    }

    #[test]
    fn copy_copies_whatever_kernel_is_chosen() {
        for n in [0, 100, SIMD_MIN - 1, SIMD_MIN, 300_001] {
            let src = pattern(n, 3);
            let mut dst = vec![0u8; n];
            copy(&mut dst, &src);
            assert_eq!(dst, src, "len {n} with {:?}", kernel());
        }
    }

    #[test]
    #[should_panic(expected = "different lengths")]
    fn lengths_must_match() {
        copy(&mut [0u8; 4], &[1u8; 5]);
    }
}
