//! Reduction kernels against the scalar reference, element by element: every dtype and op,
//! lengths around the vector widths, unaligned slices, NaN/Inf, integer wrapping, and both the
//! baseline and the run-time-selected SIMD copy.

mod common;
use common::Rng;
use half::{bf16, f16};
use rdmacomm::unstable::reduce::{reduce_into, reference as r};
use rdmacomm::{AllReduce, DType};

const SPECIAL_F64: [f64; 8] = [
    f64::NAN,
    f64::INFINITY,
    f64::NEG_INFINITY,
    0.0,
    -0.0,
    1e300,
    -1e-300,
    65504.0,
];

/// Random bytes for `elems` elements, with NaN/Inf/zeros/large values sprinkled in for floats.
fn gen(dtype: DType, elems: usize, rng: &mut Rng) -> Vec<u8> {
    let mut v = Vec::with_capacity(elems * dtype.size());
    for _ in 0..elems {
        let x = rng.next();
        let special = x % 13 == 0;
        let f = if special {
            SPECIAL_F64[(x >> 8) as usize % SPECIAL_F64.len()]
        } else {
            ((x >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * 200.0
        };
        match dtype {
            DType::f32 => v.extend_from_slice(&(f as f32).to_le_bytes()),
            DType::f64 => v.extend_from_slice(&f.to_le_bytes()),
            DType::f16 => v.extend_from_slice(&f16::from_f64(f).to_le_bytes()),
            DType::bf16 => v.extend_from_slice(&bf16::from_f64(f).to_le_bytes()),
            _ => v.extend_from_slice(&x.to_le_bytes()[..dtype.size()]),
        }
    }
    v
}

/// The reference result of one element as (bits, is NaN, is zero).
fn want(dtype: DType, op: AllReduce, x: &[u8], y: &[u8]) -> (u64, bool, bool) {
    macro_rules! fl {
        ($t:ty, $f:path) => {{
            let w = $f(
                op,
                <$t>::from_le_bytes(x.try_into().unwrap()),
                <$t>::from_le_bytes(y.try_into().unwrap()),
            );
            (w.to_bits() as u64, w.is_nan(), w == <$t>::from_f32(0.0))
        }};
    }
    macro_rules! int {
        ($t:ty, $f:path) => {{
            let w = $f(
                op,
                <$t>::from_le_bytes(x.try_into().unwrap()),
                <$t>::from_le_bytes(y.try_into().unwrap()),
            );
            let mut b = [0u8; 8];
            b[..dtype.size()].copy_from_slice(&w.to_le_bytes());
            (u64::from_le_bytes(b), false, false)
        }};
    }
    trait FromF32 {
        fn from_f32(f: f32) -> Self;
    }
    impl FromF32 for f32 {
        fn from_f32(f: f32) -> Self {
            f
        }
    }
    impl FromF32 for f64 {
        fn from_f32(f: f32) -> Self {
            f as f64
        }
    }
    match dtype {
        DType::f32 => fl!(f32, r::f32_op),
        DType::f64 => fl!(f64, r::f64_op),
        DType::f16 => fl!(f16, r::f16_op),
        DType::bf16 => fl!(bf16, r::bf16_op),
        DType::i8 => int!(i8, r::i8_op),
        DType::u8 => int!(u8, r::u8_op),
        DType::i32 => int!(i32, r::i32_op),
        DType::u32 => int!(u32, r::u32_op),
        DType::i64 => int!(i64, r::i64_op),
        DType::u64 => int!(u64, r::u64_op),
    }
}

/// Compares every element of the kernel's result with the scalar reference: the same bits,
/// except that any NaN matches NaN and a zero matches a zero of either sign.
fn check(dtype: DType, op: AllReduce, a: &[u8], b: &[u8], got: &[u8]) {
    let s = dtype.size();
    for i in 0..a.len() / s {
        let rng = i * s..(i + 1) * s;
        let (wbits, wnan, wzero) = want(dtype, op, &a[rng.clone()], &b[rng.clone()]);
        // The kernel's result element, classified by re-using `want` with Max(g, g) = g.
        let g = &got[rng.clone()];
        let (gbits, gnan, gzero) = want(dtype, AllReduce::Max, g, g);
        let ok = if wnan {
            gnan
        } else if wzero {
            gzero
        } else {
            gbits == wbits
        };
        assert!(
            ok,
            "{} {} element {i}: op({:?}, {:?}) gave {:?}, reference bits {wbits:#x}",
            dtype.name(),
            op.name(),
            &a[rng.clone()],
            &b[rng.clone()],
            g
        );
    }
}

const LENS: [usize; 12] = [0, 1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 4097];

fn run_all(seed: u64) {
    let mut rng = Rng(seed);
    for dtype in DType::ALL {
        for op in AllReduce::ALL {
            for &n in &LENS {
                let a = gen(dtype, n, &mut rng);
                let b = gen(dtype, n, &mut rng);
                let mut got = a.clone();
                reduce_into(op, dtype, &mut got, &b).unwrap();
                check(dtype, op, &a, &b, &got);
                // Unaligned: both slices one byte off their element alignment.
                if dtype.size() > 1 && n > 0 {
                    let mut ua = vec![0u8; a.len() + 1];
                    let mut ub = vec![0u8; b.len() + 1];
                    ua[1..].copy_from_slice(&a);
                    ub[1..].copy_from_slice(&b);
                    reduce_into(op, dtype, &mut ua[1..], &ub[1..]).unwrap();
                    check(dtype, op, &a, &b, &ua[1..]);
                }
            }
        }
    }
}

#[test]
fn every_dtype_and_op_matches_scalar_reference() {
    eprintln!(
        "kernel copy in use: {:?}",
        rdmacomm::unstable::reduce::simd_level()
    );
    run_all(0x1234_5678_9abc_def1);
}

#[test]
fn baseline_copy_matches_too() {
    // The baseline copy is what a CPU without AVX2 runs; force it in a child process (the
    // choice is made once per process, and the other tests here made it).
    if std::env::var("REDUCE_TEST_BASELINE").is_ok_and(|v| v == "1") {
        assert_eq!(
            rdmacomm::unstable::reduce::choose_simd(true),
            rdmacomm::unstable::reduce::SimdLevel::Baseline
        );
        return run_all(0x0fed_cba9_8765_4321);
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["baseline_copy_matches_too", "--exact", "--nocapture"])
        .env("REDUCE_TEST_BASELINE", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn integers_wrap_and_nan_propagates() {
    let mut a = 250u8.to_le_bytes().to_vec();
    reduce_into(AllReduce::Sum, DType::u8, &mut a, &10u8.to_le_bytes()).unwrap();
    assert_eq!(a, [4]);
    let mut a = i32::MAX.to_le_bytes().to_vec();
    reduce_into(AllReduce::Sum, DType::i32, &mut a, &1i32.to_le_bytes()).unwrap();
    assert_eq!(i32::from_le_bytes(a.try_into().unwrap()), i32::MIN);
    for op in AllReduce::ALL {
        for (x, y) in [(f32::NAN, 1.0f32), (1.0, f32::NAN)] {
            let mut a = x.to_le_bytes().to_vec();
            reduce_into(op, DType::f32, &mut a, &y.to_le_bytes()).unwrap();
            assert!(
                f32::from_le_bytes(a.try_into().unwrap()).is_nan(),
                "{} with NaN",
                op.name()
            );
        }
    }
    let mut a = f32::INFINITY.to_le_bytes().to_vec();
    reduce_into(
        AllReduce::Sum,
        DType::f32,
        &mut a,
        &f32::NEG_INFINITY.to_le_bytes(),
    )
    .unwrap();
    assert!(f32::from_le_bytes(a.try_into().unwrap()).is_nan());
}

#[test]
fn mismatched_lengths_are_errors() {
    let e = reduce_into(AllReduce::Sum, DType::f32, &mut [0u8; 8], &[0u8; 4]).unwrap_err();
    assert!(
        e.to_string()
            .contains("accumulator has 8 bytes but source has 4"),
        "{e}"
    );
    let e = reduce_into(AllReduce::Sum, DType::f32, &mut [0u8; 6], &[0u8; 6]).unwrap_err();
    assert!(
        e.to_string()
            .contains("not a multiple of the f32 element size 4"),
        "{e}"
    );
}
