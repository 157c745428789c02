//! No false verdict: a correct program with late or computing ranks is never failed, a stall
//! between two ranks names the rank waited on (not rank 0, computing elsewhere), and the fast
//! fault path (departures, two ranks both waiting to receive) works under every polling mode.
//! Run over the transport under test (RDMACOMM_TRANSPORT), and in the VM over RDMA.

mod common;
use common::*;
use rdmacomm::{Comm, Communicator, Error};
use std::time::{Duration, Instant};

fn env_or(k: &str, d: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| d.to_string())
}

/// The byte `i` of the message rank `r` sends.
fn pattern(r: usize, i: usize) -> u8 {
    (i.wrapping_mul(31) ^ (r * 7 + i / 4093)) as u8
}

/// Rank 0 sends 64 MiB right after a barrier; rank 1 is late by 1 s (computing, or calling
/// `health()` meanwhile), then receives it. Both must succeed, with the bytes intact.
fn late_receiver_body() {
    let (r, _) = rank_size();
    let len: usize = env_or("RXE_TEST_LEN", "67108864").parse().unwrap();
    let health = env_or("RXE_TEST_HEALTH", "0") == "1";
    let c = Comm::from_env().unwrap();
    c.barrier().unwrap();
    if r == 0 {
        let msg: Vec<u8> = (0..len).map(|i| pattern(0, i)).collect();
        c.send(1, &msg).unwrap();
    } else {
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(1) {
            if health {
                c.health().unwrap();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut got = vec![0u8; len];
        c.recv(0, &mut got).unwrap();
        let bad = (0..len).find(|&i| got[i] != pattern(0, i));
        assert_eq!(bad, None, "first wrong byte");
    }
    c.barrier().unwrap();
    println!("LATE-OK rank {r}");
}

#[test]
fn a_late_receiver_is_not_a_mismatch() {
    const NAME: &str = "a_late_receiver_is_not_a_mismatch";
    if !parent_ready(NAME, late_receiver_body) {
        return;
    }
    for health in ["0", "1"] {
        let len = if require_rdma() {
            "8388608"
        } else {
            "67108864"
        };
        let out = spawn(
            NAME,
            2,
            Placement::Hosts,
            &|_| {
                vec![
                    ("RDMACOMM_TIMEOUT".into(), "10".into()),
                    ("RXE_TEST_HEALTH".into(), health.into()),
                    ("RXE_TEST_LEN".into(), len.into()),
                ]
            },
            Duration::from_secs(60),
        );
        assert_all_ok(&out);
    }
}

/// Rank 0 sends 120 messages of 8 bytes (each lands in a mailbox, with no completion to poll);
/// rank 1 computes 20 ms before each receive, so every chunk has landed when it takes it and it
/// never waits: it only takes, returning credits. Both must succeed with every byte intact (a
/// receiver that never polled its completions would fill its send queue with credit writes).
fn slow_consumer_body() {
    let (r, _) = rank_size();
    let c = Comm::from_env().unwrap();
    let msg = |k: usize| -> Vec<u8> { (0..8).map(|i| pattern(k, i)).collect() };
    for k in 0..120 {
        if r == 0 {
            c.send(1, &msg(k)).unwrap();
        } else {
            let spin = Instant::now();
            while spin.elapsed() < Duration::from_millis(20) {
                std::hint::spin_loop();
            }
            let mut b = vec![0u8; 8];
            c.recv(0, &mut b)
                .unwrap_or_else(|e| panic!("rank 1: message {k}: {e}"));
            assert_eq!(b, msg(k), "message {k}");
        }
    }
    c.barrier().unwrap();
    println!("SLOW-OK rank {r}");
}

#[test]
fn a_receiver_that_never_waits_is_not_failed() {
    const NAME: &str = "a_receiver_that_never_waits_is_not_failed";
    if !parent_ready(NAME, slow_consumer_body) {
        return;
    }
    let out = spawn(
        NAME,
        2,
        Placement::Hosts,
        &|_| vec![("RDMACOMM_TIMEOUT".into(), "10".into())],
        Duration::from_secs(60),
    );
    assert_all_ok(&out);
    assert!(out.iter().all(|x| x.output.contains("SLOW-OK")));
}

/// Three ranks, timeout T (2 s; 6 s in the emulated VM, where a rank may take seconds to
/// start): rank 1 receives from rank 2, which is late by 3 T; rank 0 computes meanwhile. Every
/// rank must be told that rank 2 stopped making progress, rank 1 within T + 2.5 s.
fn stall_body() {
    let (r, _) = rank_size();
    let timeout: u64 = env_or("RDMACOMM_TIMEOUT", "2").parse().unwrap();
    let c = Comm::from_env().unwrap();
    c.barrier().unwrap();
    let t0 = Instant::now();
    let late = Duration::from_secs(3 * timeout);
    let verdict = match r {
        0 => {
            std::thread::sleep(late);
            c.health().unwrap_err()
        }
        1 => {
            let mut b = vec![0u8; 1024];
            let e = c.recv(2, &mut b).unwrap_err();
            assert!(
                t0.elapsed() < Duration::from_millis(timeout * 1000 + 2500),
                "rank 1 learned it after {:?}",
                t0.elapsed()
            );
            e
        }
        _ => {
            std::thread::sleep(late);
            c.barrier().unwrap_err()
        }
    };
    let msg = verdict.to_string();
    println!("rank {r} after {:?}: {msg}", t0.elapsed());
    assert_eq!(
        verdict.peer().map(|p| p.rank),
        Some(2),
        "rank {r} blames another rank: {msg}"
    );
    assert!(msg.contains("stopped making progress"), "{msg}");
    println!("STALL-NAMED rank {r}");
}

#[test]
fn a_stall_between_two_ranks_names_the_late_one() {
    const NAME: &str = "a_stall_between_two_ranks_names_the_late_one";
    if !parent_ready(NAME, stall_body) {
        return;
    }
    let out = spawn(
        NAME,
        3,
        Placement::Hosts,
        &|_| {
            let t = if require_rdma() { "6" } else { "2" };
            vec![("RDMACOMM_TIMEOUT".into(), t.into())]
        },
        Duration::from_secs(60),
    );
    assert_all_ok(&out);
}

/// With every polling mode: rank 1 drops its communicator while rank 0 waits to receive from
/// it (named as a departure well within the timeout); then, on a fresh group, both ranks wait
/// to receive from each other (a mismatch, found by the probes well within the timeout).
fn fast_path_body() {
    let (r, _) = rank_size();
    let mode = env_or("RXE_TEST_MODE", "departure");
    let c = Comm::from_env().unwrap();
    c.barrier().unwrap();
    let t = Instant::now();
    if mode == "departure" {
        if r == 1 {
            std::thread::sleep(Duration::from_millis(300));
            drop(c);
            return;
        }
        let mut b = vec![0u8; 64];
        let e = c.recv(1, &mut b).unwrap_err();
        println!("rank 0 after {:?}: {e}", t.elapsed());
        assert!(e.to_string().contains("closed its communicator"), "{e}");
        assert_eq!(e.peer().map(|p| p.rank), Some(1), "{e}");
    } else {
        let mut b = vec![0u8; 64];
        let e = c.recv(1 - r, &mut b).unwrap_err();
        println!("rank {r} after {:?}: {e}", t.elapsed());
        // The rank that found it gets Mismatch; the other is told of it.
        assert!(
            matches!(e, Error::Mismatch { .. }) || e.to_string().contains("mismatched operations"),
            "{e}"
        );
    }
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "rank {r}: found after {:?} (timeout 8 s)",
        t.elapsed()
    );
    println!("FAST-OK rank {r}");
}

#[test]
fn faults_are_found_fast_with_every_polling_mode() {
    const NAME: &str = "faults_are_found_fast_with_every_polling_mode";
    if !parent_ready(NAME, fast_path_body) {
        return;
    }
    for poll in ["spin", "yield", "auto"] {
        for mode in ["departure", "both_receive"] {
            let out = spawn(
                NAME,
                2,
                Placement::Hosts,
                &|_| {
                    vec![
                        ("RDMACOMM_TIMEOUT".into(), "8".into()),
                        ("RDMACOMM_POLL".into(), poll.into()),
                        ("RXE_TEST_MODE".into(), mode.into()),
                    ]
                },
                Duration::from_secs(30),
            );
            assert_all_ok(&out);
        }
    }
}

/// A set-up failure after the rendezvous is told to every rank: over shared memory, rank 2
/// runs as another user (with the same host id), so it cannot open its peers' segments. Every
/// rank must fail at once naming rank 2's cause, not a closed connection or rank 0.
fn setup_body() {
    let (r, _) = rank_size();
    if r == 2 && std::env::var("RXE_TEST_AS_NOBODY").is_ok() {
        // Re-run this very rank as nobody (root may open any process's files; nobody may not).
        let me = std::env::current_exe().unwrap();
        let st = std::process::Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .arg(me)
            .args(std::env::args().skip(1))
            .env_remove("RXE_TEST_AS_NOBODY")
            .status()
            .unwrap();
        std::process::exit(st.code().unwrap_or(9));
    }
    let t = Instant::now();
    let e = match Comm::from_env() {
        Ok(_) => panic!("rank {r}: the group formed"),
        Err(e) => e,
    };
    let msg = e.to_string();
    println!("rank {r} after {:?}: {msg}", t.elapsed());
    // Rank 2 has its own cause; the others are told it, naming rank 2.
    let told = r == 2 || msg.contains("rank 2 could not set up its transport");
    assert!(
        told && msg.contains("cannot open its shared memory"),
        "rank {r}: {msg}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "rank {r}: {:?}",
        t.elapsed()
    );
    println!("SETUP-TOLD rank {r}");
}

#[test]
fn a_set_up_failure_is_told_to_every_rank() {
    const NAME: &str = "a_set_up_failure_is_told_to_every_rank";
    if !parent_ready(NAME, setup_body) {
        return;
    }
    let shm = net() == Net::Shm || std::env::var("RDMACOMM_TRANSPORT").is_ok_and(|t| t == "shm");
    // SAFETY: getuid has no preconditions.
    if !shm || require_rdma() || unsafe { libc::getuid() } != 0 {
        println!(
            "SKIPPED: needs shared memory (its over_shm copy) and root (to run one rank as nobody)"
        );
        return;
    }
    let out = spawn(
        NAME,
        3,
        Placement::Local,
        &|r| {
            let mut v = vec![
                ("RDMACOMM_TIMEOUT".into(), "20".into()),
                ("RDMACOMM_HOST_ID".into(), "one-host".into()),
            ];
            if r == 2 {
                v.push(("RXE_TEST_AS_NOBODY".into(), "1".into()));
            }
            v
        },
        Duration::from_secs(60),
    );
    assert_all_ok(&out);
    for x in &out {
        assert!(x.output.contains("SETUP-TOLD"), "{}", x.output);
    }
}

crate::matrix_shm!(
    a_late_receiver_is_not_a_mismatch,
    a_stall_between_two_ranks_names_the_late_one,
    faults_are_found_fast_with_every_polling_mode,
    a_set_up_failure_is_told_to_every_rank
);

/// Three ranks in an all_reduce, timeout T: rank 2 is busy outside rdmacomm for 3 T before it
/// calls. Ranks 0 and 1 are told that rank 2 stopped making progress while it waits on nobody
/// (not that the ranks wait on each other).
fn busy_body() {
    let (r, _) = rank_size();
    let timeout: u64 = env_or("RDMACOMM_TIMEOUT", "2").parse().unwrap();
    let c = Comm::from_env().unwrap();
    c.barrier().unwrap();
    if r == 2 {
        std::thread::sleep(Duration::from_secs(3 * timeout));
    }
    let mut v = vec![0u8; 8 << 20];
    let e = c
        .all_reduce(rdmacomm::AllReduce::Sum, rdmacomm::DType::f32, &mut v)
        .unwrap_err();
    let msg = e.to_string();
    println!("rank {r}: {msg}");
    if r < 2 {
        assert_eq!(e.peer().map(|p| p.rank), Some(2), "rank {r}: {msg}");
        assert!(
            msg.contains("waits on nobody") && !msg.contains("wait on each other"),
            "rank {r}: {msg}"
        );
    }
    println!("BUSY-NAMED rank {r}");
}

#[test]
fn a_rank_busy_outside_rdmacomm_is_named_as_such() {
    const NAME: &str = "a_rank_busy_outside_rdmacomm_is_named_as_such";
    if !parent_ready(NAME, busy_body) {
        return;
    }
    let out = spawn(
        NAME,
        3,
        Placement::Local,
        &|_| {
            let t = if require_rdma() { "6" } else { "2" };
            vec![("RDMACOMM_TIMEOUT".into(), t.into())]
        },
        Duration::from_secs(60),
    );
    assert_all_ok(&out);
    assert!(out.iter().all(|x| x.output.contains("BUSY-NAMED")));
}
