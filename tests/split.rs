//! split() and the typed Group, multi-process: 6 ranks split into {even, odd} and into
//! {0..2, 3..5}, then collectives in both subgroups and the parent, interleaved, every result
//! checked against a reference; nested splits; a negative color; IdentityComm.

mod common;
use common::*;
use rdmacomm::{AllReduce, Comm, Communicator, DType, Group, IdentityComm};
use std::sync::Arc;
use std::time::Duration;

/// Sum over `ranks` of the value each contributes at element i.
fn val(r: usize, i: usize) -> f32 {
    ((r * 7 + i * 3) % 11) as f32
}

fn check_sum(g: &Group, parent_ranks: &[usize], what: &str) {
    // Each member contributes val(parent rank, i); the sum must match on every member.
    let me = parent_ranks[g.rank()];
    eprintln!("rank {me}: {what}");
    let mut d: Vec<f32> = (0..1000).map(|i| val(me, i)).collect();
    g.all_reduce(&mut d, AllReduce::Sum).unwrap();
    for (i, &x) in d.iter().enumerate() {
        let want: f32 = parent_ranks.iter().map(|&p| val(p, i)).sum();
        assert_eq!(x, want, "{what}: element {i}");
    }
}

fn split_body() {
    let (r, n) = rank_size();
    let parent = Group::from_env().unwrap();
    assert_eq!((parent.rank(), parent.size()), (r, n));
    // Even / odd, ordered by rank.
    let parity = parent.split((r % 2) as i32, r as i32).unwrap();
    let parity_ranks: Vec<usize> = (0..n).filter(|q| q % 2 == r % 2).collect();
    assert_eq!(parity.size(), parity_ranks.len());
    assert_eq!(parity.rank(), r / 2);
    // Halves, ordered by key = -rank (so reversed).
    let half = parent.split((r / 3) as i32, -(r as i32)).unwrap();
    let mut half_ranks: Vec<usize> = (0..n).filter(|q| q / 3 == r / 3).collect();
    half_ranks.reverse();
    assert_eq!(half_ranks[half.rank()], r, "key orders the subgroup");
    // Interleave collectives on the three groups.
    for round in 0..3 {
        check_sum(
            &parity,
            &parity_ranks,
            &format!("round {round}: parity all_reduce"),
        );
        check_sum(
            &parent,
            &(0..n).collect::<Vec<_>>(),
            &format!("round {round}: parent all_reduce"),
        );
        check_sum(
            &half,
            &half_ranks,
            &format!("round {round}: half all_reduce"),
        );
        let mine = [r as u32 * 10 + round];
        let mut got = vec![0u32; half.size()];
        half.all_gather(&mine, &mut got).unwrap();
        let want: Vec<u32> = half_ranks.iter().map(|&p| p as u32 * 10 + round).collect();
        assert_eq!(got, want, "half all_gather in key order");
        let mut b = [if parity.rank() == 1 {
            42u64 + round as u64
        } else {
            0
        }; 3];
        parity.broadcast(&mut b, 1).unwrap();
        assert_eq!(
            b,
            [42 + round as u64; 3],
            "parity broadcast from sub-rank 1"
        );
        parent.barrier().unwrap();
    }
    // Nested: split the parity group again, by rank / 4.
    let nested = parity.split((r / 4) as i32, 0).unwrap();
    let nested_ranks: Vec<usize> = parity_ranks
        .iter()
        .copied()
        .filter(|q| q / 4 == r / 4)
        .collect();
    check_sum(&nested, &nested_ranks, "nested all_reduce");
    nested.health().unwrap();
    // A negative color: a world of one for rank 5, the rest together.
    let some = parent.split(if r == 5 { -1 } else { 0 }, 0).unwrap();
    if r == 5 {
        assert_eq!((some.rank(), some.size()), (0, 1));
    } else {
        check_sum(&some, &(0..5).collect::<Vec<_>>(), "split without rank 5");
    }
    // Drop the parent first: the subgroups stay usable.
    drop(parent);
    check_sum(&half, &half_ranks, "half after the parent is gone");
    parity.barrier().unwrap();
    println!("rank {r}: split checks passed");
}

#[test]
fn split_six_ranks_interleaved() {
    const NAME: &str = "split_six_ranks_interleaved";
    if !parent_ready(NAME, split_body) {
        return;
    }
    spawn_local_ok(NAME, 6, &[], Duration::from_secs(400));
}

#[test]
fn identity_comm_is_a_world_of_one() {
    let g = Group::new(Arc::new(IdentityComm));
    assert!(g.broadcast(&mut [0u8; 2], 1).is_err(), "root out of range");
    let mut x = [1.0f64, 2.0];
    g.all_reduce(&mut x, AllReduce::Max).unwrap();
    assert_eq!(x, [1.0, 2.0]);
    assert_eq!(g.split(-1, 0).unwrap().size(), 1);
    let e = Communicator::all_reduce(&IdentityComm, AllReduce::Sum, DType::f64, &mut [0u8; 12])
        .unwrap_err();
    assert!(e.to_string().contains("not a multiple"), "{e}");
}

fn bcast_body() {
    let (r, n) = rank_size();
    let g = Group::from_env().unwrap();
    for root in 0..n {
        for len in [0usize, 1, 4097, (1 << 20) + 3] {
            let mut d: Vec<u8> = if r == root {
                (0..len).map(|i| (i * 31 + root) as u8).collect()
            } else {
                vec![0; len]
            };
            g.broadcast(&mut d, root).unwrap();
            assert!(
                d.iter()
                    .enumerate()
                    .all(|(i, &b)| b == (i * 31 + root) as u8),
                "broadcast of {len} B from {root}"
            );
        }
    }
    println!("rank {r}: broadcast checks passed");
}

#[test]
fn broadcast_chain_and_tree_five_ranks() {
    const NAME: &str = "broadcast_chain_and_tree_five_ranks";
    if !parent_ready(NAME, bcast_body) {
        return;
    }
    for algo in ["chain", "tree"] {
        spawn_local_ok(
            NAME,
            5,
            &[("RDMACOMM_BCAST", algo)],
            Duration::from_secs(300),
        );
    }
}

/// A world of one (a program run without a launcher) dups and splits into worlds of one, and
/// they work; this used to panic ("world of one handled by the caller").
#[test]
fn a_world_of_one_dups_and_splits_into_a_world_of_one() {
    let one = Comm::new(&rdmacomm::Config::defaults(0, 1, "")).unwrap();
    let dup = one.dup().unwrap();
    let alone = one.split_comm(-1, 0).unwrap();
    let again = alone.split_comm(3, 7).unwrap();
    for c in [&dup, &alone, &again] {
        assert_eq!((c.rank(), c.size()), (0, 1));
        let mut x = [2.5f32.to_le_bytes(), 1.0f32.to_le_bytes()].concat();
        c.all_reduce(AllReduce::Sum, DType::f32, &mut x).unwrap();
        assert_eq!(x, [2.5f32.to_le_bytes(), 1.0f32.to_le_bytes()].concat());
        c.barrier().unwrap();
    }
}

fn hybrid_split_body() {
    let (r, n) = rank_size();
    let parent = Group::from_env().unwrap();
    // One rank per host: the data-parallel group of a 2 x 2 job.
    let across = parent.split((r % 2) as i32, r as i32).unwrap();
    let across_ranks: Vec<usize> = (0..n).filter(|q| q % 2 == r % 2).collect();
    check_sum(&across, &across_ranks, "one rank per host");
    // The ranks of one host: shared memory alone.
    let within = parent.split((r / 2) as i32, r as i32).unwrap();
    let within_ranks: Vec<usize> = (0..n).filter(|q| q / 2 == r / 2).collect();
    check_sum(&within, &within_ranks, "the ranks of a host");
    check_sum(&parent, &(0..n).collect::<Vec<_>>(), "the world after both");
}

/// The usual hybrid-parallel split on 2 hosts of 2 (the launcher says 2 ranks per host): a
/// subgroup picks its transports from where its own members are. It used to inherit the
/// world's local count and choose shared memory alone for one rank per host, and fail.
#[test]
fn a_split_across_hosts_picks_its_own_transports() {
    const NAME: &str = "a_split_across_hosts_picks_its_own_transports";
    if !parent_ready(NAME, hybrid_split_body) {
        return;
    }
    let env = |r: usize| {
        vec![
            ("RDMACOMM_TIMEOUT".to_string(), "30".to_string()),
            ("RDMACOMM_TRANSPORT".to_string(), "auto".to_string()),
            ("RDMACOMM_SHM".to_string(), "1".to_string()),
            ("LOCAL_WORLD_SIZE".to_string(), "2".to_string()),
            (
                "RDMACOMM_HOST_ID".to_string(),
                format!("split-host-{}", r / 2),
            ),
        ]
    };
    assert_all_ok(&spawn(
        NAME,
        4,
        Placement::Local,
        &env,
        Duration::from_secs(120),
    ));
}

/// Rank 2 of 3 cannot set up its subgroup {0, 2} (its descriptor limit, lowered after the world
/// was made, is below what a group of two needs): every rank fails the split within 2 s naming
/// rank 2 and the limit. Ranks 0 and 1 used to wait in the split's steps for the whole timeout.
fn failed_set_up_body() {
    let (r, _) = rank_size();
    let c = Comm::from_env().unwrap_or_else(|e| panic!("rank {r}: {e}"));
    c.barrier().unwrap();
    if r == 2 {
        let low = libc::rlimit {
            rlim_cur: 66,
            rlim_max: 66,
        };
        // SAFETY: setrlimit reads one valid rlimit; lowering a limit needs no privilege.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &low) }, 0);
    }
    let t = std::time::Instant::now();
    let e = c
        .split_comm((r % 2) as i32, r as i32)
        .map(|_| ())
        .expect_err("a split that rank 2 cannot set up");
    let took = t.elapsed();
    let text = e.to_string();
    // Rank 2 has its own error; the others name it.
    assert!(
        text.contains("descriptor") && (r == 2 || text.contains("rank 2 could not set up")),
        "rank {r}: {text}"
    );
    assert!(took < Duration::from_secs(2), "rank {r}: after {took:?}");
    let later = c.barrier().unwrap_err().to_string();
    assert!(later.contains("descriptor"), "rank {r}: {later}");
    println!("RESULT rank {r}: {text}");
}

#[test]
fn a_failed_split_set_up_is_told_to_every_rank() {
    const NAME: &str = "a_failed_split_set_up_is_told_to_every_rank";
    if !parent_ready(NAME, failed_set_up_body) {
        return;
    }
    let env = |_| vec![("RDMACOMM_TIMEOUT".to_string(), "30".to_string())];
    let res = spawn(NAME, 3, Placement::Local, &env, Duration::from_secs(90));
    assert_all_ok(&res);
}

/// What this process holds of communicators: descriptors (sockets, listeners, segments,
/// devices) and mappings of shared-memory segments.
fn held() -> usize {
    let fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count());
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    fds + maps
        .lines()
        .filter(|l| l.contains("memfd:rdmacomm"))
        .count()
}

fn shared_body() {
    let (r, n) = rank_size();
    let world = Comm::from_env().unwrap();
    let all: Vec<usize> = (0..n).collect();
    // Every pair connected first (an all_to_all reaches every peer): what the views then run
    // on is there already.
    let mine: Vec<u8> = (0..n).map(|q| (r * n + q) as u8).collect();
    let mut got = vec![0u8; n];
    world.all_to_all(&mine, &mut got).unwrap();
    assert_eq!(got, (0..n).map(|q| (q * n + r) as u8).collect::<Vec<_>>());
    let before = held();
    let parity = world.split_shared((r % 2) as i32, r as i32).unwrap();
    let half = world.split_shared((r / 3) as i32, -(r as i32)).unwrap();
    let dup = world.dup_shared().unwrap();
    let nested = parity.split_shared((r / 4) as i32, 0).unwrap();
    let parity_ranks: Vec<usize> = (0..n).filter(|q| q % 2 == r % 2).collect();
    let mut half_ranks: Vec<usize> = (0..n).filter(|q| q / 3 == r / 3).collect();
    half_ranks.reverse();
    let nested_ranks: Vec<usize> = parity_ranks
        .iter()
        .copied()
        .filter(|q| q / 4 == r / 4)
        .collect();
    assert_eq!(half_ranks[half.rank()], r, "key orders the view");
    assert_eq!((dup.rank(), dup.size()), (r, n));
    // A view runs on its parent's thread, and opens no overlap scope of its own.
    let elsewhere = std::thread::scope(|s| s.spawn(|| dup.barrier()).join().unwrap());
    assert!(
        matches!(elsewhere, Err(rdmacomm::Error::WrongThread(_))),
        "{elsewhere:?}"
    );
    let scope = dup.overlap(|_| ());
    assert!(
        matches!(scope, Err(rdmacomm::Error::InvalidArgument(_))),
        "{:?}",
        scope.err()
    );
    let (world, parity, half, dup, nested) = (
        Group::new(Arc::new(world)),
        Group::new(Arc::new(parity)),
        Group::new(Arc::new(half)),
        Group::new(Arc::new(dup)),
        Group::new(Arc::new(nested)),
    );
    // The views and the world, interleaved in one order on every rank.
    for round in 0..3 {
        check_sum(
            &parity,
            &parity_ranks,
            &format!("round {round}: parity view"),
        );
        check_sum(&world, &all, &format!("round {round}: world"));
        check_sum(&half, &half_ranks, &format!("round {round}: half view"));
        check_sum(
            &nested,
            &nested_ranks,
            &format!("round {round}: view of a view"),
        );
        check_sum(&dup, &all, &format!("round {round}: dup view"));
        let mine = [r as u32 * 10 + round];
        let mut got = vec![0u32; half.size()];
        half.all_gather(&mine, &mut got).unwrap();
        let want: Vec<u32> = half_ranks.iter().map(|&p| p as u32 * 10 + round).collect();
        assert_eq!(got, want, "half view all_gather in key order");
        let mut b = [if parity.rank() == 1 {
            42u64 + round as u64
        } else {
            0
        }; 3];
        parity.broadcast(&mut b, 1).unwrap();
        assert_eq!(
            b,
            [42 + round as u64; 3],
            "parity view broadcast from its rank 1"
        );
        // A ring shift on the dup view, point to point.
        let c = dup.communicator();
        let mut from = [0u8; 8];
        c.sendrecv(
            (r + 1) % n,
            &(r as u64).to_le_bytes(),
            (r + n - 1) % n,
            &mut from,
        )
        .unwrap();
        assert_eq!(
            u64::from_le_bytes(from),
            ((r + n - 1) % n) as u64,
            "dup view sendrecv"
        );
    }
    assert_eq!(held(), before, "the views hold nothing of their own");
    // The world may go first: the views keep its link.
    drop(world);
    check_sum(&half, &half_ranks, "half view after the world is gone");
    dup.communicator().barrier().unwrap();
    println!("rank {r}: shared view checks passed");
}

/// Views of one link (`split_shared`, `dup_shared`, a view of a view) compute what the
/// independent splits do, interleaved with the world in one order, and hold no connection,
/// buffer or descriptor of their own.
#[test]
fn shared_views_run_over_their_parents_link() {
    const NAME: &str = "shared_views_run_over_their_parents_link";
    if !parent_ready(NAME, shared_body) {
        return;
    }
    spawn_local_ok(NAME, 6, &[], Duration::from_secs(300));
}

/// Independent communicators do hold their own: the measure above sees a `dup`'s.
#[test]
fn a_dup_holds_its_own_where_a_shared_view_does_not() {
    const NAME: &str = "a_dup_holds_its_own_where_a_shared_view_does_not";
    if !parent_ready(NAME, || {
        let world = Comm::from_env().unwrap();
        world.barrier().unwrap();
        let before = held();
        let t = std::time::Instant::now();
        let view = world.dup_shared().unwrap();
        view.barrier().unwrap();
        let view_took = t.elapsed();
        assert_eq!(held(), before, "a shared view");
        let t = std::time::Instant::now();
        let dup = world.dup().unwrap();
        dup.barrier().unwrap();
        let dup_took = t.elapsed();
        let dup_held = held() - before;
        assert!(dup_held > 0, "a dup holds nothing of its own?");
        if world.rank() == 0 {
            println!(
                "RESULT a shared view: nothing held, made and through a barrier in {view_took:?}; \
                 a dup: {dup_held} descriptors and mappings, in {dup_took:?}"
            );
        }
    }) {
        return;
    }
    let env = |_| vec![("RDMACOMM_TIMEOUT".to_string(), "60".to_string())];
    let res = spawn(NAME, 3, Placement::Local, &env, Duration::from_secs(120));
    assert_all_ok(&res);
    for l in res[0].output.lines().filter(|l| l.contains("RESULT")) {
        println!("{l}");
    }
}

fn misordered_body() {
    let (r, _) = rank_size();
    let world = Comm::from_env().unwrap();
    let view = world.dup_shared().unwrap();
    let mut x = 1.0f32.to_le_bytes().to_vec();
    // Same arguments, another communicator: rank 0 calls the view, the others the world.
    let e = if r == 0 {
        view.all_reduce(AllReduce::Sum, DType::f32, &mut x)
    } else {
        world.all_reduce(AllReduce::Sum, DType::f32, &mut x)
    }
    .expect_err("a view's call is not its parent's");
    println!("rank {r}: ERROR {e}");
    // Either way the link is done: both refuse further work.
    assert!(world.barrier().is_err() && view.barrier().is_err());
}

/// A rank that calls a shared view where its peers call the parent, with the same arguments:
/// named as a mismatch (the view's number rides in the descriptor), never misread or hung.
#[test]
fn a_view_called_where_peers_call_its_parent_is_named() {
    const NAME: &str = "a_view_called_where_peers_call_its_parent_is_named";
    if !parent_ready(NAME, misordered_body) {
        return;
    }
    let env = |_| vec![("RDMACOMM_TIMEOUT".to_string(), "10".to_string())];
    let res = spawn(NAME, 3, Placement::Local, &env, Duration::from_secs(120));
    assert_all_ok(&res);
    for x in &res {
        if let Some(l) = x.output.lines().find(|l| l.contains("ERROR")) {
            println!("{l}");
        }
    }
    let named = res
        .iter()
        .filter(|x| x.output.contains("on shared view"))
        .count();
    assert!(
        named >= 1,
        "{:?}",
        res.iter().map(|x| &x.output).collect::<Vec<_>>()
    );
}

#[test]
fn a_world_of_one_shares_into_a_world_of_one() {
    let one = Comm::new(&rdmacomm::Config::defaults(0, 1, "")).unwrap();
    let view = one.dup_shared().unwrap();
    assert_eq!((view.rank(), view.size()), (0, 1));
    view.barrier().unwrap();
    assert!(
        one.split_shared(-1, 0).is_ok(),
        "a negative color: a world of one"
    );
}

crate::matrix!(
    shared_views_run_over_their_parents_link,
    a_dup_holds_its_own_where_a_shared_view_does_not,
    a_view_called_where_peers_call_its_parent_is_named,
    split_six_ranks_interleaved,
    identity_comm_is_a_world_of_one,
    broadcast_chain_and_tree_five_ranks,
    a_world_of_one_dups_and_splits_into_a_world_of_one,
    a_split_across_hosts_picks_its_own_transports,
    a_failed_split_set_up_is_told_to_every_rank
);
