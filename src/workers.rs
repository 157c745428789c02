//! Byte work on worker cores (`RDMACOMM_REDUCE_THREADS`): the copies and reductions of a large
//! chunk cut into disjoint ranges of whole 4 KiB blocks, each done by one worker while the
//! caller waits (asleep, its core free for them). Every element sees the same operation on the same operands whatever
//! the number of workers, so the bits never depend on it. One pool per process, its own (not
//! rayon's global one, which the application may use), made by the first communicator that
//! asks for more than one thread.

use std::sync::OnceLock;

/// Bytes below which a pass stays on the calling thread: below it a hand-off to the workers
/// costs about what it saves.
pub(crate) const SPLIT_MIN: usize = 256 << 10;

/// Ranges are whole multiples of this (every element size, the fused kernels' block).
const GRAIN: usize = 4096;

static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();

/// Makes the process's pool of `threads` workers (1: none, the caller does the work) once,
/// pinning worker `k` to `cores[k]` where cores are given; later calls keep the first. Returns
/// the threads that share a pass (1 where the pool could not be made).
pub(crate) fn configure(threads: usize, cores: Vec<usize>) -> usize {
    let pool = POOL.get_or_init(|| {
        if threads <= 1 {
            return None;
        }
        let built = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|k| format!("rdmacomm-reduce-{k}"))
            .start_handler(move |k| {
                if let Some(&c) = cores.get(k) {
                    core_affinity::set_for_current(core_affinity::CoreId { id: c });
                }
            })
            .build();
        match built {
            Ok(p) => Some(p),
            Err(e) => {
                log::warn!("no reduce workers ({e}): byte work stays on the calling thread");
                None
            }
        }
    });
    threads_in(pool)
}

fn threads_in(pool: &Option<rayon::ThreadPool>) -> usize {
    pool.as_ref().map_or(1, |p| p.current_num_threads())
}

/// The threads that share a large pass (1: the caller alone).
pub fn threads() -> usize {
    POOL.get().map_or(1, threads_in)
}

/// The process's pool, where it has one.
fn pool() -> Option<&'static rayon::ThreadPool> {
    POOL.get()?.as_ref()
}

/// The bytes of each of `pool`'s ranges of `len` bytes, where they are worth splitting.
fn part(pool: Option<&rayon::ThreadPool>, len: usize) -> Option<(&rayon::ThreadPool, usize)> {
    let pool = pool.filter(|_| len >= SPLIT_MIN)?;
    let n = pool.current_num_threads();
    Some((pool, len.div_ceil(n).div_ceil(GRAIN) * GRAIN))
}

/// `f(dst part, src part)` over equal-length `dst` and `src`, split where worth it.
pub(crate) fn split2(dst: &mut [u8], src: &[u8], f: impl Fn(&mut [u8], &[u8]) + Sync) {
    split2_on(pool(), dst, src, f)
}

/// [`split2`] on `pool`.
fn split2_on(
    pool: Option<&rayon::ThreadPool>,
    dst: &mut [u8],
    src: &[u8],
    f: impl Fn(&mut [u8], &[u8]) + Sync,
) {
    use rayon::prelude::*;
    let Some((pool, part)) = part(pool, dst.len()) else {
        return f(dst, src);
    };
    pool.install(|| {
        dst.par_chunks_mut(part)
            .zip(src.par_chunks(part))
            .for_each(|(d, s)| f(d, s))
    });
}

/// `f(out part, a part, b part)` over equal-length slices, split where worth it.
pub(crate) fn split3(
    out: &mut [u8],
    a: &mut [u8],
    b: &[u8],
    f: impl Fn(&mut [u8], &mut [u8], &[u8]) + Sync,
) {
    split3_on(pool(), out, a, b, f)
}

/// [`split3`] on `pool`.
fn split3_on(
    pool: Option<&rayon::ThreadPool>,
    out: &mut [u8],
    a: &mut [u8],
    b: &[u8],
    f: impl Fn(&mut [u8], &mut [u8], &[u8]) + Sync,
) {
    use rayon::prelude::*;
    let Some((pool, part)) = part(pool, out.len()) else {
        return f(out, a, b);
    };
    pool.install(|| {
        out.par_chunks_mut(part)
            .zip(a.par_chunks_mut(part))
            .zip(b.par_chunks(part))
            .for_each(|((o, x), y)| f(o, x, y))
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::{AllReduce, DType};

    /// Values whose sums and products round, NaNs and infinities among them.
    fn bytes(seed: u32, len: usize, dtype: DType) -> Vec<u8> {
        let mut x = seed.wrapping_mul(2_654_435_761) | 1;
        let mut v = vec![0u8; len];
        for (i, b) in v.iter_mut().enumerate() {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            // Mostly moderate exponents; now and then anything (NaN, infinity, subnormal).
            *b = if dtype.size() > 1 && i % dtype.size() == dtype.size() - 1 && x % 97 != 0 {
                0x3c + (x % 8) as u8
            } else {
                x as u8
            };
        }
        v
    }

    /// Every dtype and op, split over 1, 2 and 3 threads (and past a range's end), gives the
    /// bits the calling thread alone gives, for the in-place reduction, the fused reduction
    /// into a slot (kept and not), the double copy and the copy.
    #[test]
    fn any_number_of_workers_gives_the_same_bits() {
        let pools: Vec<_> = (1..=3)
            .map(|n| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .build()
                    .unwrap()
            })
            .collect();
        let len = SPLIT_MIN * 3 + 5 * 4096 + 64; // uneven parts; the last range short
        for dtype in DType::ALL {
            for op in [
                AllReduce::Sum,
                AllReduce::Prod,
                AllReduce::Min,
                AllReduce::Max,
            ] {
                let (a0, b) = (bytes(1, len, dtype), bytes(2, len, dtype));
                let serial = |out: &mut [u8], a: &mut [u8], b: &[u8]| {
                    out.copy_from_slice(a);
                    crate::reduce::reduce_unchecked(op, dtype, out, b);
                    a.copy_from_slice(out);
                };
                let (mut want_out, mut want_a) = (vec![0u8; len], a0.clone());
                serial(&mut want_out, &mut want_a, &b);
                for (k, pool) in pools.iter().enumerate() {
                    let (mut out, mut a) = (vec![0u8; len], a0.clone());
                    split3_on(Some(pool), &mut out, &mut a, &b, serial);
                    let what = format!("{dtype:?} {op:?} on {} threads", k + 1);
                    assert!(out == want_out && a == want_a, "{what}: fused");
                    let mut acc = a0.clone();
                    split2_on(Some(pool), &mut acc, &b, |d, s| {
                        crate::reduce::reduce_unchecked(op, dtype, d, s)
                    });
                    assert!(acc == want_out, "{what}: in place");
                    let mut c = vec![0u8; len];
                    split2_on(Some(pool), &mut c, &b, crate::copy::copy);
                    assert!(c == b, "{what}: copy");
                }
            }
        }
    }
}
