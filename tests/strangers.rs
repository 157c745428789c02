//! Nobody uninvited: connections that are not a rank of this job (garbage, a truncated hello,
//! idle connections, a rank of another job or world size, a wrong secret) are ignored while the
//! real job's rendezvous completes; a shared secret keeps out whoever lacks it; IPv6 loopback
//! works; a world past the protocol's bound is refused by name.

mod common;
use common::*;
use rdmacomm::{AllReduce, Comm, Communicator, Config, DType};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// A real rank: joins (the non-zero ranks after `RXE_TEST_DELAY_MS`), all-reduces, checks.
fn job_body() {
    let (r, n) = rank_size();
    if r > 0 {
        let ms = std::env::var("RXE_TEST_DELAY_MS").map_or(0, |v| v.parse().unwrap());
        std::thread::sleep(Duration::from_millis(ms));
    }
    if let Ok(gate) = std::env::var("RXE_TEST_WAIT_FILE") {
        // Not before the test says so (bounded): the rendezvous must still be open then.
        let t0 = Instant::now();
        while !std::path::Path::new(&gate).exists() && t0.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    if let Ok(n) = std::env::var("RXE_TEST_NOFILE") {
        let n: u64 = n.parse().unwrap();
        let lim = libc::rlimit {
            rlim_cur: n,
            rlim_max: n,
        };
        // SAFETY: sets this process's own descriptor limit from a valid struct.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
    }
    let asked = Instant::now();
    let joined = Comm::from_env();
    println!("JOIN-TOOK {} ms", asked.elapsed().as_millis());
    let c = match joined {
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
    // The last real rank joins only once the other job's ranks were told (they must find the
    // rendezvous open, however slowly their processes start).
    let gate = std::env::temp_dir().join(format!("rdmacomm-gate-{port}"));
    let _ = std::fs::remove_file(&gate);
    let job = |r: usize| {
        let mut v = vec![
            ("RDMACOMM_COORDINATOR".to_string(), coord.clone()),
            ("RDMACOMM_TIMEOUT".to_string(), "20".to_string()),
            ("RDMACOMM_JOB_ID".to_string(), "ours".to_string()),
            // The library logs through `log`; this installs its minimal writer (stderr).
            ("RDMACOMM_DEBUG".to_string(), "info".to_string()),
            (
                "RXE_TEST_DELAY_MS".to_string(),
                if r == 1 { "500" } else { "1500" }.to_string(),
            ),
        ];
        if r == 2 {
            v.push(("RXE_TEST_WAIT_FILE".into(), gate.display().to_string()));
        }
        v
    };
    // A rank of another job, and one of another job with another world size, on the same port.
    let other = std::thread::spawn({
        let (coord, gate) = (coord.clone(), gate.clone());
        move || {
            let env = |world: &str| {
                let coord = coord.clone();
                let world = world.to_string();
                move |_r: usize| {
                    vec![
                        ("RDMACOMM_COORDINATOR".to_string(), coord.clone()),
                        ("RDMACOMM_TIMEOUT".to_string(), "12".to_string()),
                        ("RDMACOMM_DEBUG".to_string(), "warn".to_string()),
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
            std::fs::write(&gate, b"go").unwrap();
            (a, b)
        }
    });
    let t0 = Instant::now();
    let res = spawn(name, 3, Placement::Local, &job, Duration::from_secs(60));
    strangers.join().unwrap();
    let (a, b) = other.join().unwrap();
    let _ = std::fs::remove_file(&gate);
    assert_all_ok(&res);
    for x in &res {
        assert!(x.output.contains("JOINED and checked"), "{}", x.output);
    }
    let rank0 = &res[0].output;
    assert!(
        rank0.contains("rdmacomm WARN: ignored a connection to the rendezvous"),
        "strangers are logged (RDMACOMM_DEBUG's writer, stderr): {rank0}"
    );
    // Each rank's summary of its communicator, and rank 0's of the job.
    assert!(
        rank0.contains("rdmacomm INFO: job \"ours\": 3 ranks"),
        "{rank0}"
    );
    for x in &res {
        let want = format!("rdmacomm INFO: rank {} of 3: ", x.rank);
        assert!(x.output.contains(&want), "{want}: {}", x.output);
    }
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

/// A job launched with no identity and no secret (MPICH/PMI, an MLX hostfile): a rank of another
/// such job that reaches the same coordinator, with another world size or claiming a rank
/// already in, is refused and noted, and this job completes; the launch warns once at `info`.
#[test]
fn another_anonymous_job_never_ends_this_one() {
    let name = "another_anonymous_job_never_ends_this_one";
    if !parent_ready(name, job_body) {
        return;
    }
    let port = free_port();
    let coord = format!("127.0.0.1:{port}");
    let gate = std::env::temp_dir().join(format!("rdmacomm-gate-anon-{port}"));
    let _ = std::fs::remove_file(&gate);
    let job = |r: usize| {
        let mut v = vec![
            ("RDMACOMM_COORDINATOR".to_string(), coord.clone()),
            ("RDMACOMM_TIMEOUT".to_string(), "20".to_string()),
            ("RDMACOMM_JOB_ID".to_string(), String::new()),
            ("RDMACOMM_DEBUG".to_string(), "info".to_string()),
        ];
        if r == 2 {
            v.push(("RXE_TEST_WAIT_FILE".into(), gate.display().to_string()));
        }
        v
    };
    let other = std::thread::spawn({
        let (coord, gate) = (coord.clone(), gate.clone());
        move || {
            // After this job's rank 1 is in.
            std::thread::sleep(Duration::from_secs(2));
            let env = |world: &str| {
                let (coord, world) = (coord.clone(), world.to_string());
                move |_r: usize| {
                    vec![
                        ("RDMACOMM_COORDINATOR".to_string(), coord.clone()),
                        ("RDMACOMM_TIMEOUT".to_string(), "12".to_string()),
                        ("RDMACOMM_JOB_ID".to_string(), String::new()),
                        ("RDMACOMM_RANK".to_string(), "1".to_string()),
                        ("RDMACOMM_WORLD_SIZE".to_string(), world.clone()),
                    ]
                }
            };
            let limit = Duration::from_secs(60);
            let a = spawn(name, 1, Placement::Local, &env("5"), limit);
            let b = spawn(name, 1, Placement::Local, &env("3"), limit);
            std::fs::write(&gate, b"go").unwrap();
            (a, b)
        }
    });
    let res = spawn(name, 3, Placement::Local, &job, Duration::from_secs(60));
    let (a, b) = other.join().unwrap();
    let _ = std::fs::remove_file(&gate);
    assert_all_ok(&res);
    let rank0 = &res[0].output;
    assert!(
        rank0.contains("world size mismatch") && rank0.contains("joined twice"),
        "both strangers are noted: {rank0}"
    );
    assert!(
        rank0.contains("has no identity"),
        "the launch warns: {rank0}"
    );
    for (x, why) in [(&a[0], "world size mismatch"), (&b[0], "joined twice")] {
        assert_eq!(x.code, Some(3), "{}", x.output);
        assert!(x.output.contains(why), "the stranger is told: {}", x.output);
    }
}

/// 1100 idle connections held open on rank 0's port before rank 1 comes (with a secret, and
/// rank 0's descriptor limit at 256): rank 1 still joins at once, the oldest idle ones making
/// room, and descriptor exhaustion pauses accepting instead of ending the rendezvous.
#[test]
fn idle_strangers_never_keep_a_rank_out() {
    let name = "idle_strangers_never_keep_a_rank_out";
    if !parent_ready(name, job_body) {
        return;
    }
    // With rank 0's descriptors short (accept fails), and with them plentiful (MAX_PENDING full).
    for nofile in ["256", ""] {
        idle_round(name, nofile);
    }
}

fn idle_round(name: &'static str, nofile: &'static str) {
    let port = free_port();
    let coord = format!("127.0.0.1:{port}");
    let gate = std::env::temp_dir().join(format!("rdmacomm-gate-idle-{port}"));
    let _ = std::fs::remove_file(&gate);
    let gate_s = gate.display().to_string();
    let job = move |r: usize| {
        let mut v = vec![
            ("RDMACOMM_COORDINATOR".to_string(), coord.clone()),
            ("RDMACOMM_TIMEOUT".to_string(), "20".to_string()),
            ("RDMACOMM_SECRET".to_string(), "idle-test".to_string()),
        ];
        if r == 0 && !nofile.is_empty() {
            v.push(("RXE_TEST_NOFILE".into(), nofile.into()));
        } else if r > 0 {
            v.push(("RXE_TEST_WAIT_FILE".into(), gate_s.clone()));
        }
        v
    };
    let ranks =
        std::thread::spawn(move || spawn(name, 2, Placement::Local, &job, Duration::from_secs(60)));
    let first = reach(port);
    let addr = first.peer_addr().unwrap();
    let mut idle = vec![first];
    let t0 = Instant::now();
    while idle.len() < 1100 && t0.elapsed() < Duration::from_secs(20) {
        if let Ok(s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
            idle.push(s);
        }
    }
    println!("{} idle connections held", idle.len());
    std::fs::write(&gate, b"go").unwrap();
    let res = ranks.join().unwrap();
    drop(idle);
    let _ = std::fs::remove_file(&gate);
    assert_all_ok(&res);
    let took: u64 = tagged(&res[1].output, "JOIN-TOOK ")[0]
        .trim_start_matches("JOIN-TOOK ")
        .trim_end_matches(" ms")
        .parse()
        .unwrap();
    println!("rank 1 joined in {took} ms beside them");
    assert!(took < 3000, "rank 1 took {took} ms to join");
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
            ("RDMACOMM_DEBUG".to_string(), "warn".to_string()),
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
                        ("RDMACOMM_DEBUG".to_string(), "warn".to_string()),
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
                ("RDMACOMM_DEBUG".to_string(), "warn".to_string()),
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

/// Reads one frame (length, kind, body) from `s`.
fn read_frame(s: &mut TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let mut f = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut f)?;
    Ok((f[0], f[1..].to_vec()))
}

/// Writes one frame.
fn write_frame(s: &mut TcpStream, kind: u8, body: &[u8]) {
    let mut f = ((body.len() + 1) as u32).to_le_bytes().to_vec();
    f.push(kind);
    f.extend_from_slice(body);
    s.write_all(&f).unwrap();
}

/// Plays a coordinator without the secret for one rank 1 of a world of 2: challenges it, reads
/// its hello, answers with a made-up proof, and gathers what comes after until the joiner
/// closes. Returns the hello's length and those bytes, and the joiner's output.
fn fake_coordinator(name: &str, secret: Option<&str>) -> (usize, Vec<u8>, String) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let coord = l.local_addr().unwrap().to_string();
    let secret = secret.map(str::to_string);
    let joiner = std::thread::spawn({
        let name = name.to_string();
        move || {
            let res = spawn(
                &name,
                1,
                Placement::Local,
                &|_| {
                    let mut v = vec![
                        ("RDMACOMM_COORDINATOR".to_string(), coord.clone()),
                        ("RDMACOMM_TIMEOUT".to_string(), "4".to_string()),
                        ("RDMACOMM_DEBUG".to_string(), "warn".to_string()),
                        ("RDMACOMM_RANK".to_string(), "1".to_string()),
                        ("RDMACOMM_WORLD_SIZE".to_string(), "2".to_string()),
                    ];
                    if let Some(s) = &secret {
                        v.push(("RDMACOMM_SECRET".to_string(), s.clone()));
                    }
                    v
                },
                Duration::from_secs(30),
            );
            res.into_iter().next().unwrap().output
        }
    });
    let (mut s, _) = l.accept().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write_frame(&mut s, 9, &[7u8; 32]);
    let (kind, hello) = read_frame(&mut s).unwrap();
    assert_eq!(kind, 1, "a hello");
    write_frame(&mut s, 10, &[0x55u8; 32]);
    let mut after = Vec::new();
    let _ = s.read_to_end(&mut after);
    (hello.len(), after, joiner.join().unwrap())
}

#[test]
fn a_fake_coordinator_learns_no_card() {
    let name = "a_fake_coordinator_learns_no_card";
    if !parent_ready(name, job_body) {
        return;
    }
    // Without a secret the hello carries the card (nothing to check a coordinator by); with
    // one, the card waits for a proof that a process which took rank 0's port cannot give.
    let (open, _, _) = fake_coordinator(name, None);
    let (guarded, after, out) = fake_coordinator(name, Some("s3cret"));
    assert!(
        guarded < open,
        "with a secret the hello leaves the card out: {guarded} bytes against {open} without"
    );
    assert!(after.is_empty(), "nothing follows a bad proof: {after:?}");
    assert!(
        out.contains("failed authentication") && out.contains("card was not sent"),
        "the joiner names the fake: {out}"
    );
}

#[test]
fn a_joiner_that_stops_reading_is_named_within_the_deadline() {
    use rdmacomm::unstable::rendezvous::{rendezvous, Card};
    // Rank 0 in a thread; rank 1 through a relay that passes rank 0's challenge and then stops
    // reading; ranks 2..n with cards as large as a hello may be, so that rank 1's table (every
    // rank's card) is megabytes, far past what the sockets buffer.
    let n = 64;
    // Long enough for 63 joiners to get in on a loaded emulated machine: the table is sent only
    // once all have, so a shorter wait would fail for the wrong reason.
    const TIMEOUT: Duration = Duration::from_secs(12);
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let coord = l.local_addr().unwrap().to_string();
    let cfg = |r: usize, at: &str| {
        let mut c = Config::new(r, n, at).unwrap();
        c.timeout = TIMEOUT;
        c
    };
    // Each rank's its own bytes: the table's front coding saves only what a card shares with
    // the one before.
    let big = |r: usize| Card {
        common: vec![r as u8; 80_000],
        entry: 0,
        each: Vec::new(),
    };
    let t0 = Instant::now();
    let rank0 = std::thread::spawn({
        let (c, big) = (cfg(0, &coord), big(0));
        move || rdmacomm::unstable::rendezvous::rendezvous_on(&c, &big, Some(l)).map(|_| ())
    });
    let relay = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let relay_at = relay.local_addr().unwrap().to_string();
    let relay_thread = std::thread::spawn({
        let coord = coord.clone();
        move || {
            let (mut joiner, _) = relay.accept().unwrap();
            let sock =
                socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
            sock.set_recv_buffer_size(4096).unwrap();
            let sa: std::net::SocketAddr = coord.parse().unwrap();
            sock.connect(&sa.into()).unwrap();
            let mut up: TcpStream = sock.into();
            let (kind, challenge) = read_frame(&mut up).unwrap();
            write_frame(&mut joiner, kind, &challenge);
            // The hello goes up; nothing more comes down.
            let (kind, hello) = read_frame(&mut joiner).unwrap();
            write_frame(&mut up, kind, &hello);
            std::thread::sleep(TIMEOUT + Duration::from_secs(3));
            drop((up, joiner));
        }
    });
    let mut others = Vec::new();
    for r in 1..n {
        let (c, big) = (cfg(r, if r == 1 { &relay_at } else { &coord }), big(r));
        // A rank whose table came goes on to its set-up barrier, which must fail.
        others.push(std::thread::spawn(move || {
            rendezvous(&c, &big)
                .and_then(|mut rv| rv.side.barrier())
                .err()
                .map(|e| e.to_string())
        }));
    }
    let e = rank0
        .join()
        .unwrap()
        .expect_err("rank 1 never read its table");
    let took = t0.elapsed();
    let e = e.to_string();
    assert!(e.contains("rank 1") && e.contains("stopped reading"), "{e}");
    assert!(
        took < TIMEOUT + Duration::from_secs(4),
        "rank 0 gave up after {took:?}"
    );
    // Every other rank fails too: those that took their table told why (rank 1), at once.
    let mut told = 0;
    for o in others {
        let e = o.join().unwrap().expect("no rank completes without rank 0");
        told += e.contains("stopped reading") as usize;
    }
    assert_eq!(told, n - 2, "every rank but rank 1 is told why");
    relay_thread.join().unwrap();
    println!("rank 0 named the joiner that stopped reading after {took:?}: {e}");
}

/// The listening TCP ports of this process (from /proc), IPv4.
fn own_listening_ports() -> Vec<u16> {
    let inodes: Vec<String> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(
                l.strip_prefix("socket:[")?
                    .trim_end_matches(']')
                    .to_string(),
            )
        })
        .collect();
    let tcp = std::fs::read_to_string("/proc/self/net/tcp").unwrap_or_default();
    tcp.lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            (f.len() > 9 && f[3] == "0A" && inodes.iter().any(|i| i == f[9]))
                .then(|| u16::from_str_radix(f[1].rsplit(':').next()?, 16).ok())
                .flatten()
        })
        .collect()
}

/// Rank 0 of a TCP job while an impostor claims rank 1 on every data port it opens (all but
/// the coordinator's) until the communicator is made; rank 1 joins a second late.
fn impostor_body() {
    let (r, n) = rank_size();
    if r == 0 {
        let coord_port: u16 = std::env::var("RDMACOMM_COORDINATOR")
            .unwrap()
            .rsplit(':')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop = done.clone();
        let imp = std::thread::spawn(move || {
            let (mut seen, mut held) = (Vec::new(), Vec::new());
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for p in own_listening_ports() {
                    if p != coord_port && !seen.contains(&p) {
                        if let Ok(mut s) = TcpStream::connect(("127.0.0.1", p)) {
                            // "I am rank 1", and a made-up proof.
                            let mut claim = 1u32.to_le_bytes().to_vec();
                            claim.extend_from_slice(&[0u8; 32]);
                            let _ = s.write_all(&claim);
                            let _ = s.write_all(&[0xee; 4096]);
                            seen.push(p);
                            held.push(s);
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            seen.len()
        });
        let out = job_body_checked(r, n);
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        let hits = imp.join().unwrap();
        assert!(hits >= 1, "the impostor found the data port");
        println!("RESULT rank 0: {out} beside an impostor on {hits} data port(s)");
    } else {
        std::thread::sleep(Duration::from_millis(1000));
        let out = job_body_checked(r, n);
        println!("RESULT rank {r}: {out}");
    }
}

/// Makes a communicator, all-reduces, checks against the scalar sum; returns what happened.
fn job_body_checked(r: usize, n: usize) -> String {
    let c = Comm::from_env().unwrap();
    let mut d: Vec<u8> = (0..4096)
        .flat_map(|i| ((r * 7919 + i) as f32).to_le_bytes())
        .collect();
    c.all_reduce(AllReduce::Sum, DType::f32, &mut d).unwrap();
    for (i, b) in d.chunks(4).enumerate() {
        let want: f32 = (0..n).map(|q| (q * 7919 + i) as f32).sum();
        assert_eq!(
            f32::from_le_bytes(b.try_into().unwrap()),
            want,
            "element {i}"
        );
    }
    "checked".to_string()
}

#[test]
fn an_impostor_on_the_data_port_changes_nothing() {
    let name = "an_impostor_on_the_data_port_changes_nothing";
    if !parent_ready(name, impostor_body) {
        return;
    }
    let res = spawn(
        name,
        2,
        Placement::Local,
        &|_| {
            vec![
                ("RDMACOMM_TRANSPORT".to_string(), "tcp".to_string()),
                ("RDMACOMM_TIMEOUT".to_string(), "15".to_string()),
                ("RDMACOMM_DEBUG".to_string(), "warn".to_string()),
            ]
        },
        Duration::from_secs(60),
    );
    assert_all_ok(&res);
    assert!(
        res[0].output.contains("beside an impostor"),
        "{}",
        res[0].output
    );
}

#[test]
fn a_restarted_rank_takes_its_place() {
    let name = "a_restarted_rank_takes_its_place";
    if !parent_ready(name, job_body) {
        return;
    }
    let port = free_port();
    let coord = format!("127.0.0.1:{port}");
    // The first rank 1 joins and then dies (its rendezvous times out and closes); rank 2 comes
    // next (the group must not form with the dead rank 1), then a second rank 1 takes its place,
    // and the job completes.
    let first = std::thread::spawn({
        let coord = coord.clone();
        move || {
            let mut c = Config::new(1, 3, coord.clone()).unwrap();
            c.timeout = Duration::from_secs(3);
            c.job_id = job_id(&coord);
            let t0 = Instant::now();
            let r = rdmacomm::unstable::rendezvous::rendezvous(
                &c,
                &rdmacomm::unstable::rendezvous::Card::default(),
            );
            (r.is_err(), t0.elapsed())
        }
    });
    let job = |r: usize| {
        vec![
            ("RDMACOMM_COORDINATOR".to_string(), coord.clone()),
            ("RDMACOMM_TIMEOUT".to_string(), "20".to_string()),
            ("RDMACOMM_DEBUG".to_string(), "warn".to_string()),
            (
                "RXE_TEST_DELAY_MS".to_string(),
                ["0", "8000", "6000"][r].to_string(),
            ),
        ]
    };
    let res = spawn(name, 3, Placement::Local, &job, Duration::from_secs(60));
    let (failed, after) = first.join().unwrap();
    assert!(failed, "the first rank 1 never completed");
    assert!(
        after < Duration::from_secs(8),
        "it was gone before its successor came: {after:?}"
    );
    assert_all_ok(&res);
    assert!(
        res[0]
            .output
            .contains("rank 1 left the rendezvous before the group formed"),
        "rank 0 says so: {}",
        res[0].output
    );
}

crate::matrix_shm!(
    strangers_are_ignored_and_the_job_completes,
    another_anonymous_job_never_ends_this_one,
    idle_strangers_never_keep_a_rank_out,
    a_shared_secret_keeps_out_whoever_lacks_it,
    ipv6_loopback_works,
    a_world_past_the_bound_is_refused_by_name,
    fifty_failed_rendezvous_leave_nothing_behind,
    a_fake_coordinator_learns_no_card,
    a_joiner_that_stops_reading_is_named_within_the_deadline,
    an_impostor_on_the_data_port_changes_nothing,
    a_restarted_rank_takes_its_place
);
