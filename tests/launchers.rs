//! Launchers that set no `MASTER_ADDR`: Open MPI's `mpirun` (rank 0's address goes through its
//! PMIx store) and Slurm without PMIx (the step's first node and a port derived from the job).
//! Each rank checks an all_reduce and an all_gather against a scalar re-computation.

mod common;

use rdmacomm::{AllReduce, Comm, Communicator, DType};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Variables that would hand the ranks an address or an identity of another launcher.
const CLEARED: [&str; 8] = [
    "MASTER_ADDR",
    "MASTER_PORT",
    "RDMACOMM_COORDINATOR",
    "RDMACOMM_RANK",
    "RDMACOMM_WORLD_SIZE",
    "RANK",
    "WORLD_SIZE",
    "SLURM_JOB_ID",
];

/// One communicator's checks; prints `ok` with its rank and size.
fn check(comm: &Comm, round: u64) {
    let (r, n) = (comm.rank() as u64, comm.size() as u64);
    let mut v: Vec<u64> = (0..1000).map(|i| (r + 1) * (i + round)).collect();
    comm.all_reduce(AllReduce::Sum, DType::u64, bytemuck::cast_slice_mut(&mut v))
        .unwrap();
    for (i, x) in v.iter().enumerate() {
        assert_eq!(
            *x,
            (0..n).map(|q| (q + 1) * (i as u64 + round)).sum::<u64>()
        );
    }
    let mut all = vec![0u64; n as usize];
    comm.all_gather(&r.to_le_bytes(), bytemuck::cast_slice_mut(&mut all))
        .unwrap();
    assert_eq!(all, (0..n).collect::<Vec<_>>());
}

/// A rank under a launcher: two communicators from the environment, one after the other.
fn rank_body() {
    assert!(std::env::var_os("MASTER_ADDR").is_none());
    let comm = Comm::from_env().unwrap();
    check(&comm, 1);
    let again = Comm::from_env().unwrap();
    check(&again, 2);
    println!("ok rank {} of {}", comm.rank(), comm.size());
}

/// A rank under a launcher whose configuration may be bad: prints the error it got (and exits
/// 0, so that the launcher does not kill the others before they say theirs).
fn error_body() {
    use std::io::Write;
    let line = match Comm::from_env() {
        Ok(c) => format!("\nunexpected: rank {} formed a communicator\n", c.rank()),
        Err(e) => format!("\nerror: {e}\n"),
    };
    // One write to stderr (unbuffered; the test harness writes to stdout): the launcher
    // forwards what ranks write as it comes, so a line written in pieces can be split by
    // another rank's output.
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// The transports the launcher tests run over: RDMA in the VM stage, else TCP and the one
/// `auto` picks (shared memory, every rank being on this host).
fn transports() -> Vec<&'static str> {
    if common::require_rdma() {
        vec!["rdma"]
    } else {
        vec!["tcp", "auto"]
    }
}

/// `-x` settings of the device the VM stage names, if it does.
fn device_args() -> Vec<String> {
    match std::env::var("RXE_DEV") {
        Ok(d) => vec!["-x".into(), format!("RDMACOMM_IB_DEVICE={d}")],
        Err(_) => Vec::new(),
    }
}

fn mpirun() -> Command {
    let found = Command::new("mpirun")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found,
        "mpirun not found: bash tools/setup installs Open MPI (openmpi-bin)"
    );
    let mut c = Command::new("mpirun");
    for v in CLEARED {
        c.env_remove(v);
    }
    c.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .args(["--oversubscribe", "--bind-to", "none"])
        .stdin(Stdio::null());
    c
}

/// Runs `c` to its end within `limit`: exit status and stdout + stderr.
fn run(mut c: Command, limit: Duration) -> (Option<i32>, String) {
    let mut child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            let out = child.wait_with_output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr);
            return (s.code(), text);
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "not done within {limit:?}:\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn this_test(name: &str) -> Vec<String> {
    let exe = std::env::current_exe().unwrap();
    vec![
        "-x".into(),
        format!("{}={name}", common::CHILD),
        exe.to_string_lossy().into_owned(),
        name.into(),
        "--exact".into(),
        "--nocapture".into(),
        "--test-threads=1".into(),
    ]
}

#[test]
fn mpirun_needs_no_address() {
    const NAME: &str = "mpirun_needs_no_address";
    if common::is_child(NAME) {
        return rank_body();
    }
    for transport in transports() {
        let mut c = mpirun();
        c.args(["-np", "4", "-x", &format!("RDMACOMM_TRANSPORT={transport}")])
            .args(["-x", "RDMACOMM_TIMEOUT=20"])
            .args(device_args())
            .args(this_test(NAME));
        let (code, out) = run(c, Duration::from_secs(90));
        assert_eq!(code, Some(0), "{transport}: {out}");
        for r in 0..4 {
            assert!(
                out.contains(&format!("ok rank {r} of 4")),
                "{transport}: rank {r} did not finish:\n{out}"
            );
        }
    }
}

#[test]
fn mpirun_bad_setting_on_one_rank_is_named_on_every_rank() {
    const NAME: &str = "mpirun_bad_setting_on_one_rank_is_named_on_every_rank";
    if common::is_child(NAME) {
        return error_body();
    }
    // Two ranks as they should be, the third (rank 2) with a bad setting: MPMD form.
    let mut c = mpirun();
    c.args(["-x", "RDMACOMM_TRANSPORT=tcp", "-x", "RDMACOMM_TIMEOUT=20"])
        .arg("-np")
        .arg("2")
        .args(this_test(NAME))
        .args([":", "-np", "1", "-x", "RDMACOMM_SLOTS=1"])
        .args(this_test(NAME));
    let t0 = Instant::now();
    let (code, out) = run(c, Duration::from_secs(90));
    assert_eq!(code, Some(0), "{out}");
    let errors: Vec<&str> = out.lines().filter(|l| l.starts_with("error: ")).collect();
    assert_eq!(errors.len(), 3, "every rank should fail:\n{out}");
    for e in &errors {
        assert!(e.contains("RDMACOMM_SLOTS=1"), "not named: {e}\n{out}");
    }
    // Told, not timed out: well within RDMACOMM_TIMEOUT.
    assert!(t0.elapsed() < Duration::from_secs(15), "{:?}", t0.elapsed());
}

/// This test binary as test `name`'s child, without the variables of any launcher around it.
fn bare_child(name: &str) -> Command {
    let mut c = Command::new(std::env::current_exe().unwrap());
    for v in CLEARED {
        c.env_remove(v);
    }
    for (k, _) in std::env::vars() {
        if k.starts_with("PMIX_") || k.starts_with("OMPI_") {
            c.env_remove(k);
        }
    }
    c.args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(common::CHILD, name);
    c
}

#[test]
fn slurm_without_pmix_needs_no_address() {
    const NAME: &str = "slurm_without_pmix_needs_no_address";
    if common::is_child(NAME) {
        return rank_body();
    }
    let n = 3;
    // A job id of this run's own, so that the derived port is unlikely to be another's.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    let job = (u64::from(std::process::id()) * 7919 + u64::from(now.subsec_nanos())) % 1_000_000;
    for transport in transports() {
        let mut children = Vec::new();
        for r in 0..n {
            let mut c = bare_child(NAME);
            c.env("RDMACOMM_TRANSPORT", transport)
                .env("RDMACOMM_TIMEOUT", "20")
                .env("SLURM_JOB_ID", job.to_string())
                .env("SLURM_STEP_ID", "0")
                .env("SLURM_PROCID", r.to_string())
                .env("SLURM_NTASKS", n.to_string())
                .env("SLURM_JOB_NUM_NODES", "1")
                .env("SLURM_STEP_NODELIST", "localhost")
                .stdin(Stdio::null());
            if let Ok(d) = std::env::var("RXE_DEV") {
                c.env("RDMACOMM_IB_DEVICE", d);
            }
            children.push(c);
        }
        let handles: Vec<_> = children
            .into_iter()
            .map(|c| std::thread::spawn(move || run(c, Duration::from_secs(60))))
            .collect();
        for (r, h) in handles.into_iter().enumerate() {
            let (code, out) = h.join().unwrap();
            assert_eq!(code, Some(0), "{transport}: rank {r}: {out}");
            assert!(out.contains(&format!("ok rank {r} of {n}")), "{out}");
        }
    }
}

/// A PMIx server that accepts the connection and never answers (a stale or stuck launcher):
/// `PMIx_Init` would wait forever; the rank fails after `RDMACOMM_TIMEOUT`, naming it.
#[test]
fn a_pmix_server_that_never_answers_is_named() {
    const NAME: &str = "a_pmix_server_that_never_answers_is_named";
    if common::is_child(NAME) {
        return error_body();
    }
    let server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let uri = format!("silent.0;tcp4://{}", server.local_addr().unwrap());
    // Holds every connection open, silent, until the test process ends.
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in server.incoming().flatten().take(16) {
            held.push(c);
        }
    });
    let mut c = bare_child(NAME);
    c.env("RDMACOMM_TIMEOUT", "2")
        .env("OMPI_COMM_WORLD_RANK", "0")
        .env("OMPI_COMM_WORLD_SIZE", "2")
        .env("PMIX_NAMESPACE", "silent")
        .env("PMIX_RANK", "0")
        .stdin(Stdio::null());
    for v in ["41", "4", "3", "21", "2"] {
        c.env(format!("PMIX_SERVER_URI{v}"), &uri);
    }
    let t0 = Instant::now();
    let (code, out) = run(c, Duration::from_secs(30));
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("error: bootstrap: PMIx_Init did not return within 2s"),
        "{out}"
    );
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
}

/// rdmacomm-run gives each job a fresh identity and secret (so another job's ranks on the same
/// port are refused), the same on every rank of a job; and its ranks join with them.
#[test]
fn rdmacomm_run_gives_each_job_an_identity_and_a_secret() {
    const NAME: &str = "rdmacomm_run_gives_each_job_an_identity_and_a_secret";
    if common::is_child(NAME) {
        let c = Comm::from_env().unwrap();
        check(&c, 3);
        println!("RAN-CHECKED {}", c.rank());
        return;
    }
    if !common::transport_ready() {
        return;
    }
    let run = |prog: &str, args: &[&str]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_rdmacomm-run"));
        cmd.args(["-n", "2", "--", prog]).args(args);
        for v in
            CLEARED
                .iter()
                .chain(&["RDMACOMM_JOB_ID", "RDMACOMM_SECRET", "RDMACOMM_SECRET_FILE"])
        {
            cmd.env_remove(v);
        }
        let out = cmd.env("RDMACOMM_TIMEOUT", "30").output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        text
    };
    let ids = |text: &str| -> Vec<String> {
        let mut v: Vec<String> = text
            .lines()
            .filter_map(|l| l.split_once("] ").map(|(_, rest)| rest.to_string()))
            .collect();
        v.sort();
        v
    };
    let show = ["-c", "echo \"$RDMACOMM_JOB_ID $RDMACOMM_SECRET\""];
    let (a, b) = (ids(&run("sh", &show)), ids(&run("sh", &show)));
    assert_eq!(a.len(), 2, "{a:?}");
    assert_eq!(a[0], a[1], "both ranks of a job share them");
    let (id, secret) = a[0].split_once(' ').unwrap();
    assert!(
        id.starts_with("rdmacomm-run:") && secret.len() >= 32,
        "{a:?}"
    );
    assert_ne!(a[0], b[0], "each job its own");
    // A real job under it: the ranks meet with that identity and secret.
    let exe = std::env::current_exe().unwrap();
    let mut cmd_env = vec![(common::CHILD, NAME)];
    cmd_env.push(("RDMACOMM_DEBUG", "info"));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rdmacomm-run"));
    cmd.args(["-n", "2", "--"])
        .arg(&exe)
        .args([NAME, "--exact", "--nocapture", "--test-threads=1"])
        .envs(cmd_env)
        .env("RDMACOMM_TIMEOUT", "30");
    for v in CLEARED
        .iter()
        .chain(&["RDMACOMM_JOB_ID", "RDMACOMM_SECRET"])
    {
        cmd.env_remove(v);
    }
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("RAN-CHECKED 0") && text.contains("RAN-CHECKED 1"),
        "{text}"
    );
    assert!(
        text.contains("job \"rdmacomm-run:") && !text.contains("has no identity"),
        "{text}"
    );
}
