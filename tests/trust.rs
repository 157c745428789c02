//! No silent wrong result: calls that differ across ranks, two threads on one communicator, a
//! panic inside an operation and a bad setting on one rank each end in an error that names who
//! and what, on every rank, and never in an Ok with wrong data.

mod common;
use common::*;
use rdmacomm::{AllReduce, Comm, Communicator, DType, Error};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Chunk sizes the tests fix, so that "whole chunks" mean the same on both transports.
const SLOT: usize = 64 << 10;
const TCP_CHUNK: usize = (64 << 10) - 128;

fn geometry(extra: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut v = vec![
        ("RDMACOMM_TIMEOUT".to_string(), "10".to_string()),
        ("RDMACOMM_SLOT_BYTES".to_string(), SLOT.to_string()),
        ("RDMACOMM_TCP_CHUNK".to_string(), TCP_CHUNK.to_string()),
    ];
    v.extend(extra.iter().map(|(k, x)| (k.to_string(), x.to_string())));
    v
}

fn f32s(v: f32, n: usize) -> Vec<u8> {
    bytemuck::cast_slice(&vec![v; n]).to_vec()
}

/// The line a rank printed with its outcome (`RESULT rank ...`); panics, showing `all`, without.
fn result_line<'a>(x: &'a RankResult, case: &str, all: &str) -> &'a str {
    x.output
        .lines()
        .find_map(|l| l.find("RESULT rank").map(|i| &l[i..]))
        .unwrap_or_else(|| panic!("{case}: rank {} printed no result:\n{all}", x.rank))
}

/// One rank of a mismatch case: runs this rank's calls, then a barrier; prints the first
/// error, or that every call returned Ok.
fn mismatch_body() {
    let (r, n) = rank_size();
    let case = std::env::var("TRUST_CASE").unwrap();
    let c = Comm::from_env().unwrap_or_else(|e| panic!("rank {r}: {e}"));
    let mb = 1 << 20;
    let run = |c: &Comm| -> rdmacomm::Result<()> {
        match (case.as_str(), r) {
            ("4M_vs_2x2M", 0) => c.all_reduce(AllReduce::Sum, DType::f32, &mut f32s(1.0, mb))?,
            ("4M_vs_2x2M", _) => {
                c.all_reduce(AllReduce::Sum, DType::f32, &mut f32s(1.0, mb / 2))?;
                c.all_reduce(AllReduce::Sum, DType::f32, &mut f32s(1.0, mb / 2))?;
            }
            ("16M_vs_2x8M", 0) => {
                c.all_reduce(AllReduce::Sum, DType::f32, &mut f32s(1.0, 4 * mb))?
            }
            ("16M_vs_2x8M", _) => {
                c.all_reduce(AllReduce::Sum, DType::f32, &mut f32s(1.0, 2 * mb))?;
                c.all_reduce(AllReduce::Sum, DType::f32, &mut f32s(1.0, 2 * mb))?;
            }
            ("send2_recv1", 0) => c.send(1, &vec![7u8; 2 * SLOT])?,
            ("send2_recv1", 1) => {
                let mut got = vec![0u8; SLOT];
                c.recv(0, &mut got)?;
                c.all_reduce(AllReduce::Sum, DType::f32, &mut f32s(1.0, 256))?;
            }
            ("all_gather_chunks", _) => {
                let len = if r == 0 { 2 * SLOT } else { SLOT };
                c.all_gather(&vec![r as u8; len], &mut vec![0u8; n * len])?
            }
            ("broadcast_chunks", _) => {
                let len = if r == 0 { 2 * SLOT } else { SLOT };
                c.broadcast(0, &mut vec![r as u8; len])?
            }
            ("reduce_vs_broadcast", 0) => {
                c.all_reduce(AllReduce::Sum, DType::f32, &mut f32s(1.0, 256))?
            }
            ("reduce_vs_broadcast", _) => c.broadcast(1, &mut f32s(1.0, 256))?,
            ("f32_vs_i32", _) => {
                let dtype = if r == 0 { DType::f32 } else { DType::i32 };
                c.all_reduce(AllReduce::Sum, dtype, &mut f32s(1.0, 4096))?
            }
            ("all_to_all_vs_all_gather", 1) => {
                c.all_to_all(&vec![1u8; n * 4096], &mut vec![0u8; n * 4096])?
            }
            ("all_to_all_vs_all_gather", _) => {
                c.all_gather(&vec![1u8; 4096], &mut vec![0u8; n * 4096])?
            }
            ("reduce_i32_vs_f32", _) => {
                let dtype = if r == 0 { DType::f32 } else { DType::i32 };
                c.reduce(0, AllReduce::Sum, dtype, &mut f32s(1.0, 64))?
            }
            (c, _) => panic!("unknown case {c}"),
        }
        c.barrier()
    };
    match run(&c) {
        Ok(()) => println!("RESULT rank {r}: ALL OK"),
        Err(e) => println!("RESULT rank {r}: ERROR: {e}"),
    }
}

#[test]
fn mismatched_calls_are_named_on_every_rank() {
    let name = "mismatched_calls_are_named_on_every_rank";
    if !parent_ready(name, mismatch_body) {
        return;
    }
    let cases = [
        ("4M_vs_2x2M", 2),
        ("16M_vs_2x8M", 2),
        ("send2_recv1", 2),
        ("all_gather_chunks", 2),
        ("all_gather_chunks", 3),
        ("broadcast_chunks", 3),
        ("reduce_vs_broadcast", 2),
        ("f32_vs_i32", 2),
        ("all_to_all_vs_all_gather", 3),
        ("reduce_i32_vs_f32", 2),
    ];
    for (case, n) in cases {
        let t0 = Instant::now();
        let res = spawn(
            name,
            n,
            Placement::Local,
            &|_| geometry(&[("TRUST_CASE", case)]),
            Duration::from_secs(60),
        );
        let all: String = res.iter().map(|x| x.output.as_str()).collect();
        for x in &res {
            let line = result_line(x, case, &all);
            assert!(
                line.contains("ERROR") && line.contains("mismatched operations"),
                "{case}: rank {} must fail naming the mismatch: {line}\n{all}",
                x.rank
            );
            assert!(
                line.contains(" called ") && line.contains(" where rank "),
                "{case}: rank {}: both calls in words: {line}",
                x.rank
            );
        }
        println!(
            "{case} on {n} ranks: every rank named the mismatch in {:.2}s",
            t0.elapsed().as_secs_f64()
        );
    }
}

/// Two threads run 300 all_reduces of 4 KiB each (one of 1.0s, one of 1000.0s): through one
/// shared communicator the second thread's calls are refused, the owner's are right; through
/// `dup()` both threads' results are right.
fn threads_body() {
    let (r, n) = rank_size();
    let mut c = Comm::from_env().unwrap_or_else(|e| panic!("rank {r}: {e}"));
    c.adopt(); // a no-op here, on the creating thread
    let other = c.dup().unwrap_or_else(|e| panic!("rank {r}: dup: {e}"));
    let shared = Arc::new(c);
    let run = move |c: &dyn Communicator, v: f32| -> (usize, usize, Vec<String>) {
        let (mut ok, mut wrong, mut errors) = (0, 0, Vec::new());
        for _ in 0..300 {
            let mut buf = f32s(v, 1024);
            match c.all_reduce(AllReduce::Sum, DType::f32, &mut buf) {
                Ok(()) => {
                    let got: &[f32] = bytemuck::cast_slice(&buf);
                    if got.iter().all(|&x| x == v * n as f32) {
                        ok += 1;
                    } else {
                        wrong += 1;
                    }
                }
                Err(e) => errors.push(e.to_string()),
            }
        }
        (ok, wrong, errors)
    };
    // Shared: the spawned thread is not the owner.
    let s2 = Arc::clone(&shared);
    let t = std::thread::spawn(move || run(&*s2, 1000.0));
    let (ok_a, wrong_a, err_a) = run(&*shared, 1.0);
    let (ok_b, wrong_b, err_b) = t.join().unwrap();
    assert_eq!(
        (wrong_a, wrong_b),
        (0, 0),
        "rank {r}: wrong values returned Ok"
    );
    assert_eq!(ok_a, 300, "rank {r}: the owner's calls: {err_a:?}");
    assert_eq!(
        ok_b, 0,
        "rank {r}: the other thread's calls must be refused"
    );
    assert!(
        err_b.len() == 300 && err_b[0].contains("wrong thread") && err_b[0].contains("Comm::dup"),
        "rank {r}: {:?}",
        err_b.first()
    );
    // One communicator per thread: both run at once, every result right.
    let t = std::thread::spawn(move || {
        let mut mine = other;
        mine.adopt();
        run(&mine, 1000.0)
    });
    let (ok_a, wrong_a, err_a) = run(&*shared, 1.0);
    let (ok_b, wrong_b, err_b) = t.join().unwrap();
    assert_eq!((wrong_a, wrong_b), (0, 0), "rank {r}: wrong values");
    assert_eq!((ok_a, ok_b), (300, 300), "rank {r}: {err_a:?} {err_b:?}");
    println!("rank {r}: threads OK");
}

#[test]
fn two_threads_never_cross_data() {
    let name = "two_threads_never_cross_data";
    if !parent_ready(name, threads_body) {
        return;
    }
    spawn_local_ok(name, 2, &[], Duration::from_secs(120));
}

/// Rank 0 panics inside a with_registered closure; its next call is Poisoned naming the panic,
/// and rank 1's waiting barrier fails naming rank 0, well within the timeout.
fn panic_body() {
    let (r, _) = rank_size();
    let c = Comm::from_env().unwrap_or_else(|e| panic!("rank {r}: {e}"));
    c.barrier().unwrap();
    let t0 = Instant::now();
    if r == 0 {
        // The message only: a backtrace (RUST_BACKTRACE) takes seconds to resolve in the
        // emulated VM, all of it before the unwinding reaches the communicator.
        std::panic::set_hook(Box::new(|info| eprintln!("{info}")));
        let mut buf = vec![0u8; 4096];
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            c.with_registered(&mut buf, &mut |_b| panic!("boom in the user's closure"))
        }));
        assert!(caught.is_err(), "the panic goes on to the caller");
        let e = c.barrier().unwrap_err();
        assert!(matches!(e, Error::Poisoned(_)), "{e}");
        assert!(
            e.to_string()
                .contains("rank 0 panicked inside with_registered: boom in the user's closure"),
            "{e}"
        );
    } else {
        let e = c.barrier().unwrap_err().to_string();
        assert!(e.contains("rank 0 panicked"), "rank {r}: {e}");
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "rank {r}: learned it after {:?}",
            t0.elapsed()
        );
    }
    println!("rank {r}: panic handled");
}

#[test]
fn a_panic_poisons_and_is_told_to_the_peers() {
    let name = "a_panic_poisons_and_is_told_to_the_peers";
    if !parent_ready(name, panic_body) {
        return;
    }
    spawn_local_ok(
        name,
        2,
        &[("RDMACOMM_TIMEOUT", "30")],
        Duration::from_secs(60),
    );
}

fn config_body() {
    let (r, _) = rank_size();
    let t0 = Instant::now();
    match Comm::from_env() {
        Ok(_) => println!("RESULT rank {r}: JOINED"),
        Err(e) => println!(
            "RESULT rank {r}: ERROR after {:.1}s: {e}",
            t0.elapsed().as_secs_f64()
        ),
    }
}

#[test]
fn a_bad_setting_on_one_rank_is_named_on_every_rank() {
    let name = "a_bad_setting_on_one_rank_is_named_on_every_rank";
    if !parent_ready(name, config_body) {
        return;
    }
    // (rank, variable, value, what every rank's error must say)
    let cases = [
        (1, "RDMACOMM_POLL", "fast", "auto, spin or yield"),
        (0, "RDMACOMM_BCAST", "tre", "chain, tree or auto"),
        (
            2,
            "RDMACOMM_ALGO",
            "ring",
            "has RDMACOMM_ALGO=ring but rank 0 has RDMACOMM_ALGO=auto",
        ),
        (1, "RDMACOMM_TIMOUT", "5", "did you mean RDMACOMM_TIMEOUT"),
        (
            2,
            "RDMACOMM_ZERO_COPY_MIN",
            "lots",
            "RDMACOMM_ZERO_COPY_MIN",
        ),
        (1, "RDMACOMM_SIMD", "avx512", "use baseline or auto"),
        (2, "RDMACOMM_REDUCE_THREADS", "0", "use 1 to 64 threads"),
    ];
    for (bad, var, val, want) in cases {
        let t0 = Instant::now();
        // The default 30 s timeout: the point is that nobody waits it out.
        let res = spawn(
            name,
            3,
            Placement::Local,
            &|r| {
                if r == bad {
                    vec![(var.to_string(), val.to_string())]
                } else {
                    vec![]
                }
            },
            Duration::from_secs(60),
        );
        let all: String = res.iter().map(|x| x.output.as_str()).collect();
        for x in &res {
            let line = result_line(x, var, &all);
            assert!(
                line.contains("ERROR"),
                "{var}: rank {} joined: {all}",
                x.rank
            );
            assert!(line.contains(want), "{var}: rank {}: {line}", x.rank);
            if x.rank != bad {
                assert!(
                    line.contains(&format!("rank {bad}")),
                    "{var}: rank {} must name rank {bad}: {line}",
                    x.rank
                );
            }
        }
        // Two thirds of the timeout: a rank that waited it out would take all of it; under
        // TCG the first spawn alone has taken 10 s.
        let bound = rdmacomm::config::DEFAULT_TIMEOUT * 2 / 3;
        assert!(
            t0.elapsed() < bound,
            "{var}: took {:?}, past {bound:?} (the default timeout is {:?})",
            t0.elapsed(),
            rdmacomm::config::DEFAULT_TIMEOUT
        );
        println!(
            "{var}={val} on rank {bad}: every rank named it in {:?}",
            t0.elapsed()
        );
    }
}

/// fork() between collectives (a data-loader worker, a `Command`): children start and exit
/// while communicators live, and every result stays right.
fn fork_body() {
    let (r, n) = rank_size();
    let c = Comm::from_env().unwrap_or_else(|e| panic!("rank {r}: {e}"));
    for round in 0..20 {
        let st = std::process::Command::new("true").status().unwrap();
        assert!(st.success());
        // SAFETY: the child only calls _exit (async-signal-safe) after fork.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: as above.
            unsafe { libc::_exit(0) };
        }
        let mut status = 0;
        // SAFETY: waits for the child forked above.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        let mut d: Vec<u8> = (0..(1 << 16))
            .flat_map(|i| ((r + round + i % 7) as f32).to_le_bytes())
            .collect();
        c.all_reduce(AllReduce::Sum, DType::f32, &mut d).unwrap();
        for (i, b) in d.chunks(4).enumerate() {
            let want: f32 = (0..n).map(|q| (q + round + i % 7) as f32).sum();
            assert_eq!(
                f32::from_le_bytes(b.try_into().unwrap()),
                want,
                "round {round}"
            );
        }
    }
    println!("rank {r}: 20 forks between collectives, results right");
}

#[test]
fn fork_between_collectives_is_safe() {
    let name = "fork_between_collectives_is_safe";
    if !parent_ready(name, fork_body) {
        return;
    }
    spawn_local_ok(name, 2, &[], Duration::from_secs(120));
}

crate::matrix!(
    mismatched_calls_are_named_on_every_rank,
    two_threads_never_cross_data,
    a_panic_poisons_and_is_told_to_the_peers,
    a_bad_setting_on_one_rank_is_named_on_every_rank,
    fork_between_collectives_is_safe
);
