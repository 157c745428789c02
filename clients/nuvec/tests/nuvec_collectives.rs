//! nuvec's own collectives and point-to-point across processes with rdmacomm as the default
//! group: every nuvec dtype and shape class against a local reference, bit agreement, large
//! arrays, send/recv between any two ranks, transforms, a lost peer, splits and threads.

mod harness;

use harness::common::{over, Net};

use harness::{ranks, ranks_with, tagged};
use nuvec_core::distributed::{self, Group};
use nuvec_core::{array, grad, vmap, Array, Complex64, DType};
use std::time::{Duration, Instant};

/// Small integers per rank and element: exact in every dtype and in their sums.
fn values(rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7 + rank * 13) % 23) as f32 - 11.0)
        .collect()
}

const DTYPES: [DType; 13] = [
    DType::Bool,
    DType::U8,
    DType::U16,
    DType::U32,
    DType::U64,
    DType::I8,
    DType::I16,
    DType::I32,
    DType::I64,
    DType::F16,
    DType::BF16,
    DType::F32,
    DType::F64,
];

fn input(rank: usize, shape: &[usize], dtype: DType) -> Array {
    let n = shape.iter().product();
    if dtype == DType::Bool {
        let v: Vec<bool> = (0..n).map(|i| (i + rank) % 3 == 0).collect();
        return Array::from_slice(&v, shape);
    }
    let mut v = values(rank, n);
    if dtype.name().starts_with('u') {
        v.iter_mut().for_each(|x| *x += 11.0);
    }
    Array::from_slice(&v, shape).astype(dtype)
}

fn as_f64(a: &Array) -> Vec<f64> {
    a.astype(DType::F64).to_vec::<f64>().unwrap()
}

/// Every collective x dtype x shape against the fold of every rank's input, computed here.
fn collectives(g: Group) {
    let (rank, size) = (g.rank(), g.size());
    let shapes: [&[usize]; 6] = [&[], &[0], &[1], &[3], &[7, 5], &[1001]];
    for dtype in DTYPES {
        for shape in shapes {
            let x = input(rank, shape, dtype);
            let all: Vec<Vec<f64>> = (0..size).map(|r| as_f64(&input(r, shape, dtype))).collect();
            let fold = |f: fn(f64, f64) -> f64| -> Vec<f64> {
                (0..all[0].len())
                    .map(|i| all.iter().map(|v| v[i]).reduce(f).unwrap())
                    .collect()
            };
            let name = format!("{} {shape:?}", dtype.name());
            let sum = distributed::all_sum(&x, None);
            let want_sum = match dtype {
                DType::Bool => fold(f64::max),
                _ => fold(|a, b| a + b),
            };
            assert_eq!(sum.shape(), x.shape(), "{name}");
            assert_eq!(sum.dtype(), dtype, "{name}");
            assert_eq!(as_f64(&sum), want_sum, "all_sum {name}");
            let max = distributed::all_max(&x, None);
            assert_eq!(as_f64(&max), fold(f64::max), "all_max {name}");
            let min = distributed::all_min(&x, None);
            assert_eq!(as_f64(&min), fold(f64::min), "all_min {name}");
            let gathered = distributed::all_gather(&x, None);
            assert_eq!(as_f64(&gathered), all.concat(), "all_gather {name}");
            let mut dims: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
            match dims.first_mut() {
                Some(d) => *d *= size as i32,
                None => dims.push(size as i32),
            }
            assert_eq!(gathered.shape(), dims.as_slice(), "all_gather shape {name}");
        }
    }
    // 16-bit sums wrap as nuvec's ring wraps them (they travel widened to 32 bits).
    let big_u = Array::from_slice(&[40000u16, 65535, 1], [3]);
    let got = distributed::all_sum(&big_u, None).to_vec::<u16>().unwrap();
    let n = size as u16;
    assert_eq!(got, [40000u16.wrapping_mul(n), 65535u16.wrapping_mul(n), n]);
    let big_i = Array::from_slice(&[20000i16, -32768, -1], [3]);
    let got = distributed::all_sum(&big_i, None).to_vec::<i16>().unwrap();
    let k = size as i16;
    assert_eq!(
        got,
        [20000i16.wrapping_mul(k), (-32768i16).wrapping_mul(k), -k]
    );
    let got = distributed::all_min(&big_i, None).to_vec::<i16>().unwrap();
    assert_eq!(got, [20000, -32768, -1]);
    // complex64: sums per part, gathered in rank order; no order for max or min.
    let c: Vec<Complex64> = (0..5)
        .map(|i| Complex64 {
            re: (rank * 10 + i) as f32,
            im: -((rank + i) as f32),
        })
        .collect();
    let x = Array::from_slice(&c, [5]);
    let s = distributed::all_sum(&x, None)
        .to_vec::<Complex64>()
        .unwrap();
    for (i, z) in s.iter().enumerate() {
        let re: f32 = (0..size).map(|r| (r * 10 + i) as f32).sum();
        let im: f32 = (0..size).map(|r| -((r + i) as f32)).sum();
        assert_eq!((z.re, z.im), (re, im), "complex64 sum {i}");
    }
    let gathered = distributed::all_gather(&x, None)
        .to_vec::<Complex64>()
        .unwrap();
    assert_eq!(gathered.len(), 5 * size);
    assert_eq!(gathered[5 * rank..5 * rank + 5], c[..]);
    let err = distributed::all_max(&x, None)
        .eval()
        .unwrap_err()
        .to_string();
    assert!(err.contains("Max") && err.contains("Complex64"), "{err}");
    // The group still works after that refusal (an argument error poisons nothing).
    let ok = distributed::all_sum(&array![1.0f32], None)
        .item::<f32>()
        .unwrap();
    assert_eq!(ok, size as f32);
}

#[test]
fn collectives_on_two_ranks() {
    ranks("collectives_on_two_ranks", 2, collectives);
}

#[test]
fn collectives_on_three_ranks() {
    ranks("collectives_on_three_ranks", 3, collectives);
}

#[test]
fn collectives_on_four_ranks() {
    ranks("collectives_on_four_ranks", 4, collectives);
}

/// Random f32, f16 and bf16 sums (not exact): every rank prints the same bits, twice.
fn floats(g: Group) {
    let key = Array::from_slice(&[0u32, g.rank() as u32 + 7], [2]);
    let x = nuvec_core::random::normal([40_099], DType::F32, 0.0, 1.0, &key);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for _ in 0..2 {
            let s = distributed::all_sum(&x.astype(dtype), None).astype(DType::F32);
            let bits = s
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .fold(0u64, |h, v| h.rotate_left(5) ^ u64::from(v.to_bits()));
            println!("BITS {} {bits:016x}", dtype.name());
        }
    }
}

#[test]
fn float_sums_agree_bit_for_bit_across_ranks_and_reruns() {
    for n in [2, 3, 4] {
        let mut runs = Vec::new();
        for _ in 0..2 {
            let Some(outs) = ranks(
                "float_sums_agree_bit_for_bit_across_ranks_and_reruns",
                n,
                floats,
            ) else {
                return;
            };
            let lines: Vec<Vec<String>> = outs
                .iter()
                .map(|o| tagged(o, "BITS").iter().map(|s| s.to_string()).collect())
                .collect();
            assert_eq!(lines[0].len(), 6, "{lines:?}");
            for l in &lines {
                assert_eq!(l, &lines[0], "ranks disagree on {n} ranks");
            }
            // Both calls of a run agree too.
            for p in lines[0].chunks(2) {
                assert_eq!(p[0], p[1]);
            }
            runs.push(lines[0].clone());
        }
        assert_eq!(runs[0], runs[1], "a rerun on {n} ranks gave other bits");
    }
}

/// 64 MB per rank.
fn large(g: Group) {
    let n = 16 << 20;
    let x = nuvec_core::ops::full([n], g.rank() as f32 + 0.5);
    let s = distributed::all_sum(&x, None).to_vec::<f32>().unwrap();
    let want: f32 = (0..g.size()).map(|r| r as f32 + 0.5).sum();
    assert!(s.iter().all(|&v| v == want), "{} != {want}", s[0]);
    let gathered = distributed::all_gather(&x.astype(DType::U8), None)
        .to_vec::<u8>()
        .unwrap();
    for r in 0..g.size() {
        assert!(gathered[r * n..(r + 1) * n].iter().all(|&v| v == r as u8));
    }
}

#[test]
fn large_arrays_on_two_and_four_ranks() {
    for n in [2, 4] {
        if ranks("large_arrays_on_two_and_four_ranks", n, large).is_none() {
            return;
        }
    }
}

/// send/recv between every ordered pair of ranks (small and multi-chunk arrays); a recv of
/// the wrong shape fails naming it and leaves the next transfer right; a send to self fails.
fn point_to_point(g: Group) {
    let (rank, size) = (g.rank(), g.size());
    let payload = |from: usize, to: usize, n: usize| -> Vec<f32> {
        (0..n)
            .map(|i| (from * 1000 + to * 100) as f32 + i as f32)
            .collect()
    };
    for n in [6usize, 300_001] {
        for a in 0..size {
            for b in 0..size {
                if a == b {
                    continue;
                }
                if rank == a {
                    let x = Array::from_slice(&payload(a, b, n), [n]);
                    distributed::send(&x, b, None).eval().unwrap();
                } else if rank == b {
                    let got = distributed::recv([n], DType::F32, a, None);
                    assert_eq!(got.to_vec::<f32>().unwrap(), payload(a, b, n), "{a}->{b}");
                }
            }
        }
    }
    // 2 MiB sent as [512, 1024], received as [1024, 512]: nuvec drains it in 1 MiB reads.
    let (src, dst) = (size - 1, 0);
    let big: Vec<f32> = (0..512 * 1024).map(|i| i as f32).collect();
    if rank == src {
        distributed::send(&Array::from_slice(&big, [512, 1024]), dst, None)
            .eval()
            .unwrap();
        distributed::send(&array![7.0f32, 8.0], dst, None)
            .eval()
            .unwrap();
    } else if rank == dst {
        let err = distributed::recv([1024, 512], DType::F32, src, None)
            .eval()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("shape") && err.contains("[1024, 512]"),
            "{err}"
        );
        let next = distributed::recv([2], DType::F32, src, None);
        assert_eq!(next.to_vec::<f32>().unwrap(), [7.0, 8.0]);
    }
    assert!(distributed::send(&array![1.0f32], rank, None)
        .eval()
        .is_err());
    // Collectives after all of it are right.
    let s = distributed::all_sum(&array![1.0f32], None)
        .item::<f32>()
        .unwrap();
    assert_eq!(s, size as f32);
}

#[test]
fn send_and_recv_between_any_two_ranks() {
    for n in [2, 3, 4] {
        if ranks("send_and_recv_between_any_two_ranks", n, point_to_point).is_none() {
            return;
        }
    }
}

/// grad through all_sum and all_gather, compile replays, vmap.
fn transforms(g: Group) {
    let (rank, size) = (g.rank(), g.size());
    let x = Array::from_slice(&values(rank, 4), [4]);
    let total: Vec<f32> = (0..4)
        .map(|i| (0..size).map(|r| values(r, 4)[i]).sum())
        .collect();
    // loss = sum(all_sum(x)^2): d loss / dx = 2 all_sum(x).
    let loss = |x: &Array| {
        let s = distributed::all_sum(x, None);
        s.multiply(&s).sum(..)
    };
    let dx = grad(loss)(&x).unwrap().to_vec::<f32>().unwrap();
    let want: Vec<f32> = total.iter().map(|t| 2.0 * t).collect();
    assert_eq!(dx, want);
    // all_gather's vector-Jacobian product: this rank's rows of the cotangent.
    let w = nuvec_core::ops::arange(0, 4 * size as i32, 1).astype(DType::F32);
    let gathered_loss = |x: &Array| distributed::all_gather(x, None).multiply(&w).sum(..);
    let dg = grad(gathered_loss)(&x).unwrap().to_vec::<f32>().unwrap();
    let rows: Vec<f32> = (4 * rank..4 * rank + 4).map(|i| i as f32).collect();
    assert_eq!(dg, rows);
    // Compiled: every replay communicates again and equals the plain call.
    let f = nuvec_compile::compile(|x: &Array| distributed::all_sum(x, None).multiply(2.0));
    for k in 0..3 {
        let y = x.add(k as f32);
        let want: Vec<f32> = total
            .iter()
            .map(|t| 2.0 * (t + (k * size) as f32))
            .collect();
        assert_eq!(f(&y).unwrap().to_vec::<f32>().unwrap(), want);
    }
    // vmap over rows: each row reduced on its own.
    let batch = Array::from_slice(&values(rank, 8), [2, 4]);
    let batched = vmap(|r: &Array| distributed::all_sum(r, None))
        .call(&batch)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let want: Vec<f32> = (0..8)
        .map(|i| (0..size).map(|r| values(r, 8)[i]).sum())
        .collect();
    assert_eq!(batched, want);
}

#[test]
fn collectives_compose_with_transforms() {
    for n in [2, 3] {
        if ranks("collectives_compose_with_transforms", n, transforms).is_none() {
            return;
        }
    }
}

/// The last rank exits: the others' collective fails naming it within the deadline, and every
/// later one fails at once.
fn peer_exits(g: Group) {
    let last = g.size() - 1;
    // Every rank is connected and working before the last one leaves.
    assert_eq!(
        distributed::all_sum(&array![1.0f32], None)
            .item::<f32>()
            .unwrap(),
        g.size() as f32
    );
    if g.rank() == last {
        std::process::exit(0);
    }
    let x = array![1.0f32, 2.0];
    let start = Instant::now();
    let err = distributed::all_sum(&x, None)
        .eval()
        .unwrap_err()
        .to_string();
    // Named, with the true cause (it left: nuvec's groups close at exit), well before the
    // 10 s timeout that a silent peer would take.
    assert!(err.contains(&format!("rank {last}")), "{err}");
    assert!(err.contains("closed its communicator"), "{err}");
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    let start = Instant::now();
    let err = distributed::all_sum(&x, None)
        .eval()
        .unwrap_err()
        .to_string();
    // The first error again (its kind and the rank it names), said to be an earlier one.
    assert!(
        err.contains("an earlier failure") && err.contains(&format!("rank {last}")),
        "{err}"
    );
    assert!(start.elapsed() < Duration::from_secs(1));
}

#[test]
fn a_peer_that_exits_is_named_on_the_others() {
    ranks_with(
        "a_peer_that_exits_is_named_on_the_others",
        3,
        // Not shorter: the timeout also bounds the rendezvous, and in the emulated VM a rank of
        // this binary has taken over 4 s to start.
        &[("RDMACOMM_TIMEOUT", "10")],
        peer_exits,
    );
}

/// Group::split: sums inside each subgroup, a split of a split, and the parent after them.
fn splits(g: Group) {
    let (rank, size) = (g.rank(), g.size());
    let parity = g.split((rank % 2) as i32, rank as i32).unwrap();
    let members: Vec<usize> = (0..size).filter(|r| r % 2 == rank % 2).collect();
    assert_eq!(parity.size(), members.len());
    assert_eq!(parity.rank(), rank / 2);
    let x = Array::from_slice(&[rank as f32, 1.0], [2]);
    let s = distributed::all_sum(&x, Some(&parity))
        .to_vec::<f32>()
        .unwrap();
    let want: f32 = members.iter().map(|&r| r as f32).sum();
    assert_eq!(s, [want, members.len() as f32]);
    let gathered = distributed::all_gather(&x, Some(&parity))
        .to_vec::<f32>()
        .unwrap();
    let want_g: Vec<f32> = members.iter().flat_map(|&r| [r as f32, 1.0]).collect();
    assert_eq!(gathered, want_g);
    // Reversed keys reverse the order.
    let rev = g.split(0, -(rank as i32)).unwrap();
    assert_eq!(rev.rank(), size - 1 - rank);
    let order = distributed::all_gather(&array![rank as f32], Some(&rev))
        .to_vec::<f32>()
        .unwrap();
    let want_o: Vec<f32> = (0..size).rev().map(|r| r as f32).collect();
    assert_eq!(order, want_o);
    // A subgroup of one (negative color): nuvec's single group, collectives are identities.
    let alone = g.split(-1, 0).unwrap();
    assert_eq!(alone.size(), 1);
    assert_eq!(
        distributed::all_sum(&x, Some(&alone))
            .to_vec::<f32>()
            .unwrap(),
        [rank as f32, 1.0]
    );
    // The parent still works.
    let all = distributed::all_sum(&array![1.0f32], None)
        .item::<f32>()
        .unwrap();
    assert_eq!(all, size as f32);
}

#[test]
fn group_split_sums_inside_the_subgroups() {
    for n in [3, 4] {
        if ranks("group_split_sums_inside_the_subgroups", n, splits).is_none() {
            return;
        }
    }
}

/// Collectives evaluated on other threads than the one that built the group, in turn.
fn threads(g: Group) {
    let size = g.size() as f32;
    for round in 0..4 {
        let x = nuvec_core::ops::full([1000], round as f32);
        let s = if round % 2 == 0 {
            std::thread::spawn(move || distributed::all_sum(&x, None).to_vec::<f32>().unwrap())
                .join()
                .unwrap()
        } else {
            distributed::all_sum(&x, None).to_vec::<f32>().unwrap()
        };
        assert!(s.iter().all(|&v| v == round as f32 * size), "round {round}");
    }
}

#[test]
fn a_collective_evaluated_on_a_worker_thread() {
    ranks("a_collective_evaluated_on_a_worker_thread", 2, threads);
}

/// Without a launcher, `init(false)` is this process alone and `init(true)` an error.
#[test]
fn a_single_process_runs_unchanged() {
    if std::env::var(harness::common::CHILD).is_ok() {
        return;
    }
    let _env = harness::common::ENV_LOCK
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let g = rdmacomm::nuvec::init(false).unwrap();
    assert_eq!((g.rank(), g.size()), (0, 1));
    let err = rdmacomm::nuvec::init(true).unwrap_err().to_string();
    assert!(err.contains("launcher"), "{err}");
    let x = array![[1.0f32, 2.0], [3.0, 4.0]];
    assert_eq!(
        distributed::all_sum(&x, None).to_vec::<f32>().unwrap(),
        [1.0, 2.0, 3.0, 4.0]
    );
}

/// An overlap scope opened through the transport's `comm()` keeps its owner: a call through
/// the transport from another thread meanwhile is refused (it would have become the owner and
/// run the scope's queue, which lives on the scope's stack); after the scope it runs.
#[test]
fn a_scope_through_comm_keeps_its_owner() {
    if std::env::var(harness::common::CHILD).is_ok() {
        return;
    }
    let cfg = rdmacomm::Config::defaults(0, 1, "");
    let t = rdmacomm::nuvec::Transport::new(rdmacomm::Comm::new(&cfg).unwrap());
    let one = 3.5f32.to_le_bytes();
    let mut data = [0u8; 4];
    let refused = t
        .comm()
        .overlap(|o| {
            let p = o.all_reduce_bytes(rdmacomm::AllReduce::Sum, rdmacomm::DType::f32, &mut data);
            let e = std::thread::scope(|s| {
                s.spawn(|| {
                    let mut out = [0u8; 4];
                    t.sum_scatter(nuvec_core::DType::F32, &one, &mut out)
                })
                .join()
                .unwrap()
            });
            p.and_then(|p| p.wait()).unwrap();
            e
        })
        .unwrap();
    let e = refused.unwrap_err().to_string();
    assert!(e.contains("overlap scope open"), "{e}");
    // After the scope, any thread's call runs.
    let mut out = [0u8; 4];
    std::thread::scope(|s| {
        s.spawn(|| t.sum_scatter(nuvec_core::DType::F32, &one, &mut out))
            .join()
            .unwrap()
    })
    .unwrap();
    assert_eq!(out, one);
}

crate::matrix!(
    collectives_on_two_ranks,
    collectives_on_three_ranks,
    collectives_on_four_ranks,
    float_sums_agree_bit_for_bit_across_ranks_and_reruns,
    large_arrays_on_two_and_four_ranks,
    send_and_recv_between_any_two_ranks,
    collectives_compose_with_transforms,
    a_peer_that_exits_is_named_on_the_others,
    group_split_sums_inside_the_subgroups,
    a_collective_evaluated_on_a_worker_thread,
    a_single_process_runs_unchanged,
    a_scope_through_comm_keeps_its_owner
);
