//! Randomized mismatches. Every rank draws the same random sequence of operations from a shared
//! seed (every kind, several dtypes and reductions, lengths from 0 to several chunks, roots,
//! point-to-point pairs, ring shifts, batches, splits); from a random position on, one rank
//! calls something else or changes one argument. Every rank must end each sequence with correct
//! results, or with an error that names the mismatch (or the refused call): never wrong data, a
//! panic, a hang past the deadline, or another cause (a stall, a departure). One sequence in
//! eight agrees everywhere, as a control. Each sequence runs on a fresh `dup` of the world, and
//! every rank's outcome is compared over the world after it.
//!
//! Two tiers: ranks as threads of this process (thousands of sequences, milliseconds each), and
//! ranks as processes over the transport under test (hundreds; some in the VM over RDMA).

mod common;
use common::*;
use rdmacomm::{AllReduce, Comm, Communicator, DType, P2p};
use std::time::{Duration, Instant};

/// Each wait's bound; a sequence must end well within it plus the time to tell every rank.
const TIMEOUT: Duration = Duration::from_secs(5);
const DEADLINE: Duration = Duration::from_secs(8);

/// Byte lengths: mostly small, some across several chunks (TCP's are 64 KiB).
fn a_len(g: &mut Rng) -> usize {
    const LENS: [usize; 10] = [0, 1, 3, 8, 24, 100, 1000, 4096, 70_000, 200_000];
    let i = g.below(100);
    LENS[if i < 85 { i % 8 } else { 8 + i % 2 }]
}

const DTYPES: [DType; 8] = [
    DType::f32,
    DType::f64,
    DType::f16,
    DType::bf16,
    DType::i8,
    DType::u8,
    DType::i32,
    DType::u64,
];

fn a_dtype(g: &mut Rng) -> DType {
    DTYPES[g.below(DTYPES.len() as u64)]
}

fn a_reduction(g: &mut Rng) -> AllReduce {
    AllReduce::ALL[g.below(4)]
}

/// Elements of `dtype` in about `a_len` bytes.
fn elems(g: &mut Rng, dtype: DType) -> usize {
    a_len(g) / dtype.size()
}

/// One operation as a rank calls it (`n`-rank vectors are per rank).
#[derive(Clone, Debug, PartialEq)]
enum Op {
    AllReduce(DType, AllReduce, usize),
    AllGather(usize),
    SumScatter(DType, usize),
    Broadcast(usize, usize),
    Barrier,
    /// A send from the first rank to the second, received there; the others do nothing.
    Pair(usize, usize, usize),
    /// `sendrecv` to the next rank from the previous (backwards if the flag is set).
    Shift(usize, bool),
    /// A batch: rank p sends `lens[p * n + q]` bytes to each q, and receives what each sends it.
    Batch(Vec<usize>),
    AllToAll(usize),
    AllToAllV(Vec<usize>),
    Reduce(usize, DType, AllReduce, usize),
    Gather(usize, usize),
    Scatter(usize, usize),
    AllGatherV(Vec<usize>),
    /// Elements of each rank's part.
    ReduceScatterV(DType, AllReduce, Vec<usize>),
    /// Each rank's color (negative: none) and key; then an all_reduce in each subgroup.
    Split(Vec<i32>, Vec<i32>),
}

fn an_op(g: &mut Rng, n: usize) -> Op {
    let lens = |g: &mut Rng, k: usize| (0..k).map(|_| a_len(g) / 4).collect::<Vec<_>>();
    match g.below(16) {
        0 => {
            let d = a_dtype(g);
            Op::AllReduce(d, a_reduction(g), elems(g, d))
        }
        1 => Op::AllGather(a_len(g) / n),
        2 => {
            let d = a_dtype(g);
            Op::SumScatter(d, elems(g, d) / n)
        }
        3 => Op::Broadcast(g.below(n as u64), a_len(g)),
        4 => Op::Barrier,
        5 => {
            let from = g.below(n as u64);
            let to = (from + 1 + g.below(n as u64 - 1)) % n;
            Op::Pair(from, to, a_len(g))
        }
        6 => Op::Shift(a_len(g), g.below(2) == 1),
        7 => Op::Batch(lens(g, n * n)),
        8 => Op::AllToAll(a_len(g) / n),
        9 => Op::AllToAllV(lens(g, n * n)),
        10 => {
            let d = a_dtype(g);
            Op::Reduce(g.below(n as u64), d, a_reduction(g), elems(g, d))
        }
        11 => Op::Gather(g.below(n as u64), a_len(g) / n),
        12 => Op::Scatter(g.below(n as u64), a_len(g) / n),
        13 => Op::AllGatherV(lens(g, n)),
        14 => {
            let d = a_dtype(g);
            let parts = (0..n).map(|_| elems(g, d) / n).collect();
            Op::ReduceScatterV(d, a_reduction(g), parts)
        }
        _ => {
            let colors = (0..n).map(|_| g.below(3) as i32 - 1).collect();
            let keys = (0..n).map(|_| g.below(5) as i32).collect();
            Op::Split(colors, keys)
        }
    }
}

/// Another length near `l` or far from it.
fn other_len(g: &mut Rng, l: usize) -> usize {
    match g.below(5) {
        0 => l + 1,
        1 if l > 0 => l - 1,
        2 => 0,
        3 => 70_001,
        _ => l * 2 + 3,
    }
}

/// `op` with one argument changed, or another operation altogether, as `me` calls it.
fn deviate(g: &mut Rng, op: &Op, n: usize, me: usize) -> Op {
    let mut o = op.clone();
    if g.below(4) == 0 {
        loop {
            let other = an_op(g, n);
            // Another split is no changed argument: the colors are each rank's own.
            let splits = matches!((op, &other), (Op::Split(..), Op::Split(..)));
            if other != *op && !splits {
                return other;
            }
        }
    }
    let pick = g.below(3);
    let root = |g: &mut Rng, r: usize| (r + 1 + g.below(n as u64)) % (n + 1);
    match &mut o {
        Op::AllReduce(d, r, e) | Op::Reduce(_, d, r, e) => match pick {
            0 => *e = other_len(g, *e),
            1 => *d = DTYPES[(DTYPES.iter().position(|x| x == d).unwrap() + 1) % DTYPES.len()],
            _ => *r = AllReduce::ALL[(AllReduce::ALL.iter().position(|x| x == r).unwrap() + 1) % 4],
        },
        Op::AllGather(l) | Op::AllToAll(l) | Op::Shift(l, _) => *l = other_len(g, *l),
        Op::SumScatter(d, e) => {
            if pick == 0 {
                *d = DTYPES[(DTYPES.iter().position(|x| x == d).unwrap() + 3) % DTYPES.len()];
            } else {
                *e = other_len(g, *e);
            }
        }
        Op::Broadcast(root_, l) | Op::Gather(root_, l) | Op::Scatter(root_, l) => {
            if pick == 0 {
                *l = other_len(g, *l);
            } else {
                *root_ = root(g, *root_);
            }
        }
        Op::Pair(from, to, l) => match pick {
            0 => *l = other_len(g, *l),
            1 => std::mem::swap(from, to),
            _ => {
                // This rank takes part where it did not, or the other way round.
                if *from == me || *to == me {
                    *from = (me + 1) % n;
                    *to = (me + 2) % n;
                    if from == to {
                        std::mem::swap(from, to);
                        *to = me;
                    }
                } else {
                    *to = me;
                }
            }
        },
        Op::Batch(lens) | Op::AllToAllV(lens) => {
            // An entry of this rank's row (what it sends) or column (what it receives).
            let q = g.below(n as u64);
            let at = if pick == 0 { me * n + q } else { q * n + me };
            lens[at] = other_len(g, lens[at]);
        }
        Op::AllGatherV(lens) | Op::ReduceScatterV(_, _, lens) => {
            if pick == 0 {
                lens.rotate_left(1);
            }
            if pick != 0 || lens.windows(2).all(|w| w[0] == w[1]) {
                let q = g.below(n as u64);
                lens[q] = other_len(g, lens[q]);
            }
        }
        Op::Barrier | Op::Split(..) => return Op::AllReduce(DType::u8, AllReduce::Max, 1),
    }
    if o == *op {
        return Op::Barrier;
    }
    o
}

/// A value of rank `r`'s input: small integers, so that every reduction is exact.
fn val(seed: u64, k: usize, r: usize, i: usize, d: DType, op: AllReduce) -> i64 {
    let h = (seed as usize)
        .wrapping_mul(31)
        .wrapping_add(k * 131 + r * 17 + i * 7 + i / 13);
    let unsigned = matches!(d, DType::u8 | DType::u64);
    match op {
        AllReduce::Prod => 1 + (h % 2) as i64,
        _ if unsigned => (h % 7) as i64,
        _ => (h % 7) as i64 - 3,
    }
}

fn encode(d: DType, vals: impl Iterator<Item = i64>) -> Vec<u8> {
    let mut out = Vec::new();
    for v in vals {
        match d {
            DType::f32 => out.extend((v as f32).to_le_bytes()),
            DType::f64 => out.extend((v as f64).to_le_bytes()),
            DType::f16 => out.extend(half::f16::from_f64(v as f64).to_le_bytes()),
            DType::bf16 => out.extend(half::bf16::from_f64(v as f64).to_le_bytes()),
            DType::i8 | DType::u8 => out.push(v as u8),
            DType::i32 => out.extend((v as i32).to_le_bytes()),
            DType::u64 => out.extend((v as u64).to_le_bytes()),
            _ => unreachable!("not drawn"),
        }
    }
    out
}

/// The reduction of `vals` as `d` computes it (wrapping for integers; exact for these values).
fn fold(d: DType, op: AllReduce, vals: impl Iterator<Item = i64>) -> i64 {
    let unsigned = matches!(d, DType::u8 | DType::u64);
    let mut acc: Option<i64> = None;
    for v in vals {
        acc = Some(match acc {
            None => v,
            Some(a) => match op {
                AllReduce::Sum => a.wrapping_add(v),
                AllReduce::Prod => a.wrapping_mul(v),
                AllReduce::Min if unsigned => (a as u64).min(v as u64) as i64,
                AllReduce::Max if unsigned => (a as u64).max(v as u64) as i64,
                AllReduce::Min => a.min(v),
                _ => a.max(v),
            },
        });
    }
    acc.unwrap_or(0)
}

/// Rank `r`'s `len` bytes for peer `to` (or for all) of operation `k`.
fn bytes(seed: u64, k: usize, r: usize, to: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (seed as usize ^ (k * 29 + r * 101 + to * 7 + i * 3 + i / 251)) as u8)
        .collect()
}

/// What one rank saw of one sequence.
#[derive(Debug, Default)]
struct Seen {
    /// The first error, if any.
    error: Option<String>,
    /// An operation that returned Ok with data other than the reference: the sequence fails.
    wrong: Option<String>,
}

/// Runs `op` (operation `k` of sequence `seed`) as rank `r` on `c`: Ok(None) for the reference
/// result, Ok(Some(what)) for wrong data, Err for an error.
fn run_op(c: &Comm, seed: u64, k: usize, op: &Op) -> rdmacomm::Result<Option<String>> {
    let (r, n) = (c.rank(), c.size());
    let check = |got: &[u8], want: &[u8], what: &str| -> Option<String> {
        (got != want).then(|| format!("{what}: {} bytes differ from the reference", got.len()))
    };
    Ok(match op {
        Op::AllReduce(d, o, e) => {
            let mut data = encode(*d, (0..*e).map(|i| val(seed, k, r, i, *d, *o)));
            c.all_reduce(*o, *d, &mut data)?;
            let want = encode(
                *d,
                (0..*e).map(|i| fold(*d, *o, (0..n).map(|q| val(seed, k, q, i, *d, *o)))),
            );
            check(&data, &want, "all_reduce")
        }
        Op::AllGather(l) => {
            let mut out = vec![0u8; n * l];
            c.all_gather(&bytes(seed, k, r, n, *l), &mut out)?;
            let want: Vec<u8> = (0..n).flat_map(|q| bytes(seed, k, q, n, *l)).collect();
            check(&out, &want, "all_gather")
        }
        Op::SumScatter(d, e) => {
            let s = AllReduce::Sum;
            let input = encode(*d, (0..n * e).map(|i| val(seed, k, r, i, *d, s)));
            let mut out = vec![0u8; e * d.size()];
            c.sum_scatter(*d, &input, &mut out)?;
            let want = encode(
                *d,
                (r * e..(r + 1) * e)
                    .map(|i| fold(*d, s, (0..n).map(|q| val(seed, k, q, i, *d, s)))),
            );
            check(&out, &want, "sum_scatter")
        }
        Op::Broadcast(root, l) => {
            let mut data = if r == *root {
                bytes(seed, k, r, n, *l)
            } else {
                vec![0u8; *l]
            };
            c.broadcast(*root, &mut data)?;
            check(&data, &bytes(seed, k, *root, n, *l), "broadcast")
        }
        Op::Barrier => {
            c.barrier()?;
            None
        }
        Op::Pair(from, to, l) => {
            if r == *from {
                c.send(*to, &bytes(seed, k, r, *to, *l))?;
                None
            } else if r == *to {
                let mut got = vec![0u8; *l];
                c.recv(*from, &mut got)?;
                check(&got, &bytes(seed, k, *from, r, *l), "recv")
            } else {
                None
            }
        }
        Op::Shift(l, back) => {
            let (dst, src) = if *back {
                ((r + n - 1) % n, (r + 1) % n)
            } else {
                ((r + 1) % n, (r + n - 1) % n)
            };
            let mut got = vec![0u8; *l];
            c.sendrecv(dst, &bytes(seed, k, r, dst, *l), src, &mut got)?;
            check(&got, &bytes(seed, k, src, r, *l), "sendrecv")
        }
        Op::Batch(lens) => {
            let sends: Vec<(usize, Vec<u8>)> = (0..n)
                .filter(|&q| q != r)
                .map(|q| (q, bytes(seed, k, r, q, lens[r * n + q])))
                .collect();
            let mut recvs: Vec<(usize, Vec<u8>)> = (0..n)
                .filter(|&q| q != r)
                .map(|q| (q, vec![0u8; lens[q * n + r]]))
                .collect();
            let mut ops: Vec<P2p<'_>> = sends
                .iter()
                .map(|(q, d)| P2p::Send { peer: *q, data: d })
                .collect();
            ops.extend(
                recvs
                    .iter_mut()
                    .map(|(q, d)| P2p::Recv { peer: *q, data: d }),
            );
            c.batch(&mut ops)?;
            drop(ops);
            recvs
                .iter()
                .find_map(|(q, got)| check(got, &bytes(seed, k, *q, r, lens[q * n + r]), "batch"))
        }
        Op::AllToAll(b) => {
            let input: Vec<u8> = (0..n).flat_map(|q| bytes(seed, k, r, q, *b)).collect();
            let mut out = vec![0u8; n * b];
            c.all_to_all(&input, &mut out)?;
            let want: Vec<u8> = (0..n).flat_map(|q| bytes(seed, k, q, r, *b)).collect();
            check(&out, &want, "all_to_all")
        }
        Op::AllToAllV(lens) => {
            let sl: Vec<usize> = (0..n).map(|q| lens[r * n + q]).collect();
            let rl: Vec<usize> = (0..n).map(|q| lens[q * n + r]).collect();
            let input: Vec<u8> = (0..n).flat_map(|q| bytes(seed, k, r, q, sl[q])).collect();
            let mut out = vec![0u8; rl.iter().sum()];
            c.all_to_allv(&input, &sl, &mut out, &rl)?;
            let want: Vec<u8> = (0..n).flat_map(|q| bytes(seed, k, q, r, rl[q])).collect();
            check(&out, &want, "all_to_allv")
        }
        Op::Reduce(root, d, o, e) => {
            let mine = encode(*d, (0..*e).map(|i| val(seed, k, r, i, *d, *o)));
            let mut data = mine.clone();
            c.reduce(*root, *o, *d, &mut data)?;
            let want = if r == *root {
                encode(
                    *d,
                    (0..*e).map(|i| fold(*d, *o, (0..n).map(|q| val(seed, k, q, i, *d, *o)))),
                )
            } else {
                mine
            };
            check(&data, &want, "reduce")
        }
        Op::Gather(root, l) => {
            let mut out = vec![0u8; if r == *root { n * l } else { 0 }];
            c.gather(*root, &bytes(seed, k, r, n, *l), &mut out)?;
            let want: Vec<u8> = if r == *root {
                (0..n).flat_map(|q| bytes(seed, k, q, n, *l)).collect()
            } else {
                Vec::new()
            };
            check(&out, &want, "gather")
        }
        Op::Scatter(root, l) => {
            let input: Vec<u8> = if r == *root {
                (0..n).flat_map(|q| bytes(seed, k, r, q, *l)).collect()
            } else {
                Vec::new()
            };
            let mut out = vec![0u8; *l];
            c.scatter(*root, &input, &mut out)?;
            check(&out, &bytes(seed, k, *root, r, *l), "scatter")
        }
        Op::AllGatherV(lens) => {
            let mut out = vec![0u8; lens.iter().sum()];
            c.all_gather_v(&bytes(seed, k, r, n, lens[r]), &mut out, lens)?;
            let want: Vec<u8> = (0..n).flat_map(|q| bytes(seed, k, q, n, lens[q])).collect();
            check(&out, &want, "all_gather_v")
        }
        Op::ReduceScatterV(d, o, parts) => {
            let total: usize = parts.iter().sum();
            let input = encode(*d, (0..total).map(|i| val(seed, k, r, i, *d, *o)));
            let mut out = vec![0u8; parts[r] * d.size()];
            let lens: Vec<usize> = parts.iter().map(|p| p * d.size()).collect();
            c.reduce_scatter_v(*o, *d, &input, &mut out, &lens)?;
            let at: usize = parts[..r].iter().sum();
            let want = encode(
                *d,
                (at..at + parts[r])
                    .map(|i| fold(*d, *o, (0..n).map(|q| val(seed, k, q, i, *d, *o)))),
            );
            check(&out, &want, "reduce_scatter_v")
        }
        Op::Split(colors, keys) => {
            let sub = c.split_comm(colors[r], keys[r])?;
            let members: Vec<usize> = if colors[r] < 0 {
                vec![r]
            } else {
                (0..n).filter(|&q| colors[q] == colors[r]).collect()
            };
            let s = AllReduce::Sum;
            let mut data = encode(
                DType::i32,
                (0..5).map(|i| val(seed, k, r, i, DType::i32, s)),
            );
            sub.all_reduce(s, DType::i32, &mut data)?;
            let want = encode(
                DType::i32,
                (0..5).map(|i| {
                    fold(
                        DType::i32,
                        s,
                        members.iter().map(|&q| val(seed, k, q, i, DType::i32, s)),
                    )
                }),
            );
            check(&data, &want, "an all_reduce in a split")
        }
    })
}

/// The sequence of `seed` as rank `me` of `n` calls it, and the position of the change (None
/// for a control sequence).
fn sequence(seed: u64, n: usize, me: usize) -> (Vec<Op>, Option<(usize, usize)>) {
    let mut g = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let len = 1 + g.below(6);
    let mut ops: Vec<Op> = (0..len).map(|_| an_op(&mut g, n)).collect();
    if g.below(8) == 0 {
        return (ops, None);
    }
    let (at, who) = (g.below(len as u64), g.below(n as u64));
    if me == who {
        ops[at] = deviate(&mut g, &ops[at], n, me);
    }
    (ops, Some((at, who)))
}

/// Errors that name the true cause of a changed call.
const CAUSES: [&str; 4] = [
    "mismatched operations",
    "refused its call",
    "invalid argument",
    "were expected",
];
/// Errors that blame something else.
const WRONG: [&str; 5] = [
    "stopped",
    "no progress",
    "closed its communicator",
    "timed out",
    "hung",
];

/// Tallies of a run.
#[derive(Debug, Default)]
struct Tally {
    sequences: usize,
    controls: usize,
    errors: usize,
    /// Changes that changed nothing visible (every rank got the reference).
    harmless: usize,
}

/// Runs sequences `first..first + count` on dups of `world` (every rank alike), checking each
/// against the others' outcomes; panics naming the seed on the first violation.
fn run_sequences(world: &Comm, first: u64, count: u64) -> Tally {
    let (r, n) = (world.rank(), world.size());
    let mut tally = Tally::default();
    for seed in first..first + count {
        let (ops, change) = sequence(seed, n, r);
        let c = world
            .dup()
            .unwrap_or_else(|e| panic!("rank {r}: seed {seed}: dup: {e}"));
        let t = Instant::now();
        let mut seen = Seen::default();
        for (k, op) in ops.iter().enumerate() {
            let r0 = run_op(&c, seed, k, op);
            if std::env::var("MISMATCH_TRACE").is_ok() {
                eprintln!(
                    "TRACE rank {r} op {k} at {:?}: {:?}",
                    t.elapsed(),
                    r0.as_ref().map_err(|e| e.to_string())
                );
            }
            match r0 {
                Ok(None) => {}
                Ok(Some(what)) => {
                    seen.wrong
                        .get_or_insert(format!("operation {k} {op:?}: {what}"));
                }
                Err(e) => {
                    seen.error
                        .get_or_insert(format!("operation {k} {op:?}: {e}"));
                }
            }
        }
        if let Err(e) = c.barrier() {
            seen.error
                .get_or_insert(format!("the closing barrier: {e}"));
        }
        let why = || format!("rank {r}: seed {seed} ({change:?}, ops {ops:?})");
        assert!(
            seen.wrong.is_none(),
            "{}: wrong data: {:?}",
            why(),
            seen.wrong
        );
        if change.is_none() {
            assert!(
                seen.error.is_none(),
                "{}: a control failed: {:?}",
                why(),
                seen.error
            );
        }
        // A rank may end with correct results while another found the change (a send that left
        // before its receiver saw it): after every rank is done, a second barrier tells whether
        // the failure reached every rank.
        let mut all = vec![0u8; n];
        world
            .all_gather(&[u8::from(seen.error.is_some())], &mut all)
            .unwrap_or_else(|e| panic!("{}: comparing outcomes: {e}", why()));
        let failed_somewhere = all.contains(&1);
        match c.barrier() {
            Ok(()) => assert!(
                !failed_somewhere,
                "{}: ranks {all:?} failed, yet a later barrier passed here",
                why()
            ),
            Err(e) => {
                assert!(
                    failed_somewhere,
                    "{}: a later barrier failed, nobody did before: {e}",
                    why()
                );
                seen.error.get_or_insert(format!("after the sequence: {e}"));
            }
        }
        let took = t.elapsed();
        drop(c);
        assert!(
            took < DEADLINE,
            "{}: took {took:?}: {:?}",
            why(),
            seen.error
        );
        if let Some(e) = &seen.error {
            assert!(
                CAUSES.iter().any(|c| e.contains(c)) && !WRONG.iter().any(|w| e.contains(w)),
                "{}: the wrong cause: {e}",
                why()
            );
        }
        tally.sequences += 1;
        tally.controls += usize::from(change.is_none());
        tally.errors += usize::from(failed_somewhere);
        tally.harmless += usize::from(change.is_some() && !failed_somewhere);
    }
    tally
}

fn report(who: &str, n: usize, t: &Tally) {
    println!(
        "RESULT {who}, {n} ranks: {} sequences ({} controls): {} ended in a named error on every \
         rank, {} changes harmless (reference results everywhere), none wrong",
        t.sequences, t.controls, t.errors, t.harmless
    );
}

/// Thread-ranks of this process, over the test's [`Net`] (TCP by default): each runs `count` sequences from `first` with `run` (MISMATCH_SEED=s replays
/// sequence s alone: a failure names its seed); rank 0's tally.
fn threads_as_ranks(n: usize, first: u64, count: u64, run: fn(&Comm, u64, u64) -> Tally) -> Tally {
    let port = free_port();
    let (first, count) = match std::env::var("MISMATCH_SEED") {
        Ok(s) => (s.parse().expect("a seed"), 1),
        Err(_) => (first, count),
    };
    let net = net();
    let tallies: Vec<Tally> = std::thread::scope(|s| {
        let ranks: Vec<_> = (0..n)
            .map(|r| {
                s.spawn(move || {
                    let mut cfg = rdmacomm::Config::new(r, n, format!("127.0.0.1:{port}"))
                        .unwrap_or_else(|e| panic!("rank {r}: {e}"));
                    cfg.timeout = TIMEOUT;
                    configure(&mut cfg, net, r);
                    let world = Comm::new(&cfg).unwrap_or_else(|e| panic!("rank {r}: {e}"));
                    run(&world, first, count)
                })
            })
            .collect();
        ranks.into_iter().map(|h| h.join().unwrap()).collect()
    });
    tallies.into_iter().next().expect("rank 0")
}

/// `n` sequences, times `MISMATCH_SCALE` (default 1; a longer run, say 4, away from CI).
fn sequences(n: u64) -> u64 {
    let scale: u64 = std::env::var("MISMATCH_SCALE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    n.saturating_mul(scale.max(1))
}

/// `count` changed-call sequences on `n` thread-ranks.
fn in_process(n: usize, count: u64) {
    let t = threads_as_ranks(n, 1000 * n as u64, count, run_sequences);
    report("in-process", n, &t);
}

#[test]
fn thousands_of_changed_calls_between_threads() {
    if require_rdma() {
        println!("SKIPPED: the VM runs the process tier");
        return;
    }
    in_process(2, sequences(600));
    in_process(3, sequences(400));
}

/// A correct program with delays, as rank `me` of `n` runs sequence `seed`: its operations
/// (one in four a send of 1-4 MiB, more than a transport's buffers hold) and, per operation,
/// how long each rank computes before calling it: mostly nothing or a few milliseconds, and in
/// one sequence in eight a rank (rank 0 in half of them) late by 110-220 ms, past the probes'
/// 100 ms.
fn delayed_sequence(seed: u64, n: usize) -> Vec<(Op, Vec<Duration>)> {
    let mut g = Rng(seed.wrapping_mul(0xD1B5_4A32_D192_ED03) | 1);
    let len = 1 + g.below(6);
    let mut ops: Vec<(Op, Vec<Duration>)> = (0..len)
        .map(|_| {
            let op = if g.below(4) == 0 {
                let from = g.below(n as u64);
                let to = (from + 1 + g.below(n as u64 - 1)) % n;
                Op::Pair(from, to, (1 << 20) + g.below(3 << 20))
            } else {
                an_op(&mut g, n)
            };
            let late = (0..n)
                .map(|_| match g.below(10) {
                    0..=6 => Duration::ZERO,
                    _ => Duration::from_micros(g.below(5000) as u64),
                })
                .collect();
            (op, late)
        })
        .collect();
    if g.below(8) == 0 {
        let k = g.below(len as u64);
        let who = if g.below(2) == 0 {
            0
        } else {
            g.below(n as u64)
        };
        ops[k].1[who] = Duration::from_millis(110 + g.below(111) as u64);
    }
    ops
}

/// Runs correct sequences `first..first + count` with their delays on dups of `world`: every
/// operation must return the reference result; no error is allowed.
fn run_delayed(world: &Comm, first: u64, count: u64) -> Tally {
    let (r, n) = (world.rank(), world.size());
    let mut tally = Tally::default();
    for seed in first..first + count {
        let ops = delayed_sequence(seed, n);
        let c = world
            .dup()
            .unwrap_or_else(|e| panic!("rank {r}: seed {seed}: dup: {e}"));
        let t = Instant::now();
        for (k, (op, late)) in ops.iter().enumerate() {
            std::thread::sleep(late[r]);
            match run_op(&c, seed, k, op) {
                Ok(None) => {}
                Ok(Some(what)) => panic!("rank {r}: seed {seed}: operation {k} {op:?}: {what}"),
                Err(e) => panic!(
                    "rank {r}: seed {seed}: a correct program failed at operation {k} {op:?} \
                     (delays {:?}): {e}",
                    ops.iter().map(|o| &o.1).collect::<Vec<_>>()
                ),
            }
        }
        c.barrier()
            .unwrap_or_else(|e| panic!("rank {r}: seed {seed}: closing barrier: {e}"));
        let took = t.elapsed();
        assert!(took < DEADLINE, "rank {r}: seed {seed}: took {took:?}");
        tally.sequences += 1;
        tally.controls += 1;
    }
    tally
}

/// `count` delayed correct sequences on `n` thread-ranks.
fn delayed_in_process(n: usize, count: u64) {
    let t = threads_as_ranks(n, 5_000_000 + 1000 * n as u64, count, run_delayed);
    println!(
        "RESULT in-process, {n} ranks: {} correct sequences with late ranks and large sends, \
         none failed",
        t.sequences
    );
}

#[test]
fn thousands_of_correct_programs_with_late_ranks() {
    if require_rdma() {
        println!("SKIPPED: the VM runs the process tier");
        return;
    }
    delayed_in_process(2, sequences(250));
    delayed_in_process(3, sequences(250));
}

fn processes_body() {
    let (r, n) = rank_size();
    let c = Comm::from_env().unwrap_or_else(|e| panic!("rank {r}: {e}"));
    let count: u64 = std::env::var("MISMATCH_SEQUENCES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    let t = run_sequences(&c, 7_000_000 + 1000 * n as u64, count);
    if r == 0 {
        report("processes", n, &t);
    }
    // Correct programs with late ranks and large sends, over the transport under test.
    let t = run_delayed(&c, 8_000_000 + 1000 * n as u64, count / 2);
    if r == 0 {
        println!(
            "RESULT processes, {n} ranks: {} correct sequences with late ranks and large sends, \
             none failed",
            t.sequences
        );
    }
}

#[test]
fn hundreds_of_changed_calls_between_processes() {
    const NAME: &str = "hundreds_of_changed_calls_between_processes";
    if !parent_ready(NAME, processes_body) {
        return;
    }
    // Fewer in the emulated VM, where rxe moves a few tens of MB/s.
    let count = sequences(if require_rdma() { 24 } else { 80 });
    // Under TCG a process can start seconds after its peer: the wait must cover it.
    let timeout = if require_rdma() { 4 * TIMEOUT } else { TIMEOUT };
    for n in [2, 3] {
        let env = |_| {
            vec![
                (
                    "RDMACOMM_TIMEOUT".to_string(),
                    timeout.as_secs().to_string(),
                ),
                ("MISMATCH_SEQUENCES".to_string(), count.to_string()),
            ]
        };
        let res = spawn(NAME, n, Placement::Local, &env, Duration::from_secs(600));
        assert_all_ok(&res);
        for line in res[0].output.lines().filter(|l| l.contains("RESULT")) {
            println!("{line}");
        }
    }
}

crate::matrix_shm!(
    thousands_of_changed_calls_between_threads,
    thousands_of_correct_programs_with_late_ranks,
    hundreds_of_changed_calls_between_processes
);
