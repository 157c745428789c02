//! compare-fuel: what rdmacomm's fuel transport costs beside the same bytes through
//! what any transport must do by hand, and fuel's own `RowParallel::forward` of a 4096 x 4096
//! f32 layer.
//!
//! `compare-fuel [--ranks N] [--transport tcp|shm|auto|rdma] [--rounds R]` runs N ranks on this
//! host. For f32 tensors of 4 KiB to 16 MiB it alternates, R rounds, the transport's
//! `all_reduce(&tensor, Sum)` (reading the tensor out of fuel, the ranks' header check, the
//! reduction, and the result built on the tensor's graph) with the same done by hand (fuel's
//! `realize_one_bytes`, `Comm::all_reduce`, `const_f32_like`), and shows `Comm::all_reduce`
//! alone on a buffer of the same bytes, and prints the medians. Then it times `RowParallel::forward` (batch 64: a
//! 1 MiB all_reduce) against the layer's local matmul alone.

use fuel::lazy::Tensor;
use fuel::{Device, Shape};
use fuel_parallel::comm::{Communicator, ReduceOp};
use fuel_parallel::tensor_parallel::{Linear, RowParallel, ShardDim, TensorShard};
use rdmacomm::fuel::Transport;
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::Instant;

fn arg(name: &str, default: &str) -> String {
    let a: Vec<String> = std::env::args().collect();
    a.iter()
        .position(|x| x == name)
        .and_then(|i| a.get(i + 1).cloned())
        .unwrap_or_else(|| default.to_string())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Microseconds per call, the best of 3 bursts of `reps`.
fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..3)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..reps {
                f();
            }
            t.elapsed().as_secs_f64() * 1e6 / reps as f64
        })
        .fold(f64::MAX, f64::min)
}

fn rank() {
    let rounds: usize = std::env::var("COMPARE_FUEL_ROUNDS")
        .unwrap()
        .parse()
        .unwrap();
    let c = Transport::from_env().expect("rdmacomm");
    let info = c.info();
    let (r, n) = (info.rank, info.world_size);
    let cpu = Device::cpu();
    let mut bytes = 4096;
    while bytes <= 16 << 20 {
        let elems = bytes / 4;
        // A fresh graph for every call: fuel's graphs keep every node (and constant) added to
        // them, so reusing one would time a growing graph.
        let ones: std::sync::Arc<[f32]> = vec![1.0f32; elems].into();
        let fresh = || {
            Tensor::from_f32(ones.clone(), Shape::from_dims(&[elems / 1024, 1024]), &cpu).unwrap()
        };
        let mut buf = vec![0u8; bytes];
        let reps = ((32usize << 20) / bytes).clamp(3, 100);
        let shape = || Shape::from_dims(&[elems / 1024, 1024]);
        let (mut adapter, mut by_hand, mut bare) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds {
            adapter.push(time(reps, || {
                let t = fresh();
                let out = c.all_reduce(&t, ReduceOp::Sum).unwrap();
                assert_eq!(out.graph_id(), t.graph_id());
            }));
            // The least any transport must do: read the tensor out, reduce, build the result.
            by_hand.push(time(reps, || {
                let t = fresh();
                let mut b = fuel::pipelined_bridge::realize_one_bytes(t.graph(), t.node_id(), &cpu)
                    .unwrap();
                rdmacomm::Communicator::all_reduce(
                    c.comm(),
                    rdmacomm::AllReduce::Sum,
                    rdmacomm::DType::f32,
                    &mut b,
                )
                .unwrap();
                let v: Vec<f32> = bytemuck::pod_collect_to_vec(&b);
                t.const_f32_like(v, shape()).unwrap();
            }));
            bare.push(time(reps, || {
                rdmacomm::Communicator::all_reduce(
                    c.comm(),
                    rdmacomm::AllReduce::Sum,
                    rdmacomm::DType::f32,
                    &mut buf,
                )
                .unwrap();
            }));
        }
        if r == 0 {
            println!(
                "ALLREDUCE {bytes} {:.1} {:.1} {:.1}",
                median(adapter),
                median(by_hand),
                median(bare)
            );
        }
        bytes *= 4;
    }
    // RowParallel over a 4096 x 4096 layer: this rank's 4096/n input rows.
    let (fin, fout, batch) = (4096, 4096, 64);
    let per = fin / n;
    let w: Vec<f32> = (0..per * fout)
        .map(|i| ((i * 7 + r) % 13) as f32 * 1e-3)
        .collect();
    let x: Vec<f32> = (0..batch * per)
        .map(|i| ((i * 3) % 11) as f32 * 1e-2)
        .collect();
    let shard = TensorShard {
        rank: r,
        world_size: n,
        dim: ShardDim::Row,
        original_shape: [fin, fout],
    };
    let lin = Linear::from_f32(w, per, fout, None).unwrap();
    let row = RowParallel::new(lin.clone(), shard, c.clone());
    let x: std::sync::Arc<[f32]> = x.into();
    let xt = || Tensor::from_f32(x.clone(), Shape::from_dims(&[batch, per]), &cpu).unwrap();
    let realise = |t: &Tensor| {
        fuel::pipelined_bridge::realize_one_bytes(t.graph(), t.node_id(), &cpu).unwrap()
    };
    let (mut fwd, mut local) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        fwd.push(time(3, || {
            realise(&row.forward(&xt()).unwrap());
        }));
        local.push(time(3, || {
            realise(&lin.forward(&xt()).unwrap());
        }));
    }
    if r == 0 {
        println!("ROWPARALLEL {:.1} {:.1}", median(fwd), median(local));
    }
}

fn main() {
    if std::env::var("RDMACOMM_RANK").is_ok() {
        return rank();
    }
    let n: usize = arg("--ranks", "2").parse().expect("--ranks N");
    let transport = arg("--transport", "tcp");
    let rounds = arg("--rounds", "5");
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let exe = std::env::current_exe().unwrap();
    let kids: Vec<_> = (0..n)
        .map(|r| {
            Command::new(&exe)
                .env("RDMACOMM_RANK", r.to_string())
                .env("RDMACOMM_WORLD_SIZE", n.to_string())
                .env("RDMACOMM_COORDINATOR", format!("127.0.0.1:{port}"))
                .env("RDMACOMM_TRANSPORT", &transport)
                .env("COMPARE_FUEL_ROUNDS", &rounds)
                .stdout(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut lines = String::new();
    for (r, k) in kids.into_iter().enumerate() {
        let out = k.wait_with_output().unwrap();
        assert!(out.status.success(), "rank {r} failed");
        if r == 0 {
            lines = String::from_utf8_lossy(&out.stdout).into_owned();
        }
    }
    println!(
        "fuel over rdmacomm, {n} ranks over {transport}, median of {rounds} alternating rounds"
    );
    println!(
        "| f32 bytes | transport all_reduce (us) | by hand: realise + Comm::all_reduce + \
         const_f32_like (us) | transport / by hand | Comm::all_reduce alone (us) |"
    );
    println!("|---:|---:|---:|---:|---:|");
    for l in lines.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        match f.as_slice() {
            ["ALLREDUCE", b, a, h, d] => {
                let p = |x: &str| x.parse::<f64>().unwrap();
                let (a, h, d) = (p(a), p(h), p(d));
                println!("| {b} | {a:.1} | {h:.1} | {:.3} | {d:.1} |", a / h);
            }
            ["ROWPARALLEL", fwd, local] => {
                let (fw, lo): (f64, f64) = (fwd.parse().unwrap(), local.parse().unwrap());
                println!(
                    "\nRowParallel::forward, 4096 x 4096 f32, batch 64 (a 1 MiB all_reduce): \
                     {:.2} ms; its local matmul alone {:.2} ms; the all_reduce's share {:.2} ms",
                    fw / 1e3,
                    lo / 1e3,
                    (fw - lo) / 1e3
                );
            }
            _ => {}
        }
    }
}
