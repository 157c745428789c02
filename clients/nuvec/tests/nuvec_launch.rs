//! How a nuvec program meets its peers over rdmacomm, and the transport's nuvec 0.6 methods:
//! nuvec's own launch (`MLX_RANK` + `MLX_HOSTFILE`) unchanged, `sum_scatter` for every kind of
//! dtype, and `health` while idle before and after a peer leaves.

mod harness;

use harness::common::{over, Net};

use harness::common::{assert_all_ok, is_child, transport_ready, ENV_LOCK};
use harness::ranks_raw;
use nuvec_core::distributed::{self, Communicator};
use nuvec_core::{Array, Complex64, DType};
use rdmacomm::nuvec::Transport;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const MLX: &str = "a_nuvec_launch_with_mlx_hostfile_runs_unchanged";

/// A child of the MLX launch: nuvec's variables only (no RDMACOMM_RANK).
fn mlx_child() {
    let g = rdmacomm::nuvec::init(true).expect("init from MLX_RANK and MLX_HOSTFILE");
    let r = g.rank() as f32;
    let s = distributed::all_sum(&Array::from_slice(&[r, 1.0], [2]), None)
        .to_vec::<f32>()
        .unwrap();
    let n = g.size() as f32;
    assert_eq!(s, [n * (n - 1.0) / 2.0, n]);
    println!("MLX rank {} of {}", g.rank(), g.size());
}

#[test]
fn a_nuvec_launch_with_mlx_hostfile_runs_unchanged() {
    if is_child(MLX) {
        mlx_child();
        return;
    }
    if !transport_ready() {
        return;
    }
    let n = 3;
    let ports: Vec<u16> = (0..n).map(|_| harness::common::free_port()).collect();
    let list: Vec<String> = ports
        .iter()
        .map(|p| format!("[\"127.0.0.1:{p}\"]"))
        .collect();
    let hostfile = std::env::temp_dir().join(format!("rdmacomm-mlx-{}.json", std::process::id()));
    std::fs::write(&hostfile, format!("[{}]", list.join(", "))).unwrap();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = {
        let _env = ENV_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        (0..n)
            .map(|r| {
                let mut c = Command::new(&exe);
                c.args([MLX, "--exact", "--nocapture"])
                    .env(harness::common::CHILD, MLX)
                    .env("MLX_RANK", r.to_string())
                    .env("MLX_HOSTFILE", &hostfile)
                    .env("NUVEC_DISTRIBUTED_TIMEOUT", "20")
                    .stdin(Stdio::null())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped());
                for v in [
                    "RDMACOMM_RANK",
                    "RDMACOMM_WORLD_SIZE",
                    "RDMACOMM_COORDINATOR",
                ] {
                    c.env_remove(v);
                }
                for (k, v) in harness::common::net_vars(harness::common::net(), r) {
                    c.env(k, v);
                }
                c.spawn().unwrap()
            })
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let results: Vec<_> = children
        .into_iter()
        .enumerate()
        .map(|(rank, mut c)| {
            while c.try_wait().unwrap().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = c.kill();
            let out = c.wait_with_output().unwrap();
            harness::common::RankResult {
                rank,
                code: out.status.code(),
                output: format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ),
            }
        })
        .collect();
    let _ = std::fs::remove_file(&hostfile);
    assert_all_ok(&results);
    for (r, res) in results.iter().enumerate() {
        assert!(
            res.output.contains(&format!("MLX rank {r} of {n}")),
            "{}",
            res.output
        );
    }
}

/// nuvec 0.6's sum_scatter on the transport itself: every plan (direct, bool, widened,
/// complex) against the block sums computed here; then health while idle.
fn scatter_and_health() {
    let t = Transport::new(rdmacomm::Comm::from_env().unwrap());
    let (rank, size) = (t.rank(), t.size());
    let per = 5;
    // Rank r's element i of block b: small integers, exact in every dtype.
    let v = |r: usize, i: usize| ((r * 7 + i * 3) % 11) as i64 - 5;
    let check =
        |dtype: DType, bytes_of: &dyn Fn(i64) -> Vec<u8>, sum: &dyn Fn(&[i64]) -> Vec<u8>| {
            let input: Vec<u8> = (0..size * per).flat_map(|i| bytes_of(v(rank, i))).collect();
            let mut out = vec![0u8; input.len() / size];
            t.sum_scatter(dtype, &input, &mut out).unwrap();
            let want: Vec<u8> = (0..per)
                .flat_map(|i| {
                    let col: Vec<i64> = (0..size).map(|r| v(r, rank * per + i)).collect();
                    sum(&col)
                })
                .collect();
            assert_eq!(out, want, "{dtype:?}");
        };
    check(DType::F32, &|x| (x as f32).to_le_bytes().to_vec(), &|c| {
        (c.iter().sum::<i64>() as f32).to_le_bytes().to_vec()
    });
    check(DType::I16, &|x| (x as i16).to_le_bytes().to_vec(), &|c| {
        (c.iter().sum::<i64>() as i16).to_le_bytes().to_vec()
    });
    check(
        DType::U16,
        &|x| ((x + 60000) as u16).to_le_bytes().to_vec(),
        &|c| {
            (c.iter().map(|x| x + 60000).sum::<i64>() as u16)
                .to_le_bytes()
                .to_vec()
        },
    );
    check(
        DType::Bool,
        &|x| vec![(x > 0) as u8 * 3], // any non-zero byte reads as true
        &|c| vec![c.iter().any(|&x| x > 0) as u8],
    );
    check(
        DType::Complex64,
        &|x| {
            bytemuck_c(Complex64 {
                re: x as f32,
                im: -2.0 * x as f32,
            })
        },
        &|c| {
            let re = c.iter().map(|&x| x as f32).sum();
            let im = c.iter().map(|&x| -2.0 * x as f32).sum();
            bytemuck_c(Complex64 { re, im })
        },
    );
    // A wrong length is an argument error naming both lengths, and poisons nothing.
    let mut small = vec![0u8; 4];
    let err = t
        .sum_scatter(DType::F32, &[0u8; 4], &mut small)
        .unwrap_err()
        .to_string();
    if size > 1 {
        assert!(err.contains("sum_scatter"), "{err}");
    }
    t.health().unwrap();
    // The last rank leaves only once every other rank has seen its health and is past its
    // last collective: each tells it so (after a collective alone, a rank still finishing its
    // part would rightly fail on the departure).
    if rank + 1 < size {
        t.send(size - 1, &[1]).unwrap();
    } else {
        for q in 0..size - 1 {
            let mut b = [0u8; 1];
            t.recv(q, &mut b).unwrap();
            assert_eq!(b, [1], "from rank {q}");
        }
    }
    // The last rank dies (no exit handlers: as a crash would); the others' health names it
    // within a second, without a collective.
    if rank == size - 1 {
        // SAFETY: ends the process at once; nothing of it runs after.
        unsafe { libc::_exit(0) };
    }
    let start = Instant::now();
    let err = loop {
        match t.health() {
            Ok(()) if start.elapsed() < Duration::from_secs(5) => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Ok(()) => panic!("health still Ok 5 s after rank {} left", size - 1),
            Err(e) => break e.to_string(),
        }
    };
    assert!(
        err.contains(&format!("rank {}", size - 1)) && err.contains("closed"),
        "{err}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
}

fn bytemuck_c(z: Complex64) -> Vec<u8> {
    [z.re.to_le_bytes(), z.im.to_le_bytes()].concat()
}

#[test]
fn sum_scatter_and_health_as_nuvec_06_defines_them() {
    for n in [2, 3] {
        if ranks_raw(
            "sum_scatter_and_health_as_nuvec_06_defines_them",
            n,
            &[],
            scatter_and_health,
        )
        .is_none()
        {
            return;
        }
    }
}

/// Two calls at once on one transport, from two threads: the second is refused (the two could
/// pair differently on each rank), naming the rank once; the first completes. The message used
/// to say "rank 0:" twice.
fn two_at_once() {
    let t = std::sync::Arc::new(Transport::new(rdmacomm::Comm::from_env().unwrap()));
    let rank = t.rank();
    if rank == 1 {
        std::thread::sleep(Duration::from_millis(600));
    }
    let first = t.clone();
    let under_way = std::thread::spawn(move || {
        let mut b = 1.0f32.to_le_bytes();
        first
            .all_reduce(distributed::AllReduce::Sum, DType::F32, &mut b)
            .map(|()| f32::from_le_bytes(b))
    });
    if rank == 0 {
        std::thread::sleep(Duration::from_millis(200));
        let mut b = 1.0f32.to_le_bytes();
        let err = t
            .all_reduce(distributed::AllReduce::Sum, DType::F32, &mut b)
            .unwrap_err()
            .to_string();
        assert!(err.contains("another thread's call runs"), "{err}");
        assert_eq!(err.matches("rank 0:").count(), 1, "{err}");
    }
    assert_eq!(under_way.join().unwrap().unwrap(), 2.0);
}

#[test]
fn a_second_call_at_once_is_refused_naming_the_rank_once() {
    ranks_raw(
        "a_second_call_at_once_is_refused_naming_the_rank_once",
        2,
        &[],
        two_at_once,
    );
}

crate::matrix!(
    a_nuvec_launch_with_mlx_hostfile_runs_unchanged,
    sum_scatter_and_health_as_nuvec_06_defines_them,
    a_second_call_at_once_is_refused_naming_the_rank_once
);
