//! The rooted, uneven and point-to-point collectives over the in-memory link
//! ([`super::mem_link`]): 2 to 8 ranks, every root, queues of 1 to 4 chunks, zero-length and
//! uneven blocks, each result checked against a scalar re-computation.

use super::mem_link::{bytes, f32s, mesh, on_every_rank};
use super::rooted::BlockAt;
use super::{binomial, bruck, exchange, ring, rooted};
use crate::dtype::{AllReduce, DType};
use crate::transport::Link as _;

const LINKS: [(usize, usize); 3] = [(1, 8), (2, 64), (4, 4096)];

/// Rank r's element i (small integers: every sum is exact in f32 in any order).
fn value(r: usize, i: usize) -> f32 {
    ((r * 5 + i * 3) % 17) as f32 - 8.0
}

/// Byte `i` of the block rank `from` sends rank `to`.
fn byte(from: usize, to: usize, i: usize) -> u8 {
    (from * 31 + to * 7 + i) as u8
}

/// Uneven block lengths (bytes) for the pair (from, to), zero for some pairs.
fn block_len(from: usize, to: usize, scale: usize) -> usize {
    ((from * 3 + to * 5) % 4) * scale
}

#[test]
fn both_ranks_sending_first_cannot_deadlock() {
    // Each rank sends to the next and receives from the previous at once (a ring shift), with
    // messages far larger than the queue; and two messages to one peer arrive in order.
    for n in 2..=5 {
        for (slots, chunk) in LINKS {
            for len in [0usize, 1, 5000] {
                let out = on_every_rank(mesh(n, slots, chunk, None), move |l| {
                    let r = l.rank();
                    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
                    let a: Vec<u8> = (0..len).map(|i| byte(r, next, i)).collect();
                    let b: Vec<u8> = (0..len / 2).map(|i| byte(r, next, i + 1)).collect();
                    let (mut x, mut y) = (vec![0u8; len], vec![0u8; len / 2]);
                    exchange::exchange(
                        l,
                        &[(next, &a), (next, &b)],
                        &mut [(prev, &mut x), (prev, &mut y)],
                    )
                    .unwrap();
                    (x, y)
                });
                for (r, (x, y)) in out.iter().enumerate() {
                    let prev = (r + n - 1) % n;
                    let want: Vec<u8> = (0..len).map(|i| byte(prev, r, i)).collect();
                    let want2: Vec<u8> = (0..len / 2).map(|i| byte(prev, r, i + 1)).collect();
                    let what = format!("{n} ranks, {slots} x {chunk} B, {len} B: rank {r}");
                    assert_eq!(x, &want, "{what}: first message");
                    assert_eq!(y, &want2, "{what}: second message");
                }
            }
        }
    }
}

#[test]
fn reduce_to_every_root_by_tree_and_by_reduce_scatter() {
    for n in 2..=8 {
        for (slots, chunk) in LINKS {
            for root in 0..n {
                for elems in [0usize, 1, 7, 1001] {
                    for tree in [false, true] {
                        let out = on_every_rank(mesh(n, slots, chunk, None), move |l| {
                            let r = l.rank();
                            let mut d = bytes((0..elems).map(|i| value(r, i)));
                            let mut scratch = crate::collectives::Scratch::default();
                            let (op, t) = (AllReduce::Sum, DType::f32);
                            if tree {
                                rooted::reduce_tree(l, root, op, t, &mut d, &mut scratch)
                            } else {
                                rooted::reduce_scatter_gather(l, root, op, t, &mut d, &mut scratch)
                            }
                            .unwrap();
                            f32s(&d)
                        });
                        for (r, d) in out.iter().enumerate() {
                            let what = format!(
                                "reduce (tree {tree}) to {root} on {n} ranks, {slots} x {chunk} \
                                 B, x{elems}: rank {r}"
                            );
                            for (i, &got) in d.iter().enumerate() {
                                let want: f32 = if r == root {
                                    (0..n).map(|q| value(q, i)).sum()
                                } else {
                                    value(r, i)
                                };
                                assert_eq!(got, want, "{what} element {i}");
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn gather_and_scatter_at_every_root() {
    for n in 2..=8 {
        for (slots, chunk) in LINKS {
            for root in 0..n {
                for len in [0usize, 3, 700] {
                    let out = on_every_rank(mesh(n, slots, chunk, None), move |l| {
                        let r = l.rank();
                        let mine: Vec<u8> = (0..len).map(|i| byte(r, root, i)).collect();
                        let mut all = vec![0u8; if r == root { n * len } else { 0 }];
                        // One set of counters for both: reused as a communicator reuses it.
                        let mut counters = Vec::new();
                        rooted::gather(l, root, &mine, &mut all, &mut counters).unwrap();
                        let src: Vec<u8> = if r == root {
                            (0..n)
                                .flat_map(|q| (0..len).map(move |i| byte(root, q, i)))
                                .collect()
                        } else {
                            Vec::new()
                        };
                        let mut got = vec![0u8; len];
                        rooted::scatter(l, root, &src, &mut got, &mut counters).unwrap();
                        (all, got)
                    });
                    let what = format!("root {root} on {n} ranks, {slots} x {chunk} B, {len} B");
                    let want: Vec<u8> = (0..n)
                        .flat_map(|q| (0..len).map(move |i| byte(q, root, i)))
                        .collect();
                    assert_eq!(out[root].0, want, "gather to {what}");
                    for (r, (_, got)) in out.iter().enumerate() {
                        let want: Vec<u8> = (0..len).map(|i| byte(root, r, i)).collect();
                        assert_eq!(got, &want, "scatter from {what}: rank {r}");
                    }
                }
            }
        }
    }
}

#[test]
fn all_to_all_with_equal_uneven_and_empty_blocks() {
    for n in 2..=8 {
        for (slots, chunk) in LINKS {
            for (scale, even) in [(0, true), (1, true), (300, true), (1, false), (90, false)] {
                let len = move |from: usize, to: usize| {
                    if even {
                        scale
                    } else {
                        block_len(from, to, scale)
                    }
                };
                for pairwise in [false, true] {
                    let out = on_every_rank(mesh(n, slots, chunk, None), move |l| {
                        let r = l.rank();
                        let so = crate::collectives::rooted::offsets(
                            &(0..n).map(|q| len(r, q)).collect::<Vec<_>>(),
                        );
                        let ro = crate::collectives::rooted::offsets(
                            &(0..n).map(|q| len(q, r)).collect::<Vec<_>>(),
                        );
                        let input: Vec<u8> = (0..n)
                            .flat_map(|q| (0..len(r, q)).map(move |i| byte(r, q, i)))
                            .collect();
                        let mut output = vec![0u8; ro[n]];
                        let (send_at, recv_at) = (BlockAt::Listed(&so), BlockAt::Listed(&ro));
                        let mut counters = Vec::new();
                        rooted::all_to_all(
                            l,
                            &input,
                            send_at,
                            &mut output,
                            recv_at,
                            pairwise,
                            &mut counters,
                        )
                        .unwrap();
                        output
                    });
                    for (r, got) in out.iter().enumerate() {
                        let want: Vec<u8> = (0..n)
                            .flat_map(|q| (0..len(q, r)).map(move |i| byte(q, r, i)))
                            .collect();
                        assert_eq!(
                            got, &want,
                            "all_to_all (even {even}, x{scale}) on {n} ranks, {slots} x {chunk} B: \
                             rank {r}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn uneven_all_gather_and_reduce_scatter() {
    for n in 2..=8 {
        for (slots, chunk) in LINKS {
            for scale in [0usize, 1, 250] {
                // Part q has (q * 3 % 4) * scale elements: some parts empty, most uneven.
                let counts: Vec<usize> = (0..n).map(|q| (q * 3 % 4) * scale).collect();
                let elems: usize = counts.iter().sum();
                let offs = crate::collectives::rooted::offsets(
                    &counts.iter().map(|c| c * 4).collect::<Vec<_>>(),
                );
                let (o2, c2) = (offs.clone(), counts.clone());
                let out = on_every_rank(mesh(n, slots, chunk, None), move |l| {
                    let r = l.rank();
                    let parts = ring::Chunks::listed(&o2, 4);
                    let mut all = vec![0u8; 4 * elems];
                    let mine = bytes((0..c2[r]).map(|i| value(r, i)));
                    all[o2[r]..o2[r + 1]].copy_from_slice(&mine);
                    ring::all_gather_in(l, &mut all, parts).unwrap();
                    let mut d = bytes((0..elems).map(|i| value(r, i)));
                    ring::reduce_scatter_in(l, AllReduce::Sum, DType::f32, &mut d, parts).unwrap();
                    (f32s(&all), f32s(&d[o2[r]..o2[r + 1]]))
                });
                let what = format!("{n} ranks, {slots} x {chunk} B, counts {counts:?}");
                let gathered: Vec<f32> = (0..n)
                    .flat_map(|q| (0..counts[q]).map(move |i| value(q, i)))
                    .collect();
                for (r, (all, part)) in out.iter().enumerate() {
                    assert_eq!(all, &gathered, "all_gather_v {what}: rank {r}");
                    let first = offs[r] / 4;
                    let want: Vec<f32> = (first..first + counts[r])
                        .map(|i| (0..n).map(|q| value(q, i)).sum())
                        .collect();
                    assert_eq!(part, &want, "reduce_scatter_v {what}: rank {r}");
                }
            }
        }
    }
}

#[test]
fn bruck_all_to_all_with_equal_uneven_and_empty_blocks_over_log_partners() {
    for n in 1..=9 {
        for (slots, chunk) in LINKS {
            for (scale, even) in [(0, true), (1, true), (300, true), (1, false), (90, false)] {
                let len = move |from: usize, to: usize| {
                    if even {
                        scale
                    } else {
                        block_len(from, to, scale)
                    }
                };
                let out = on_every_rank(mesh(n, slots, chunk, None), move |l| {
                    let r = l.rank();
                    let so = rooted::offsets(&(0..n).map(|q| len(r, q)).collect::<Vec<_>>());
                    let ro = rooted::offsets(&(0..n).map(|q| len(q, r)).collect::<Vec<_>>());
                    let input: Vec<u8> = (0..n)
                        .flat_map(|q| (0..len(r, q)).map(move |i| byte(r, q, i)))
                        .collect();
                    let mut output = vec![0u8; ro[n]];
                    let (send_at, recv_at) = if even {
                        (BlockAt::Equal(scale), BlockAt::Equal(scale))
                    } else {
                        (BlockAt::Listed(&so), BlockAt::Listed(&ro))
                    };
                    let (mut bufs, mut counters) = Default::default();
                    // Twice, reusing the buffers: the second call must not see the first's.
                    for _ in 0..2 {
                        output.fill(0);
                        bruck::all_to_all(
                            l,
                            &input,
                            send_at,
                            &mut output,
                            recv_at,
                            &mut bufs,
                            &mut counters,
                        )
                        .unwrap();
                    }
                    (output, l.used.clone())
                });
                for (r, (got, used)) in out.iter().enumerate() {
                    let what = format!(
                        "bruck all_to_all (even {even}, x{scale}) on {n} ranks, {slots} x {chunk} \
                         B: rank {r}"
                    );
                    let want: Vec<u8> = (0..n)
                        .flat_map(|q| (0..len(q, r)).map(move |i| byte(q, r, i)))
                        .collect();
                    assert_eq!(got, &want, "{what}");
                    let partners = bruck::partners(r, n);
                    assert!(
                        used.iter().all(|p| partners.contains(p)),
                        "{what}: {used:?}"
                    );
                    assert!(partners.len() <= 2 * (n.max(1).ilog2() as usize + 1));
                }
            }
        }
    }
}

#[test]
fn bruck_all_to_allv_names_the_rank_whose_block_differs() {
    // Rank 1 sends rank 0 five bytes where rank 0 expects four: rank 0 names rank 1.
    let n = 5;
    let out = on_every_rank(mesh(n, 2, 64, None), move |l| {
        let r = l.rank();
        let send: Vec<usize> = (0..n)
            .map(|q| if (r, q) == (1, 0) { 5 } else { 4 })
            .collect();
        let (so, ro) = (rooted::offsets(&send), rooted::offsets(&[4; 5]));
        let input = vec![r as u8; so[n]];
        let mut output = vec![0u8; ro[n]];
        let (send_at, recv_at) = (BlockAt::Listed(&so), BlockAt::Listed(&ro));
        let mut bufs = Default::default();
        bruck::all_to_all(
            l,
            &input,
            send_at,
            &mut output,
            recv_at,
            &mut bufs,
            &mut Vec::new(),
        )
    });
    match &out[0] {
        Err(crate::Error::LengthMismatch { from, got, want }) => {
            assert_eq!((*from, *got, *want), (1, 5, 4))
        }
        other => panic!("rank 0: {other:?}"),
    }
    assert!(out[1..].iter().all(|o| o.is_ok()), "{out:?}");
}

#[test]
fn binomial_gather_and_scatter_at_every_root_over_log_partners() {
    for n in 1..=9 {
        for (slots, chunk) in LINKS {
            for root in 0..n {
                for len in [0usize, 3, 700] {
                    let out = on_every_rank(mesh(n, slots, chunk, None), move |l| {
                        let r = l.rank();
                        let mine: Vec<u8> = (0..len).map(|i| byte(r, root, i)).collect();
                        let mut all = vec![0u8; if r == root { n * len } else { 0 }];
                        let (mut held, mut counters) = (Vec::new(), Vec::new());
                        binomial::gather(l, root, &mine, &mut all, &mut held, &mut counters)
                            .unwrap();
                        let src: Vec<u8> = if r == root {
                            (0..n)
                                .flat_map(|q| (0..len).map(move |i| byte(root, q, i)))
                                .collect()
                        } else {
                            Vec::new()
                        };
                        let mut got = vec![0u8; len];
                        binomial::scatter(l, root, &src, &mut got, &mut held, &mut counters)
                            .unwrap();
                        (all, got, l.used.clone())
                    });
                    let what = format!("root {root} on {n} ranks, {slots} x {chunk} B, {len} B");
                    let want: Vec<u8> = (0..n)
                        .flat_map(|q| (0..len).map(move |i| byte(q, root, i)))
                        .collect();
                    assert_eq!(out[root].0, want, "tree gather to {what}");
                    for (r, (_, got, used)) in out.iter().enumerate() {
                        let want: Vec<u8> = (0..len).map(|i| byte(root, r, i)).collect();
                        assert_eq!(got, &want, "tree scatter from {what}: rank {r}");
                        let partners = binomial::partners(r, n, root);
                        assert!(
                            used.iter().all(|p| partners.contains(p)),
                            "{what}: {used:?}"
                        );
                        assert!(partners.len() <= n.max(1).ilog2() as usize + 1, "{what}");
                    }
                }
            }
        }
    }
}
