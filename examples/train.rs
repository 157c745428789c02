//! Data-parallel training on CPUs with gradient buckets, as PyTorch DDP does it: the model's
//! layers are fitted by SGD to targets drawn from each rank's shard of a synthetic data set;
//! backward produces the gradients layer by layer from the last, and each bucket of layers
//! (`BUCKET_BYTES`, DDP's `bucket_cap_mb`) is all-reduced as soon as its gradients exist, while
//! backward goes on with the next (`Comm::overlap`); the update waits for every bucket.
//!
//! It trains twice from the same start, without overlap (each bucket all-reduced after the whole
//! backward) and with it, prints both loss curves and step times, and checks that the final
//! weights are bit-identical on every rank and between the two runs.
//!
//! `target/release/rdmacomm-run -n 4 -- target/release/examples/train` (RDMA where a device is
//! usable, TCP otherwise), or inside the soft-RoCE VM: `tools/rxe-vm -- ...`.

use rdmacomm::{AllReduce, Comm, Communicator, DType};
use std::time::Instant;

/// Layers, and parameters in each.
const LAYERS: usize = 8;
const PARAMS: usize = 16 << 10;
/// Gradient bucket size (bytes): whole layers, at least one.
const BUCKET_BYTES: usize = 128 << 10;
const SAMPLES: usize = 16;
const STEPS: usize = 60;
const LR: f32 = 0.2;

/// A hash of `k` in [-1, 1).
fn unit(k: usize) -> f32 {
    let mut x = k as u64 ^ 0x9E37_79B9_7F4A_7C15;
    x ^= x >> 33;
    x = x.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    x ^= x >> 29;
    (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// Sample `s`'s target for parameter `i` of layer `l`: a signal common to all samples plus
/// noise; the same data set whatever the number of ranks.
fn target(s: usize, l: usize, i: usize) -> f32 {
    let p = l * PARAMS + i;
    unit(p) + 0.25 * unit((s + 1) * LAYERS * PARAMS + p)
}

/// Backward of layer `l` over this rank's samples: the gradient sum of
/// 0.5 * |w - t(s)|^2 into `g`, and the loss sum into `loss`.
fn backward(l: usize, w: &[f32], shard: &[usize], g: &mut [f32], loss: &mut f32) {
    g.fill(0.0);
    for &s in shard {
        for (i, (gi, wi)) in g.iter_mut().zip(w).enumerate() {
            let d = wi - target(s, l, i);
            *gi += d;
            *loss += 0.5 * d * d;
        }
    }
}

/// Layers per bucket.
fn per_bucket() -> usize {
    (BUCKET_BYTES / (PARAMS * 4)).max(1)
}

/// Trains from zero; returns the weights and the mean step time (ms).
fn train(c: &Comm, overlap: bool) -> rdmacomm::Result<(Vec<f32>, f64)> {
    let (rank, n) = (c.rank(), c.size());
    let shard: Vec<usize> = (rank..SAMPLES).step_by(n).collect();
    let mut w = vec![0f32; LAYERS * PARAMS];
    let mut grad = vec![0f32; LAYERS * PARAMS];
    let t0 = Instant::now();
    for step in 0..=STEPS {
        let mut loss = 0f32;
        if overlap {
            let (g, w, shard, loss) = (&mut grad[..], &w[..], &shard[..], &mut loss);
            c.overlap(move |s| -> rdmacomm::Result<()> {
                let mut pending = Vec::new();
                let mut rest = g;
                for b in (0..LAYERS.div_ceil(per_bucket())).rev() {
                    let first = b * per_bucket();
                    let (head, bucket) = rest.split_at_mut(first * PARAMS);
                    for (j, gl) in bucket.chunks_mut(PARAMS).enumerate() {
                        let l = first + j;
                        backward(l, &w[l * PARAMS..(l + 1) * PARAMS], shard, gl, loss);
                    }
                    // In flight while backward produces the next bucket.
                    pending.push(s.all_reduce(bucket, AllReduce::Sum)?);
                    rest = head;
                }
                for p in pending {
                    p.wait()?;
                }
                Ok(())
            })??;
        } else {
            // The same buckets in the same order, each all-reduced after the whole backward.
            let buckets = || (0..LAYERS.div_ceil(per_bucket())).rev();
            for b in buckets() {
                for l in b * per_bucket()..((b + 1) * per_bucket()).min(LAYERS) {
                    let r = l * PARAMS..(l + 1) * PARAMS;
                    backward(l, &w[r.clone()], &shard, &mut grad[r], &mut loss);
                }
            }
            for b in buckets() {
                let r = b * per_bucket() * PARAMS..((b + 1) * per_bucket()).min(LAYERS) * PARAMS;
                c.all_reduce(
                    AllReduce::Sum,
                    DType::f32,
                    bytemuck::cast_slice_mut(&mut grad[r]),
                )?;
            }
        }
        let mut l = [loss];
        c.all_reduce(AllReduce::Sum, DType::f32, bytemuck::cast_slice_mut(&mut l))?;
        if step % 10 == 0 && rank == 0 {
            let mode = if overlap { "overlapped" } else { "blocking" };
            println!(
                "step {step:3} loss {:.6} ({mode})",
                l[0] / (SAMPLES * LAYERS * PARAMS) as f32
            );
        }
        if step < STEPS {
            for (wi, gi) in w.iter_mut().zip(&grad) {
                *wi -= LR * gi / SAMPLES as f32;
            }
        }
    }
    let ms = t0.elapsed().as_secs_f64() * 1e3 / (STEPS + 1) as f64;
    Ok((w, ms))
}

fn main() -> rdmacomm::Result<()> {
    let c = Comm::from_env()?;
    let (rank, n) = (c.rank(), c.size());
    let (w_block, ms_block) = train(&c, false)?;
    let (w, ms_overlap) = train(&c, true)?;
    // Bit identity of the final weights across ranks, and with the blocking run.
    let bits: Vec<u32> = w.iter().map(|v| v.to_bits()).collect();
    let mut all = vec![0u32; bits.len() * n];
    c.all_gather(
        bytemuck::cast_slice(&bits),
        bytemuck::cast_slice_mut(&mut all),
    )?;
    let same = all.chunks(bits.len()).all(|q| q == bits.as_slice());
    let same_runs = w
        .iter()
        .zip(&w_block)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    if rank == 0 {
        println!(
            "step time: {ms_block:.2} ms blocking, {ms_overlap:.2} ms with overlap \
             ({} buckets of {} KiB, {} parameters)",
            LAYERS.div_ceil(per_bucket()),
            (per_bucket() * PARAMS * 4) >> 10,
            LAYERS * PARAMS
        );
        println!(
            "final weights {} on all {n} ranks, {} between the runs (w[0] {:.5}, w[last] {:.5})",
            if same { "bit-identical" } else { "DIFFER" },
            if same_runs { "identical" } else { "DIFFERENT" },
            w[0],
            w[w.len() - 1]
        );
    }
    if !same || !same_runs {
        std::process::exit(1);
    }
    Ok(())
}
