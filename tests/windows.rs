//! Landing in the caller's memory over RDMA: inside `with_registered` a ring all_reduce's
//! all-gather half is written by the left neighbour straight into this rank's buffer, through a
//! window offered for that operation alone. The bits are those of the staged ring; a peer that
//! writes past its window, or with a window kept past the registration's scope (the test hooks
//! `land-past-window` and `land-stale-window`, on rank 1 only), is refused by the device: every
//! rank fails, and no byte lands outside the window or after the scope; nor after an operation
//! failed, when a rank is killed while chunks land.

mod common;
use common::*;
use rdmacomm::{Algo, AllReduce, Comm, Communicator, DType};
use std::time::Duration;

/// Elements: several 1 MiB slots' worth at 2 and 3 ranks.
const ELEMS: usize = 3 << 18;

/// Rank r's element i of round `round`: fractions, so the order of additions shows in the bits.
fn val(r: usize, i: usize, round: usize) -> f32 {
    ((r * 7 + i * 3 + round) % 101) as f32 / 7.0 + r as f32 * 0.001
}

fn input(r: usize, round: usize) -> Vec<u8> {
    (0..ELEMS)
        .flat_map(|i| val(r, i, round).to_le_bytes())
        .collect()
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// Every rank: the ring all_reduce staged, then landed (registered); the same bits, near the
/// scalar sum.
fn same_bits_body() {
    let (r, n) = rank_size();
    let c = Comm::from_env().unwrap();
    c.set_algorithm(Algo::Ring);
    let mut staged = input(r, 0);
    c.all_reduce(AllReduce::Sum, DType::f32, &mut staged)
        .unwrap();
    let mut landed = input(r, 0);
    let before = c.ledger();
    c.with_registered(&mut landed, &mut |b| {
        c.all_reduce(AllReduce::Sum, DType::f32, b)
    })
    .unwrap();
    let l = c.ledger() - before;
    assert!(staged == landed, "rank {r}: landed bits differ from staged");
    for (i, got) in floats(&landed).into_iter().enumerate() {
        let want: f32 = (0..n).map(|q| val(q, i, 0)).sum();
        assert!(
            (got - want).abs() <= 1e-4 * want.abs().max(1.0),
            "rank {r}[{i}]"
        );
    }
    // Nothing copied out of a slot: the all-gather half landed.
    assert_eq!(l.copied_out, 0, "rank {r}: {l:?}");
    println!("rank {r}: {:.3} passes per wire byte", l.passes());
}

/// Every rank: the ring staged everywhere, then with only the odd ranks registered, so that
/// an even rank, which relays a received chunk straight into its next send, lands that send in
/// its right neighbour's window: the same bits, and nothing copied out on the odd ranks.
fn mixed_body() {
    let (r, _) = rank_size();
    let c = Comm::from_env().unwrap();
    c.set_algorithm(Algo::Ring);
    let mut staged = input(r, 4);
    c.all_reduce(AllReduce::Sum, DType::f32, &mut staged)
        .unwrap();
    let mut mixed = input(r, 4);
    let before = c.ledger();
    if r % 2 == 1 {
        c.with_registered(&mut mixed, &mut |b| {
            c.all_reduce(AllReduce::Sum, DType::f32, b)
        })
        .unwrap();
    } else {
        c.all_reduce(AllReduce::Sum, DType::f32, &mut mixed)
            .unwrap();
    }
    let l = c.ledger() - before;
    assert!(
        staged == mixed,
        "rank {r}: a mixed ring's bits differ from staged"
    );
    if r % 2 == 1 {
        assert_eq!(l.copied_out, 0, "rank {r}: {l:?}");
    } else {
        assert!(l.copied_in < l.wire, "rank {r} relayed nothing: {l:?}");
    }
}

/// Every rank, with `RDMACOMM_ZERO_COPY_MIN` set: a plain buffer lent for one all_reduce is
/// offered as that operation's window: nothing copied in or out, one registration an operation,
/// the bits of a registered buffer's landing (which are the staged ring's, above).
fn lent_body() {
    let (r, n) = rank_size();
    let c = Comm::from_env().unwrap();
    c.set_algorithm(Algo::Ring);
    let before = c.ledger();
    let mut lent = input(r, 3);
    c.all_reduce(AllReduce::Sum, DType::f32, &mut lent).unwrap();
    let l = c.ledger() - before;
    let mut registered = input(r, 3);
    c.with_registered(&mut registered, &mut |b| {
        c.all_reduce(AllReduce::Sum, DType::f32, b)
    })
    .unwrap();
    assert!(registered == lent, "rank {r}: a lent buffer's bits differ");
    for (i, got) in floats(&lent).into_iter().enumerate().step_by(101) {
        let want: f32 = (0..n).map(|q| val(q, i, 3)).sum();
        assert!(
            (got - want).abs() <= 1e-4 * want.abs().max(1.0),
            "rank {r}[{i}]"
        );
    }
    assert_eq!((l.copied_in, l.copied_out), (0, 0), "rank {r}: {l:?}");
    assert_eq!(l.registrations, 1, "rank {r}: {l:?}");
    println!("rank {r}: lent, {:.3} passes per wire byte", l.passes());
}

/// Every rank: a first landed all_reduce that must succeed, then one that rank 1's hook
/// spoils (past its window, or with the first's window after its scope). Each rank reports the
/// error and checks that nothing landed where it should not.
fn refused_body() {
    let (r, n) = rank_size();
    let stale = std::env::var("WINDOW_CASE").unwrap() == "stale";
    let c = Comm::from_env().unwrap();
    c.set_algorithm(Algo::Ring);
    let s = ELEMS * 4;
    // The operation's buffer, then a canary that is no part of any registration.
    let mut mem = input(r, 1);
    mem.resize(s + 4096, 0xA5);
    let first = if stale {
        let got = c.with_registered(&mut mem[..s], &mut |b| {
            c.all_reduce(AllReduce::Sum, DType::f32, b)
        });
        got.unwrap();
        for (i, got) in floats(&mem[..s]).into_iter().enumerate().step_by(997) {
            let want: f32 = (0..n).map(|q| val(q, i, 1)).sum();
            assert!(
                (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                "rank {r}[{i}]"
            );
        }
        // The second operation runs outside the scope, on fresh values.
        mem[..s].copy_from_slice(&input(r, 2));
        c.all_reduce(AllReduce::Sum, DType::f32, &mut mem[..s])
    } else {
        c.with_registered(&mut mem[..s], &mut |b| {
            c.all_reduce(AllReduce::Sum, DType::f32, b)
        })
    };
    let e = first.expect_err("the spoiled all_reduce must fail");
    println!("RESULT rank {r}: ERROR {e}");
    assert!(
        mem[s..].iter().all(|&b| b == 0xA5),
        "rank {r}: bytes landed past the window"
    );
    if stale && r == 0 {
        // Rank 1's all-gather chunk would land in rank 0's chunk 0, which rank 0 only sent:
        // still rank 0's own input where the write was refused.
        let round = input(0, 2);
        let half = (ELEMS / 2) * 4;
        assert!(
            mem[..half] == round[..half],
            "rank 0: a stale window's write landed"
        );
    }
}

/// Every rank: registered ring all_reduces of 16 MiB until one fails (rank 2 is killed 300 ms
/// in); the survivors' buffers must not change after their operation failed.
fn killed_body() {
    let (r, _) = rank_size();
    let c = Comm::from_env().unwrap();
    c.set_algorithm(Algo::Ring);
    if r == 2 {
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            // SAFETY: a plain libc call on this process.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        });
    }
    let mut mem = vec![0u8; 16 << 20];
    let got = c.with_registered(&mut mem, &mut |b| {
        for round in 0.. {
            b.chunks_mut(4)
                .enumerate()
                .for_each(|(i, e)| e.copy_from_slice(&val(r, i, round).to_le_bytes()));
            if let Err(e) = c.all_reduce(AllReduce::Sum, DType::f32, b) {
                // A peer still in its operation must not write here any more.
                let then = b.to_vec();
                std::thread::sleep(Duration::from_millis(500));
                assert!(then == b, "rank {r}: its buffer changed after the failure");
                return Err(e);
            }
        }
        Ok(())
    });
    let e = got.expect_err("the all_reduce of a killed rank fails");
    println!("RESULT rank {r}: ERROR {e}");
    assert!(
        e.to_string().contains("rank 2"),
        "rank {r} names rank 2: {e}"
    );
}

fn run(name: &str, body: fn(), n: usize, env: &[(&str, &str)]) -> Vec<RankResult> {
    if !parent_ready(name, body) || !rdma_available() {
        return Vec::new();
    }
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    spawn(
        name,
        n,
        Placement::Local,
        &|r| {
            let mut e = env.clone();
            e.push(("RDMACOMM_TRANSPORT".into(), "rdma".into()));
            e.push(("RDMACOMM_TIMEOUT".into(), "10".into()));
            if r != 1 {
                e.retain(|(k, _)| k != "RDMACOMM_TEST_FAULT");
            }
            e
        },
        Duration::from_secs(120),
    )
}

#[test]
fn landed_all_reduce_gives_the_staged_bits() {
    for n in [2, 3] {
        let r = run(
            "landed_all_reduce_gives_the_staged_bits",
            same_bits_body,
            n,
            &[],
        );
        assert_all_ok(&r);
        for x in &r {
            for l in x
                .output
                .lines()
                .filter(|l| l.contains("passes per wire byte"))
            {
                println!("{n} ranks, {l}");
            }
        }
    }
}

#[test]
fn a_relay_lands_in_a_registered_neighbour() {
    for n in [2, 4] {
        let r = run(
            "a_relay_lands_in_a_registered_neighbour",
            mixed_body,
            n,
            &[],
        );
        assert_all_ok(&r);
    }
}

#[test]
fn a_buffer_lent_for_one_all_reduce_lands_too() {
    let r = run(
        "a_buffer_lent_for_one_all_reduce_lands_too",
        lent_body,
        3,
        &[("RDMACOMM_ZERO_COPY_MIN", "65536")],
    );
    assert_all_ok(&r);
}

fn refused(name: &str, case: &str, hook: &str) {
    if !debug_hooks(name) {
        return;
    }
    let r = run(
        name,
        refused_body,
        2,
        &[("WINDOW_CASE", case), ("RDMACOMM_TEST_FAULT", hook)],
    );
    if r.is_empty() {
        return;
    }
    assert_all_ok(&r);
    let said: Vec<String> = r
        .iter()
        .map(|x| tagged(&x.output, "RESULT").join(" "))
        .collect();
    println!("{said:#?}");
    // Each rank names the other; the device's refusal shows as the writer's remote access
    // error, or, where the receiver's failure reached the writer first, as the receiver's queue
    // pair put in the error state by it.
    assert!(
        said[0].contains("ERROR") && said[0].contains("rank 1"),
        "{said:?}"
    );
    assert!(
        said[1].contains("ERROR") && said[1].contains("rank 0"),
        "{said:?}"
    );
    assert!(
        said.iter()
            .any(|s| s.contains("remote access") || s.contains("flushed")),
        "the device refused the write: {said:?}"
    );
}

#[test]
fn a_write_past_its_window_is_refused() {
    refused(
        "a_write_past_its_window_is_refused",
        "past",
        "land-past-window",
    );
}

#[test]
fn a_window_kept_past_its_scope_is_refused() {
    refused(
        "a_window_kept_past_its_scope_is_refused",
        "stale",
        "land-stale-window",
    );
}

#[test]
fn a_rank_killed_while_chunks_land_leaves_no_late_write() {
    let r = run(
        "a_rank_killed_while_chunks_land_leaves_no_late_write",
        killed_body,
        3,
        &[],
    );
    if r.is_empty() {
        return;
    }
    for x in &r[..2] {
        assert_eq!(x.code, Some(0), "rank {}: {}", x.rank, x.output);
        println!("{}", tagged(&x.output, "RESULT").join(" "));
    }
    assert_eq!(r[2].code, None, "rank 2 was killed: {}", r[2].output);
}
