//! Survive a lost rank: ranks killed (SIGKILL) or stopped (SIGSTOP) inside an all_reduce, a
//! broadcast and a sendrecv; the survivors shrink, agree on the last step every one completed,
//! and their new communicator's results match a scalar re-computation over the members. Each
//! rank prints what it saw; the parent checks every survivor against the others.

mod common;
use common::*;
use rdmacomm::{AllReduce, Comm, Communicator, DType};
use std::time::{Duration, Instant};

/// RDMACOMM_TIMEOUT for these tests (seconds): a silent rank costs this, a dead one nothing.
/// Longer in the VM, whose emulated CPUs can hold a busy rank off a wait for seconds.
fn timeout_s() -> u64 {
    if require_rdma() {
        10
    } else {
        4
    }
}
/// Elements of each step's all_reduce (big enough that a kill lands inside it).
const ELEMS: usize = 1 << 16;

/// The value rank `r` brings to step `s` at element `i` (exact in f64 sums).
fn val(r: usize, s: u64, i: usize) -> f64 {
    ((r * 7 + s as usize * 3 + i % 97) % 1024) as f64
}

/// One step of the kind named by `SHRINK_OP`, on `c`, checked: rank `old[q]` of the world is
/// rank q of `c`.
fn step(c: &Comm, op: &str, s: u64, old: &[usize]) -> rdmacomm::Result<()> {
    let (r, n) = (c.rank(), c.size());
    match op {
        "broadcast" => {
            let mut b: Vec<u8> = (0..ELEMS * 4)
                .map(|i| if r == 0 { (i as u64 * 31 + s) as u8 } else { 0 })
                .collect();
            c.broadcast(0, &mut b)?;
            for (i, x) in b.iter().enumerate() {
                assert_eq!(*x, (i as u64 * 31 + s) as u8, "broadcast byte {i}");
            }
        }
        "sendrecv" => {
            let mine: Vec<u8> = (0..ELEMS * 4)
                .map(|i| (i + old[r] + s as usize) as u8)
                .collect();
            let mut got = vec![0u8; mine.len()];
            let (to, from) = ((r + 1) % n, (r + n - 1) % n);
            c.sendrecv(to, &mine, from, &mut got)?;
            for (i, x) in got.iter().enumerate() {
                assert_eq!(
                    *x,
                    (i + old[from] + s as usize) as u8,
                    "from rank {from}, byte {i}"
                );
            }
        }
        _ => {
            let mut v: Vec<u8> = (0..ELEMS)
                .flat_map(|i| val(old[r], s, i).to_le_bytes())
                .collect();
            c.all_reduce(AllReduce::Sum, DType::f64, &mut v)?;
            for (i, x) in v.chunks_exact(8).enumerate() {
                let want: f64 = old.iter().map(|&q| val(q, s, i)).sum();
                assert_eq!(
                    f64::from_le_bytes(x.try_into().unwrap()),
                    want,
                    "element {i}"
                );
            }
        }
    }
    Ok(())
}

fn var(k: &str) -> String {
    std::env::var(k).unwrap_or_default()
}

fn ranks_in(k: &str) -> Vec<usize> {
    var(k)
        .split(',')
        .filter(|x| !x.is_empty())
        .map(|x| x.parse().unwrap())
        .collect()
}

/// Rank 0's step and world ids, as every rank takes them after a grow.
fn share_state(c: &Comm, s: u64, old: &[usize]) -> (u64, Vec<usize>) {
    let mut b = [0u64; 32];
    b[0] = s;
    b[1] = old.len() as u64;
    for (i, &q) in old.iter().enumerate() {
        b[2 + i] = q as u64;
    }
    let mut bytes: Vec<u8> = b.iter().flat_map(|x| x.to_le_bytes()).collect();
    c.broadcast(0, &mut bytes).unwrap();
    let w: Vec<u64> = bytes
        .chunks_exact(8)
        .map(|x| u64::from_le_bytes(x.try_into().unwrap()))
        .collect();
    let len = w[1] as usize;
    (w[0], w[2..2 + len].iter().map(|&q| q as usize).collect())
}

/// The wall clock in milliseconds (the ranks share the host's: a fault's time against the
/// survivors' recovery, for `tools/fault-bench`).
fn unix_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

/// This rank ends itself in the middle of its next operation: SIGKILL, or SIGSTOP with a
/// helper that wakes it `wake` later; `replace`: SIGKILL, after starting its replacement
/// (which shares this rank's output).
fn strike(how: &str, wake: u64) {
    let pid = std::process::id();
    if how == "replace" {
        std::process::Command::new(std::env::current_exe().unwrap())
            .args(std::env::args().skip(1))
            .env("ELASTIC_NEWCOMER", "1")
            .env("RDMACOMM_TIMEOUT", "20")
            .spawn()
            .map(std::mem::forget) // it outlives this process, which is about to be killed
            .unwrap();
    }
    if how == "stop" {
        std::process::Command::new("sh")
            .args(["-c", &format!("sleep {wake}; kill -CONT {pid}")])
            .spawn()
            .map(std::mem::forget) // it wakes this process, stopped meanwhile
            .unwrap();
    }
    let sig = if how == "stop" {
        libc::SIGSTOP
    } else {
        libc::SIGKILL
    };
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(2));
        // SAFETY: kill(2) on this process; no memory is involved.
        unsafe { libc::kill(pid as i32, sig) };
    });
}

fn shrink_body() {
    let (r, n) = rank_size();
    let op = var("SHRINK_OP");
    let victims = ranks_in("SHRINK_VICTIMS");
    let later = ranks_in("SHRINK_LATER");
    let how = var("SHRINK_HOW");
    let grow = var("ELASTIC_GROW") == "1";
    let newcomer = var("ELASTIC_NEWCOMER") == "1";
    let mut old: Vec<usize> = (0..n).collect();
    let mut last_done = 0u64;
    let mut s = 1u64;
    let mut round = 0;
    let mut struck = newcomer;
    let mut grown = newcomer;
    let mut c = if newcomer {
        let t0 = Instant::now();
        let c = Comm::rejoin_from_env().unwrap();
        (s, old) = share_state(&c, s, &old);
        println!(
            "REJOINED as rank {} of {} (epoch {}) at step {s} in {:.3}s",
            c.rank(),
            c.size(),
            c.epoch(),
            t0.elapsed().as_secs_f64()
        );
        c
    } else {
        Comm::from_env().unwrap()
    };
    while s <= 8 {
        if grow && round > 0 && !grown && s >= 5 {
            // A step boundary after the shrink: the replacement is admitted and told the step
            // and who is who (it brings the id 100 + its rank).
            let t0 = Instant::now();
            let next = c.grow(1).unwrap();
            drop(c);
            c = next;
            old.push(100 + old.len());
            (s, old) = share_state(&c, s, &old);
            grown = true;
            println!(
                "GREW to {} (epoch {}) in {:.3}s",
                c.size(),
                c.epoch(),
                t0.elapsed().as_secs_f64()
            );
        }
        // The victims strike in step 3; the later ones in step 6, after the first shrink.
        if (s == 3 && victims.contains(&r) || s == 6 && later.contains(&r)) && !struck {
            struck = true;
            // Only the first victims are replaced: a later one's replacement would wait in vain.
            let how = if s == 6 && how == "replace" {
                "kill"
            } else {
                how.as_str()
            };
            println!("STRUCK {how} at {} ms", unix_ms());
            strike(how, timeout_s() + 1);
            // The signal lands 2 ms on, inside this step or while this rank waits here after it
            // (a short step would otherwise finish the run first): never past the next one.
            let r = step(&c, &op, s, &old);
            std::thread::sleep(Duration::from_millis(200));
            if r.is_err() {
                println!("the victim's step failed first: {r:?}");
            }
            continue;
        }
        match step(&c, &op, s, &old) {
            Ok(()) => {
                last_done = s;
                s += 1;
            }
            Err(e) => {
                let t0 = Instant::now();
                println!("FAILED step {s}: {e}");
                let (next, agreed) = match c.shrink(last_done) {
                    Ok(x) => x,
                    Err(e) => {
                        println!(
                            "SHRINK REFUSED: {e} (named: {:?})",
                            e.peer().map(|p| p.rank)
                        );
                        std::process::exit(4);
                    }
                };
                round += 1;
                // The old communicator refuses work (its first error says why).
                assert!(c
                    .all_reduce(AllReduce::Sum, DType::f64, &mut [0u8; 8])
                    .is_err());
                let dropped = Instant::now();
                drop(c);
                let drop_s = dropped.elapsed().as_secs_f64();
                old = agreed.members.iter().map(|&q| old[q]).collect();
                c = next;
                println!(
                    "SHRUNK round {round} epoch {} members {:?} least {} all {} mine {last_done} \
                     in {:.3}s (old one dropped in {drop_s:.3}s)",
                    c.epoch(),
                    old,
                    agreed.least,
                    agreed.all,
                    t0.elapsed().as_secs_f64()
                );
                assert_eq!(c.size(), old.len());
                // Redo from the step every member completed.
                s = agreed.least + 1;
                let t1 = Instant::now();
                step(&c, &op, s, &old).unwrap();
                println!(
                    "FIRST STEP after the shrink in {:.3}s ({:.3}s from the failure) at {} ms",
                    t1.elapsed().as_secs_f64(),
                    t0.elapsed().as_secs_f64(),
                    unix_ms()
                );
                last_done = s;
                s += 1;
            }
        }
    }
    println!("DONE world {:?}", old);
    if var("SHRINK_LINGER") == "1" {
        // Alive (its old port answering) while a stalled coordinator wakes and asks.
        std::thread::sleep(Duration::from_secs(2 * timeout_s() + 1));
    }
    if how == "stop" {
        // Alive while the stopped rank wakes (the helper wakes it a second past the timeout
        // after it stopped, once the others named it and shrank) and is told it was left out.
        std::thread::sleep(Duration::from_secs(timeout_s() + 1));
    }
}

/// A case's defaults: rank 2 of 4 killed in an all_reduce, no replacement.
const KILL: Case = Case {
    op: "all_reduce",
    n: 4,
    victims: "2",
    later: "",
    how: "kill",
    fault: None,
    linger: false,
    grow: false,
    file: false,
    debug: false,
};

struct Case {
    op: &'static str,
    /// Whether the survivors grow by one after the shrink (the victim's replacement).
    grow: bool,
    /// Whether newcomers find rank 0 through a coordinator file.
    file: bool,
    /// Whether ranks log at `info` (what each carried over).
    debug: bool,
    n: usize,
    victims: &'static str,
    later: &'static str,
    how: &'static str,
    fault: Option<(usize, &'static str)>,
    /// Whether the survivors stay alive for two timeouts after they are done.
    linger: bool,
}

/// Runs `k`; checks every survivor went on with the same members (all but the victims), agreed
/// on one least step no later than its own, and finished; returns the outputs by rank.
fn run(name: &str, mut k: Case) -> Vec<RankResult> {
    // A larger world for the fault benchmark (`tools/fault-bench`).
    if let Some(n) = std::env::var("ELASTIC_N").ok().and_then(|v| v.parse().ok()) {
        k.n = n;
    }
    let lost: Vec<usize> = ranks_in_text(k.victims)
        .into_iter()
        .chain(ranks_in_text(k.later))
        .chain(k.fault.map(|(r, _)| r))
        .collect();
    let r = spawn(
        name,
        k.n,
        Placement::Local,
        &|r| {
            let mut v = vec![
                ("RDMACOMM_TIMEOUT".to_string(), timeout_s().to_string()),
                ("SHRINK_OP".into(), k.op.into()),
                ("SHRINK_VICTIMS".into(), k.victims.into()),
                ("SHRINK_LATER".into(), k.later.into()),
                ("SHRINK_HOW".into(), k.how.into()),
            ];
            if k.grow {
                v.push(("ELASTIC_GROW".into(), "1".into()));
            }
            if k.linger {
                v.push(("SHRINK_LINGER".into(), "1".into()));
            }
            if k.debug {
                v.push(("RDMACOMM_DEBUG".into(), "info".into()));
            }
            if k.file {
                let f =
                    std::env::temp_dir().join(format!("rdmacomm-{name}-{}", std::process::id()));
                v.push(("RDMACOMM_COORDINATOR_FILE".into(), f.display().to_string()));
            }
            if let Some((f, what)) = k.fault {
                if f == r {
                    v.push(("RDMACOMM_TEST_FAULT".into(), what.into()));
                }
            }
            v
        },
        Duration::from_secs(60),
    );
    let survivors: Vec<usize> = (0..k.n).filter(|q| !lost.contains(q)).collect();
    let mut world = survivors.clone();
    if k.grow {
        // The newcomer's id counts the members it joined (the later victims among them).
        let later = ranks_in_text(k.later);
        world.push(100 + survivors.len() + later.len());
        world.retain(|q| !later.contains(q));
        // The replacement shares the victim's output.
        let x = &r[lost[0]];
        assert!(
            x.output.contains(&format!("DONE world {world:?}")),
            "the replacement: {}",
            x.output
        );
    }
    let mut agreed: Option<String> = None;
    for x in &r {
        // A child's first line follows the test harness' own on the same line: found anywhere.
        for l in x.output.lines().filter_map(|l| {
            [
                "STRUCK ",
                "FAILED step",
                "SHRUNK",
                "FIRST",
                "SHRINK REFUSED",
                "DONE",
                "GREW",
                "REJOINED",
            ]
            .iter()
            .find_map(|t| l.find(t).map(|i| &l[i..]))
        }) {
            println!("rank {}: {l}", x.rank);
        }
        if !survivors.contains(&x.rank) {
            continue;
        }
        assert_eq!(x.code, Some(0), "rank {}: {}", x.rank, x.output);
        assert!(
            x.output.contains(&format!("DONE world {world:?}")),
            "rank {}: {}",
            x.rank,
            x.output
        );
        // Every survivor agreed on the same least step (and AND), no later than its own.
        let lines = tagged(&x.output, "SHRUNK");
        assert!(!lines.is_empty(), "rank {}: {}", x.rank, x.output);
        let l = lines[lines.len() - 1];
        let field = |k: &str| -> u64 {
            let at = l.find(&format!(" {k} ")).unwrap() + k.len() + 2;
            l[at..].split(' ').next().unwrap().parse().unwrap()
        };
        assert!(field("least") <= field("mine"), "rank {}: {l}", x.rank);
        // From the epoch on: a newcomer counts its shrinks from its own start.
        let key = l[l.find("epoch").unwrap()..l.find(" mine ").unwrap()].to_string();
        match &agreed {
            None => agreed = Some(key),
            Some(a) => assert_eq!(a, &key, "rank {} disagrees", x.rank),
        }
    }
    r
}

fn ranks_in_text(t: &str) -> Vec<usize> {
    t.split(',')
        .filter(|x| !x.is_empty())
        .map(|x| x.parse().unwrap())
        .collect()
}

macro_rules! case {
    ($name:ident, $k:expr) => {
        #[test]
        fn $name() {
            const NAME: &str = stringify!($name);
            let k: Case = $k;
            if (k.fault.is_some() && !debug_hooks(NAME)) || !parent_ready(NAME, shrink_body) {
                return;
            }
            run(NAME, k);
        }
    };
}

case!(
    a_middle_rank_killed_in_an_all_reduce_is_shrunk_away,
    Case { ..KILL }
);
case!(
    rank_0_killed_in_a_broadcast_is_shrunk_away,
    Case {
        op: "broadcast",
        victims: "0",
        ..KILL
    }
);
case!(
    the_last_rank_killed_in_a_sendrecv_is_shrunk_away,
    Case {
        op: "sendrecv",
        victims: "3",
        ..KILL
    }
);
case!(
    two_ranks_killed_at_once_are_shrunk_away,
    Case {
        n: 5,
        victims: "1,3",
        ..KILL
    }
);
case!(
    a_rank_lost_inside_the_shrink_is_dropped_too,
    Case {
        n: 5,
        fault: Some((4, "exit-in-shrink")),
        ..KILL
    }
);
case!(
    a_coordinator_lost_after_its_decision_is_dropped_too,
    Case {
        fault: Some((0, "exit-after-decide")),
        ..KILL
    }
);
// Killed while it sends GO (the test hook: after the first): one member holds the decision,
// the other only its pledge. The holder fails to meet the dead coordinator and agrees again;
// its next attempt's INVITE brings the pledged one along (before, in the VM: the holder went
// on alone and the other was left behind, the finding).
case!(
    a_coordinator_lost_while_it_sends_go_is_dropped_too,
    Case {
        fault: Some((0, "exit-while-go")),
        ..KILL
    }
);
case!(
    a_group_shrinks_twice,
    Case {
        n: 5,
        victims: "1",
        later: "4",
        ..KILL
    }
);

/// Rank 0 coordinates the shrink after rank 2 is killed, then stalls for three timeouts right
/// after its decision (the test hook). Ranks 1 and 3 give up on it and go on as a group of
/// their own; woken, rank 0 decides again and is told that its members went on without it:
/// it is refused, named, and forms no group of one (before, it dropped them and went on alone).
#[test]
fn a_coordinator_stalled_after_its_decision_is_left_out_not_alone() {
    const NAME: &str = "a_coordinator_stalled_after_its_decision_is_left_out_not_alone";
    if !debug_hooks(NAME) || !parent_ready(NAME, shrink_body) {
        return;
    }
    if require_rdma() {
        println!("SKIPPED: the agreement is the transports' alike; the host runs it");
        return;
    }
    let r = run(
        NAME,
        Case {
            fault: Some((0, "stall-after-decide")),
            linger: true,
            ..KILL
        },
    );
    let x = &r[0];
    assert!(
        x.output.contains("SHRINK REFUSED") && x.output.contains("left out"),
        "rank 0: {}",
        x.output
    );
}

/// The survivors carry their connections to each other into the shrunk group (TCP connections
/// on the host, queue pairs over RDMA in the VM), drained of what the failed all_reduce left in
/// flight (half a megabyte a step: its results after the shrink are checked, as in every case,
/// against a scalar re-computation).
#[test]
fn survivors_carry_their_connections_over() {
    const NAME: &str = "survivors_carry_their_connections_over";
    if !parent_ready(NAME, shrink_body) {
        return;
    }
    let tcp = std::env::var("RDMACOMM_TRANSPORT").map_or(true, |t| t == "tcp");
    if net() != Net::Env || !(tcp || require_rdma()) {
        println!("SKIPPED: TCP connections or RDMA queue pairs only");
        return;
    }
    let r = run(
        NAME,
        Case {
            debug: true,
            ..KILL
        },
    );
    for x in r.iter().filter(|x| x.rank != 2) {
        let line = x
            .output
            .lines()
            .find(|l| l.contains(" connection(s) carried over"))
            .unwrap_or_else(|| panic!("rank {}: {}", x.rank, x.output));
        let at = line.find(" connection(s) carried over").unwrap();
        let carried: usize = line[..at]
            .split_whitespace()
            .last()
            .unwrap()
            .parse()
            .unwrap();
        // Halving-doubling on 4 ranks connected each survivor to another survivor.
        assert!(carried >= 1, "rank {}: {line}", x.rank);
    }
}

#[test]
fn a_stopped_rank_is_left_out_and_refused_when_it_wakes() {
    const NAME: &str = "a_stopped_rank_is_left_out_and_refused_when_it_wakes";
    if !parent_ready(NAME, shrink_body) {
        return;
    }
    let r = run(
        NAME,
        Case {
            how: "stop",
            ..KILL
        },
    );
    // Woken after the others shrank: its operation fails and its shrink is refused, named.
    let x = &r[2];
    assert_eq!(x.code, Some(4), "{}", x.output);
    // The error names the rank that told it so.
    assert!(
        x.output.contains("SHRINK REFUSED") && x.output.contains("(named: Some("),
        "{}",
        x.output
    );
}

#[test]
fn a_stopped_rank_0_is_left_out_not_alone_when_it_wakes() {
    const NAME: &str = "a_stopped_rank_0_is_left_out_not_alone_when_it_wakes";
    if !parent_ready(NAME, shrink_body) {
        return;
    }
    // Rank 0 is the lowest rank: woken, it would coordinate; it must find that the others
    // went on without it (their old ports answer), not go on as a group of one.
    let r = run(
        NAME,
        Case {
            n: 3,
            victims: "0",
            how: "stop",
            ..KILL
        },
    );
    let x = &r[0];
    assert_eq!(x.code, Some(4), "{}", x.output);
    assert!(
        x.output.contains("SHRINK REFUSED")
            && x.output.contains("left out")
            && x.output.contains("(named: Some("),
        "{}",
        x.output
    );
}

case!(
    a_replacement_for_a_middle_rank_rejoins,
    Case {
        how: "replace",
        grow: true,
        ..KILL
    }
);
case!(
    a_replacement_for_rank_0_rejoins_through_the_coordinator_file,
    Case {
        victims: "0",
        how: "replace",
        grow: true,
        file: true,
        ..KILL
    }
);

case!(
    a_group_shrinks_grows_and_shrinks_again,
    Case {
        later: "1",
        how: "replace",
        grow: true,
        ..KILL
    }
);

/// Rank 3 of 4 dies: the subgroup it was in ({1, 3}, from `split_comm`) shrinks to rank 1
/// alone, the other ({0, 2}) goes on untouched, and the world shrinks to ranks 0-2.
fn subgroup_body() {
    let (r, _) = rank_size();
    let world = Comm::from_env().unwrap();
    let sub = world.split_comm((r % 2) as i32, r as i32).unwrap();
    let sum = |c: &Comm, x: f64| -> rdmacomm::Result<f64> {
        let mut v = x.to_le_bytes();
        c.all_reduce(AllReduce::Sum, DType::f64, &mut v)?;
        Ok(f64::from_le_bytes(v))
    };
    assert_eq!(
        sum(&sub, r as f64).unwrap(),
        if r % 2 == 0 { 2.0 } else { 4.0 }
    );
    if r == 3 {
        // SAFETY: kill(2) on this process; no memory is involved.
        unsafe { libc::kill(std::process::id() as i32, libc::SIGKILL) };
    }
    // The odd subgroup's op fails on rank 1; the even one's succeeds.
    let sub = match sum(&sub, 10.0 + r as f64) {
        Ok(x) => {
            assert_eq!(x, 22.0, "the even subgroup: ranks 0 and 2");
            sub
        }
        Err(e) => {
            println!("SUBGROUP FAILED: {e}");
            let (s, a) = sub.shrink(0).unwrap();
            assert_eq!(a.members, vec![0], "rank 1 alone of the odd subgroup");
            assert_eq!(sum(&s, 5.0).unwrap(), 5.0);
            s
        }
    };
    let world = match sum(&world, 1.0) {
        Ok(_) => panic!("the world lost rank 3"),
        Err(_) => world.shrink(0).unwrap().0,
    };
    assert_eq!(sum(&world, r as f64).unwrap(), 3.0, "ranks 0, 1, 2");
    println!("DONE sub {} world {}", sub.size(), world.size());
}

#[test]
fn a_subgroup_that_lost_a_member_shrinks_too() {
    const NAME: &str = "a_subgroup_that_lost_a_member_shrinks_too";
    if !parent_ready(NAME, subgroup_body) {
        return;
    }
    let r = spawn(
        NAME,
        4,
        Placement::Local,
        &|_| vec![("RDMACOMM_TIMEOUT".to_string(), timeout_s().to_string())],
        Duration::from_secs(60),
    );
    for x in r.iter().filter(|x| x.rank != 3) {
        assert_eq!(x.code, Some(0), "rank {}: {}", x.rank, x.output);
        let sub = if x.rank == 1 { 1 } else { 2 };
        assert!(
            x.output.contains(&format!("DONE sub {sub} world 3")),
            "rank {}: {}",
            x.rank,
            x.output
        );
    }
}

matrix_shm!(
    a_middle_rank_killed_in_an_all_reduce_is_shrunk_away,
    rank_0_killed_in_a_broadcast_is_shrunk_away,
    the_last_rank_killed_in_a_sendrecv_is_shrunk_away,
    two_ranks_killed_at_once_are_shrunk_away,
    a_subgroup_that_lost_a_member_shrinks_too,
    a_grow_one_member_fails_is_undone_on_every_member,
    a_coordinator_lost_after_its_decision_is_dropped_too,
);

/// The members grow by one; a newcomer comes (`GROW_NEWCOMER`, started by rank 0) or not, and
/// with the test hook `grow-unmet` the last member fails after the others met the grown group.
/// Every member fails alike and goes on with the old communicator (an all_reduce there,
/// checked against a scalar sum); the newcomer's first operation fails.
fn failed_grow_body() {
    let (r, n) = rank_size();
    if var("ELASTIC_NEWCOMER") == "1" {
        let c = Comm::rejoin_from_env().unwrap();
        let mut b = [0u8; 8];
        let went_on = c.broadcast(0, &mut b);
        println!(
            "NEWCOMER {} as rank {}: {went_on:?}",
            if went_on.is_err() {
                "REFUSED"
            } else {
                "WENT ON"
            },
            c.rank()
        );
        return;
    }
    let c = Comm::from_env().unwrap();
    if r == 0 && var("GROW_NEWCOMER") == "1" {
        std::process::Command::new(std::env::current_exe().unwrap())
            .args(std::env::args().skip(1))
            .env("ELASTIC_NEWCOMER", "1")
            .spawn()
            .map(std::mem::forget) // it outlives this call; it ends on its own
            .unwrap();
    }
    let t0 = Instant::now();
    match c.grow(1) {
        Ok(g) => panic!("rank {r}: the grow went on as {} ranks", g.size()),
        Err(e) => println!("GROW FAILED in {:.3}s: {e}", t0.elapsed().as_secs_f64()),
    }
    let mut v = (r as f64 + 1.0).to_le_bytes();
    c.all_reduce(AllReduce::Sum, DType::f64, &mut v).unwrap();
    assert_eq!(f64::from_le_bytes(v), (n * (n + 1) / 2) as f64);
    println!("DONE the old group of {n}");
}

fn failed_grow(name: &str, newcomer: bool) -> Vec<RankResult> {
    spawn(
        name,
        3,
        Placement::Local,
        &|_| {
            vec![
                ("RDMACOMM_TIMEOUT".to_string(), timeout_s().to_string()),
                ("RDMACOMM_TEST_FAULT".into(), "grow-unmet".into()),
                (
                    "GROW_NEWCOMER".into(),
                    if newcomer { "1" } else { "0" }.into(),
                ),
            ]
        },
        Duration::from_secs(60),
    )
}

/// Grow's commit loses its coordinator: rank 0 dies right after its decision went out (the
/// test hook). The other members agree without it that the grow is undone, each failing with
/// rank 0 named; their shrink of the old communicator then gives ranks 1 and 2 a group (an
/// all_reduce there, checked against a scalar sum). No member goes on grown.
#[test]
fn a_coordinator_lost_in_a_grows_commit_leaves_every_member_undone() {
    const NAME: &str = "a_coordinator_lost_in_a_grows_commit_leaves_every_member_undone";
    if !debug_hooks(NAME) || !parent_ready(NAME, lost_commit_body) {
        return;
    }
    if require_rdma() {
        println!("SKIPPED: the commit is the transports' alike; the host runs it");
        return;
    }
    let r = spawn(
        NAME,
        3,
        Placement::Local,
        &|rank| {
            let mut v = vec![
                ("RDMACOMM_TIMEOUT".to_string(), timeout_s().to_string()),
                ("GROW_NEWCOMER".into(), "1".into()),
            ];
            if rank == 0 {
                v.push(("RDMACOMM_TEST_FAULT".into(), "exit-after-decide".into()));
            }
            v
        },
        Duration::from_secs(90),
    );
    assert_ne!(r[0].code, Some(0), "rank 0 lives on: {}", r[0].output);
    for x in &r[1..] {
        assert_eq!(x.code, Some(0), "rank {}: {}", x.rank, x.output);
        assert!(
            x.output.contains("GROW UNDONE")
                && x.output.contains("rank(s) [0]")
                && x.output.contains("DONE the shrunk group of [1, 2]"),
            "rank {}: {}",
            x.rank,
            x.output
        );
    }
}

/// Rank 0 starts a newcomer and all grow by one; a member whose grow fails shrinks the old
/// communicator and checks an all_reduce there.
fn lost_commit_body() {
    let (r, _) = rank_size();
    if var("ELASTIC_NEWCOMER") == "1" {
        // Its grown group lost rank 0 and was dropped by the others: its first operation fails.
        let c = Comm::rejoin_from_env().unwrap();
        let mut b = [0u8; 8];
        println!("NEWCOMER: {:?}", c.broadcast(0, &mut b));
        return;
    }
    let c = Comm::from_env().unwrap();
    if r == 0 {
        std::process::Command::new(std::env::current_exe().unwrap())
            .args(std::env::args().skip(1))
            .env("ELASTIC_NEWCOMER", "1")
            .env_remove("RDMACOMM_TEST_FAULT")
            .spawn()
            .map(std::mem::forget) // it outlives this call; it ends on its own
            .unwrap();
    }
    match c.grow(1) {
        Ok(g) => panic!("rank {r}: the grow went on as {} ranks", g.size()),
        Err(e) => println!("GROW UNDONE: {e}"),
    }
    let (s, agreed) = c.shrink(0).unwrap();
    let mut v = (r as f64 + 1.0).to_le_bytes();
    s.all_reduce(AllReduce::Sum, DType::f64, &mut v).unwrap();
    let want: usize = agreed.members.iter().map(|q| q + 1).sum();
    assert_eq!(f64::from_le_bytes(v), want as f64);
    println!("DONE the shrunk group of {:?}", agreed.members);
}

/// A grow no newcomer comes to fails on every member at once: the group goes on (before, rank 0
/// returned a timeout after the others, whose next operation could time out on it).
#[test]
fn a_grow_no_newcomer_comes_to_fails_on_every_member_and_the_group_goes_on() {
    const NAME: &str = "a_grow_no_newcomer_comes_to_fails_on_every_member_and_the_group_goes_on";
    if !parent_ready(NAME, failed_grow_body) {
        return;
    }
    for x in failed_grow(NAME, false) {
        assert_eq!(x.code, Some(0), "rank {}: {}", x.rank, x.output);
        assert!(
            x.output.contains("GROW FAILED") && x.output.contains("DONE the old group of 3"),
            "rank {}: {}",
            x.rank,
            x.output
        );
        // Its bound (`Comm::grow`): the timeout the newcomers are awaited, and a margin.
        let l = tagged(&x.output, "GROW FAILED in ")[0];
        let secs: f64 = l["GROW FAILED in ".len()..]
            .split('s')
            .next()
            .and_then(|x| x.parse().ok())
            .unwrap();
        let bound = timeout_s() as f64 * 1.5;
        assert!(
            secs < bound,
            "rank {}: {secs} s, over {bound} s: {l}",
            x.rank
        );
    }
}

/// Grow's commit: a member that fails after the others met the grown group (the test hook on
/// the last member) undoes the grow on every member; none goes on grown.
#[test]
fn a_grow_one_member_fails_is_undone_on_every_member() {
    const NAME: &str = "a_grow_one_member_fails_is_undone_on_every_member";
    if !debug_hooks(NAME) || !parent_ready(NAME, failed_grow_body) {
        return;
    }
    let r = failed_grow(NAME, true);
    for x in &r {
        assert_eq!(x.code, Some(0), "rank {}: {}", x.rank, x.output);
        assert!(
            x.output.contains("did not meet the grown group")
                && x.output.contains("DONE the old group of 3"),
            "rank {}: {}",
            x.rank,
            x.output
        );
    }
    // The newcomer shares rank 0's output.
    assert!(r[0].output.contains("NEWCOMER REFUSED"), "{}", r[0].output);
}
