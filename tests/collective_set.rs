//! The rest of the collective set, multi-process over the transport under test: all_to_all(v),
//! reduce, gather and scatter at every root, all_gather_v and reduce_scatter_v with uneven and
//! empty parts, sendrecv with both ranks sending first, batches; on 1 to 8 ranks. Every result
//! is checked against a scalar re-computation of what each rank contributed.

mod common;
use common::reference::*;
use common::*;
use rdmacomm::{AllReduce, Comm, Communicator, DType, Group, P2p};
use std::sync::Arc;
use std::time::Duration;

/// Byte `i` of what rank `from` sends rank `to` in case `case`.
fn byte(case: usize, from: usize, to: usize, i: usize) -> u8 {
    (case * 13 + from * 31 + to * 7 + i * 3 + i / 251) as u8
}

/// Uneven lengths, zero for some pairs.
fn uneven(from: usize, to: usize, scale: usize) -> usize {
    ((from * 3 + to * 5) % 4) * scale
}

fn block(case: usize, from: usize, to: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| byte(case, from, to, i)).collect()
}

const DTYPES: [(DType, AllReduce); 4] = [
    (DType::f32, AllReduce::Sum),
    (DType::bf16, AllReduce::Max),
    (DType::i32, AllReduce::Sum),
    (DType::u64, AllReduce::Min),
];

fn body() {
    let (r, n) = rank_size();
    let c = Comm::from_env().unwrap_or_else(|e| panic!("rank {r}: {e}"));
    let ok = |what: &str, res: rdmacomm::Result<()>| {
        res.unwrap_or_else(|e| panic!("rank {r}: {what}: {e}"));
    };
    // Bad arguments are named before anything is sent. A world of one stays usable after them;
    // with peers the communicator ends on every rank (checked at the end).
    let bad = |what: &str, res: rdmacomm::Result<()>, want: &str| {
        let e = res.expect_err(what).to_string();
        assert!(e.contains(want), "rank {r}: {what}: {e}");
    };
    if n == 1 {
        bad(
            "all_to_all",
            c.all_to_all(&[0u8; 8 * 5], &mut [0u8; 4]),
            "all_to_all",
        );
        let too_many = vec![0usize; n + 1];
        bad(
            "all_to_allv",
            c.all_to_allv(&[], &too_many, &mut [], &too_many),
            "entries",
        );
        bad("gather", c.gather(n, &[1], &mut []), "out of range");
        if r == 0 {
            bad(
                "gather",
                c.gather(0, &[1, 2], &mut [0u8; 1]),
                "gather: the root's output has 1 bytes",
            );
        }
        bad(
            "reduce_scatter_v",
            c.reduce_scatter_v(
                AllReduce::Sum,
                DType::f32,
                &[0u8; 6],
                &mut [0u8; 6],
                &[6; 1],
            ),
            "reduce_scatter_v",
        );
        bad("sendrecv", c.sendrecv(r, &[1], r, &mut [0]), "itself");
    }
    // all_to_all: equal blocks from empty to several chunks; on 2 ranks also blocks that TCP
    // exchanges pairwise.
    let big = if n <= 2 { (8 << 20) + 13 } else { 0 };
    for (case, len) in [0usize, 1, 13, 70_000, 1 << 20, big]
        .into_iter()
        .enumerate()
    {
        let input: Vec<u8> = (0..n).flat_map(|q| block(case, r, q, len)).collect();
        let mut out = vec![0u8; n * len];
        ok("all_to_all", c.all_to_all(&input, &mut out));
        let want: Vec<u8> = (0..n).flat_map(|q| block(case, q, r, len)).collect();
        assert!(out == want, "rank {r}: all_to_all of {len} B blocks");
    }
    // all_to_allv: uneven and empty blocks.
    for (case, scale) in [(10usize, 1usize), (11, 999), (12, 100_000)] {
        let sl: Vec<usize> = (0..n).map(|q| uneven(r, q, scale)).collect();
        let rl: Vec<usize> = (0..n).map(|q| uneven(q, r, scale)).collect();
        let input: Vec<u8> = (0..n).flat_map(|q| block(case, r, q, sl[q])).collect();
        let mut out = vec![0u8; rl.iter().sum()];
        ok("all_to_allv", c.all_to_allv(&input, &sl, &mut out, &rl));
        let want: Vec<u8> = (0..n).flat_map(|q| block(case, q, r, rl[q])).collect();
        assert!(out == want, "rank {r}: all_to_allv x{scale}");
    }
    // reduce to every root: tree (small) and reduce-scatter + gather (large).
    for root in 0..n {
        for (dtype, op) in DTYPES {
            for elems in [0usize, 1, 7, 4097, 300_000] {
                let mine = fill(dtype, op, r, elems);
                let mut d = mine.clone();
                ok("reduce", c.reduce(root, op, dtype, &mut d));
                if r == root {
                    check_all_reduce(dtype, op, n, &d)
                        .unwrap_or_else(|e| panic!("rank {r}: reduce to {root} of {elems}: {e}"));
                } else {
                    assert!(d == mine, "rank {r}: reduce changed a non-root's data");
                }
            }
        }
    }
    // gather and scatter at every root.
    for root in 0..n {
        for (case, len) in [(20usize, 0usize), (21, 5), (22, 100_000)] {
            let mut all = vec![0u8; if r == root { n * len } else { 0 }];
            ok(
                "gather",
                c.gather(root, &block(case, r, root, len), &mut all),
            );
            if r == root {
                let want: Vec<u8> = (0..n).flat_map(|q| block(case, q, root, len)).collect();
                assert!(all == want, "rank {r}: gather of {len} B to {root}");
            }
            let src: Vec<u8> = if r == root {
                (0..n).flat_map(|q| block(case, root, q, len)).collect()
            } else {
                Vec::new()
            };
            let mut got = vec![0u8; len];
            ok("scatter", c.scatter(root, &src, &mut got));
            assert!(
                got == block(case, root, r, len),
                "rank {r}: scatter of {len} B from {root}"
            );
        }
    }
    // all_gather_v and reduce_scatter_v with uneven and empty parts.
    for scale in [0usize, 1, 5000] {
        let counts: Vec<usize> = (0..n).map(|q| (q * 3 % 4) * scale).collect();
        let lens: Vec<usize> = counts.iter().map(|c| c * 4).collect();
        let mut out = vec![0u8; lens.iter().sum()];
        ok(
            "all_gather_v",
            c.all_gather_v(&block(30, r, 0, lens[r]), &mut out, &lens),
        );
        let want: Vec<u8> = (0..n).flat_map(|q| block(30, q, 0, lens[q])).collect();
        assert!(out == want, "rank {r}: all_gather_v counts {counts:?}");
        for (dtype, op) in DTYPES {
            let total: usize = counts.iter().sum();
            let blens: Vec<usize> = counts.iter().map(|c| c * dtype.size()).collect();
            let mut part = vec![0u8; blens[r]];
            ok(
                "reduce_scatter_v",
                c.reduce_scatter_v(op, dtype, &fill(dtype, op, r, total), &mut part, &blens),
            );
            let first: usize = counts[..r].iter().sum();
            check_reduced_from(dtype, op, n, first, &part)
                .unwrap_or_else(|e| panic!("rank {r}: reduce_scatter_v counts {counts:?}: {e}"));
        }
    }
    if n > 1 {
        // sendrecv: every rank sends to the next and receives from the previous at once,
        // messages far beyond the slots (two blocking sends first would deadlock).
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        for (case, len) in [(40usize, 0usize), (41, 3), (42, 8 << 20)] {
            let mut got = vec![0u8; len];
            ok(
                "sendrecv",
                c.sendrecv(next, &block(case, r, next, len), prev, &mut got),
            );
            assert!(
                got == block(case, prev, r, len),
                "rank {r}: sendrecv of {len} B"
            );
        }
        // A batch: two messages to every peer and two from each, in order.
        let outs: Vec<(usize, Vec<u8>, Vec<u8>)> = (0..n)
            .filter(|&q| q != r)
            .map(|q| (q, block(50, r, q, 3000 + q), block(51, r, q, 70_000)))
            .collect();
        let mut ins: Vec<(usize, Vec<u8>, Vec<u8>)> = (0..n)
            .filter(|&q| q != r)
            .map(|q| (q, vec![0u8; 3000 + r], vec![0u8; 70_000]))
            .collect();
        let mut ops: Vec<P2p<'_>> = Vec::new();
        for (q, a, b) in &outs {
            ops.push(P2p::Send { peer: *q, data: a });
            ops.push(P2p::Send { peer: *q, data: b });
        }
        for (q, a, b) in ins.iter_mut() {
            ops.push(P2p::Recv { peer: *q, data: a });
            ops.push(P2p::Recv { peer: *q, data: b });
        }
        ok("batch", c.batch(&mut ops));
        drop(ops);
        for (q, a, b) in &ins {
            assert!(
                *a == block(50, *q, r, 3000 + r),
                "rank {r}: batch first from {q}"
            );
            assert!(
                *b == block(51, *q, r, 70_000),
                "rank {r}: batch second from {q}"
            );
        }
    }
    // The typed front: counts in elements.
    let c = Arc::new(c);
    let g = Group::new(c.clone());
    let counts: Vec<usize> = (0..n).map(|q| q + 1).collect();
    let mine: Vec<f64> = (0..=r).map(|i| (r * 100 + i) as f64).collect();
    let mut all = vec![0f64; counts.iter().sum()];
    ok(
        "Group::all_gather_v",
        g.all_gather_v(&mine, &mut all, &counts),
    );
    let want: Vec<f64> = (0..n)
        .flat_map(|q| (0..=q).map(move |i| (q * 100 + i) as f64))
        .collect();
    assert_eq!(all, want, "rank {r}: typed all_gather_v");
    let mut s = vec![(r + 1) as i64; 3];
    ok("Group::reduce", g.reduce(&mut s, AllReduce::Sum, n - 1));
    if r == n - 1 {
        assert_eq!(s, vec![(n * (n + 1) / 2) as i64; 3], "typed reduce");
    }
    let closing = g.barrier();
    if n == 1 {
        ok("barrier", closing);
    } else {
        // A call refused on one rank while the others are in it: every rank fails with rank 0's
        // cause within a second (they used to wait out the timeout), and refuses further work.
        // Rank 0 may leave the barrier while others still finish it: its refusal may end their
        // barrier, and a sender may finish its part of the gather first; a later call fails then.
        let t = std::time::Instant::now();
        let mut out = vec![0u8; if r == 0 { 1 } else { 0 }];
        let e = closing
            .and_then(|()| c.gather(0, &[1, 2], &mut out))
            .and_then(|()| c.barrier())
            .expect_err("a refused gather");
        let took = t.elapsed();
        let want = "gather: the root's output has 1 bytes";
        assert!(e.to_string().contains(want), "rank {r}: {e}");
        assert!(
            took < Duration::from_secs(2),
            "rank {r}: told after {took:?}"
        );
        let later = c.barrier().expect_err("a failed communicator");
        assert!(later.to_string().contains(want), "rank {r}: {later}");
    }
    println!("rank {r}: the collective set checked");
}

fn run(name: &str, n: usize) {
    if !parent_ready(name, body) {
        return;
    }
    let r = spawn(
        name,
        n,
        Placement::Local,
        &|_| vec![("RDMACOMM_TIMEOUT".into(), "60".into())],
        Duration::from_secs(600),
    );
    assert_all_ok(&r);
}

#[test]
fn set_world_1() {
    run("set_world_1", 1);
}
#[test]
fn set_world_2() {
    run("set_world_2", 2);
}
#[test]
fn set_world_3() {
    run("set_world_3", 3);
}
#[test]
fn set_world_4() {
    run("set_world_4", 4);
}
#[test]
fn set_world_5() {
    run("set_world_5", 5);
}
#[test]
fn set_world_8() {
    run("set_world_8", 8);
}

crate::matrix!(
    set_world_1,
    set_world_2,
    set_world_3,
    set_world_4,
    set_world_5,
    set_world_8
);
