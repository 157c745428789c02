//! Collectives over RDMA, multi-process: world sizes 2, 3, 4, 5, 8; every dtype with Sum and one
//! other op; lengths 0, 1, 7, 4097 elements and 16 MiB. Results are checked element by element
//! against an independent f64 / exact-integer reference, and bit identity across ranks is checked
//! by all-gathering a hash of every rank's result.

mod common;
use common::*;
use half::{bf16, f16};
use rdmacomm::{AllReduce, Communicator, DType, RdmaComm};
use std::time::Duration;

/// The value rank `r` contributes at element `i`, as f64 (exact in every float dtype), or as
/// raw integer bits for integer dtypes.
fn float_val(op: AllReduce, r: usize, i: usize) -> f64 {
    let h = (i.wrapping_mul(2654435761) ^ r.wrapping_mul(40503)) >> 3;
    match op {
        // Powers of two keep products exact.
        AllReduce::Prod => {
            let k = (h % 5) as i32 - 2;
            let s = if (h >> 4) % 2 == 0 { 1.0 } else { -1.0 };
            s * 2f64.powi(k)
        }
        _ => ((h % 17) as f64 - 8.0) * 0.5,
    }
}

fn int_val(r: usize, i: usize) -> u64 {
    let mut x = (i as u64) ^ ((r as u64 + 1) << 40);
    x = x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^ (x >> 29)
}

fn fill(dtype: DType, op: AllReduce, r: usize, elems: usize) -> Vec<u8> {
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

fn float_ref(op: AllReduce, n: usize, i: usize) -> f64 {
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
fn int_ref(dtype: DType, op: AllReduce, n: usize, i: usize) -> u64 {
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

fn read_elem(dtype: DType, b: &[u8]) -> f64 {
    match dtype {
        DType::f32 => f32::from_le_bytes(b.try_into().unwrap()) as f64,
        DType::f64 => f64::from_le_bytes(b.try_into().unwrap()),
        DType::f16 => f16::from_le_bytes(b.try_into().unwrap()).to_f64(),
        DType::bf16 => bf16::from_le_bytes(b.try_into().unwrap()).to_f64(),
        _ => unreachable!(),
    }
}

fn read_int(dtype: DType, b: &[u8]) -> u64 {
    let mut x = [0u8; 8];
    x[..dtype.size()].copy_from_slice(b);
    u64::from_le_bytes(x)
}

fn check_all_reduce(dtype: DType, op: AllReduce, n: usize, data: &[u8]) -> Result<(), String> {
    for (i, b) in data.chunks(dtype.size()).enumerate() {
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
fn hash(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x100_0000_01b3)
    })
}

fn same_everywhere(c: &RdmaComm, what: &str, data: &[u8]) {
    let h = hash(data).to_le_bytes();
    let mut all = vec![0u8; 8 * c.size()];
    c.all_gather(&h, &mut all).unwrap();
    for (r, hr) in all.chunks(8).enumerate() {
        assert_eq!(
            hr,
            h,
            "{what}: rank {r}'s result differs from rank {}'s (bits not identical)",
            c.rank()
        );
    }
}

fn other_op(dtype: DType) -> AllReduce {
    match dtype {
        DType::f32 | DType::i8 | DType::u32 => AllReduce::Prod,
        DType::f64 | DType::bf16 | DType::i32 | DType::u64 => AllReduce::Min,
        _ => AllReduce::Max,
    }
}

fn body() {
    let (r, n) = rank_size();
    let c = RdmaComm::from_env().unwrap_or_else(|e| panic!("rank {r}: {e}"));
    eprintln!("rank {r}/{n}: {:?}", c.device());
    let big_elems = |d: DType| (16 << 20) / d.size();
    let full = std::env::var("RXE_TEST_FULL16").is_ok_and(|v| v == "1") || n == 2;
    // all_reduce
    for dtype in DType::ALL {
        for op in [AllReduce::Sum, other_op(dtype)] {
            let mut lens = vec![0usize, 1, 7, 4097];
            if full
                || (dtype == DType::f32 && op == AllReduce::Sum)
                || (dtype == DType::bf16 && op != AllReduce::Sum)
            {
                lens.push(big_elems(dtype));
            }
            for &elems in &lens {
                let mut data = fill(dtype, op, r, elems);
                c.all_reduce(op, dtype, &mut data)
                    .unwrap_or_else(|e| panic!("rank {r}: all_reduce: {e}"));
                let what = format!(
                    "all_reduce {} {} x{elems} on {n} ranks",
                    dtype.name(),
                    op.name()
                );
                if let Err(e) = check_all_reduce(dtype, op, n, &data) {
                    panic!("rank {r}: {what}: {e}");
                }
                same_everywhere(&c, &what, &data);
            }
        }
    }
    // all_gather
    for bytes in [0usize, 1, 7, 4097 * 4, (1 << 20) + 3] {
        let input: Vec<u8> = (0..bytes).map(|i| (int_val(r, i) & 0xff) as u8).collect();
        let mut out = vec![0u8; bytes * n];
        c.all_gather(&input, &mut out).unwrap();
        for q in 0..n {
            let want: Vec<u8> = (0..bytes).map(|i| (int_val(q, i) & 0xff) as u8).collect();
            assert!(
                out[q * bytes..(q + 1) * bytes] == want[..],
                "all_gather {bytes} B: rank {q}'s part is wrong"
            );
        }
    }
    // sum_scatter
    for dtype in [DType::f32, DType::bf16, DType::i64, DType::u8] {
        for elems in [0usize, 1, 7, 4097] {
            let input = fill(dtype, AllReduce::Sum, r, elems * n);
            let mut out = vec![0u8; elems * dtype.size()];
            c.sum_scatter(dtype, &input, &mut out).unwrap();
            // Reference: the full sum, then this rank's chunk.
            let off = r * elems;
            for (j, b) in out.chunks(dtype.size()).enumerate() {
                let i = off + j;
                if dtype.is_float() {
                    assert_eq!(
                        read_elem(dtype, b),
                        float_ref(AllReduce::Sum, n, i),
                        "sum_scatter {} elem {j}",
                        dtype.name()
                    );
                } else {
                    assert_eq!(
                        read_int(dtype, b),
                        int_ref(dtype, AllReduce::Sum, n, i),
                        "sum_scatter {} elem {j}",
                        dtype.name()
                    );
                }
            }
        }
    }
    // send / recv around the ring, even ranks send first (lengths beyond the slots included)
    for bytes in [0usize, 1, 7, (3 << 20) + 5] {
        let to = (r + 1) % n;
        let from = (r + n - 1) % n;
        let mine: Vec<u8> = (0..bytes).map(|i| (int_val(r, i) >> 8) as u8).collect();
        let mut got = vec![0u8; bytes];
        if r % 2 == 0 {
            c.send(to, &mine).unwrap();
            c.recv(from, &mut got).unwrap();
        } else {
            c.recv(from, &mut got).unwrap();
            c.send(to, &mine).unwrap();
        }
        let want: Vec<u8> = (0..bytes).map(|i| (int_val(from, i) >> 8) as u8).collect();
        assert!(got == want, "recv {bytes} B from rank {from}: wrong bytes");
    }
    // Bad input: clear errors, before any traffic, and the communicator still works after.
    let mut odd = vec![0u8; 6];
    let e = c
        .all_reduce(AllReduce::Sum, DType::f32, &mut odd)
        .unwrap_err()
        .to_string();
    assert!(e.contains("multiple of the f32 element size 4"), "{e}");
    let e = c
        .all_gather(&[1, 2], &mut [0u8; 3])
        .unwrap_err()
        .to_string();
    assert!(e.contains("all_gather: output has 3 bytes"), "{e}");
    let e = c.send(r, &[1]).unwrap_err().to_string();
    assert!(e.contains("itself"), "{e}");
    let e = c.recv(n, &mut [0]).unwrap_err().to_string();
    assert!(e.contains("out of range"), "{e}");
    let mut one = fill(DType::i32, AllReduce::Sum, r, 3);
    c.all_reduce(AllReduce::Sum, DType::i32, &mut one).unwrap();
    check_all_reduce(DType::i32, AllReduce::Sum, n, &one).unwrap();
    eprintln!("rank {r}/{n}: all checks passed");
}

fn run(name: &str, n: usize, placement: Placement) {
    if is_child(name) {
        return body();
    }
    if !rdma_available() {
        return;
    }
    if placement == Placement::Hosts && vm_hosts() < 2 {
        if std::env::var("RDMACOMM_REQUIRE_RDMA").is_ok_and(|v| v == "1") {
            panic!("RDMACOMM_REQUIRE_RDMA=1 needs tools/rxe-vm --hosts 3 for {name}");
        }
        eprintln!("SKIPPED: needs soft-RoCE hosts (tools/rxe-vm --hosts 3)");
        return;
    }
    let r = spawn(
        name,
        n,
        placement,
        &|_| vec![("RDMACOMM_TIMEOUT".into(), "60".into())],
        Duration::from_secs(900),
    );
    assert_all_ok(&r);
}

#[test]
fn world_2() {
    run("world_2", 2, Placement::Local);
}
#[test]
fn world_3() {
    run("world_3", 3, Placement::Local);
}
#[test]
fn world_4() {
    run("world_4", 4, Placement::Local);
}
#[test]
fn world_5() {
    run("world_5", 5, Placement::Local);
}
#[test]
fn world_8() {
    run("world_8", 8, Placement::Local);
}
#[test]
fn world_3_across_hosts() {
    run("world_3_across_hosts", 3, Placement::Hosts);
}
