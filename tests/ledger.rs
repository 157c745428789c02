//! The pass ledger over the real transports: a 1.5 MiB f32 all_reduce by ring and by
//! halving-doubling at 2, 4, 6 and 8 ranks, each rank's copies in, reductions, copies out and
//! wire bytes held against what the algorithm's definition says they must be (computed here,
//! apart from the code), and the result against a scalar sum. Over RDMA and shared memory the
//! ring relays (a received segment reduced or copied straight into the next send's slot): 1 +
//! 1 / (2 (n - 1)) passes per wire byte where it took 2; from a registered buffer over RDMA it
//! sends in place and the all-gather half lands in the receiver's buffer: 0.5 (halving too,
//! where no rank folds). TCP's user-space copies depend on what the socket takes at once, so
//! there the reductions, the wire and the kernel's copies are exact.

mod common;
use common::*;
use rdmacomm::{Algo, AllReduce, Comm, Communicator, DType, Ledger};
use std::time::Duration;

/// Elements: divisible by 2, 4, 6 and 8, and under TCP's 2 MiB slice.
const ELEMS: usize = 3 << 17;

/// Rank r's element i (small integers: every sum exact in f32).
fn val(r: usize, i: usize) -> f32 {
    ((r * 5 + i) % 11) as f32
}

/// What carries the job, from the communicator's own words.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Kind {
    Rdma,
    Shm,
    Tcp,
}

/// (copied in, reduced, copied out, wire) of a ring all_reduce of `s` bytes on `n` ranks
/// (chunks of s / n): 2 (n - 1) chunks sent, n - 1 reduced, n - 1 copied out; every send is
/// staged, or, relayed, only the first step's; from memory sent in place, none, and what the
/// all-gather received landed in place: nothing copied out.
fn ring(n: u64, s: u64, staged: Staging) -> [u64; 4] {
    let c = s / n;
    let wire = 2 * (n - 1) * c;
    let copied_in = match staged {
        Staging::All => wire,
        Staging::FirstStep => c,
        Staging::None => 0,
    };
    let copied_out = match staged {
        Staging::None => 0,
        _ => (n - 1) * c,
    };
    [copied_in, (n - 1) * c, copied_out, wire]
}

/// The same for halving-doubling (Open MPI's fold for a world not a power of two: the even
/// ranks below 2 rem hand their vector to the odd one above and get the result back; the odd
/// one takes it, reduces it in and copies it into place). Every send is staged; or, `landed`
/// (a registered buffer over RDMA), sent in place, and the doubling's chunks land in place.
fn halving(n: u64, r: u64, s: u64, landed: bool) -> [u64; 4] {
    let p = 1 << (63 - n.leading_zeros());
    let rem = n - p;
    let staged = |wire: u64| if landed { 0 } else { wire };
    if r < 2 * rem && r % 2 == 0 {
        return [staged(s), 0, s, s];
    }
    let part = s * (p - 1) / p;
    let [mut wire, mut reduced, mut out] = [2 * part, part, staged(part)];
    if r < 2 * rem {
        // Fold in: taken (copied out), reduced, copied into place; fold out: sent.
        out += 2 * s;
        reduced += s;
        wire += s;
    }
    [staged(wire), reduced, out, wire]
}

#[derive(Clone, Copy, Debug)]
enum Staging {
    /// Every send (a link that does not relay).
    #[allow(dead_code)]
    All,
    FirstStep,
    None,
}

fn body() {
    let (r, n) = rank_size();
    let c = Comm::from_env().unwrap_or_else(|e| panic!("rank {r}: {e}"));
    let dev = c.device().unwrap_or_default();
    let kind = if dev.starts_with("RDMA") {
        Kind::Rdma
    } else if dev.starts_with("shared memory") {
        Kind::Shm
    } else {
        assert_eq!(dev, "TCP", "rank {r}");
        Kind::Tcp
    };
    let s = (ELEMS * 4) as u64;
    let want_sum: Vec<u8> = (0..ELEMS)
        .flat_map(|i| (0..n).map(|q| val(q, i)).sum::<f32>().to_le_bytes())
        .collect();
    let mut data: Vec<u8> = Vec::new();
    for (algo, registered) in [
        (Algo::Ring, false),
        (Algo::Ring, true),
        (Algo::Halving, false),
        (Algo::Halving, true),
    ] {
        c.set_algorithm(algo);
        data.clear();
        data.extend((0..ELEMS).flat_map(|i| val(r, i).to_le_bytes()));
        let before = c.ledger();
        let bytes = &mut data[..];
        if registered {
            c.with_registered(bytes, &mut |b| c.all_reduce(AllReduce::Sum, DType::f32, b))
                .unwrap();
        } else {
            c.all_reduce(AllReduce::Sum, DType::f32, bytes).unwrap();
        }
        let l: Ledger = c.ledger() - before;
        assert!(data == want_sum, "rank {r}: {algo:?} all_reduce is wrong");
        let what = format!("rank {r} of {n}, {algo:?}, registered {registered}, {kind:?}");
        let want = match algo {
            Algo::Ring => {
                let staged = match (kind, registered) {
                    (Kind::Rdma, true) => Staging::None,
                    _ => Staging::FirstStep,
                };
                ring(n as u64, s, staged)
            }
            _ => halving(n as u64, r as u64, s, registered && kind == Kind::Rdma),
        };
        let have = [l.copied_in, l.reduced, l.copied_out, l.wire];
        eprintln!(
            "{what}: {have:?} against {want:?}: {:.3} passes per wire byte",
            l.passes()
        );
        if kind == Kind::Tcp {
            // Sent from the caller's memory by the kernel; what it did not take at once, and
            // what came with a header, is copied in user space.
            assert_eq!((l.reduced, l.wire), (want[1], want[3]), "{what}");
            assert_eq!(l.kernel, 2 * l.wire, "{what}: kernel copies");
            assert!(l.copied_in <= l.wire, "{what}");
            assert!(l.copied_out <= want[2], "{what}");
            continue;
        }
        assert_eq!(have, want, "{what}: (copied in, reduced, copied out, wire)");
        assert_eq!(l.kernel, 0, "{what}");
        if algo == Algo::Ring && !registered {
            let passes = 1.0 + 1.0 / (2.0 * (n as f64 - 1.0));
            assert!((l.passes() - passes).abs() < 1e-9, "{what}: {}", l.passes());
        }
        if registered && kind == Kind::Rdma && (algo == Algo::Ring || n.is_power_of_two()) {
            // Reduced once, landed in place: the floor for a CPU reduction.
            assert!((l.passes() - 0.5).abs() < 1e-9, "{what}: {}", l.passes());
        }
    }
    // Nothing of another rank's counts here: the ledger is this rank's alone.
    let mut all = vec![0u8; 8 * n];
    let mine = c.ledger().wire.to_le_bytes();
    c.all_gather(&mine, &mut all).unwrap();
}

fn run(name: &str, n: usize) {
    if !parent_ready(name, body) {
        return;
    }
    let r = spawn(
        name,
        n,
        Placement::Local,
        &|_| vec![("RDMACOMM_TIMEOUT".to_string(), "60".to_string())],
        Duration::from_secs(300),
    );
    assert_all_ok(&r);
    for line in r[0]
        .output
        .lines()
        .filter(|l| l.contains("passes per wire byte"))
    {
        println!("{line}");
    }
}

#[test]
fn ledger_2_ranks() {
    run("ledger_2_ranks", 2);
}
#[test]
fn ledger_4_ranks() {
    run("ledger_4_ranks", 4);
}
#[test]
fn ledger_6_ranks() {
    run("ledger_6_ranks", 6);
}
#[test]
fn ledger_8_ranks() {
    run("ledger_8_ranks", 8);
}

crate::matrix_shm!(
    ledger_2_ranks,
    ledger_4_ranks,
    ledger_6_ranks,
    ledger_8_ranks
);
