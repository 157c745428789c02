//! Reduction kernel throughput beside memcpy, in GB/s of bytes read plus bytes written
//! (a reduction `acc = acc + src` moves 3 x size bytes, a memcpy 2 x size).
//!
//! `cargo bench --bench reduce_kernels` (`-- --quick` for fewer sizes).

use rdmacomm::unstable::reduce::{reduce_into, simd_level};
use rdmacomm::{AllReduce, DType};
use std::hint::black_box;
use std::time::{Duration, Instant};

/// Median of per-iteration times over ~0.3 s (at least 5 runs).
fn time(mut f: impl FnMut()) -> Duration {
    f();
    let mut v = Vec::new();
    let t0 = Instant::now();
    while v.len() < 5 || (t0.elapsed() < Duration::from_millis(300) && v.len() < 2000) {
        let t = Instant::now();
        f();
        v.push(t.elapsed());
    }
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let sizes: Vec<usize> = if quick {
        vec![64 << 10, 16 << 20]
    } else {
        vec![64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
    };
    println!("kernel copy: {:?}", simd_level());
    println!(
        "{:>10} {:>12} {:>12} {:>12} {:>12} {:>8} {:>8}",
        "size", "memcpy GB/s", "f32 sum", "bf16 sum", "f16 sum", "f32/cp", "f16/cp"
    );
    for &size in &sizes {
        let src = vec![1u8; size];
        let mut dst = vec![0u8; size];
        let t_cp = time(|| {
            dst.copy_from_slice(black_box(&src));
            black_box(&dst);
        });
        let cp = 2.0 * size as f64 / t_cp.as_secs_f64() / 1e9;
        let rate = |dtype: DType| {
            // Values that stay finite under repeated adds.
            let mut acc = vec![0u8; size];
            let s = vec![0u8; size];
            let t = time(|| {
                reduce_into(AllReduce::Sum, dtype, black_box(&mut acc), black_box(&s)).unwrap();
            });
            3.0 * size as f64 / t.as_secs_f64() / 1e9
        };
        let (f32r, bf16r, f16r) = (rate(DType::f32), rate(DType::bf16), rate(DType::f16));
        println!(
            "{:>10} {:>12.2} {:>12.2} {:>12.2} {:>12.2} {:>8.2} {:>8.2}",
            size,
            cp,
            f32r,
            bf16r,
            f16r,
            f32r / cp,
            f16r.min(bf16r) / cp
        );
    }
}
