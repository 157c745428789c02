//! Every algorithm over the in-memory link ([`super::mem_link`]): 2 to 8 ranks, queues of 1 to 4
//! chunks of 8 B to 4 KiB, lengths from empty to several thousand elements, each result checked
//! against a scalar re-computation, and bit identity across ranks where rounding depends on order.

use super::mem_link::{bytes, f32s, mesh, on_every_rank, MemLink};
use super::{bcast, direct, halving, hier, ring, rooted, Algo};
use crate::dtype::{AllReduce, DType};
use crate::transport::Link as _;
use std::time::{Duration, Instant};

/// Slots per pair and chunk bytes: one slot of 8 bytes (every element its own chunk, every post
/// waits for a take), a few small ones, and room for whole vectors.
const LINKS: [(usize, usize); 3] = [(1, 8), (2, 64), (4, 4096)];
const LENGTHS: [usize; 5] = [0, 1, 5, 1000, 4097];

/// Rank r's element i: small integers (sums exact in f32) or, with `frac`, values whose sum
/// rounds differently in different orders.
fn value(r: usize, i: usize, frac: bool) -> f32 {
    if frac {
        (r as f32 + 1.0) / 3.0 + i as f32 * 1e-3
    } else {
        ((r * 7 + i) % 13) as f32 - 6.0
    }
}

/// Runs all_reduce with `algo` (the way `Comm` dispatches it) on every rank and checks every
/// element against the sum and, with fractional values, the same bits on every rank.
fn all_reduce_checked(algo: Algo, n: usize, slots: usize, chunk: usize, hosts: Option<&[usize]>) {
    for &elems in &LENGTHS {
        for frac in [false, true] {
            let links = mesh(n, slots, chunk, hosts);
            let out = on_every_rank(links, move |l: &mut MemLink| {
                let r = crate::transport::Link::rank(l);
                let mut d = bytes((0..elems).map(|i| value(r, i, frac)));
                let mut scratch = Vec::new();
                let (op, t) = (AllReduce::Sum, DType::f32);
                match algo {
                    Algo::Ring => ring::all_reduce(l, op, t, &mut d),
                    Algo::Halving => halving::all_reduce_halving(l, op, t, &mut d, &mut scratch),
                    Algo::Doubling => halving::all_reduce_doubling(l, op, t, &mut d, &mut scratch),
                    Algo::Direct => direct::all_reduce_direct(l, op, t, &mut d, &mut scratch),
                    _ => {
                        let layout = l
                            .props()
                            .hosts
                            .as_deref()
                            .and_then(|h| hier::Layout::of(h, r));
                        hier::all_reduce(l, layout.as_ref(), op, t, &mut d, &mut scratch)
                    }
                }
                .unwrap();
                d
            });
            let what = format!("{algo:?} on {n} ranks, {slots} x {chunk} B, x{elems}, {hosts:?}");
            for (r, d) in out.iter().enumerate() {
                for (i, got) in f32s(d).into_iter().enumerate() {
                    let want: f64 = (0..n).map(|q| value(q, i, frac) as f64).sum();
                    let ok = if frac {
                        (got as f64 - want).abs() <= 1e-5 * want.abs().max(1.0)
                    } else {
                        got as f64 == want
                    };
                    assert!(ok, "{what}: rank {r} element {i}: {got} against {want}");
                }
                assert_eq!(d, &out[0], "{what}: rank {r}'s bits differ from rank 0's");
            }
        }
    }
}

#[test]
fn flat_all_reduces_on_2_to_8_ranks() {
    for n in 2..=8 {
        for (slots, chunk) in LINKS {
            for algo in [Algo::Ring, Algo::Halving, Algo::Doubling, Algo::Direct] {
                all_reduce_checked(algo, n, slots, chunk, None);
            }
        }
    }
}

#[test]
fn hierarchical_all_reduce_on_regular_and_uneven_layouts() {
    for hosts in [
        &[0, 0, 1, 1][..],
        &[0, 1, 0, 1],
        &[0, 0, 0, 1, 1, 1],
        &[0, 0, 1, 1, 2, 2],
        &[0, 0, 1, 1, 2, 2, 3, 3],
        // Uneven or one rank a host: the flat algorithms.
        &[0, 0, 1],
        &[0, 1, 1, 1],
        &[0, 1, 2],
    ] {
        for (slots, chunk) in LINKS {
            all_reduce_checked(Algo::Hierarchical, hosts.len(), slots, chunk, Some(hosts));
        }
    }
}

#[test]
fn reduce_scatters_and_all_gather() {
    for n in 2..=8 {
        for (slots, chunk) in LINKS {
            for per in [0usize, 1, 3, 300] {
                let len = per * n;
                // Ring reduce-scatter (any n) and halving's (powers of two): rank r's part
                // holds the sum of every rank's part r.
                for halving_rs in [false, true] {
                    if halving_rs && !n.is_power_of_two() {
                        continue;
                    }
                    let out = on_every_rank(mesh(n, slots, chunk, None), move |l| {
                        let r = crate::transport::Link::rank(l);
                        let mut d = bytes((0..len).map(|i| value(r, i, false)));
                        let (op, t) = (AllReduce::Sum, DType::f32);
                        if halving_rs {
                            halving::reduce_scatter_halving(l, op, t, &mut d).unwrap();
                        } else {
                            ring::reduce_scatter(l, op, t, &mut d).unwrap();
                        }
                        f32s(&d)
                    });
                    for (r, d) in out.iter().enumerate() {
                        for (i, &got) in d.iter().enumerate().skip(r * per).take(per) {
                            let want: f32 = (0..n).map(|q| value(q, i, false)).sum();
                            assert_eq!(got, want, "reduce-scatter (halving {halving_rs}) {n} ranks {slots} x {chunk}: rank {r} element {i}");
                        }
                    }
                }
                // all_gather: part q of every rank's result is rank q's input.
                let out = on_every_rank(mesh(n, slots, chunk, None), move |l| {
                    let r = crate::transport::Link::rank(l);
                    let mut d = vec![0u8; 4 * len];
                    let mine = bytes((0..per).map(|i| value(r, i, true)));
                    d[4 * r * per..4 * (r + 1) * per].copy_from_slice(&mine);
                    ring::all_gather(l, &mut d).unwrap();
                    d
                });
                let want: Vec<u8> = (0..n)
                    .flat_map(|q| bytes((0..per).map(move |i| value(q, i, true))))
                    .collect();
                for (r, d) in out.iter().enumerate() {
                    assert_eq!(
                        d, &want,
                        "all_gather {n} ranks {slots} x {chunk} x{per}: rank {r}"
                    );
                }
            }
        }
    }
}

/// Byte i of rank `from`'s block for rank `to` (all_to_all).
fn a2a_byte(from: usize, to: usize, i: usize) -> u8 {
    (from * 31 + to * 7 + i) as u8
}

/// Rank `from`'s block length for rank `to` in the uneven case (some empty).
fn a2a_len(from: usize, to: usize, per: usize) -> usize {
    (from + 2 * to) % 3 * per
}

#[test]
fn all_to_alls_pairwise_and_at_once() {
    for n in 2..=9 {
        for (slots, chunk) in LINKS {
            for per in [0usize, 1, 700] {
                for pairwise in [false, true] {
                    for uneven in [false, true] {
                        let out = on_every_rank(mesh(n, slots, chunk, None), move |l| {
                            let r = crate::transport::Link::rank(l);
                            let len = |f, t| if uneven { a2a_len(f, t, per) } else { per };
                            let offsets = |by: &dyn Fn(usize) -> usize| {
                                let mut o = vec![0];
                                for q in 0..n {
                                    o.push(o[q] + by(q));
                                }
                                o
                            };
                            let (so, ro) = (offsets(&|q| len(r, q)), offsets(&|q| len(q, r)));
                            let input: Vec<u8> = (0..n)
                                .flat_map(|q| (0..len(r, q)).map(move |i| a2a_byte(r, q, i)))
                                .collect();
                            let mut output = vec![0u8; ro[n]];
                            let (sa, ra) =
                                (rooted::BlockAt::Listed(&so), rooted::BlockAt::Listed(&ro));
                            let mut counters = Vec::new();
                            rooted::all_to_all(
                                l,
                                &input,
                                sa,
                                &mut output,
                                ra,
                                pairwise,
                                &mut counters,
                            )
                            .unwrap();
                            output
                        });
                        for (r, got) in out.iter().enumerate() {
                            let len = |f, t| if uneven { a2a_len(f, t, per) } else { per };
                            let want: Vec<u8> = (0..n)
                                .flat_map(|q| (0..len(q, r)).map(move |i| a2a_byte(q, r, i)))
                                .collect();
                            assert!(
                                got == &want,
                                "all_to_all (pairwise {pairwise}, uneven {uneven}) {n} ranks {slots} x {chunk} x{per}: rank {r}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn broadcasts_from_every_root() {
    for n in 2..=8 {
        for (slots, chunk) in LINKS {
            for root in 0..n {
                for tree in [false, true] {
                    for len in [0usize, 1, 100, 5000] {
                        let out = on_every_rank(mesh(n, slots, chunk, None), move |l| {
                            let r = crate::transport::Link::rank(l);
                            let mut d: Vec<u8> = (0..len).map(|i| (i * 31 + r) as u8).collect();
                            if tree {
                                bcast::broadcast_tree(l, root, &mut d).unwrap();
                            } else {
                                bcast::broadcast(l, root, &mut d).unwrap();
                            }
                            d
                        });
                        let want: Vec<u8> = (0..len).map(|i| (i * 31 + root) as u8).collect();
                        for (r, d) in out.iter().enumerate() {
                            assert_eq!(
                                d, &want,
                                "broadcast (tree {tree}) from {root} on {n} ranks, {slots} x {chunk} B, {len} B: rank {r}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn a_barrier_holds_every_rank_until_the_last_arrives() {
    for n in 2..=8 {
        for late in [0, n - 1] {
            let start = Instant::now();
            let hold = Duration::from_millis(60);
            let out = on_every_rank(mesh(n, 2, 64, None), move |l| {
                if crate::transport::Link::rank(l) == late {
                    std::thread::sleep(hold);
                }
                bcast::barrier(l).unwrap();
                start.elapsed()
            });
            for (r, t) in out.iter().enumerate() {
                assert!(
                    *t >= hold,
                    "{n} ranks, rank {late} late: rank {r} left the barrier after {t:?}"
                );
            }
        }
    }
}

/// The ring over links that relay (a received segment reduced or copied straight into the next
/// send's slot) gives the bits it gives over links that do not, at every world size, slot count
/// and chunk, for all_reduce, reduce_scatter and all_gather; a single slot leaves no window and
/// so no relay, and must still complete.
#[test]
fn relayed_rings_give_the_same_bits() {
    use super::mem_link::relaying;
    for n in 2..=8 {
        for (slots, chunk) in [(1, 8), (2, 8), (2, 64), (3, 64), (4, 4096)] {
            for &elems in &LENGTHS {
                // 0: no relays; 1: every rank relays; 2: the odd ranks send in place (as from
                // a buffer only they registered) in the same order of segments; 3: as 2, and
                // the all-gather lands in the odd ranks' buffers; 4: every rank in place and
                // landing.
                let run = |relay: u8| {
                    let links = mesh(n, slots, chunk, None);
                    let mut links = if relay > 0 { relaying(links) } else { links };
                    for (r, l) in links.iter_mut().enumerate() {
                        l.in_place = (relay == 2 || relay == 3) && r % 2 == 1 || relay == 4;
                        l.landing = relay >= 3;
                    }
                    on_every_rank(links, move |l: &mut MemLink| {
                        let r = crate::transport::Link::rank(l);
                        let (op, t) = (AllReduce::Sum, DType::f32);
                        let mut a = bytes((0..elems).map(|i| value(r, i, true)));
                        ring::all_reduce(l, op, t, &mut a).unwrap();
                        let m = elems.div_ceil(n).max(1) * n;
                        let mut rs = bytes((0..m).map(|i| value(r, i, true)));
                        ring::reduce_scatter(l, op, t, &mut rs).unwrap();
                        let own = rs.len() / n;
                        let rs = rs[r * own..(r + 1) * own].to_vec();
                        let mut ag = vec![0u8; m * 4];
                        ag[r * own..(r + 1) * own].copy_from_slice(&rs);
                        ring::all_gather(l, &mut ag).unwrap();
                        (a, rs, ag, l.ledger)
                    })
                };
                let (plain, relayed) = (run(0), run(1));
                for (v, how) in [(2, "odd in place"), (3, "odd landing"), (4, "all landing")] {
                    for (r, (p, q)) in plain.iter().zip(&run(v)).enumerate() {
                        let what = format!("{n} ranks, {slots} x {chunk} B, x{elems}, {how}");
                        assert_eq!((&p.0, &p.1, &p.2), (&q.0, &q.1, &q.2), "{what}: rank {r}");
                    }
                }
                let what = format!("{n} ranks, {slots} x {chunk} B, x{elems}");
                for (r, (p, q)) in plain.iter().zip(&relayed).enumerate() {
                    assert_eq!(p.0, q.0, "{what}: rank {r}'s all_reduce bits");
                    assert_eq!(p.1, q.1, "{what}: rank {r}'s reduce_scatter bits");
                    assert_eq!(p.2, q.2, "{what}: rank {r}'s all_gather bits");
                    assert_eq!(p.3.wire, q.3.wire, "{what}: rank {r}'s wire bytes");
                    if slots > 1 && elems >= 1000 {
                        assert!(
                            q.3.copied_in < p.3.copied_in,
                            "{what}: rank {r} relayed none"
                        );
                    }
                }
            }
        }
    }
}

/// The ledger of a ring all_reduce of `n` equal chunks of `c` bytes, from the algorithm's
/// definition: 2 (n - 1) chunks sent; the first n - 1 received are reduced, the rest copied out.
/// Without a relay every send is copied in; with one only the first step's.
fn ring_ledger(n: u64, c: u64, relay: bool) -> (u64, u64, u64, u64) {
    let wire = 2 * (n - 1) * c;
    let copied_in = if relay { c } else { wire };
    (copied_in, (n - 1) * c, (n - 1) * c, wire)
}

/// A ring all_reduce whose every rank sends in place and lands the all-gather half in its
/// peers' buffers copies nothing: it reduces (n - 1) chunks and puts 2 (n - 1) on the wire,
/// 0.5 passes per wire byte, the floor for a CPU reduction.
#[test]
fn a_landing_ring_makes_half_a_pass_per_wire_byte() {
    use super::mem_link::relaying;
    for n in [2usize, 4, 6, 8] {
        for relay in [false, true] {
            let elems = n * 3 * 1024;
            let links = mesh(n, 3, 4096, None);
            let mut links = if relay { relaying(links) } else { links };
            for l in &mut links {
                (l.in_place, l.landing) = (true, true);
            }
            let got = on_every_rank(links, move |l: &mut MemLink| {
                let r = crate::transport::Link::rank(l);
                let mut a = bytes((0..elems).map(|i| value(r, i, false)));
                ring::all_reduce(l, AllReduce::Sum, DType::f32, &mut a).unwrap();
                (a, l.ledger)
            });
            let (n64, c) = (n as u64, (elems / n * 4) as u64);
            let want: Vec<f32> = (0..elems)
                .map(|i| (0..n).map(|q| value(q, i, false)).sum())
                .collect();
            for (r, (a, l)) in got.iter().enumerate() {
                assert_eq!(f32s(a), want, "{n} ranks, relay {relay}: rank {r}'s sums");
                let have = (l.copied_in, l.reduced, l.copied_out, l.wire);
                let wire = 2 * (n64 - 1) * c;
                assert_eq!(have, (0, (n64 - 1) * c, 0, wire), "{n} ranks: rank {r}");
                assert!((l.passes() - 0.5).abs() < 1e-12, "{n}: {}", l.passes());
            }
        }
    }
}

/// Halving-doubling whose doubling lands in the partners' buffers: the bits of the staged run
/// at every world size (the folded ones included), and, where no rank folds, half a pass; a
/// halving reduce-scatter after it, over the same links, is unchanged.
#[test]
fn a_landing_halving_keeps_its_bits_and_makes_half_a_pass() {
    for n in 2..=8usize {
        for &elems in &LENGTHS {
            let run = |landing: bool| {
                let mut links = mesh(n, 3, 4096, None);
                for l in &mut links {
                    (l.in_place, l.landing) = (landing, landing);
                }
                on_every_rank(links, move |l: &mut MemLink| {
                    let r = crate::transport::Link::rank(l);
                    let mut a = bytes((0..elems).map(|i| value(r, i, true)));
                    let mut scratch = Vec::new();
                    let (op, t) = (AllReduce::Sum, DType::f32);
                    halving::all_reduce_halving(l, op, t, &mut a, &mut scratch).unwrap();
                    let ledger = l.ledger;
                    // A reduce-scatter alone offers nothing and takes no offer.
                    if n.is_power_of_two() {
                        let m = elems.div_ceil(n).max(1) * n;
                        let mut rs = bytes((0..m).map(|i| value(r, i, true)));
                        halving::reduce_scatter_halving(l, op, t, &mut rs).unwrap();
                        a.extend_from_slice(&rs[r * m / n * 4..(r + 1) * m / n * 4]);
                    }
                    (a, ledger)
                })
            };
            let (staged, landed) = (run(false), run(true));
            for (r, (s, l)) in staged.iter().zip(&landed).enumerate() {
                assert_eq!(s.0, l.0, "{n} ranks, x{elems}: rank {r}'s bits");
                let p = l.1;
                if n.is_power_of_two() && elems % n == 0 && elems >= 1000 {
                    let part = (elems * 4 / n * (n - 1)) as u64;
                    let have = (p.copied_in, p.reduced, p.copied_out, p.wire);
                    assert_eq!(
                        have,
                        (0, part, 0, 2 * part),
                        "{n} ranks, x{elems}: rank {r}"
                    );
                }
            }
        }
    }
}

#[test]
fn the_ledger_counts_the_ring_s_passes() {
    use super::mem_link::relaying;
    for n in [2usize, 4, 6, 8] {
        for relay in [false, true] {
            // 3 segments of 4 KiB a chunk: several windows of 3 slots.
            let elems = n * 3 * 1024;
            let links = mesh(n, 3, 4096, None);
            let links = if relay { relaying(links) } else { links };
            let got = on_every_rank(links, move |l: &mut MemLink| {
                let r = crate::transport::Link::rank(l);
                let mut a = bytes((0..elems).map(|i| value(r, i, false)));
                ring::all_reduce(l, AllReduce::Sum, DType::f32, &mut a).unwrap();
                l.ledger
            });
            let (n64, c) = (n as u64, (elems / n * 4) as u64);
            let want = ring_ledger(n64, c, relay);
            for (r, l) in got.iter().enumerate() {
                let have = (l.copied_in, l.reduced, l.copied_out, l.wire);
                assert_eq!(have, want, "{n} ranks, relay {relay}: rank {r}");
                // Passes per wire byte: 2 without a relay; 1 + 1 / (2 (n - 1)) with one.
                let passes = if relay {
                    1.0 + 1.0 / (2.0 * (n as f64 - 1.0))
                } else {
                    2.0
                };
                assert!((l.passes() - passes).abs() < 1e-12, "{n}: {}", l.passes());
            }
        }
    }
}
