//! Bootstrap failures end in clear errors on every rank that waited, never a hang: a rank that
//! never joins, a world-size mismatch, a duplicated rank, a coordinator port already in use.
//! Also: launcher variables are read in the documented order.

mod common;
use common::*;
use rdmacomm::{Comm, Communicator, Config};
use std::time::{Duration, Instant};

/// A rank: join, print the outcome, exit 0 on success and 3 on error.
fn join_body() {
    let t0 = Instant::now();
    match Comm::from_env() {
        Ok(c) => {
            println!("JOINED rank {} of {}", c.rank(), c.size());
        }
        Err(e) => {
            println!("ERROR after {:.1}s: {e}", t0.elapsed().as_secs_f64());
            std::process::exit(3);
        }
    }
}

fn short() -> Vec<(String, String)> {
    vec![("RDMACOMM_TIMEOUT".into(), "4".into())]
}

#[test]
fn missing_rank_is_named_on_every_waiting_rank() {
    if !parent_ready("missing_rank_is_named_on_every_waiting_rank", join_body) {
        return;
    }
    // World of 3, only ranks 0 and 1 started.
    let r = spawn(
        "missing_rank_is_named_on_every_waiting_rank",
        2,
        Placement::Local,
        &|_| {
            let mut v = short();
            v.push(("RDMACOMM_WORLD_SIZE".into(), "3".into()));
            v
        },
        Duration::from_secs(60),
    );
    for x in &r {
        assert_eq!(x.code, Some(3), "rank {} should fail: {}", x.rank, x.output);
        assert!(
            x.output.contains("rank(s) [2] of 3 never joined"),
            "rank {}: {}",
            x.rank,
            x.output
        );
    }
}

#[test]
fn world_size_mismatch_is_refused() {
    if !parent_ready("world_size_mismatch_is_refused", join_body) {
        return;
    }
    let r = spawn(
        "world_size_mismatch_is_refused",
        2,
        Placement::Local,
        &|rank| {
            let mut v = short();
            if rank == 1 {
                v.push(("RDMACOMM_WORLD_SIZE".into(), "3".into()));
            }
            v
        },
        Duration::from_secs(60),
    );
    for x in &r {
        assert_eq!(x.code, Some(3), "rank {}: {}", x.rank, x.output);
        assert!(
            x.output.contains("world size mismatch: rank 1"),
            "rank {}: {}",
            x.rank,
            x.output
        );
    }
}

#[test]
fn tcp_chunk_mismatch_is_refused() {
    if is_child("tcp_chunk_mismatch_is_refused") {
        return join_body();
    }
    let r = spawn(
        "tcp_chunk_mismatch_is_refused",
        2,
        Placement::Local,
        &|rank| {
            let mut v = short();
            v.push(("RDMACOMM_TRANSPORT".into(), "tcp".into()));
            if rank == 1 {
                v.push(("RDMACOMM_TCP_CHUNK".into(), "131072".into()));
            }
            v
        },
        Duration::from_secs(60),
    );
    for x in &r {
        assert_eq!(x.code, Some(3), "rank {}: {}", x.rank, x.output);
        assert!(
            x.output.contains("RDMACOMM_TCP_CHUNK=")
                && x.output.contains("set it alike everywhere"),
            "rank {}: {}",
            x.rank,
            x.output
        );
    }
}

#[test]
fn duplicated_rank_is_refused() {
    if !parent_ready("duplicated_rank_is_refused", join_body) {
        return;
    }
    // Three processes for a world of 3, but two of them claim rank 1.
    let r = spawn(
        "duplicated_rank_is_refused",
        3,
        Placement::Local,
        &|rank| {
            // The conflict is found when the second rank 1 arrives, not at a timeout: a long
            // one leaves a slow emulated machine time to start all three processes.
            let mut v = vec![("RDMACOMM_TIMEOUT".into(), "20".into())];
            if rank == 2 {
                v.push(("RDMACOMM_RANK".into(), "1".into()));
            }
            v
        },
        Duration::from_secs(60),
    );
    assert_eq!(r[0].code, Some(3), "{}", r[0].output);
    assert!(
        r[0].output.contains("rank 1 joined twice"),
        "{}",
        r[0].output
    );
    for x in &r[1..] {
        assert_eq!(
            x.code,
            Some(3),
            "rank {} must fail too: {}",
            x.rank,
            x.output
        );
    }
}

#[test]
fn coordinator_port_in_use_is_named() {
    if !parent_ready("coordinator_port_in_use_is_named", join_body) {
        return;
    }
    let port = free_port();
    let _hold = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
    let r = spawn(
        "coordinator_port_in_use_is_named",
        2,
        Placement::Local,
        &|_| {
            let mut v = short();
            v.push(("RDMACOMM_COORDINATOR".into(), format!("127.0.0.1:{port}")));
            v
        },
        Duration::from_secs(60),
    );
    assert_eq!(r[0].code, Some(3));
    assert!(r[0].output.contains("already in use"), "{}", r[0].output);
    assert_eq!(r[1].code, Some(3), "rank 1 must not hang: {}", r[1].output);
}

// ---- configuration from the environment (host-only: no device needed) ----

fn with_env(vars: &[(&str, &str)], f: impl FnOnce()) {
    // Tests in this binary run in one process: no child is spawned while the environment is
    // edited (see ENV_LOCK).
    let _g = ENV_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let keys = [
        "RDMACOMM_RANK",
        "RDMACOMM_WORLD_SIZE",
        "RANK",
        "WORLD_SIZE",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "PMI_RANK",
        "PMI_SIZE",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "MASTER_ADDR",
        "MASTER_PORT",
        "RDMACOMM_COORDINATOR",
        "RDMACOMM_TIMEOUT",
        "RDMACOMM_TCP_CHUNK",
        "RDMACOMM_PIN",
    ];
    let saved: Vec<_> = keys.iter().map(|k| (k, std::env::var(k).ok())).collect();
    for k in keys {
        std::env::remove_var(k);
    }
    for (k, v) in vars {
        std::env::set_var(k, v);
    }
    f();
    for (k, v) in saved {
        match v {
            Some(v) => std::env::set_var(k, v),
            None => std::env::remove_var(k),
        }
    }
}

#[test]
fn launcher_variables_in_documented_order() {
    with_env(
        &[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "10.1.2.3"),
        ],
        || {
            let c = Config::from_env().unwrap();
            assert_eq!(
                (c.rank, c.world_size, c.coordinator.as_str()),
                (2, 4, "10.1.2.3:29500")
            );
        },
    );
    with_env(
        &[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("RDMACOMM_COORDINATOR", "h:7"),
        ],
        || {
            let c = Config::from_env().unwrap();
            assert_eq!(
                (c.rank, c.world_size, c.coordinator.as_str()),
                (1, 2, "h:7")
            );
        },
    );
    with_env(
        &[
            ("PMI_RANK", "0"),
            ("PMI_SIZE", "3"),
            ("MASTER_ADDR", "a"),
            ("MASTER_PORT", "9"),
        ],
        || {
            let c = Config::from_env().unwrap();
            assert_eq!(
                (c.rank, c.world_size, c.coordinator.as_str()),
                (0, 3, "a:9")
            );
        },
    );
    with_env(&[], || {
        let c = Config::from_env().unwrap();
        assert_eq!(
            (c.rank, c.world_size),
            (0, 1),
            "no launcher: a world of one"
        );
    });
}

#[test]
fn bad_configuration_says_what_to_fix() {
    let cases: &[(&[(&str, &str)], &str)] = &[
        (
            &[("RANK", "4"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "x")],
            "rank 4 is out of range for world size 4",
        ),
        (
            &[("RANK", "0"), ("WORLD_SIZE", "2")],
            "set RDMACOMM_COORDINATOR=host:port or MASTER_ADDR",
        ),
        (&[("RANK", "0")], "RANK is set but WORLD_SIZE is not"),
        (
            &[("RDMACOMM_TCP_CHUNK", "100")],
            "RDMACOMM_TCP_CHUNK=100: must be a multiple of 64 between 4096 and 16 MiB",
        ),
        (
            &[("RDMACOMM_PIN", "0,x")],
            "RDMACOMM_PIN=0,x: use off, auto, or core ids",
        ),
        (
            &[("RDMACOMM_PIN", "99999")],
            "core 99999 is not one this process may run on",
        ),
        (&[("RDMACOMM_TIMEOUT", "soon")], "RDMACOMM_TIMEOUT"),
    ];
    for (vars, want) in cases {
        with_env(vars, || {
            let e = Config::from_env().unwrap_err().to_string();
            assert!(e.contains(want), "{vars:?}: {e}");
        });
    }
}

#[test]
fn world_of_one_needs_no_device() {
    let cfg = Config::new(0, 1, "").unwrap();
    let c = Comm::new(&cfg).unwrap();
    let mut d = 1.5f32.to_le_bytes();
    c.all_reduce(rdmacomm::AllReduce::Sum, rdmacomm::DType::f32, &mut d)
        .unwrap();
    assert_eq!(f32::from_le_bytes(d), 1.5);
    let mut out = [0u8; 3];
    c.all_gather(&[1, 2, 3], &mut out).unwrap();
    assert_eq!(out, [1, 2, 3]);
    assert!(c.send(0, &[1]).unwrap_err().to_string().contains("itself"));
    assert!(c
        .recv(1, &mut [0])
        .unwrap_err()
        .to_string()
        .contains("out of range"));
}

#[test]
fn no_device_is_a_clear_error() {
    // On the host (no RDMA in the kernel) a world of 2 fails at once, saying why.
    if rdmacomm::unstable::verbs::list_ports().is_ok() {
        eprintln!("SKIPPED: this host has an RDMA device");
        return;
    }
    let mut cfg = Config::new(0, 2, "127.0.0.1:1").unwrap();
    cfg.transport = rdmacomm::config::TransportKind::Rdma;
    let e = Comm::new(&cfg)
        .err()
        .expect("must fail without a device")
        .to_string();
    assert!(e.starts_with("no usable RDMA device: "), "{e}");
}

// ---- RDMACOMM_PIN: the creating thread ends up on the core its local rank was given ----

/// The calling thread's allowed cores, read from /proc (independently of the crate).
fn thread_cores() -> Vec<usize> {
    let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap();
    let mut cores = Vec::new();
    for part in line.trim().split(',') {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        cores.extend(a.parse::<usize>().unwrap()..=b.parse::<usize>().unwrap());
    }
    cores
}

fn pin_body() {
    let (r, n) = rank_size();
    let before = thread_cores();
    let want = match std::env::var("RDMACOMM_PIN").unwrap().as_str() {
        "auto" => before[r % before.len()],
        list => list.split(',').nth(r).unwrap().parse().unwrap(),
    };
    let c = Comm::from_env().unwrap();
    assert_eq!(
        thread_cores(),
        vec![want],
        "rank {r}: allowed before {before:?}"
    );
    let mut d = ((r + 1) as f32).to_le_bytes();
    c.all_reduce(rdmacomm::AllReduce::Sum, rdmacomm::DType::f32, &mut d)
        .unwrap();
    assert_eq!(f32::from_le_bytes(d), (n * (n + 1) / 2) as f32);
    println!("PINNED rank {r} to core {want}");
}

fn check_pinned(name: &str, pin: String) {
    let r = spawn(
        name,
        2,
        Placement::Local,
        &|_| vec![("RDMACOMM_PIN".into(), pin.clone())],
        Duration::from_secs(60),
    );
    for x in &r {
        assert_eq!(x.code, Some(0), "rank {}: {}", x.rank, x.output);
        assert!(x.output.contains("PINNED rank"), "{}", x.output);
    }
}

#[test]
fn pin_auto_gives_each_local_rank_its_core() {
    if is_child("pin_auto_gives_each_local_rank_its_core") {
        return pin_body();
    }
    if transport_ready() {
        check_pinned("pin_auto_gives_each_local_rank_its_core", "auto".into());
    }
}

#[test]
fn pin_list_is_followed_per_local_rank() {
    if is_child("pin_list_is_followed_per_local_rank") {
        return pin_body();
    }
    if transport_ready() {
        // Reversed: local rank 0 on the last allowed core, rank 1 on the first.
        let cores = thread_cores();
        let pin = format!("{},{}", cores[cores.len() - 1], cores[0]);
        check_pinned("pin_list_is_followed_per_local_rank", pin);
    }
}

/// Cards with a part for each rank (the `Card` shape the rendezvous still takes, though the
/// transports' cards have none): each rank gets every card's common part and its own entry, not
/// another rank's (rank 0 then sends each rank a table of its own).
#[test]
fn a_card_with_an_entry_per_rank_gives_each_rank_its_own() {
    use rdmacomm::unstable::rendezvous::{rendezvous, rendezvous_on, Card};
    let n = 3;
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let coord = l.local_addr().unwrap().to_string();
    let card = |r: usize| Card {
        common: vec![0xc0 + r as u8; 3],
        entry: 2,
        each: (0..n).flat_map(|q| [r as u8, q as u8]).collect(),
    };
    let mut l = Some(l);
    let ranks: Vec<_> = (0..n)
        .map(|r| {
            let (c, at, l) = (card(r), coord.clone(), l.take());
            std::thread::spawn(move || {
                // Not from the environment: other tests of this binary set variables meanwhile.
                let cfg = Config::defaults(r, n, at);
                let rv = match l {
                    Some(l) => rendezvous_on(&cfg, &c, Some(l)),
                    None => rendezvous(&cfg, &c),
                };
                rv.unwrap_or_else(|e| panic!("rank {r}: {e}")).cards
            })
        })
        .collect();
    for (r, h) in ranks.into_iter().enumerate() {
        let cards = h.join().unwrap();
        for (q, got) in cards.iter().enumerate() {
            let mut want = vec![0xc0 + q as u8; 3];
            want.extend_from_slice(&[q as u8, r as u8]);
            assert_eq!(got, &want, "rank {r}: rank {q}'s card");
        }
    }
}

#[test]
fn a_table_fans_out_along_a_tree_to_every_rank() {
    use rdmacomm::unstable::rendezvous::{rendezvous_on, Card};
    // 80 ranks: rank 0 writes the table to ranks 1-8, they to 9-72, rank 9 to 73-79. The
    // cards have no per-rank entries (as every transport's), so one table serves all.
    let n = 80;
    for secret in [None, Some("fan out")] {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let coord = l.local_addr().unwrap().to_string();
        let mut l = Some(l);
        let ranks: Vec<_> = (0..n)
            .map(|r| {
                let (at, l) = (coord.clone(), l.take());
                std::thread::spawn(move || {
                    let mut cfg = Config::defaults(r, n, at);
                    cfg.timeout = Duration::from_secs(60);
                    if let Some(s) = secret {
                        cfg.secret = Some(rdmacomm::config::Secret::new(s));
                    }
                    let card = Card {
                        common: format!("card of rank {r}").into_bytes(),
                        ..Card::default()
                    };
                    let rv =
                        rendezvous_on(&cfg, &card, l).unwrap_or_else(|e| panic!("rank {r}: {e}"));
                    // Kept until every rank has its table: rank 0's connections stay open.
                    rv
                })
            })
            .collect();
        let got: Vec<_> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
        for (r, rv) in got.iter().enumerate() {
            let (cards, addrs, session) = (&rv.cards, &rv.addrs, &rv.session);
            for (q, c) in cards.iter().enumerate() {
                assert_eq!(
                    c,
                    &format!("card of rank {q}").into_bytes(),
                    "rank {r}: rank {q}'s card"
                );
            }
            assert_eq!(addrs.len(), n, "rank {r}");
            assert_eq!(
                session, &got[0].session,
                "rank {r}: one session for the group"
            );
        }
    }
}

#[test]
fn a_rank_that_dies_before_passing_on_the_table_is_named_by_all() {
    const NAME: &str = "a_rank_that_dies_before_passing_on_the_table_is_named_by_all";
    if !debug_hooks(NAME) || !parent_ready(NAME, join_body) {
        return;
    }
    // Twelve ranks: rank 1 takes its table from rank 0 and is to pass it to ranks 9-11; it
    // exits first. Each rank's error names rank 1, not rank 0 nor itself. Its exit is seen at
    // once, so a long timeout costs nothing and lets twelve slow starts in the VM join.
    let r = spawn(
        NAME,
        12,
        Placement::Local,
        &|r| {
            let mut v = vec![("RDMACOMM_TIMEOUT".to_string(), "30".to_string())];
            if r == 1 {
                v.push((
                    "RDMACOMM_TEST_FAULT".into(),
                    "exit-before-passing-table".into(),
                ));
            }
            v
        },
        Duration::from_secs(60),
    );
    for x in &r {
        assert_eq!(x.code, Some(3), "rank {} should fail: {}", x.rank, x.output);
        if let Some(l) = x.output.lines().find(|l| l.contains("ERROR")) {
            println!("rank {}: {l}", x.rank);
        }
        if x.rank != 1 {
            assert!(
                x.output.contains("ERROR") && x.output.contains("rank 1 ("),
                "rank {}: {}",
                x.rank,
                x.output
            );
        }
    }
}

#[test]
fn a_rank_that_hangs_before_passing_on_the_table_is_named_below_it() {
    const NAME: &str = "a_rank_that_hangs_before_passing_on_the_table_is_named_below_it";
    if !debug_hooks(NAME) || !parent_ready(NAME, join_body) {
        return;
    }
    if require_rdma() {
        println!("SKIPPED: the bootstrap is the host's; 74 processes are too many for the VM");
        return;
    }
    // 74 ranks: rank 1 is to pass the table to ranks 9-16, and rank 9 to 73; rank 1 hangs.
    // Rank 73 waits on rank 9, which waited on rank 1: it names rank 1 too, not rank 9.
    let r = spawn(
        NAME,
        74,
        Placement::Local,
        &|r| {
            let mut v = short();
            if r == 1 {
                v.push((
                    "RDMACOMM_TEST_FAULT".into(),
                    "hang-before-passing-table".into(),
                ));
            }
            v
        },
        Duration::from_secs(90),
    );
    for x in r
        .iter()
        .filter(|x| [0, 2, 9, 16, 17, 72, 73].contains(&x.rank))
    {
        if let Some(l) = x.output.lines().find(|l| l.contains("ERROR")) {
            println!("rank {}: {l}", x.rank);
        }
    }
    for x in r.iter().filter(|x| x.rank != 1) {
        assert_eq!(x.code, Some(3), "rank {} should fail: {}", x.rank, x.output);
        assert!(
            x.output.contains("ERROR") && x.output.contains("rank 1 ("),
            "rank {}: {}",
            x.rank,
            x.output
        );
    }
}
