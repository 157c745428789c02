//! Data-parallel training on CPUs: logistic regression with SGD on synthetic data sharded across
//! ranks; every step the gradients are summed with all_reduce and averaged, so every rank makes
//! the same update and prints the same loss curve. At the end the weights are checked to be
//! bit-identical on every rank.
//!
//! `target/release/rdmacomm-run -n 4 -- target/release/examples/train` (RDMA where a device is
//! usable, TCP otherwise), or inside the soft-RoCE VM: `tools/rxe-vm -- ...`.

use rdmacomm::{AllReduce, Group};

const FEATURES: usize = 16;
const SAMPLES: usize = 8192;
const STEPS: usize = 60;
const LR: f32 = 0.5;

/// A deterministic sample (x, y): the same data set whatever the number of ranks.
fn sample(i: usize) -> ([f32; FEATURES], f32) {
    let mut s = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    let mut x = [0f32; FEATURES];
    x.iter_mut().for_each(|v| *v = next());
    let truth: f32 = x
        .iter()
        .enumerate()
        .map(|(j, v)| v * (j as f32 - 7.5) / 4.0)
        .sum::<f32>()
        + 0.3 * next();
    (x, if truth > 0.0 { 1.0 } else { 0.0 })
}

fn main() -> rdmacomm::Result<()> {
    let g = Group::from_env()?;
    let (rank, n) = (g.rank(), g.size());
    let shard: Vec<_> = (rank..SAMPLES).step_by(n).map(sample).collect();
    let mut w = [0f32; FEATURES + 1]; // weights and bias
    for step in 0..=STEPS {
        // Local gradient sum, loss sum and count, reduced across ranks in one all_reduce.
        let mut acc = vec![0f32; FEATURES + 3];
        for (x, y) in &shard {
            let z: f32 = x.iter().zip(&w).map(|(a, b)| a * b).sum::<f32>() + w[FEATURES];
            let p = 1.0 / (1.0 + (-z).exp());
            for j in 0..FEATURES {
                acc[j] += (p - y) * x[j];
            }
            acc[FEATURES] += p - y;
            acc[FEATURES + 1] -= y * p.max(1e-7).ln() + (1.0 - y) * (1.0 - p).max(1e-7).ln();
            acc[FEATURES + 2] += 1.0;
        }
        g.all_reduce(&mut acc, AllReduce::Sum)?;
        let count = acc[FEATURES + 2];
        if step % 10 == 0 {
            println!("step {step:3} loss {:.6}", acc[FEATURES + 1] / count);
        }
        if step < STEPS {
            for j in 0..=FEATURES {
                w[j] -= LR * acc[j] / count;
            }
        }
    }
    // Bit identity of the final weights across ranks.
    let bits: Vec<u32> = w.iter().map(|v| v.to_bits()).collect();
    let mut all = vec![0u32; bits.len() * n];
    g.all_gather(&bits, &mut all)?;
    let same = all.chunks(bits.len()).all(|c| c == bits.as_slice());
    if rank == 0 {
        println!(
            "final weights {} on all {n} ranks (bias {:.5}, w[0] {:.5}, w[15] {:.5})",
            if same { "bit-identical" } else { "DIFFER" },
            w[FEATURES],
            w[0],
            w[15]
        );
    }
    if !same {
        std::process::exit(1);
    }
    Ok(())
}
