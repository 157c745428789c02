//! Collectives over RDMA, multi-process: world sizes 2, 3, 4, 5, 8; every dtype with Sum and one
//! other op; lengths 0, 1, 7, 4097 elements and 16 MiB. Results are checked element by element
//! against an independent f64 / exact-integer reference, and bit identity across ranks is checked
//! by all-gathering a hash of every rank's result.

mod common;
use common::reference::*;
use common::*;
use rdmacomm::{Algo, AllReduce, Comm, Communicator, DType};
use std::time::Duration;

fn same_everywhere(c: &Comm, what: &str, data: &[u8]) {
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
    let c = Comm::from_env().unwrap_or_else(|e| panic!("rank {r}: {e}"));
    eprintln!("rank {r}/{n}: {:?}", c.device());
    let big_elems = |d: DType| (16 << 20) / d.size();
    let full = std::env::var("RXE_TEST_FULL16").is_ok_and(|v| v == "1") || n == 2;
    // all_reduce, with every algorithm (doubling only where auto would use it: small sizes)
    for algo in [Algo::Ring, Algo::Halving, Algo::Doubling] {
        c.set_algorithm(algo);
        for dtype in DType::ALL {
            for op in [AllReduce::Sum, other_op(dtype)] {
                let mut lens = vec![0usize, 1, 7, 4097];
                let big = (full && algo != Algo::Doubling)
                    || (algo == Algo::Ring && dtype == DType::f32 && op == AllReduce::Sum)
                    || (algo == Algo::Halving && dtype == DType::bf16 && op != AllReduce::Sum);
                if big {
                    lens.push(big_elems(dtype));
                }
                if algo == Algo::Doubling && matches!(dtype, DType::f32 | DType::bf16) {
                    lens.push(300_001); // many segments, the last one short
                }
                for &elems in &lens {
                    let mut data = fill(dtype, op, r, elems);
                    c.all_reduce(op, dtype, &mut data)
                        .unwrap_or_else(|e| panic!("rank {r}: all_reduce: {e}"));
                    let what = format!(
                        "{algo:?} all_reduce {} {} x{elems} on {n} ranks",
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
    }
    // Operand order: under Min, op(+0, -0) and op(-0, +0) differ in sign; under Sum, two NaNs
    // yield the payload of one of them. Ranks that combined in different orders would end with
    // different bits, so every algorithm must combine alike everywhere.
    for algo in [Algo::Ring, Algo::Halving, Algo::Doubling] {
        c.set_algorithm(algo);
        for elems in [7usize, 300_001] {
            let zero = |i: usize| if (r + i) % 2 == 0 { 0.0f32 } else { -0.0 };
            let mut z: Vec<u8> = (0..elems).flat_map(|i| zero(i).to_le_bytes()).collect();
            c.all_reduce(AllReduce::Min, DType::f32, &mut z).unwrap();
            let vals = z
                .chunks(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()));
            assert!(vals.into_iter().all(|v| v == 0.0), "{algo:?} min of zeros");
            same_everywhere(&c, &format!("{algo:?} min of signed zeros x{elems}"), &z);
            let nan = |i: usize| f32::from_bits(0x7fc0_0000 | ((r * 7919 + i) as u32 & 0x3f_ffff));
            let mut q: Vec<u8> = (0..elems).flat_map(|i| nan(i).to_le_bytes()).collect();
            c.all_reduce(AllReduce::Sum, DType::f32, &mut q).unwrap();
            let vals = q
                .chunks(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()));
            assert!(vals.into_iter().all(f32::is_nan), "{algo:?} sum of NaNs");
            same_everywhere(&c, &format!("{algo:?} sum of NaN payloads x{elems}"), &q);
        }
    }
    c.set_algorithm(Algo::Auto);
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
    if !parent_ready(name, body) {
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
