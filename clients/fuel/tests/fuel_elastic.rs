//! fuel's tensor-parallel layers go on after a lost rank: 4 ranks run a RowParallel layer (its
//! input features split across the ranks) against the whole layer; rank 2 is SIGKILLed at the
//! second step; the survivors shrink the transport, rebuild the layer on the new one (48
//! features over 3 ranks) and its output still equals the whole layer's.

mod harness;

use fuel::lazy::Tensor;
use fuel::{DType, Device, Shape};
use fuel_parallel::comm::Communicator;
use fuel_parallel::tensor_parallel::{Linear, RowParallel, ShardDim, TensorShard};
use harness::common::{spawn, transport_ready, Placement, CHILD};
use rdmacomm::fuel::Transport;
use std::time::Duration;

const NAME: &str = "fuel_layers_are_rebuilt_on_the_shrunk_transport";
const BATCH: usize = 5;
const FIN: usize = 48;
const FOUT: usize = 24;

fn draws(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 1000) as f32 / 500.0 - 1.0
        })
        .collect()
}

fn f32_tensor(v: &[f32], dims: &[usize]) -> Tensor {
    Tensor::from_f32(v.to_vec(), Shape::from_dims(dims), &Device::cpu()).unwrap()
}

fn f64s(t: &Tensor) -> fuel::Result<Vec<f64>> {
    let t = t.to_dtype(DType::F64)?;
    let b = fuel::pipelined_bridge::realize_one_bytes(t.graph(), t.node_id(), &Device::cpu())?;
    Ok(bytemuck::pod_collect_to_vec(&b))
}

/// This rank's RowParallel layer on `c` applied to its slice of the input; its output.
fn forward(c: &Transport, w: &[f32], bias: &[f32], x: &[f32]) -> fuel::Result<Vec<f64>> {
    let info = c.info();
    let (rank, n) = (info.rank, info.world_size);
    let per = FIN / n;
    let (a, b) = (rank * per, (rank + 1) * per);
    let rows: Vec<f32> = w[a * FOUT..b * FOUT].to_vec();
    let cols: Vec<f32> = (0..BATCH)
        .flat_map(|i| x[i * FIN + a..i * FIN + b].to_vec())
        .collect();
    let mine = Linear::from_f32(rows, per, FOUT, (rank == 0).then(|| bias.to_vec().into()))?;
    let shard = TensorShard {
        rank,
        world_size: n,
        dim: ShardDim::Row,
        original_shape: [FIN, FOUT],
    };
    let layer = RowParallel::new(mine, shard, c.clone());
    f64s(&layer.forward(&f32_tensor(&cols, &[BATCH, per]))?)
}

fn body() {
    let (w, bias, x) = (
        draws(7, FIN * FOUT),
        draws(11, FOUT),
        draws(13, BATCH * FIN),
    );
    let whole = Linear::from_f32(w.clone(), FIN, FOUT, Some(bias.clone().into())).unwrap();
    let want = f64s(&whole.forward(&f32_tensor(&x, &[BATCH, FIN])).unwrap()).unwrap();
    let mut c = Transport::from_env().unwrap();
    let mut step = 0;
    while step < 4 {
        if step == 1 && c.info().rank == 2 && c.comm().epoch() == 0 {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &std::process::id().to_string()])
                .status();
        }
        match forward(&c, &w, &bias, &x) {
            Ok(got) => {
                let worst = got
                    .iter()
                    .zip(&want)
                    .map(|(g, w)| (g - w).abs())
                    .fold(0.0, f64::max);
                assert!(worst < 1e-4, "step {step}: off by {worst}");
                step += 1;
            }
            Err(e) => {
                println!("FAILED step {step}: {e}");
                let (next, agreed) = c.shrink(step as u64).unwrap();
                c = next;
                // A rank whose step completed before the loss goes on where the others do: the
                // survivors resume from the least step any of them failed in.
                step = agreed.least as usize;
                println!(
                    "SHRUNK to {} ranks (old {:?})",
                    c.info().world_size,
                    agreed.members
                );
            }
        }
    }
    println!("DONE on {} ranks", c.info().world_size);
}

#[test]
fn fuel_layers_are_rebuilt_on_the_shrunk_transport() {
    if std::env::var(CHILD).is_ok_and(|v| v == NAME) {
        body();
        return;
    }
    if !transport_ready() {
        return;
    }
    let out = spawn(
        NAME,
        4,
        Placement::Local,
        &|_| vec![("RDMACOMM_TIMEOUT".to_string(), "20".to_string())],
        Duration::from_secs(120),
    );
    for x in &out {
        for l in x
            .output
            .lines()
            .filter(|l| ["FAILED", "SHRUNK", "DONE"].iter().any(|t| l.contains(t)))
        {
            println!("rank {}: {l}", x.rank);
        }
        if x.rank == 2 {
            assert_eq!(x.code, None, "rank 2 was killed: {}", x.output);
            continue;
        }
        assert_eq!(x.code, Some(0), "rank {}: {}", x.rank, x.output);
        assert!(
            x.output.contains("SHRUNK to 3 ranks (old [0, 1, 3])")
                && x.output.contains("DONE on 3 ranks"),
            "rank {}: {}",
            x.rank,
            x.output
        );
    }
}
