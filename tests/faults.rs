//! Never hang, never corrupt: a rank killed (SIGKILL) before, during and between collectives, a
//! host's link cut during a collective, and health() on healthy and broken groups. Every
//! surviving rank must return an error naming the lost peer within the bound, then refuse further
//! work at once; no process may be left hanging (the harness kills and fails after its limit).

mod common;
use common::*;
use rdmacomm::{AllReduce, Comm, Communicator, DType, Error};
use std::time::{Duration, Instant};

/// RDMACOMM_TIMEOUT for these tests, and the bound on noticing a failure.
const TIMEOUT_S: u64 = 20;
const BOUND: Duration = Duration::from_secs(TIMEOUT_S + 2);

fn env_var(k: &str) -> String {
    std::env::var(k).unwrap_or_default()
}

fn die() -> ! {
    // SAFETY: plain libc call on our own pid.
    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    unreachable!()
}

/// What a survivor checks once an operation failed: the error names `victim`, came within the
/// bound, the communicator refuses further work at once, and health() names the victim too.
fn check_failure(c: &Comm, e: &Error, victim: usize, op_started: Instant) {
    let took = op_started.elapsed();
    let msg = e.to_string();
    println!(
        "rank {} saw after {:.3}s: {msg}",
        c.rank(),
        took.as_secs_f64()
    );
    let names =
        e.peer().map(|p| p.rank) == Some(victim) || msg.contains(&format!("rank {victim} ("));
    assert!(
        names,
        "rank {}: error does not name rank {victim}: {msg}",
        c.rank()
    );
    assert!(
        took < BOUND,
        "rank {}: took {took:?} to fail (bound {BOUND:?})",
        c.rank()
    );
    let t = Instant::now();
    let mut d = vec![0u8; 64];
    let again = c
        .all_reduce(AllReduce::Sum, DType::f32, &mut d)
        .unwrap_err();
    // The first error's kind and peer, saying it is an earlier failure.
    let same_kind = std::mem::discriminant(&again) == std::mem::discriminant(e);
    assert!(
        again.peer() == e.peer() && (same_kind || matches!(again, Error::Poisoned(_))),
        "later call: {again} (first: {e})"
    );
    assert!(
        again.to_string().contains(&format!("rank {victim}")),
        "later call must name the peer: {again}"
    );
    assert!(
        t.elapsed() < Duration::from_millis(200),
        "a poisoned call must return at once"
    );
    let h = c.health().unwrap_err().to_string();
    assert!(
        h.contains(&format!("rank {victim}")),
        "health() must name the peer: {h}"
    );
    println!(
        "FAILED-AS-EXPECTED rank {} in {:.3}s",
        c.rank(),
        took.as_secs_f64()
    );
}

/// Survivors loop on 16 MiB all_reduces until one fails (bounded).
fn survive(c: &Comm, victim: usize) {
    let mut data = vec![0u8; 16 << 20];
    let t0 = Instant::now();
    loop {
        let started = Instant::now();
        match c.all_reduce(AllReduce::Sum, DType::f32, &mut data) {
            Ok(()) => assert!(
                t0.elapsed() < Duration::from_secs(60),
                "no failure noticed in 60 s"
            ),
            Err(e) => return check_failure(c, &e, victim, started),
        }
    }
}

fn kill_body() {
    let (r, _) = rank_size();
    let victim: usize = env_var("RXE_TEST_VICTIM").parse().unwrap();
    let mode = env_var("RXE_TEST_MODE");
    let c = Comm::from_env().unwrap();
    if r == victim {
        match mode.as_str() {
            "before" => die(),
            "during" => {
                std::thread::spawn(|| {
                    std::thread::sleep(Duration::from_millis(300));
                    die()
                });
                let mut data = vec![0u8; 16 << 20];
                loop {
                    let _ = c.all_reduce(AllReduce::Sum, DType::f32, &mut data);
                }
            }
            _ => {
                let mut d = vec![0u8; 4096];
                c.all_reduce(AllReduce::Sum, DType::f32, &mut d).unwrap();
                die()
            }
        }
    }
    if mode == "between" {
        // The victim may die right after its part of this collective, before a survivor has
        // finished it: then this one fails already (naming the victim), which is as good.
        let mut d = vec![0u8; 4096];
        let started = Instant::now();
        if let Err(e) = c.all_reduce(AllReduce::Sum, DType::f32, &mut d) {
            return check_failure(&c, &e, victim, started);
        }
    }
    survive(&c, victim);
}

/// Prints what a survivor saw (its "saw after" lines).
fn print_seen(x: &RankResult) {
    for l in x.output.lines().filter(|l| l.contains("saw after")) {
        println!("{l}");
    }
}

fn kill_case(name: &str, n: usize, victim: usize, mode: &str) {
    if !parent_ready(name, kill_body) {
        return;
    }
    let (v, m) = (victim.to_string(), mode.to_string());
    let t0 = Instant::now();
    let res = spawn(
        name,
        n,
        Placement::Local,
        &|_| {
            vec![
                ("RDMACOMM_TIMEOUT".into(), TIMEOUT_S.to_string()),
                ("RXE_TEST_VICTIM".into(), v.clone()),
                ("RXE_TEST_MODE".into(), m.clone()),
            ]
        },
        Duration::from_secs(120),
    );
    for x in &res {
        if x.rank == victim {
            assert_eq!(
                x.code, None,
                "the victim must have died by SIGKILL: {}",
                x.output
            );
            continue;
        }
        if x.code != Some(0) || !x.output.contains("FAILED-AS-EXPECTED") {
            for y in &res {
                eprintln!("----- rank {} (exit {:?})\n{}", y.rank, y.code, y.output);
            }
            panic!("rank {} did not fail cleanly", x.rank);
        }
        print!(
            "{}",
            x.output
                .lines()
                .filter(|l| l.contains("saw after"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        println!();
    }
    println!("{name}: whole case {:.1}s", t0.elapsed().as_secs_f64());
}

#[test]
fn killed_before_a_collective() {
    kill_case("killed_before_a_collective", 4, 2, "before");
}

#[test]
fn killed_during_16mib_all_reduce() {
    kill_case("killed_during_16mib_all_reduce", 4, 2, "during");
}

#[test]
fn killed_between_collectives() {
    kill_case("killed_between_collectives", 4, 1, "between");
}

#[test]
fn coordinator_killed_between_collectives() {
    kill_case("coordinator_killed_between_collectives", 3, 0, "between");
}

/// A rank stopped (SIGSTOP) during 1 MiB all_reduces: every survivor, whether it waits on the
/// stopped rank or on a rank that waits on it, names the stopped rank, within the timeout and
/// the stall window. Survivors then kill it (its pid came round in an all_gather).
fn stop_body() {
    let (r, n) = rank_size();
    let victim: usize = env_var("RXE_TEST_VICTIM").parse().unwrap();
    let c = Comm::from_env().unwrap();
    let mut pids = vec![0u8; 4 * n];
    c.all_gather(&std::process::id().to_le_bytes(), &mut pids)
        .unwrap();
    let pid = |q: usize| u32::from_le_bytes(pids[4 * q..4 * q + 4].try_into().unwrap());
    if r == victim {
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            // SAFETY: plain libc call on our own process.
            unsafe { libc::kill(libc::getpid(), libc::SIGSTOP) };
        });
    }
    let mut data = vec![0u8; 1 << 20];
    let t0 = Instant::now();
    loop {
        let started = Instant::now();
        if let Err(e) = c.all_reduce(AllReduce::Sum, DType::f32, &mut data) {
            check_failure(&c, &e, victim, started);
            assert!(
                started.elapsed() < STOP_BOUND,
                "rank {r}: named it after {:?}",
                started.elapsed()
            );
            assert!(matches!(e, Error::Timeout { .. }), "rank {r}: {e}");
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "no failure noticed");
    }
    // Let every other survivor reach its own verdict (each wait is bounded by STOP_BOUND; one
    // that began later under the VM's load was still waiting 2 s after this one) before the
    // kill turns its view into a dead peer's.
    std::thread::sleep(STOP_BOUND);
    // SAFETY: plain libc call; the pid is the stopped rank's (a sibling process of this test).
    unsafe { libc::kill(pid(victim) as i32, libc::SIGKILL) };
}

/// RDMACOMM_TIMEOUT of the stop test, and its bound: the timeout, the stall verdict (at most
/// 0.8 s), and the part of the operation that ran before the stop, in the emulated VM.
const STOP_TIMEOUT_S: u64 = 5;
const STOP_BOUND: Duration = Duration::from_secs(STOP_TIMEOUT_S + 3);

fn stop_case(name: &str, victim: usize) {
    if !parent_ready(name, stop_body) {
        return;
    }
    let v = victim.to_string();
    let res = spawn(
        name,
        4,
        Placement::Local,
        &|_| {
            vec![
                ("RDMACOMM_TIMEOUT".into(), STOP_TIMEOUT_S.to_string()),
                ("RXE_TEST_VICTIM".into(), v.clone()),
            ]
        },
        Duration::from_secs(90),
    );
    for x in &res {
        if x.rank == victim {
            assert_eq!(x.code, None, "the victim was killed: {}", x.output);
            continue;
        }
        assert!(
            x.code == Some(0) && x.output.contains("FAILED-AS-EXPECTED"),
            "rank {}: {}",
            x.rank,
            x.output
        );
        print_seen(x);
    }
}

#[test]
fn a_stopped_rank_is_named_on_every_survivor() {
    stop_case("a_stopped_rank_is_named_on_every_survivor", 2);
}

#[test]
fn a_stopped_coordinator_is_named_on_every_survivor() {
    stop_case("a_stopped_coordinator_is_named_on_every_survivor", 0);
}

/// A rank that never calls an operation after joining (alive, its sockets open, answering
/// nothing): with connections on demand, no peer has a connection to it yet, and a dial to it
/// is never answered. Every other rank names it within the timeout and the stall window.
fn silent_body() {
    let (r, _) = rank_size();
    let victim: usize = env_var("RXE_TEST_VICTIM").parse().unwrap();
    let c = Comm::from_env().unwrap();
    if r == victim {
        std::thread::sleep(2 * STOP_BOUND);
        std::process::exit(0);
    }
    let mut d = vec![0u8; 4096];
    let started = Instant::now();
    let e = c
        .all_reduce(AllReduce::Sum, DType::f32, &mut d)
        .expect_err("an all_reduce without one of its ranks cannot complete");
    check_failure(&c, &e, victim, started);
    assert!(
        started.elapsed() < STOP_BOUND,
        "rank {r}: named it after {:?}",
        started.elapsed()
    );
}

#[test]
fn a_rank_that_never_answers_a_late_connection_is_named() {
    const NAME: &str = "a_rank_that_never_answers_a_late_connection_is_named";
    if !parent_ready(NAME, silent_body) {
        return;
    }
    let res = spawn(
        NAME,
        4,
        Placement::Local,
        &|_| {
            vec![
                ("RDMACOMM_TIMEOUT".into(), STOP_TIMEOUT_S.to_string()),
                ("RXE_TEST_VICTIM".into(), "3".into()),
            ]
        },
        Duration::from_secs(60),
    );
    for x in &res {
        let ok = if x.rank == 3 {
            x.code == Some(0)
        } else {
            x.code == Some(0) && x.output.contains("FAILED-AS-EXPECTED")
        };
        assert!(ok, "rank {}: {}", x.rank, x.output);
        print_seen(x);
    }
}

fn link_body() {
    let (r, n) = rank_size();
    let c = Comm::from_env().unwrap();
    if env_var("RXE_TEST_HEALTHY") == "1" {
        // After the link came back: the fabric works again, results checked.
        for round in 0..5 {
            let mut d: Vec<u8> = (0..1 << 18)
                .flat_map(|_| ((r + round) as f32).to_le_bytes())
                .collect();
            c.all_reduce(AllReduce::Sum, DType::f32, &mut d).unwrap();
            let want: f32 = (0..n).map(|q| (q + round) as f32).sum();
            let ok = d
                .chunks(4)
                .all(|b| f32::from_le_bytes(b.try_into().unwrap()) == want);
            assert!(ok, "round {round}: wrong sum after the link came back");
        }
        println!("FAILED-AS-EXPECTED rank {r}: (healthy again)");
        return;
    }
    let mut data = vec![0u8; 4 << 20];
    let t0 = Instant::now();
    loop {
        let started = Instant::now();
        match c.all_reduce(AllReduce::Sum, DType::f32, &mut data) {
            Ok(()) => assert!(
                t0.elapsed() < Duration::from_secs(90),
                "no failure noticed in 90 s"
            ),
            Err(e) => {
                if r == 2 {
                    // The cut-off rank itself: any peer error, within the bound.
                    println!(
                        "rank 2 (cut off) saw after {:.3}s: {e}",
                        started.elapsed().as_secs_f64()
                    );
                    assert!(started.elapsed() < BOUND);
                    println!("FAILED-AS-EXPECTED rank 2");
                    return;
                }
                return check_failure(&c, &e, 2, started);
            }
        }
    }
}

#[test]
fn link_down_during_a_collective() {
    const NAME: &str = "link_down_during_a_collective";
    if !parent_ready(NAME, link_body) {
        return;
    }
    if vm_hosts() < 3 {
        if env_var("RDMACOMM_REQUIRE_RDMA") == "1" {
            panic!("needs tools/rxe-vm --hosts 3");
        }
        eprintln!("SKIPPED: needs three soft-RoCE hosts (tools/rxe-vm --hosts 3)");
        return;
    }
    let cutter = std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(4));
        let st = std::process::Command::new(env_var("RXE_HOST_CTL"))
            .args(["down", "2"])
            .status()
            .unwrap();
        assert!(st.success());
    });
    let res = spawn(
        NAME,
        3,
        Placement::Hosts,
        &|_| vec![("RDMACOMM_TIMEOUT".into(), TIMEOUT_S.to_string())],
        Duration::from_secs(150),
    );
    cutter.join().unwrap();
    // Restore the host (link, routes, neighbours) for later tests, waiting until it is ACTIVE.
    let up = std::process::Command::new(env_var("RXE_HOST_CTL"))
        .args(["up", "2"])
        .status()
        .unwrap();
    assert!(up.success(), "host 2 did not come back");
    let again = spawn(
        NAME,
        3,
        Placement::Hosts,
        &|_| vec![("RXE_TEST_HEALTHY".into(), "1".into())],
        Duration::from_secs(120),
    );
    assert_all_ok(&again);
    assert_all_ok(&res);
    for x in &res {
        assert!(
            x.output.contains("FAILED-AS-EXPECTED"),
            "rank {}: {}",
            x.rank,
            x.output
        );
        print_seen(x);
    }
}

fn health_body() {
    let (r, _) = rank_size();
    let c = Comm::from_env().unwrap();
    // Healthy: Ok, quickly, many times (probes complete in between).
    let mut worst = Duration::ZERO;
    for _ in 0..50 {
        let t = Instant::now();
        c.health()
            .unwrap_or_else(|e| panic!("rank {r}: healthy group reported {e}"));
        worst = worst.max(t.elapsed());
        std::thread::sleep(Duration::from_millis(5));
    }
    println!(
        "rank {r}: health() on a healthy group: Ok, slowest call {:?}",
        worst
    );
    assert!(
        worst < Duration::from_millis(100),
        "health() must not block: {worst:?}"
    );
    let mut d = vec![0u8; 4096];
    // Rank 2 may die right after its part of this all_reduce, before the others finish it: then
    // this already fails, naming rank 2, and health() must say the same below.
    if let Err(e) = c.all_reduce(AllReduce::Sum, DType::f32, &mut d) {
        assert!(e.to_string().contains("rank 2 ("), "{e}");
    }
    if r == 2 {
        die();
    }
    // Survivors: only health() calls, no collective; each must be fast, and name rank 2 soon.
    let t0 = Instant::now();
    loop {
        let t = Instant::now();
        let h = c.health();
        assert!(
            t.elapsed() < Duration::from_millis(100),
            "health() blocked for {:?}",
            t.elapsed()
        );
        if let Err(e) = h {
            println!(
                "rank {r}: health() named the loss after {:.3}s: {e}",
                t0.elapsed().as_secs_f64()
            );
            assert!(e.to_string().contains("rank 2 ("), "{e}");
            assert!(t0.elapsed() < BOUND);
            println!("FAILED-AS-EXPECTED");
            return;
        }
        assert!(
            t0.elapsed() < BOUND,
            "health() did not notice rank 2's death within {BOUND:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn health_ok_then_names_a_dead_peer() {
    const NAME: &str = "health_ok_then_names_a_dead_peer";
    if !parent_ready(NAME, health_body) {
        return;
    }
    let res = spawn(
        NAME,
        4,
        Placement::Local,
        &|_| vec![("RDMACOMM_TIMEOUT".into(), TIMEOUT_S.to_string())],
        Duration::from_secs(120),
    );
    for x in &res {
        if x.rank == 2 {
            continue;
        }
        assert!(
            x.code == Some(0) && x.output.contains("FAILED-AS-EXPECTED"),
            "rank {}: {}",
            x.rank,
            x.output
        );
        println!("{}", x.output.trim());
    }
}

crate::matrix!(
    killed_before_a_collective,
    killed_during_16mib_all_reduce,
    killed_between_collectives,
    coordinator_killed_between_collectives,
    a_stopped_rank_is_named_on_every_survivor,
    a_stopped_coordinator_is_named_on_every_survivor,
    link_down_during_a_collective,
    health_ok_then_names_a_dead_peer
);
