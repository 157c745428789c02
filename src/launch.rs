//! Starting N local ranks of a program (the `rdmacomm-run` launcher, `rdmacomm-perf --local`).

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Runs `prog args` as `n` local ranks with torchrun-style variables (`RANK`, `WORLD_SIZE`,
/// `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), each output line prefixed
/// with `[rank r]` when `prefix` is set. The job gets a fresh identity (`RDMACOMM_JOB_ID`) and
/// secret (`RDMACOMM_SECRET`) unless they are set, so another job's ranks on the same port are
/// refused. If any rank fails, the others are killed. Returns the first failing exit code, or 0.
pub fn run_local(n: usize, prog: &str, args: &[String], prefix: bool) -> std::io::Result<i32> {
    run_local_with(n, prog, args, prefix, 0)
}

/// [`run_local`], elastic where `restarts > 0` (torchrun's `--max-restarts`): a rank that fails
/// does not stop the others but is started again, with the same variables and
/// `RDMACOMM_REPLACEMENT=1` (the program then joins the running group with `Comm::rejoin`), up
/// to `restarts` times in all. Returns 0 when every rank's last process succeeded, else the
/// first failing exit code.
pub fn run_local_with(
    n: usize,
    prog: &str,
    args: &[String],
    prefix: bool,
    restarts: usize,
) -> std::io::Result<i32> {
    let port = match std::env::var("MASTER_PORT") {
        Ok(p) => p,
        Err(_) => TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port()
            .to_string(),
    };
    let addr = std::env::var("MASTER_ADDR").unwrap_or_else(|_| "127.0.0.1".into());
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let set = |k: &str| std::env::var(k).is_ok_and(|v| !v.trim().is_empty());
    let mut identity: Vec<(&str, String)> = Vec::new();
    if !set("RDMACOMM_JOB_ID") {
        let id = crate::bootstrap::rendezvous::random::<8>();
        identity.push(("RDMACOMM_JOB_ID", format!("rdmacomm-run:{}", hex(&id))));
    }
    if !set("RDMACOMM_SECRET") && !set("RDMACOMM_SECRET_FILE") {
        let key = crate::bootstrap::rendezvous::random::<16>();
        identity.push(("RDMACOMM_SECRET", hex(&key)));
    }
    let mut pumps = Vec::new();
    let mut start = |r: usize, replacement: bool| -> std::io::Result<Child> {
        let mut cmd = Command::new(prog);
        cmd.args(args)
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", r.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", &addr)
            .env("MASTER_PORT", &port)
            .env_remove("RDMACOMM_RANK")
            .env_remove("RDMACOMM_WORLD_SIZE")
            .envs(identity.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if replacement {
            cmd.env("RDMACOMM_REPLACEMENT", "1");
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| std::io::Error::new(e.kind(), format!("cannot start {prog}: {e}")))?;
        let out = child.stdout.take().expect("piped");
        let err = child.stderr.take().expect("piped");
        let tag = if prefix {
            format!("[rank {r}] ")
        } else {
            String::new()
        };
        let t2 = tag.clone();
        pumps.push(std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let mut o = std::io::stdout().lock();
                let _ = writeln!(o, "{tag}{line}");
            }
        }));
        pumps.push(std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                let mut o = std::io::stderr().lock();
                let _ = writeln!(o, "{t2}{line}");
            }
        }));
        Ok(child)
    };
    let mut children: Vec<Child> = Vec::with_capacity(n);
    for r in 0..n {
        match start(r, false) {
            Ok(c) => children.push(c),
            Err(e) => {
                for c in children.iter_mut() {
                    let _ = c.kill();
                }
                return Err(e);
            }
        }
    }
    let mut done = vec![false; n];
    // The first failure in time; and whether each rank's last process failed.
    let mut first = None;
    let mut failed = vec![false; n];
    let mut left = restarts;
    while done.iter().any(|d| !d) {
        // Every exit seen first, then judged: whether the others are done does not depend on
        // the order they are looked at in.
        let mut ended = Vec::new();
        for (r, c) in children.iter_mut().enumerate().filter(|(r, _)| !done[*r]) {
            if let Some(st) = c.try_wait()? {
                ended.push((r, st));
            }
        }
        let running = |done: &[bool], r: usize| {
            (0..n).any(|q| q != r && !done[q] && !ended.iter().any(|(e, _)| *e == q))
        };
        for &(r, st) in &ended {
            // A replacement is for a job still running: not once every other rank ended.
            if !st.success() && left > 0 && running(&done, r) {
                left -= 1;
                if first.is_none() {
                    first = Some(st.code().unwrap_or(1).max(1));
                }
                eprintln!("rdmacomm-run: rank {r} failed ({st}); starting its replacement");
                match start(r, true) {
                    Ok(c) => {
                        children[r] = c;
                        continue;
                    }
                    Err(e) => eprintln!("rdmacomm-run: {e}"),
                }
            }
            done[r] = true;
            failed[r] = !st.success();
            if failed[r] && first.is_none() {
                first = Some(st.code().unwrap_or(1).max(1));
            }
            if failed[r] && restarts == 0 {
                eprintln!("rdmacomm-run: rank {r} failed ({st}); stopping the other ranks");
                for (q, c) in children.iter_mut().enumerate() {
                    if !done[q] {
                        let _ = c.kill();
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    for p in pumps {
        let _ = p.join();
    }
    // Elastic: a rank whose replacement succeeded is no failure of the job.
    Ok(if failed.contains(&true) {
        first.unwrap_or(1)
    } else {
        0
    })
}
