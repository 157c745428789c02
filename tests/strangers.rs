//! Nobody uninvited: connections that are not a rank of this job (garbage, a truncated hello,
//! idle connections, a rank of another job or world size, a wrong secret) are ignored while the
//! real job's rendezvous completes; a shared secret keeps out whoever lacks it; IPv6 loopback
//! works; a world past the protocol's bound is refused by name.

mod common;
use common::*;
use rdmacomm::{AllReduce, Comm, Communicator, Config, DType};
use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// A real rank: joins (the non-zero ranks after `RXE_TEST_DELAY_MS`), all-reduces, checks.
fn job_body() {
    let (r, n) = rank_size();
    if r > 0 {
        let ms = std::env::var("RXE_TEST_DELAY_MS").map_or(0, |v| v.parse().unwrap());
        std::thread::sleep(Duration::from_millis(ms));
    }
    let c = match Comm::from_env() {
        Ok(c) => c,
        Err(e) => {
            println!("RESULT rank {r}: ERROR: {e}");
            std::process::exit(3);
        }
    };
    let mut d: Vec<u8> = (0..1024)
        .flat_map(|i| ((r * 1000 + i) as f32).to_le_bytes())
        .collect();
    c.all_reduce(AllReduce::Sum, DType::f32, &mut d).unwrap();
    for (i, b) in d.chunks(4).enumerate() {
        let want: f32 = (0..n).map(|q| (q * 1000 + i) as f32).sum();
        assert_eq!(
            f32::from_le_bytes(b.try_into().unwrap()),
            want,
            "element {i}"
        );
    }
    println!("RESULT rank {r}: JOINED and checked");
}

/// Connects to `port` until it answers (rank 0 may not listen yet), for up to 20 s.
fn reach(port: u16) -> TcpStream {
    let t0 = Instant::now();
    loop {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => return s,
            Err(_) if t0.elapsed() < Duration::from_secs(20) => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) => panic!("the coordinator never listened: {e}"),
        }
    }
}

#[test]
fn strangers_are_ignored_and_the_job_completes() {
    let name = "strangers_are_ignored_and_the_job_completes";
    if !parent_ready(name, job_body) {
        return;
    }
    let port = free_port();
    let coord = format!("127.0.0.1:{port}");
    // Before the real ranks join: garbage, a truncated hello, and four idle connections held
    // open through the rendezvous (with a 12 s timeout, idle ones taken one at a time starved
    // the real ranks before).
    let strangers = std::thread::spawn(move || {
        let mut idle = Vec::new();
        let mut g = reach(port);
        let _ = g.write_all(&[0x02, 0, 0, 0, 0x01, 0]);
        drop(g);
        let mut t = reach(port);
        let _ = t.write_all(&[100, 0, 0, 0, 1, 0x43, 0x4d]);
        drop(t);
        for _ in 0..4 {
            idle.push(reach(port));
        }
        std::thread::sleep(Duration::from_secs(6));
        drop(idle);
    });
    let job = |r: usize| {
        vec![
            ("RDMACOMM_COORDINATOR".to_string(), coord.clone()),
            ("RDMACOMM_TIMEOUT".to_string(), "12".to_string()),
            ("RDMACOMM_JOB_ID".to_string(), "ours".to_string()),
            (
                "RXE_TEST_DELAY_MS".to_string(),
                if r == 1 { "500" } else { "1500" }.to_string(),
            ),
        ]
    };
    // A rank of another job, and one of another job with another world size, on the same port.
    let other = std::thread::spawn({
        let coord = coord.clone();
        move || {
            let env = |world: &str| {
                let coord = coord.clone();
                let world = world.to_string();
                move |_r: usize| {
                    vec![
                        ("RDMACOMM_COORDINATOR".to_string(), coord.clone()),
                        ("RDMACOMM_TIMEOUT".to_string(), "12".to_string()),
                        ("RDMACOMM_JOB_ID".to_string(), "theirs".to_string()),
                        ("RDMACOMM_RANK".to_string(), "1".to_string()),
                        ("RDMACOMM_WORLD_SIZE".to_string(), world.clone()),
                    ]
                }
            };
            let a = spawn(
                name,
                1,
                Placement::Local,
                &env("3"),
                Duration::from_secs(60),
            );
            let b = spawn(
                name,
                1,
                Placement::Local,
                &env("5"),
                Duration::from_secs(60),
            );
            (a, b)
        }
    });
    let t0 = Instant::now();
    let res = spawn(name, 3, Placement::Local, &job, Duration::from_secs(60));
    strangers.join().unwrap();
    let (a, b) = other.join().unwrap();
    assert_all_ok(&res);
    for x in &res {
        assert!(x.output.contains("JOINED and checked"), "{}", x.output);
    }
    let rank0 = &res[0].output;
    assert!(
        rank0.contains("ignored a connection to the rendezvous"),
        "strangers are said on stderr: {rank0}"
    );
    for x in a.iter().chain(b.iter()) {
        assert!(
            x.output.contains("another job"),
            "the other job's rank is told: {}",
            x.output
        );
    }
    println!(
        "the job completed in {:.1}s beside garbage, a truncated hello, 4 idle connections and 2 \
         ranks of another job",
        t0.elapsed().as_secs_f64()
    );
}

#[test]
fn a_shared_secret_keeps_out_whoever_lacks_it() {
    let name = "a_shared_secret_keeps_out_whoever_lacks_it";
    if !parent_ready(name, job_body) {
        return;
    }
    let port = free_port();
    let coord = format!("127.0.0.1:{port}");
    let dir = std::env::temp_dir().join(format!("rdmacomm-secret-{port}"));
    std::fs::write(&dir, "s3cret\n").unwrap();
    // The real job: a secret file on one rank, the same secret inline on the others.
    let job = |r: usize| {
        let mut v = vec![
            ("RDMACOMM_COORDINATOR".to_string(), coord.clone()),
            ("RDMACOMM_TIMEOUT".to_string(), "10".to_string()),
            ("RXE_TEST_DELAY_MS".to_string(), "1000".to_string()),
        ];
        if r == 1 {
            v.push(("RDMACOMM_SECRET_FILE".into(), dir.display().to_string()));
        } else {
            v.push(("RDMACOMM_SECRET".into(), "s3cret".into()));
        }
        v
    };
    // Someone with the right rank and world size but the wrong secret, first in line.
    let intruder = std::thread::spawn({
        let coord = coord.clone();
        move || {
            std::thread::sleep(Duration::from_millis(300));
            spawn(
                name,
                1,
                Placement::Local,
                &|_| {
                    vec![
                        ("RDMACOMM_COORDINATOR".to_string(), coord.clone()),
                        ("RDMACOMM_TIMEOUT".to_string(), "10".to_string()),
                        ("RDMACOMM_SECRET".to_string(), "guess".to_string()),
                        ("RDMACOMM_RANK".to_string(), "2".to_string()),
                        ("RDMACOMM_WORLD_SIZE".to_string(), "3".to_string()),
                    ]
                },
                Duration::from_secs(60),
            )
        }
    });
    let res = spawn(name, 3, Placement::Local, &job, Duration::from_secs(60));
    let bad = intruder.join().unwrap();
    let _ = std::fs::remove_file(&dir);
    assert_all_ok(&res);
    assert!(
        bad[0].output.contains("authentication failed"),
        "the intruder is refused: {}",
        bad[0].output
    );
    assert!(
        res[0].output.contains("failed authentication"),
        "{}",
        res[0].output
    );
}

#[test]
fn ipv6_loopback_works() {
    let name = "ipv6_loopback_works";
    if !parent_ready(name, job_body) {
        return;
    }
    if std::net::TcpListener::bind("[::1]:0").is_err() {
        eprintln!("SKIPPED: no IPv6 loopback here");
        return;
    }
    let port = free_port();
    let res = spawn(
        name,
        2,
        Placement::Local,
        &|_| {
            vec![
                ("RDMACOMM_COORDINATOR".to_string(), String::new()),
                ("MASTER_ADDR".to_string(), "::1".to_string()),
                ("MASTER_PORT".to_string(), port.to_string()),
                ("RDMACOMM_TIMEOUT".to_string(), "20".to_string()),
            ]
        },
        Duration::from_secs(60),
    );
    assert_all_ok(&res);
}

#[test]
fn a_world_past_the_bound_is_refused_by_name() {
    let e = Config::new(0, (1 << 14) + 1, "127.0.0.1:1")
        .unwrap_err()
        .to_string();
    assert!(e.contains("more than rdmacomm supports (16384"), "{e}");
}

/// Open file descriptors of this process.
fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// In a process of its own (other tests' threads open descriptors meanwhile): fifty failed
/// rendezvous, alternately as rank 0 whose rank 1 never comes and as a rank 1 whose rank 0
/// never listens. Over RDMA (the VM stage) each attempt opens the device, registers memory and
/// creates queue pairs before it meets anyone; over TCP, listeners and sockets.
fn leak_body() {
    let attempt = |rank: usize| {
        let port = free_port();
        let mut cfg = Config::new(rank, 2, format!("127.0.0.1:{port}")).unwrap();
        cfg.timeout = Duration::from_millis(150);
        assert!(Comm::new(&cfg).is_err(), "rank {rank} joined nobody");
    };
    attempt(0);
    attempt(1);
    let before = fds();
    for i in 0..50 {
        attempt(i % 2);
    }
    let after = fds();
    assert_eq!(
        after, before,
        "descriptors left behind by 50 failed rendezvous"
    );
    println!("50 failed rendezvous: {before} descriptors before, {after} after");
}

#[test]
fn fifty_failed_rendezvous_leave_nothing_behind() {
    let name = "fifty_failed_rendezvous_leave_nothing_behind";
    if !parent_ready(name, leak_body) {
        return;
    }
    assert_all_ok(&spawn(
        name,
        1,
        Placement::Local,
        &|_| vec![],
        Duration::from_secs(60),
    ));
}
