//! Many ranks on one host (oversubscribed: slow, but it must be right): 64 over TCP and 32 over
//! shared memory run a checked all_reduce, all_gather, broadcast and barrier, and each rank's
//! own accounting (the `info` lines' "holds") stays within the bounds: no pinned memory over
//! TCP, a shared-memory segment of at most 4 MiB, no TCP connection before a collective needs
//! it (and every one at creation with `RDMACOMM_CONNECT=eager`).

mod common;
use common::*;
use rdmacomm::{AllReduce, Comm, Communicator, DType};
use std::time::{Duration, Instant};

/// Joins, runs the four collectives against a scalar reference, and says so.
fn body() {
    let (r, n) = rank_size();
    let t0 = Instant::now();
    let c = Comm::from_env().unwrap_or_else(|e| panic!("rank {r}: {e}"));
    let joined = t0.elapsed();
    let val = |q: usize, i: usize| ((q * 131 + i * 7) % 1009) as f32;
    let mut d: Vec<f32> = (0..4096).map(|i| val(r, i)).collect();
    c.all_reduce(AllReduce::Sum, DType::f32, bytemuck::cast_slice_mut(&mut d))
        .unwrap_or_else(|e| panic!("rank {r}: all_reduce: {e}"));
    for (i, &x) in d.iter().enumerate() {
        // Whole numbers far below 2^24: every order of summing gives this exactly.
        let want: f32 = (0..n).map(|q| val(q, i)).sum();
        assert_eq!(x, want, "rank {r}: all_reduce element {i}");
    }
    let mine = [r as u32, (r * r) as u32];
    let mut all = vec![0u32; 2 * n];
    c.all_gather(
        bytemuck::cast_slice(&mine),
        bytemuck::cast_slice_mut(&mut all),
    )
    .unwrap_or_else(|e| panic!("rank {r}: all_gather: {e}"));
    for q in 0..n {
        assert_eq!(
            &all[2 * q..2 * q + 2],
            &[q as u32, (q * q) as u32],
            "rank {r}: block {q}"
        );
    }
    let root = n - 1;
    let mut b: Vec<u8> = if r == root {
        (0..1000).map(|i| (i % 251) as u8).collect()
    } else {
        vec![0; 1000]
    };
    c.broadcast(root, &mut b)
        .unwrap_or_else(|e| panic!("rank {r}: broadcast: {e}"));
    assert!(
        b.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8),
        "rank {r}: broadcast"
    );
    c.barrier()
        .unwrap_or_else(|e| panic!("rank {r}: barrier: {e}"));
    println!(
        "RESULT rank {r}: CHECKED joined in {} ms",
        joined.as_millis()
    );
}

/// What a rank held: shared MiB, pinned MiB, connections.
type Held = (f64, f64, usize);

/// Runs `n` ranks of `name` over `transport` (connecting as `connect` says), asserts every one
/// checked its results, and returns what each rank held when it had joined and when it closed
/// (its `info` lines).
fn run(name: &str, n: usize, transport: &str, connect: &str) -> Vec<(Held, Held)> {
    let env = |_| {
        [
            ("RDMACOMM_TRANSPORT", transport),
            ("RDMACOMM_TIMEOUT", "120"),
            ("RDMACOMM_DEBUG", "info"),
            ("RDMACOMM_CONNECT", connect),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    };
    let t0 = Instant::now();
    let outs = spawn(name, n, Placement::Local, &env, Duration::from_secs(600));
    assert_all_ok(&outs);
    let holds = outs
        .iter()
        .map(|x| {
            let out = &x.output;
            assert!(out.contains("CHECKED"), "rank {}: {out}", x.rank);
            let held = |line: &str| -> Held {
                let held = line.split("holds ").nth(1).expect("holds");
                let num = |what: &str| -> f64 {
                    let at = held.find(what).expect(what);
                    held[..at]
                        .split_whitespace()
                        .last()
                        .unwrap()
                        .parse()
                        .unwrap()
                };
                (
                    num(" MiB shared"),
                    num(" MiB pinned"),
                    num(" connections") as usize,
                )
            };
            let line = |what: &str| out.lines().find(|l| l.contains(what)).expect(what);
            (held(line("; holds ")), held(line(" closes; it holds ")))
        })
        .collect();
    println!(
        "{n} ranks over {transport}: {} ms from start to end",
        t0.elapsed().as_millis()
    );
    holds
}

#[test]
fn sixty_four_ranks_over_tcp() {
    const NAME: &str = "sixty_four_ranks_over_tcp";
    if !parent_ready(NAME, body) {
        return;
    }
    if require_rdma() {
        println!("SKIPPED: runs on the host (the VM holds fewer ranks)");
        return;
    }
    for (r, (joined, closed)) in run(NAME, 64, "tcp", "on-demand").into_iter().enumerate() {
        assert_eq!(
            joined,
            (0.0, 0.0, 0),
            "rank {r}: nothing connected at creation"
        );
        let (shared, pinned, conns) = closed;
        assert_eq!((shared, pinned), (0.0, 0.0), "rank {r}");
        // Recursive doubling (6 partners), a ring (2) and a binomial tree (at most 6 children
        // and a parent) overlap: never a socket to most of the 63 peers.
        assert!(
            (1..=15).contains(&conns),
            "rank {r}: {conns} connections for 4 collectives"
        );
    }
}

#[test]
fn sixteen_ranks_connect_eagerly() {
    const NAME: &str = "sixteen_ranks_connect_eagerly";
    if !parent_ready(NAME, body) {
        return;
    }
    if require_rdma() {
        println!("SKIPPED: runs on the host");
        return;
    }
    for (r, (joined, closed)) in run(NAME, 16, "tcp", "eager").into_iter().enumerate() {
        assert_eq!(joined, (0.0, 0.0, 15), "rank {r}: a socket to every peer");
        assert_eq!(closed, joined, "rank {r}");
    }
}

#[test]
fn thirty_two_ranks_over_shared_memory() {
    const NAME: &str = "thirty_two_ranks_over_shared_memory";
    if !parent_ready(NAME, body) {
        return;
    }
    if require_rdma() {
        println!("SKIPPED: runs on the host");
        return;
    }
    for (r, ((shared, pinned, conns), _)) in
        run(NAME, 32, "shm", "on-demand").into_iter().enumerate()
    {
        assert!(shared <= 4.0, "rank {r}: {shared} MiB of shared memory");
        assert_eq!((pinned, conns), (0.0, 0), "rank {r}");
    }
}
