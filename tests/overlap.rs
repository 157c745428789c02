//! Non-blocking operations (`Comm::overlap`) and `Comm::abort`, multi-process over the transport
//! under test: several operations in flight mixed with blocking ones, waited out of order or not
//! at all, checked against a scalar re-computation; an abort from another thread ends every
//! pending and blocked operation on every rank with an error naming the rank that aborted.
//! Under `RDMACOMM_PROGRESS=caller` the same hold, and an operation moves only inside its
//! caller's calls: a peer waits on it until then, and `test()` alone carries it to its end.

mod common;
use common::*;
use rdmacomm::{AllReduce, Comm, Communicator, DType, Error, Progress};
use std::time::{Duration, Instant};

/// Rank r's element i of buffer k (small integers: sums exact in f32).
fn val(k: usize, r: usize, i: usize) -> f32 {
    ((k * 7 + r * 3 + i) % 23) as f32 - 11.0
}

fn filled(k: usize, r: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| val(k, r, i)).collect()
}

fn summed(k: usize, n: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (0..n).map(|r| val(k, r, i)).sum())
        .collect()
}

fn in_flight_body() {
    let (r, n) = rank_size();
    let c = Comm::from_env().unwrap_or_else(|e| panic!("rank {r}: {e}"));
    let lens = [0usize, 1, 1000, 300_000, 2_000_000];
    for round in 0..3 {
        let mut bufs: Vec<Vec<f32>> = (0..lens.len())
            .map(|k| filled(k + round, r, lens[k]))
            .collect();
        let mut blocking = filled(99 + round, r, 4097);
        let mut bcast: Vec<f32> = if r == n - 1 {
            filled(50 + round, r, 70_000)
        } else {
            vec![0.0; 70_000]
        };
        let mine: Vec<f32> = filled(60 + round, r, 3000);
        let mut gathered = vec![0f32; 3000 * n];
        let mut dropped = filled(70 + round, r, 5000);
        c.overlap(|s| -> rdmacomm::Result<()> {
            let mut it = bufs.iter_mut();
            let p0 = s.all_reduce(it.next().unwrap(), AllReduce::Sum)?;
            let p1 = s.all_reduce(it.next().unwrap(), AllReduce::Sum)?;
            let p2 = s.all_reduce(it.next().unwrap(), AllReduce::Sum)?;
            let pb = s.broadcast(&mut bcast, n - 1)?;
            // A blocking call in the middle runs after those started before it.
            c.all_reduce(
                AllReduce::Sum,
                DType::f32,
                bytemuck::cast_slice_mut(&mut blocking),
            )?;
            assert!(
                p0.test() && p1.test() && p2.test() && pb.test(),
                "started before"
            );
            let p3 = s.all_reduce(it.next().unwrap(), AllReduce::Sum)?;
            let pg = s.all_gather(&mine, &mut gathered)?;
            let p4 = s.all_reduce(it.next().unwrap(), AllReduce::Sum)?;
            // Dropped without a wait: it still completes before the scope ends.
            drop(s.all_reduce(&mut dropped, AllReduce::Sum)?);
            // Waited out of order.
            let b4 = p4.wait()?;
            assert_eq!(b4.len(), lens[4]);
            pg.wait()?;
            p1.wait()?;
            p3.wait()?;
            p0.wait()?;
            // p2 and pb are never waited: the scope waits for them.
            drop((p2, pb));
            Ok(())
        })
        .unwrap_or_else(|e| panic!("rank {r}: {e}"))
        .unwrap_or_else(|e| panic!("rank {r}: {e}"));
        for (k, b) in bufs.iter().enumerate() {
            assert_eq!(b, &summed(k + round, n, lens[k]), "rank {r}: buffer {k}");
        }
        assert_eq!(blocking, summed(99 + round, n, 4097), "rank {r}: blocking");
        assert_eq!(
            bcast,
            filled(50 + round, n - 1, 70_000),
            "rank {r}: broadcast"
        );
        let want: Vec<f32> = (0..n).flat_map(|q| filled(60 + round, q, 3000)).collect();
        assert_eq!(gathered, want, "rank {r}: all_gather");
        assert_eq!(
            dropped,
            summed(70 + round, n, 5000),
            "rank {r}: dropped handle"
        );
    }
    // Bad arguments are refused at the start; as the peers may be in the call already, the
    // communicator then fails on every rank (each refuses alike here, on a dup of its own).
    let mut odd = vec![0f32; 3 * n + 1];
    let mut out = vec![0f32; 3 * n + 2];
    let d = c.dup().unwrap();
    let started = d
        .overlap(|s| s.all_to_all(&odd, &mut out).map(|_| ()))
        .unwrap();
    assert!(
        matches!(&started, Err(Error::InvalidArgument(m)) if m.contains("all_to_all")),
        "{started:?}"
    );
    if n > 1 {
        let later = d.barrier().unwrap_err().to_string();
        assert!(later.contains("all_to_all"), "rank {r}: {later}");
    }
    drop(d);
    odd.truncate(3 * n);
    let d = c.dup().unwrap();
    let e = d
        .overlap(|s| s.sendrecv(r, &odd, r, &mut out).map(|_| ()))
        .unwrap();
    assert!(
        matches!(&e, Err(Error::InvalidArgument(m)) if m.contains("itself")),
        "{e:?}"
    );
    drop(d);
    // Blocking operations after the scopes, and a nested scope refused.
    let mut after = filled(7, r, 100);
    c.all_reduce(
        AllReduce::Sum,
        DType::f32,
        bytemuck::cast_slice_mut(&mut after),
    )
    .unwrap();
    assert_eq!(after, summed(7, n, 100));
    let nested = c.overlap(|_| c.overlap(|_| ()).map(|_| ())).unwrap();
    assert!(
        matches!(&nested, Err(Error::InvalidArgument(m)) if m.contains("do not nest")),
        "{nested:?}"
    );
    println!("rank {r}: non-blocking operations checked");
}

/// Rank 0 starts an all_reduce (256 KiB) and computes (sleeps) for `HOLD` without calling on it, then
/// carries it to its end by `test()` alone; the others start it and wait. Under caller progress
/// their waits cannot end before rank 0's tests begin; under a progress thread they end during
/// rank 0's computation.
fn progress_body() {
    const HOLD: Duration = Duration::from_millis(500);
    let (r, n) = rank_size();
    let mode = match std::env::var("PROGRESS_CASE").unwrap().as_str() {
        "caller" => Progress::Caller,
        _ => Progress::Thread,
    };
    let c = Comm::from_env().unwrap_or_else(|e| panic!("rank {r}: {e}"));
    let len = 64 << 10;
    for round in 0..2 {
        let mut buf = filled(round, r, len);
        c.barrier().unwrap();
        let t0 = Instant::now();
        let (tests, took) = c
            .overlap_with(mode, |s| -> rdmacomm::Result<(usize, Duration)> {
                let p = s.all_reduce(&mut buf, AllReduce::Sum)?;
                if r != 0 {
                    p.wait()?;
                    return Ok((0, t0.elapsed()));
                }
                std::thread::sleep(HOLD);
                let mut tests = 1;
                while !p.test() {
                    tests += 1;
                    assert!(
                        t0.elapsed() < Duration::from_secs(60),
                        "tests never ended it"
                    );
                    std::hint::black_box((0..2000u64).sum::<u64>());
                }
                let took = t0.elapsed();
                p.wait()?;
                Ok((tests, took))
            })
            .unwrap()
            .unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(buf, summed(round, n, len), "rank {r}: round {round}");
        if r != 0 {
            match mode {
                Progress::Caller => assert!(
                    took >= HOLD - Duration::from_millis(50),
                    "rank {r}: the wait ended after {took:?}, while rank 0 made no call on it"
                ),
                _ => assert!(
                    took < HOLD,
                    "rank {r}: the progress thread did not carry it: {took:?}"
                ),
            }
        }
        println!("RESULT rank {r} round {round}: done after {took:?}, {tests} tests");
    }
}

/// Rank 0 aborts from a second thread while every rank waits: in a non-blocking receive that
/// nobody matches (in a scope), or in a blocking one.
fn abort_body() {
    let (r, n) = rank_size();
    let case = std::env::var("ABORT_CASE").unwrap();
    let blocking = case == "blocking";
    // Rank 0's receive begins (one test), then stays held while it computes: the abort must
    // still reach the peers at once.
    let held = case == "held";
    let c = Comm::from_env().unwrap_or_else(|e| panic!("rank {r}: {e}"));
    c.barrier().unwrap();
    let t0 = Instant::now();
    let err = std::thread::scope(|ts| {
        if r == 0 {
            let c = &c;
            ts.spawn(move || {
                std::thread::sleep(Duration::from_millis(300));
                let t = Instant::now();
                c.abort("the test's watchdog fired");
                assert!(
                    t.elapsed() < Duration::from_secs(5),
                    "abort took {:?}",
                    t.elapsed()
                );
            });
        }
        let mut buf = vec![0f32; 1000];
        let from = (r + 1) % n;
        if blocking {
            c.recv(from, bytemuck::cast_slice_mut(&mut buf))
                .unwrap_err()
        } else if held {
            c.overlap_with(Progress::Caller, |s| {
                let p = s.recv(from, &mut buf)?;
                assert!(!p.test());
                // The held receive keeps the link: what the owner may still call returns at once
                // (not when the abort, at 300 ms, lets it go).
                let t = Instant::now();
                assert!(c.device().is_some() && c.health().is_ok());
                assert!(
                    t.elapsed() < Duration::from_millis(150),
                    "{:?}",
                    t.elapsed()
                );
                if r == 0 {
                    std::thread::sleep(Duration::from_millis(1500));
                }
                p.wait().map(|_| ())
            })
            .and_then(|r| r)
            .unwrap_err()
        } else {
            c.overlap(|s| s.recv(from, &mut buf).and_then(|p| p.wait()).map(|_| ()))
                .and_then(|r| r)
                .unwrap_err()
        }
    });
    let took = t0.elapsed();
    match &err {
        Error::Aborted { by, reason } => {
            assert_eq!(by.rank, 0, "rank {r}: {err}");
            assert!(reason.contains("watchdog fired"), "rank {r}: {err}");
        }
        e => panic!("rank {r}: want Aborted naming rank 0, got {e}"),
    }
    // Every later operation is refused alike.
    let later = c.barrier().unwrap_err();
    assert!(matches!(later, Error::Aborted { .. }), "rank {r}: {later}");
    println!("RESULT rank {r}: aborted after {took:?}: {err}");
}

/// The last rank dies while the others have operations pending in a scope.
fn death_body() {
    let (r, n) = rank_size();
    let c = Comm::from_env().unwrap_or_else(|e| panic!("rank {r}: {e}"));
    c.barrier().unwrap();
    if r == n - 1 {
        std::thread::sleep(Duration::from_millis(200));
        std::process::exit(3);
    }
    let t0 = Instant::now();
    let mut a = vec![1f32; 1 << 20];
    let mut b = vec![1f32; 1000];
    let res = c.overlap(|s| -> rdmacomm::Result<()> {
        let pa = s.all_reduce(&mut a, AllReduce::Sum)?;
        let pb = s.all_reduce(&mut b, AllReduce::Sum)?;
        let ea = pa.wait().map(|_| ()).unwrap_err();
        let eb = pb.wait().map(|_| ()).unwrap_err();
        assert!(
            ea.to_string().contains(&format!("rank {}", n - 1)),
            "rank {r}: {ea}"
        );
        assert!(
            eb.peer() == ea.peer() && eb.to_string().contains("refuses further work"),
            "rank {r}: the next one refused, with the first one's kind and peer: {eb}"
        );
        Err(ea)
    });
    // The scope ends with the failure too (its operations failed).
    let e = res.unwrap_err();
    assert!(
        e.to_string().contains(&format!("rank {}", n - 1)),
        "rank {r}: {e}"
    );
    println!("RESULT rank {r}: failed after {:?}: {e}", t0.elapsed());
    std::process::exit(0);
}

#[test]
fn a_dead_peer_fails_every_pending_operation() {
    let name = "a_dead_peer_fails_every_pending_operation";
    if !parent_ready(name, death_body) {
        return;
    }
    let t0 = Instant::now();
    let res = spawn(
        name,
        3,
        Placement::Local,
        &|_| vec![("RDMACOMM_TIMEOUT".into(), "30".into())],
        Duration::from_secs(60),
    );
    for x in &res[..2] {
        assert_eq!(x.code, Some(0), "rank {}:\n{}", x.rank, x.output);
    }
    assert!(
        t0.elapsed() < Duration::from_secs(15),
        "took {:?}",
        t0.elapsed()
    );
}

#[test]
fn operations_in_flight_with_blocking_ones() {
    let name = "operations_in_flight_with_blocking_ones";
    if !parent_ready(name, in_flight_body) {
        return;
    }
    for n in [1, 2, 3, 4] {
        spawn_local_ok(name, n, &[], Duration::from_secs(300));
    }
}

#[test]
fn caller_progress_moves_operations_only_inside_calls() {
    let name = "caller_progress_moves_operations_only_inside_calls";
    if !parent_ready(name, progress_body) {
        return;
    }
    for (case, sizes) in [("caller", &[2, 3][..]), ("thread", &[3][..])] {
        for &n in sizes {
            let res = spawn(
                name,
                n,
                Placement::Local,
                &|_| vec![("PROGRESS_CASE".into(), case.into())],
                Duration::from_secs(120),
            );
            assert_all_ok(&res);
            for x in &res {
                for line in x.output.lines().filter(|l| l.contains("RESULT")) {
                    println!("{case}, {n} ranks: {line}");
                }
            }
        }
    }
}

#[test]
fn operations_in_flight_under_caller_progress() {
    let name = "operations_in_flight_with_blocking_ones";
    for n in [2, 3] {
        spawn_local_ok(
            name,
            n,
            &[("RDMACOMM_PROGRESS", "caller")],
            Duration::from_secs(300),
        );
    }
}

#[test]
fn abort_ends_every_pending_call_on_every_rank() {
    let name = "abort_ends_every_pending_call_on_every_rank";
    if !parent_ready(name, abort_body) {
        return;
    }
    for case in ["overlap", "blocking", "held"] {
        let t0 = Instant::now();
        let res = spawn(
            name,
            3,
            Placement::Local,
            &|_| {
                vec![
                    ("RDMACOMM_TIMEOUT".into(), "30".into()),
                    ("ABORT_CASE".into(), case.into()),
                ]
            },
            Duration::from_secs(60),
        );
        assert_all_ok(&res);
        for x in &res {
            let line = x.output.lines().find(|l| l.contains("RESULT")).unwrap();
            println!("{case}: {line}");
        }
        // Far below the 30 s timeout: the abort, not a timeout, ended the waits.
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "{case}: took {:?}",
            t0.elapsed()
        );
    }
}

/// A blocking call after a start runs the started operation itself: it does not wait for the
/// progress thread to look (which, while every operation is run by its own waiter, it does only
/// every 20 ms). 20 rounds of 16 started-and-waited operations and a pause (after which the
/// progress thread looks seldom), then one started, a blocking one timed, and the wait: a few
/// microseconds each, where it used to wait for the progress thread's next look.
#[test]
fn a_blocking_call_runs_the_operations_started_before_it() {
    let c = Comm::new(&rdmacomm::Config::defaults(0, 1, "127.0.0.1:9")).unwrap();
    let (mut a, mut b) = (filled(0, 0, 64), filled(1, 0, 64));
    let mut blocked = Duration::ZERO;
    c.overlap(|s| -> rdmacomm::Result<()> {
        let mut buf = &mut a[..];
        for _ in 0..20 {
            for _ in 0..16 {
                buf = s.all_reduce(buf, AllReduce::Sum)?.wait()?;
            }
            std::thread::sleep(Duration::from_millis(3));
            let p = s.all_reduce(buf, AllReduce::Max)?;
            let t0 = Instant::now();
            c.all_reduce(AllReduce::Sum, DType::f32, bytemuck::cast_slice_mut(&mut b))?;
            blocked += t0.elapsed();
            assert!(
                p.test(),
                "the blocking call ran after the one started before it"
            );
            buf = p.wait()?;
        }
        Ok(())
    })
    .unwrap()
    .unwrap();
    assert_eq!(a, summed(0, 1, 64));
    assert_eq!(b, summed(1, 1, 64));
    assert!(
        blocked < Duration::from_millis(50),
        "20 blocking calls took {blocked:?}"
    );
}

/// Rank 0 sends one 16 MiB chunk (`RDMACOMM_TCP_CHUNK`, more than the sockets hold) under caller
/// progress to rank 1, which is late by 1.5 s (4 s in the VM), and carries it by `test()` alone: no test may
/// wait for the late peer (the data still queued for it leaves through the operation's waits,
/// where a test stops). Rank 1 checks every element.
fn late_peer_body() {
    // Longer in the emulated VM, where moving 16 MiB over rxe alone takes a few hundred ms.
    let late = Duration::from_millis(if require_rdma() { 4000 } else { 1500 });
    let (r, _) = rank_size();
    let c = Comm::from_env().unwrap_or_else(|e| panic!("rank {r}: {e}"));
    let len = (16 << 20) / 4;
    // Both buffers made before the barrier, so that the lateness is rank 1's sleep alone.
    let data = filled(7, 0, len);
    let mut got = vec![0f32; len];
    c.barrier().unwrap();
    if r == 1 {
        std::thread::sleep(late);
        c.recv(0, bytemuck::cast_slice_mut(&mut got)).unwrap();
        assert_eq!(got, data, "rank 1: the data from rank 0");
        return;
    }
    let (tests, longest) = c
        .overlap_with(
            Progress::Caller,
            |s| -> rdmacomm::Result<(usize, Duration)> {
                let p = s.send(1, &data)?;
                let (mut tests, mut longest) = (0, Duration::ZERO);
                loop {
                    let t = Instant::now();
                    let done = p.test();
                    longest = longest.max(t.elapsed());
                    tests += 1;
                    if done {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                p.wait()?;
                Ok((tests, longest))
            },
        )
        .unwrap()
        .unwrap_or_else(|e| panic!("rank {r}: {e}"));
    println!("RESULT rank 0: {tests} tests, the longest {longest:?}");
    assert!(
        longest < late / 4,
        "a test() waited {longest:?} for the late peer"
    );
}

#[test]
fn a_test_does_not_wait_for_a_late_peer() {
    let name = "a_test_does_not_wait_for_a_late_peer";
    if !parent_ready(name, late_peer_body) {
        return;
    }
    let res = spawn(
        name,
        2,
        Placement::Local,
        &|_| vec![("RDMACOMM_TCP_CHUNK".into(), (16 << 20).to_string())],
        Duration::from_secs(120),
    );
    assert_all_ok(&res);
    for line in res[0].output.lines().filter(|l| l.contains("RESULT")) {
        println!("{line}");
    }
}

/// Every blocking operation also starts in an overlap scope: gather, scatter, all_gather_v,
/// all_to_allv, sum_scatter, reduce_scatter_v and a batch, all in flight at once, each checked
/// against a scalar re-computation.
fn every_operation_body() {
    let (r, n) = rank_size();
    let c = Comm::from_env().unwrap_or_else(|e| panic!("rank {r}: {e}"));
    let byte = |from: usize, to: usize, i: usize| (from * 31 + to * 7 + i) as u8;
    let root = n - 1;
    // gather: rank q's 5 values at the root; scatter: the root's block q to rank q.
    let gin = filled(2, r, 5);
    let mut gout = vec![0f32; if r == root { 5 * n } else { 0 }];
    let sin: Vec<f32> = if r == root {
        (0..n).flat_map(|q| filled(3, q, 4)).collect()
    } else {
        Vec::new()
    };
    let mut sout = vec![0f32; 4];
    // all_gather_v: rank q brings q + 1 bytes.
    let lens: Vec<usize> = (0..n).map(|q| q + 1).collect();
    let vin: Vec<u8> = (0..=r).map(|i| byte(r, n, i)).collect();
    let mut vout = vec![0u8; lens.iter().sum()];
    // all_to_allv: rank p sends p + q + 1 bytes to q.
    let send_lens: Vec<usize> = (0..n).map(|q| r + q + 1).collect();
    let recv_lens: Vec<usize> = (0..n).map(|p| p + r + 1).collect();
    let ain: Vec<u8> = (0..n)
        .flat_map(|q| (0..send_lens[q]).map(move |i| byte(r, q, i)))
        .collect();
    let mut aout = vec![0u8; recv_lens.iter().sum()];
    // sum_scatter of 3 values a rank; reduce_scatter_v (max) with parts of 2 + q floats.
    let ssin = filled(4, r, 3 * n);
    let mut ssout = vec![0f32; 3];
    let parts: Vec<usize> = (0..n).map(|q| (2 + q) * 4).collect();
    let rsin: Vec<u8> =
        bytemuck::cast_slice(&filled(5, r, parts.iter().sum::<usize>() / 4)).to_vec();
    let mut rsout = vec![0u8; parts[r]];
    // A batch: a ring shift of 6 bytes.
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let bsend: Vec<u8> = (0..6).map(|i| byte(r, next, i)).collect();
    let mut brecv = vec![0u8; 6];
    let mut ops = vec![
        rdmacomm::P2p::Send {
            peer: next,
            data: &bsend,
        },
        rdmacomm::P2p::Recv {
            peer: prev,
            data: &mut brecv,
        },
    ];
    c.overlap(|s| -> rdmacomm::Result<()> {
        let pg = s.gather(root, &gin, &mut gout)?;
        let ps = s.scatter(root, &sin, &mut sout)?;
        let pv = s.all_gather_v(&vin, &mut vout, &lens)?;
        let pa = s.all_to_allv(&ain, &send_lens, &mut aout, &recv_lens)?;
        let pss = s.sum_scatter(&ssin, &mut ssout)?;
        let prs = s.reduce_scatter_v(AllReduce::Max, DType::f32, &rsin, &mut rsout, &parts)?;
        let pb = s.batch(&mut ops)?;
        // Waited out of order.
        pb.wait()?;
        prs.wait()?;
        pss.wait()?;
        pa.wait()?;
        pv.wait()?;
        ps.wait()?;
        pg.wait()?;
        Ok(())
    })
    .unwrap()
    .unwrap();
    drop(ops);
    if r == root {
        let want: Vec<f32> = (0..n).flat_map(|q| filled(2, q, 5)).collect();
        assert_eq!(gout, want, "gather");
    }
    assert_eq!(sout, filled(3, r, 4), "scatter");
    let want: Vec<u8> = (0..n)
        .flat_map(|q| (0..=q).map(move |i| byte(q, n, i)))
        .collect();
    assert_eq!(vout, want, "all_gather_v");
    let want: Vec<u8> = (0..n)
        .flat_map(|p| (0..recv_lens[p]).map(move |i| byte(p, r, i)))
        .collect();
    assert_eq!(aout, want, "all_to_allv");
    let want: Vec<f32> = (0..3)
        .map(|i| (0..n).map(|q| val(4, q, r * 3 + i)).sum())
        .collect();
    assert_eq!(ssout, want, "sum_scatter");
    let at: usize = parts[..r].iter().sum::<usize>() / 4;
    let want: Vec<f32> = (at..at + parts[r] / 4)
        .map(|i| (0..n).map(|q| val(5, q, i)).fold(f32::MIN, f32::max))
        .collect();
    assert_eq!(
        bytemuck::cast_slice::<u8, f32>(&rsout),
        &want[..],
        "reduce_scatter_v"
    );
    let want: Vec<u8> = (0..6).map(|i| byte(prev, r, i)).collect();
    assert_eq!(brecv, want, "batch");
    println!("EVERY-OP-OK rank {r}");
}

#[test]
fn every_operation_starts_in_an_overlap_scope() {
    let name = "every_operation_starts_in_an_overlap_scope";
    if !parent_ready(name, every_operation_body) {
        return;
    }
    for n in [2, 3] {
        spawn_local_ok(name, n, &[], Duration::from_secs(60));
    }
}

crate::matrix!(
    a_dead_peer_fails_every_pending_operation,
    operations_in_flight_with_blocking_ones,
    caller_progress_moves_operations_only_inside_calls,
    operations_in_flight_under_caller_progress,
    abort_ends_every_pending_call_on_every_rank,
    a_blocking_call_runs_the_operations_started_before_it,
    a_test_does_not_wait_for_a_late_peer,
    every_operation_starts_in_an_overlap_scope
);
