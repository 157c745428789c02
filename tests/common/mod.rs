//! Test harness: runs a test body as N rank processes (this test binary re-executed), and
//! decides whether RDMA tests run here.
#![allow(dead_code)]

pub mod handshake;
pub mod reference;

use std::cell::Cell;
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A deterministic xorshift stream (the same on every rank for a shared seed).
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A number in `0..n`.
    pub fn below(&mut self, n: u64) -> usize {
        (self.next() % n) as usize
    }
}

/// Env var that marks a child rank process and names the test it runs.
pub const CHILD: &str = "RDMACOMM_TEST_CHILD";

/// Whether this process is a rank child of test `name`.
pub fn is_child(name: &str) -> bool {
    std::env::var(CHILD).is_ok_and(|v| v == name)
}

/// The entry of a multi-process test: in a rank child of test `name`, runs `body` and returns
/// false; in the parent, returns whether the transport is ready (false after saying why not).
pub fn parent_ready(name: &str, body: fn()) -> bool {
    if is_child(name) {
        body();
        return false;
    }
    transport_ready()
}

/// Whether the library's test fault hook (`RDMACOMM_TEST_FAULT`, debug builds only) works in
/// this build; a test of test `name` that needs it skips under `--release`, saying so.
pub fn debug_hooks(name: &str) -> bool {
    if !cfg!(debug_assertions) && !is_child(name) {
        eprintln!("{name}: skipped: the test fault hook is in debug builds only");
    }
    cfg!(debug_assertions)
}

/// This child's rank and world size (set by [`spawn`]).
pub fn rank_size() -> (usize, usize) {
    let r = std::env::var("RDMACOMM_RANK").unwrap().parse().unwrap();
    let n = std::env::var("RDMACOMM_WORLD_SIZE")
        .unwrap()
        .parse()
        .unwrap();
    (r, n)
}

/// Whether an RDMA device is usable here. Returns false after printing why when RDMA tests
/// should be skipped; panics when `RDMACOMM_REQUIRE_RDMA=1` (the VM stage of CI) and none is.
pub fn rdma_available() -> bool {
    match rdmacomm::unstable::verbs::list_ports() {
        Ok(ports) if ports.iter().any(|p| p.active) => true,
        other => {
            let why = match other {
                Ok(_) => "no ACTIVE RDMA port".to_string(),
                Err(e) => e.to_string(),
            };
            if std::env::var("RDMACOMM_REQUIRE_RDMA").is_ok_and(|v| v == "1") {
                panic!("RDMACOMM_REQUIRE_RDMA=1 but RDMA is not usable: {why}");
            }
            eprintln!("SKIPPED (needs RDMA; run under tools/rxe-vm): {why}");
            false
        }
    }
}

/// Whether the VM stage demands RDMA (`RDMACOMM_REQUIRE_RDMA=1`).
pub fn require_rdma() -> bool {
    std::env::var("RDMACOMM_REQUIRE_RDMA").is_ok_and(|v| v == "1")
}

/// Whether transport-agnostic tests can run: always (over TCP on a host without RDMA, with
/// RDMACOMM_TRANSPORT=auto); under `RDMACOMM_REQUIRE_RDMA=1` only over RDMA (panics otherwise),
/// and [`spawn`] then sets `RDMACOMM_TRANSPORT=rdma` so nothing falls back to TCP.
pub fn transport_ready() -> bool {
    !require_rdma() || rdma_available()
}

/// A free TCP port on loopback (for the coordinator), below the ephemeral range: a port the
/// kernel hands out for binding to 0 may be taken by an outgoing connection (tests running
/// beside this one connect a lot) before the rank that is to listen on it binds it.
pub fn free_port() -> u16 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let salt = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut rng = Rng((std::process::id() as u64) << 32 ^ salt | 1);
    loop {
        let k = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let port = 20_000 + ((rng.next() ^ k) % 12_000) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// Number of soft-RoCE "hosts" the VM made (0 outside `tools/rxe-vm --hosts N`).
pub fn vm_hosts() -> usize {
    std::env::var("RXE_HOSTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The outcome of one rank process.
#[derive(Debug)]
pub struct RankResult {
    /// Rank.
    pub rank: usize,
    /// Exit code (None: killed).
    pub code: Option<i32>,
    /// Combined output.
    pub output: String,
}

/// How ranks are placed: all on the default device, or rank i on VM host i % hosts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Every rank on the default device (rxe0 on lo in the VM), coordinator on 127.0.0.1.
    Local,
    /// Rank i on host i % RXE_HOSTS (its own rxe device and IP); coordinator on host 0's IP.
    Hosts,
}

/// What carries a test's ranks: the transport matrix every multi-rank suite runs over in one
/// plain `cargo test` (its `over_shm::` and `over_mixed::` copies, from [`matrix!`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Net {
    /// What `RDMACOMM_TRANSPORT` names: TCP where it is unset; RDMA in the VM stage.
    Env,
    /// Shared memory (`RDMACOMM_TRANSPORT=shm`).
    Shm,
    /// TCP and shared memory at once, ranks two to a host (`auto` with host ids).
    Mixed,
    /// TCP and shared memory, each rank's host named in a list (`a,b,b,c`: uneven hosts).
    Hosts(&'static str),
}

thread_local! {
    /// The net of the test running on this thread.
    static NET: Cell<Net> = const { Cell::new(Net::Env) };
}

/// The net of the test running on this thread.
pub fn net() -> Net {
    NET.with(Cell::get)
}

/// Runs `test` with its ranks over `net`. The VM stage runs every test over RDMA alone, so
/// there the copies for other nets only say so.
pub fn over(net: Net, test: fn()) {
    if require_rdma() {
        println!("SKIPPED: the {net:?} copy runs on the host");
        return;
    }
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            NET.with(|n| n.set(Net::Env));
        }
    }
    let _reset = Reset;
    NET.with(|n| n.set(net));
    test();
}

/// The variables rank `r` of a job over `net` gets (before the test's own, which win).
pub fn net_vars(net: Net, r: usize) -> Vec<(String, String)> {
    let v = |k: &str, v: String| (k.to_string(), v);
    match net {
        Net::Env if require_rdma() => vec![v("RDMACOMM_TRANSPORT", "rdma".into())],
        Net::Env if std::env::var_os("RDMACOMM_TRANSPORT").is_none() => {
            vec![v("RDMACOMM_TRANSPORT", "tcp".into())]
        }
        Net::Env => vec![],
        Net::Shm => vec![v("RDMACOMM_TRANSPORT", "shm".into())],
        Net::Mixed => vec![
            v("RDMACOMM_TRANSPORT", "auto".into()),
            v("RDMACOMM_HOST_ID", format!("test-host-{}", r / 2)),
            v("RXE_TEST_RANKS_PER_HOST", "2".into()),
        ],
        Net::Hosts(list) => vec![
            v("RDMACOMM_TRANSPORT", "auto".into()),
            v(
                "RDMACOMM_HOST_ID",
                format!("test-host-{}", list.split(',').nth(r).unwrap_or("x")),
            ),
            v("RXE_TEST_HOSTS", list.into()),
        ],
    }
}

/// Sets `cfg` (rank `r`'s, made in this process) to run over `net`, as [`net_vars`] does for a
/// rank process.
pub fn configure(cfg: &mut rdmacomm::Config, net: Net, r: usize) {
    use rdmacomm::config::TransportKind;
    for (k, v) in net_vars(net, r) {
        match k.as_str() {
            "RDMACOMM_TRANSPORT" => cfg.transport = TransportKind::parse(&v).expect("a transport"),
            "RDMACOMM_HOST_ID" => cfg.host_id = v,
            _ => {}
        }
    }
}

/// Copies the named tests (each a `fn()` of a file that has [`over`] and [`Net`] in scope)
/// into `over_shm::` and `over_mixed::`,
/// whose ranks run over shared memory, and over TCP and shared memory at once: with the
/// originals (over TCP, or what `RDMACOMM_TRANSPORT` names) a plain `cargo test` covers the
/// transport matrix.
#[macro_export]
macro_rules! matrix {
    ($($test:ident),* $(,)?) => {
        mod over_shm {
            $(#[test]
            fn $test() {
                super::over(super::Net::Shm, super::$test)
            })*
        }
        mod over_mixed {
            $(#[test]
            fn $test() {
                super::over(super::Net::Mixed, super::$test)
            })*
        }
    };
}

/// As [`matrix!`], over shared memory alone.
#[macro_export]
macro_rules! matrix_shm {
    ($($test:ident),* $(,)?) => {
        mod over_shm {
            $(#[test]
            fn $test() {
                super::over(super::Net::Shm, super::$test)
            })*
        }
    };
}

/// Held while a test edits this process's environment and while children are spawned (they
/// inherit it), so tests running in parallel threads never pass each other's edits on.
pub static ENV_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs test `name` as `n` ranks; `env(rank)` adds variables. Kills all after `limit`.
pub fn spawn(
    name: &str,
    n: usize,
    placement: Placement,
    env: &dyn Fn(usize) -> Vec<(String, String)>,
    limit: Duration,
) -> Vec<RankResult> {
    let exe = std::env::current_exe().unwrap();
    let port = free_port();
    let hosts = vm_hosts();
    let coord_ip = match placement {
        Placement::Hosts if hosts > 0 => std::env::var("RXE_IP_0").unwrap(),
        _ => "127.0.0.1".to_string(),
    };
    let mut children = Vec::new();
    for r in 0..n {
        let mut c = Command::new(&exe);
        // A child of an ignored test (run by hand) runs its body too.
        c.args([
            name,
            "--exact",
            "--nocapture",
            "--test-threads=1",
            "--include-ignored",
        ])
        .env(CHILD, name)
        .env("RDMACOMM_RANK", r.to_string())
        .env("RDMACOMM_WORLD_SIZE", n.to_string())
        .env("RDMACOMM_COORDINATOR", format!("{coord_ip}:{port}"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        for (k, v) in net_vars(net(), r) {
            c.env(k, v);
        }
        if placement == Placement::Hosts && hosts > 0 {
            let h = r % hosts;
            c.env(
                "RDMACOMM_IB_DEVICE",
                std::env::var(format!("RXE_DEV_{h}")).unwrap(),
            )
            .env(
                "RDMACOMM_BIND_ADDR",
                std::env::var(format!("RXE_IP_{h}")).unwrap(),
            );
        } else if let Ok(d) = std::env::var("RXE_DEV") {
            c.env("RDMACOMM_IB_DEVICE", d);
        }
        // Ranks grouped into "hosts" of k for shared memory (RDMACOMM_HOST_ID), as tools/test
        // does to run the suites over shared memory and a network transport at once.
        if let Some(k) = std::env::var("RXE_TEST_RANKS_PER_HOST")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
        {
            c.env("RDMACOMM_HOST_ID", format!("test-host-{}", r / k.max(1)));
        }
        // Or each rank's "host" named in a list (RXE_TEST_HOSTS=a,b,b,c: uneven hosts).
        if let Some(h) = std::env::var("RXE_TEST_HOSTS")
            .ok()
            .and_then(|v| v.split(',').nth(r).map(str::to_string))
        {
            c.env("RDMACOMM_HOST_ID", format!("test-host-{h}"));
        }
        // A job with an identity, as rdmacomm-run and the common launchers give theirs (one per
        // coordinator: ranks of one job share it); a test's own RDMACOMM_JOB_ID ("": none) wins.
        let vars = env(r);
        let coord = vars
            .iter()
            .find(|(k, _)| k == "RDMACOMM_COORDINATOR")
            .map_or_else(|| format!("{coord_ip}:{port}"), |(_, v)| v.clone());
        c.env("RDMACOMM_JOB_ID", job_id(&coord));
        for (k, v) in vars {
            // A device list replaces the device the harness names.
            if k == "RDMACOMM_IB_HCA" {
                c.env_remove("RDMACOMM_IB_DEVICE");
            }
            c.env(k, v);
        }
        let _env = ENV_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        children.push(c.spawn().expect("spawn rank"));
    }
    let deadline = Instant::now() + limit;
    let mut codes: Vec<Option<Option<i32>>> = (0..n).map(|_| None).collect();
    while codes.iter().any(|c| c.is_none()) {
        for (r, ch) in children.iter_mut().enumerate() {
            if codes[r].is_none() {
                if let Some(st) = ch.try_wait().unwrap() {
                    codes[r] = Some(st.code());
                }
            }
        }
        if Instant::now() > deadline {
            for (r, ch) in children.iter_mut().enumerate() {
                if codes[r].is_none() {
                    let _ = ch.kill();
                    codes[r] = Some(None);
                }
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    children
        .into_iter()
        .enumerate()
        .map(|(r, ch)| {
            let out = ch.wait_with_output().unwrap();
            RankResult {
                rank: r,
                code: codes[r].unwrap(),
                output: format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ),
            }
        })
        .collect()
}

/// The identity [`spawn`] gives the job that meets at `coordinator`.
pub fn job_id(coordinator: &str) -> String {
    format!("test:{coordinator}")
}

/// Spawns `n` ranks of test `name` on the default device with `env` (besides a 60 s timeout)
/// and asserts every rank exited 0.
pub fn spawn_local_ok(name: &str, n: usize, env: &[(&str, &str)], limit: Duration) {
    let mut vars = vec![("RDMACOMM_TIMEOUT".to_string(), "60".to_string())];
    vars.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    assert_all_ok(&spawn(name, n, Placement::Local, &|_| vars.clone(), limit));
}

/// Asserts every rank exited 0, printing all output otherwise.
pub fn assert_all_ok(results: &[RankResult]) {
    let bad: Vec<&RankResult> = results.iter().filter(|r| r.code != Some(0)).collect();
    if !bad.is_empty() {
        for r in results {
            eprintln!(
                "----- rank {} (exit {:?}) -----\n{}",
                r.rank, r.code, r.output
            );
        }
        panic!("{} of {} ranks failed", bad.len(), results.len());
    }
}

/// For a framework's real-client tests: in a rank child of `name`, runs `body` on what `init`
/// builds (the framework's communicator) and returns `None`. In the parent: runs `n` ranks
/// placed across the VM's hosts where there are some, with `env` and a 30 s timeout, asserts
/// each exited 0 and returns their outputs (`None` where the transport is not usable here).
pub fn ranks_of<G>(
    name: &str,
    n: usize,
    env: &[(&str, &str)],
    init: impl FnOnce() -> G,
    body: impl FnOnce(G),
) -> Option<Vec<String>> {
    if is_child(name) {
        body(init());
        return None;
    }
    if !transport_ready() {
        return None;
    }
    let mut vars = vec![("RDMACOMM_TIMEOUT".to_string(), "30".to_string())];
    vars.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let out = spawn(
        name,
        n,
        Placement::Hosts,
        &|_| vars.clone(),
        Duration::from_secs(240),
    );
    assert_all_ok(&out);
    Some(out.into_iter().map(|r| r.output).collect())
}

/// What follows `tag` on each line of `out` that has it (the test harness may print before it).
pub fn tagged<'a>(out: &'a str, tag: &str) -> Vec<&'a str> {
    out.lines()
        .filter_map(|l| l.find(tag).map(|i| &l[i..]))
        .collect()
}

/// The figure just before `what` after "holds " in `line` (a rank's `info` accounting: "holds
/// 0.0 MiB pinned, 3.9 MiB shared ... 7 connections").
#[allow(dead_code)]
pub fn held(line: &str, what: &str) -> f64 {
    let held = line.split("holds ").nth(1).expect("a holds figure");
    let at = held
        .find(what)
        .unwrap_or_else(|| panic!("{what} in {held}"));
    held[..at]
        .split_whitespace()
        .last()
        .and_then(|x| x.parse().ok())
        .unwrap_or_else(|| panic!("a number before {what} in {held}"))
}
