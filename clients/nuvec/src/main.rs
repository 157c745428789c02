//! compare-nuvec: nuvec's own `all_sum(..).eval()` on f32 arrays through rdmacomm and through
//! nuvec-distributed's TCP ring, on the same ranks, alternating launches, several rounds.
//!
//! `compare-nuvec [--ranks N] [--rounds R] [--transport tcp|shm|auto|rdma] [--max BYTES]`
//! prints, per size, the median over rounds of each launch's best burst (µs per call): the
//! ring, rdmacomm through nuvec, nuvec's own share of a call (a fresh array written once),
//! and, alternated on one buffer, the transport's `Communicator::all_reduce` (nuvec's graph
//! left out) beside `Comm::all_reduce` directly (the transport left out too).

use nuvec_core::distributed::{self, Communicator};
use nuvec_core::DType;
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::Instant;

const ROLE: &str = "COMPARE_NUVEC_ROLE";

fn main() {
    match std::env::var(ROLE).as_deref() {
        Ok("ring") => rank(false),
        Ok("rdmacomm") => rank(true),
        _ => launch(),
    }
}

fn arg(name: &str, default: &str) -> String {
    let a: Vec<String> = std::env::args().collect();
    a.iter()
        .position(|x| x == name)
        .and_then(|i| a.get(i + 1).cloned())
        .unwrap_or_else(|| default.to_string())
}

fn sizes(max: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut b = 8;
    while b <= max {
        v.push(b);
        b *= 8;
    }
    if v.last() != Some(&max) {
        v.push(max);
    }
    v
}

/// Microseconds per call of `f`: the best of 4 bursts (the first one warms up).
fn time(bytes: usize, mut f: impl FnMut()) -> f64 {
    let reps = (64usize << 20)
        .checked_div(bytes)
        .unwrap_or(1)
        .clamp(3, 200);
    let mut best = f64::MAX;
    for burst in 0..4 {
        let t = Instant::now();
        for _ in 0..reps {
            f();
        }
        let us = t.elapsed().as_secs_f64() * 1e6 / reps as f64;
        if burst > 0 {
            best = best.min(us);
        }
    }
    best
}

/// One rank: every size through the backend its role names; rank 0 prints the times.
fn rank(rdma: bool) {
    let max: usize = std::env::var("COMPARE_NUVEC_MAX").unwrap().parse().unwrap();
    let transport = if rdma {
        let t = std::sync::Arc::new(rdmacomm::nuvec::Transport::new(
            rdmacomm::Comm::from_env().expect("rdmacomm"),
        ));
        let g = distributed::Group::new(t.clone());
        distributed::set_default_group(g);
        Some(t)
    } else {
        nuvec_distributed::init(true).expect("nuvec ring");
        None
    };
    let g = distributed::default_group();
    for bytes in sizes(max) {
        let n = bytes / 4;
        let x = nuvec_core::ops::full([n], 1.0f32);
        x.eval().unwrap();
        let via_nuvec = time(bytes, || {
            distributed::all_sum(&x, None).eval().unwrap();
        });
        // Check once: every element is the world size.
        let s = distributed::all_sum(&x, None).to_vec::<f32>().unwrap();
        assert!(s.iter().all(|&v| v == g.size() as f32), "wrong sum");
        // nuvec's own share of a call: a fresh output array, written once (as an all_sum's is).
        let own = time(bytes, || {
            x.multiply(1.0f32).eval().unwrap();
        });
        let mut line = format!("TIME {bytes} nuvec {via_nuvec:.2} own {own:.2}");
        if let Some(t) = &transport {
            // The transport and the communicator under it on one buffer, alternated 3 times.
            let mut buf = vec![0u8; bytes];
            let (mut adapter, mut direct) = (f64::MAX, f64::MAX);
            for _ in 0..3 {
                adapter = adapter.min(time(bytes, || {
                    t.all_reduce(distributed::AllReduce::Sum, DType::F32, &mut buf)
                        .unwrap();
                }));
                direct = direct.min(time(bytes, || {
                    rdmacomm::Communicator::all_reduce(
                        t.comm(),
                        rdmacomm::AllReduce::Sum,
                        rdmacomm::DType::f32,
                        &mut buf,
                    )
                    .unwrap();
                }));
            }
            line += &format!(" adapter {adapter:.2} direct {direct:.2}");
        }
        if g.rank() == 0 {
            println!("{line}");
        }
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One launch of `n` ranks in `role`; rank 0's lines.
fn run(role: &str, n: usize, transport: &str, max: usize) -> Vec<String> {
    let exe = std::env::current_exe().unwrap();
    let hostfile = std::env::temp_dir().join(format!("compare-nuvec-{}.json", std::process::id()));
    let list: Vec<String> = (0..n)
        .map(|_| format!("[\"127.0.0.1:{}\"]", free_port()))
        .collect();
    std::fs::write(&hostfile, format!("[{}]", list.join(","))).unwrap();
    let coord = format!("127.0.0.1:{}", free_port());
    let kids: Vec<_> = (0..n)
        .map(|r| {
            let mut c = Command::new(&exe);
            c.env(ROLE, role)
                .env("COMPARE_NUVEC_MAX", max.to_string())
                .stdout(Stdio::piped());
            if role == "ring" {
                c.env("MLX_RANK", r.to_string())
                    .env("MLX_HOSTFILE", &hostfile);
            } else {
                c.env("RDMACOMM_RANK", r.to_string())
                    .env("RDMACOMM_WORLD_SIZE", n.to_string())
                    .env("RDMACOMM_COORDINATOR", &coord)
                    .env("RDMACOMM_TRANSPORT", transport);
            }
            c.spawn().unwrap()
        })
        .collect();
    let mut lines = Vec::new();
    for (r, k) in kids.into_iter().enumerate() {
        let out = k.wait_with_output().unwrap();
        assert!(out.status.success(), "{role} rank {r} failed");
        if r == 0 {
            lines = String::from_utf8_lossy(&out.stdout)
                .lines()
                .map(String::from)
                .collect();
        }
    }
    let _ = std::fs::remove_file(&hostfile);
    lines
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn launch() {
    let n: usize = arg("--ranks", "2").parse().expect("--ranks N");
    let rounds: usize = arg("--rounds", "3").parse().expect("--rounds R");
    let transport = arg("--transport", "tcp");
    let max: usize = arg("--max", &(64usize << 20).to_string())
        .parse()
        .expect("--max BYTES");
    // times[size index][column] over rounds: ring, nuvec over rdmacomm, transport, Comm,
    // nuvec's own share.
    let sz = sizes(max);
    let mut times = vec![vec![Vec::new(); 5]; sz.len()];
    for _ in 0..rounds {
        for role in ["ring", "rdmacomm"] {
            for line in run(role, n, &transport, max) {
                let f: Vec<&str> = line.split_whitespace().collect();
                if f.first() != Some(&"TIME") {
                    continue;
                }
                let i = sz
                    .iter()
                    .position(|s| s.to_string() == f[1])
                    .expect("a size");
                let num = |k: usize| f[k].parse::<f64>().expect("a time");
                if role == "ring" {
                    times[i][0].push(num(3));
                } else {
                    times[i][1].push(num(3));
                    times[i][4].push(num(5));
                    times[i][2].push(num(7));
                    times[i][3].push(num(9));
                }
            }
        }
    }
    println!(
        "nuvec all_sum(f32).eval(), {n} ranks, rdmacomm over {transport}, median of {rounds} \
         alternating rounds (us per call)"
    );
    println!(
        "| bytes | nuvec ring | nuvec over rdmacomm | ring / rdmacomm | nuvec's own share | \
         transport | Comm | transport / Comm |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (i, b) in sz.iter().enumerate() {
        let m: Vec<f64> = times[i].iter().map(|v| median(v.clone())).collect();
        println!(
            "| {b} | {:.1} | {:.1} | {:.2}x | {:.1} | {:.1} | {:.1} | {:.3} |",
            m[0],
            m[1],
            m[0] / m[1],
            m[4],
            m[2],
            m[3],
            m[2] / m[3]
        );
    }
}
