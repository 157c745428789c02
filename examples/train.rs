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
//!
//! `rdmacomm-run -n 4 --max-restarts 1 -- train --elastic`: a rank is lost mid-training and the
//! job goes on. Rank 2 SIGKILLs itself in step 20 and the launcher starts a replacement; the three
//! survivors shrink, agree on the last step every one completed, roll back to it and redo the
//! next; at step 30 they grow by the replacement, which receives the step and the weights by
//! broadcast. It prints the time from the fault to the first completed step after it, and
//! checks that the final weights are bit-identical on every rank (and how far they are from a
//! run that never failed: the sums' order differs while three ranks share the samples).
//! `train --elastic --relaunch DIR` does what a job does without shrink, for comparison: it
//! checkpoints to DIR every 8 steps, ends at the fault, and resumes when started again.

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

/// Backward over `shard` into `grad`, then each bucket all-reduced, in the overlapped run's
/// order (the blocking run and the elastic one).
fn blocking(
    c: &Comm,
    w: &[f32],
    shard: &[usize],
    grad: &mut [f32],
    loss: &mut f32,
) -> rdmacomm::Result<()> {
    let buckets = || (0..LAYERS.div_ceil(per_bucket())).rev();
    for b in buckets() {
        for l in b * per_bucket()..((b + 1) * per_bucket()).min(LAYERS) {
            let r = l * PARAMS..(l + 1) * PARAMS;
            backward(l, &w[r.clone()], shard, &mut grad[r], loss);
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
    Ok(())
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
            blocking(c, &w, &shard, &mut grad, &mut loss)?;
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

/// The step inside which rank 2 is lost, and the one before which its replacement joins.
const FAULT_STEP: usize = 20;
const GROW_STEP: usize = 30;
/// How often a job that relaunches on failure checkpoints.
const CHECKPOINT_EVERY: usize = 8;

/// The wall clock in milliseconds (to time a fault across processes).
fn unix_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

/// One step of blocking training on `c` from weights `w`: backward over this rank's shard, the
/// buckets all-reduced, the update; the loss summed over all ranks.
fn step_on(c: &Comm, w: &mut [f32], grad: &mut [f32]) -> rdmacomm::Result<f32> {
    let shard: Vec<usize> = (c.rank()..SAMPLES).step_by(c.size()).collect();
    let mut loss = 0f32;
    blocking(c, w, &shard, grad, &mut loss)?;
    let mut l = [loss];
    c.all_reduce(AllReduce::Sum, DType::f32, bytemuck::cast_slice_mut(&mut l))?;
    for (wi, gi) in w.iter_mut().zip(grad.iter()) {
        *wi -= LR * gi / SAMPLES as f32;
    }
    Ok(l[0] / (SAMPLES * LAYERS * PARAMS) as f32)
}

/// Whether `w` is the same, bit for bit, on every rank of `c`.
fn same_everywhere(c: &Comm, w: &[f32]) -> rdmacomm::Result<bool> {
    let bits: Vec<u32> = w.iter().map(|v| v.to_bits()).collect();
    let mut all = vec![0u32; bits.len() * c.size()];
    c.all_gather(
        bytemuck::cast_slice(&bits),
        bytemuck::cast_slice_mut(&mut all),
    )?;
    Ok(all.chunks(bits.len()).all(|q| q == bits.as_slice()))
}

/// Rank 0's step and weights, on every rank (a newcomer's start).
fn share(c: &Comm, step: &mut usize, w: &mut [f32]) -> rdmacomm::Result<()> {
    let mut s = (*step as u64).to_le_bytes();
    c.broadcast(0, &mut s)?;
    *step = u64::from_le_bytes(s) as usize;
    c.broadcast(0, bytemuck::cast_slice_mut(w))
}

/// Training that loses rank 2 at [`FAULT_STEP`] and takes its replacement at [`GROW_STEP`].
///
/// With `relaunch` (a directory), what a job does today instead: no shrink; rank 0 checkpoints
/// every [`CHECKPOINT_EVERY`] steps there, the lost rank ends the job, and the job started again
/// resumes from the checkpoint (the fault strikes once).
fn elastic(relaunch: Option<std::path::PathBuf>) -> rdmacomm::Result<()> {
    let mut w = vec![0f32; LAYERS * PARAMS];
    let mut grad = vec![0f32; LAYERS * PARAMS];
    // The weights after the last step this rank completed, and after the one before.
    let (mut done, mut before) = (0usize, w.clone());
    let mut step = 0;
    let started = Instant::now();
    // A replacement (`RDMACOMM_REPLACEMENT=1`, set by the launcher) joins the running group.
    let mut c = Comm::from_env()?;
    let newcomer = c.rejoined();
    let mut struck = false;
    if let Some(dir) = &relaunch {
        struck = dir.join("struck").exists();
        if let Ok(b) = std::fs::read(dir.join("checkpoint")) {
            step = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
            bytemuck::cast_slice_mut(&mut w).copy_from_slice(&b[8..]);
            done = step;
            if c.rank() == 0 {
                println!("step {step:3}: resumed from the checkpoint");
            }
        }
    }
    if newcomer {
        share(&c, &mut step, &mut w)?;
        println!(
            "[newcomer] joined as rank {} of {} at step {step}, weights received, {:.1} ms \
             after it started",
            c.rank(),
            c.size(),
            started.elapsed().as_secs_f64() * 1e3
        );
        done = step;
    }
    let mut fault: Option<Instant> = None;
    let mut grown = newcomer;
    while step < STEPS {
        if step == FAULT_STEP && c.rank() == 2 && !grown && !struck && c.epoch() == 0 {
            // SIGKILL in step 20; the launcher starts the replacement.
            if let Some(dir) = &relaunch {
                let _ = std::fs::write(dir.join("struck"), b"");
            }
            println!("fault: SIGKILL at {} ms", unix_ms());
            // As this rank starts the step: the others are inside it, waiting on its
            // gradients (a signal from another thread could land a step later).
            // SAFETY: kill(2) on this process; no memory is involved.
            unsafe { libc::kill(std::process::id() as i32, libc::SIGKILL) };
        }
        if step == GROW_STEP && !grown && relaunch.is_none() {
            let t = Instant::now();
            let next = c.grow(1)?;
            drop(c);
            c = next;
            share(&c, &mut step, &mut w)?;
            grown = true;
            if c.rank() == 0 {
                println!(
                    "step {step:3}: grew to {} ranks in {:.1} ms; the newcomer has the weights",
                    c.size(),
                    t.elapsed().as_secs_f64() * 1e3
                );
            }
        }
        let snapshot = w.clone();
        match step_on(&c, &mut w, &mut grad) {
            Ok(loss) => {
                (done, before) = (step + 1, snapshot);
                step += 1;
                if step == FAULT_STEP + 1 && c.rank() == 0 && (c.epoch() > 0 || struck) {
                    println!("back: step {step} completed again at {} ms", unix_ms());
                }
                if let Some(dir) = relaunch.as_ref().filter(|_| c.rank() == 0) {
                    if step % CHECKPOINT_EVERY == 0 {
                        let mut b = (step as u64).to_le_bytes().to_vec();
                        b.extend_from_slice(bytemuck::cast_slice(&w));
                        let tmp = dir.join("checkpoint.tmp");
                        std::fs::write(&tmp, b)
                            .and_then(|()| std::fs::rename(&tmp, dir.join("checkpoint")))
                            .expect("writing the checkpoint");
                    }
                }
                if let Some(t) = fault.take() {
                    if c.rank() == 0 {
                        println!(
                            "step {step:3}: first step completed {:.1} ms after the fault was seen",
                            t.elapsed().as_secs_f64() * 1e3
                        );
                    }
                }
                if step % 10 == 0 && c.rank() == 0 {
                    println!("step {step:3} loss {loss:.6} ({} ranks)", c.size());
                }
            }
            Err(e) if relaunch.is_some() => {
                // What a job without shrink does: it ends, and its launcher starts it again.
                if c.rank() == 0 {
                    println!("step {step:3} failed: {e}; the job ends");
                }
                std::process::exit(3);
            }
            Err(e) => {
                let t = Instant::now();
                if c.rank() == 0 || c.rank() == 1 {
                    println!("step {step:3} failed: {e}");
                }
                let (next, agreed) = c.shrink(done as u64)?;
                drop(c);
                c = next;
                // Back to the last step every survivor completed; a rank one step ahead rolls
                // back (its update of that step undone from its snapshot).
                let least = agreed.least as usize;
                if done > least {
                    w.copy_from_slice(&before);
                } else {
                    w.copy_from_slice(&snapshot);
                }
                step = least;
                fault = Some(t);
                if c.rank() == 0 {
                    println!(
                        "step {step:3}: shrunk to ranks {:?} of the old group in {:.1} ms; \
                         they agree to go on from step {least}",
                        agreed.members,
                        t.elapsed().as_secs_f64() * 1e3
                    );
                }
            }
        }
    }
    let (rank, n) = (c.rank(), c.size());
    let same = same_everywhere(&c, &w)?;
    if rank == 0 {
        // A run that never failed, on this rank alone (every sample in order).
        let mut r = vec![0f32; LAYERS * PARAMS];
        let mut g = vec![0f32; PARAMS];
        let every: Vec<usize> = (0..SAMPLES).collect();
        for _ in 0..STEPS {
            for l in 0..LAYERS {
                let wl = &mut r[l * PARAMS..(l + 1) * PARAMS];
                backward(l, wl, &every, &mut g, &mut 0.0);
                for (wi, gi) in wl.iter_mut().zip(&g) {
                    *wi -= LR * gi / SAMPLES as f32;
                }
            }
        }
        let far = w
            .iter()
            .zip(&r)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        println!(
            "final weights {} on all {n} ranks (w[0] {:.5}, w[last] {:.5}); at most {far:.2e} \
             from a run that never failed",
            if same { "bit-identical" } else { "DIFFER" },
            w[0],
            w[w.len() - 1]
        );
    }
    if !same {
        std::process::exit(1);
    }
    Ok(())
}

fn main() -> rdmacomm::Result<()> {
    if std::env::args().any(|a| a == "--elastic") {
        let args: Vec<String> = std::env::args().collect();
        let relaunch = args
            .iter()
            .position(|a| a == "--relaunch")
            .and_then(|i| args.get(i + 1))
            .map(std::path::PathBuf::from);
        return elastic(relaunch);
    }
    let c = Comm::from_env()?;
    let (rank, n) = (c.rank(), c.size());
    let (w_block, ms_block) = train(&c, false)?;
    let (w, ms_overlap) = train(&c, true)?;
    // Bit identity of the final weights across ranks, and with the blocking run.
    let same = same_everywhere(&c, &w)?;
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
