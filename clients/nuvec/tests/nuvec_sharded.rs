//! nuvec-nn's tensor-parallel layers across processes over rdmacomm: a column- then
//! row-parallel pair, its gradient, its quantized form and a tensor-parallel attention block,
//! each against the same model run whole in one process.

mod harness;

use harness::common::{over, Net};

use harness::ranks;
use nuvec::distributed::Group;
use nuvec::{grad, random, Array, DType, Quant};
use nuvec_nn::sharded::{AllToShardedLinear, ShardedToAllLinear};
use nuvec_nn::{Linear, QuantizedLinear};

/// The largest element-wise difference, after checking the shapes agree.
fn worst(name: &str, got: &Array, want: &Array) -> f32 {
    assert_eq!(got.shape(), want.shape(), "{name}");
    let (g, w) = (got.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
    g.iter()
        .zip(&w)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
}

fn near(name: &str, got: &Array, want: &Array, tol: f32) {
    let d = worst(name, got, want);
    assert!(d <= tol, "{name}: {d} off");
}

/// Every rank draws the same weights (one seed) and checks its sharded result against the
/// whole layers it also holds.
fn layer_pair(g: Group) {
    random::seed(29);
    let x = random::normal([5, 64], DType::F32, 0.0, 1.0, None);
    let first = Linear::new(64, 128);
    let second = Linear::new(128, 40);
    let col = AllToShardedLinear::from_linear(&first, &g).unwrap();
    let row = ShardedToAllLinear::from_linear(&second, &g).unwrap();
    let whole = |x: &Array| second.forward(&nuvec_nn::gelu_approx(&first.forward(x)));
    let split = |x: &Array| row.forward(&nuvec_nn::gelu_approx(&col.forward(x)));
    near("pair", &split(&x), &whole(&x), 1e-4);
    // This rank holds its slice of the first layer's features.
    let per = 128 / g.size() as i32;
    let r = g.rank() as i32;
    near(
        "column slice",
        &col.forward(&x),
        &first.forward(&x).i((.., r * per..(r + 1) * per)),
        1e-5,
    );
    // The input's gradient through the split pair (sum_gradients on the way back) is the
    // whole pair's.
    let dsplit = grad(|x: &Array| {
        let y = split(x);
        y.multiply(&y).sum(..)
    })(&x)
    .unwrap();
    let dwhole = grad(|x: &Array| {
        let y = whole(x);
        y.multiply(&y).sum(..)
    })(&x)
    .unwrap();
    near("input gradient", &dsplit, &dwhole, 1e-3);
    // Quantized (4-bit affine, groups of 32): the split pair equals the whole quantized pair.
    let (q1, q2) = (
        QuantizedLinear::from_linear_with(&first, Quant::affine(32, 4)),
        QuantizedLinear::from_linear_with(&second, Quant::affine(32, 4)),
    );
    let want = q2.forward(&nuvec_nn::gelu_approx(&q1.forward(&x)));
    let got = ShardedToAllLinear::from_quantized(&q2, &g)
        .unwrap()
        .forward(&nuvec_nn::gelu_approx(
            &AllToShardedLinear::from_quantized(&q1, &g)
                .unwrap()
                .forward(&x),
        ));
    near("quantized pair", &got, &want, 1e-4);
    // A layer whose features do not split evenly is refused, naming it.
    let odd = Linear::new(64, 4 * g.size() as i32 + 1);
    let err = AllToShardedLinear::from_linear(&odd, &g)
        .unwrap_err()
        .to_string();
    assert!(err.contains("AllToShardedLinear"), "{err}");
}

#[test]
fn sharded_layers_equal_the_whole_layers() {
    for n in [2, 4] {
        if ranks("sharded_layers_equal_the_whole_layers", n, layer_pair).is_none() {
            return;
        }
    }
}

/// A causal self-attention block with a residual MLP: 4 heads of 6 over width 24, an MLP of
/// 72. Split by heads and hidden units: q, k, v and the MLP's first layer column-parallel, the
/// output projection and the MLP's second layer row-parallel.
struct Block {
    q: Linear,
    k: Linear,
    v: Linear,
    out: Linear,
    mlp_in: Linear,
    mlp_out: Linear,
}

const HEAD: i32 = 6;

fn attend(q: &Array, k: &Array, v: &Array) -> Array {
    let t = q.shape()[0];
    let heads = q.shape()[1] / HEAD;
    let by_head = |a: &Array| a.reshape([t, heads, HEAD]).transpose([1, 0, 2]);
    let (q, k, v) = (by_head(q), by_head(k), by_head(v));
    let scores = q
        .matmul(&k.transpose([0, 2, 1]))
        .multiply(1.0 / (HEAD as f32).sqrt());
    let i = nuvec::ops::arange(0, t, 1);
    let visible = i.reshape([t, 1]).greater_equal(i.reshape([1, t]));
    let p = nuvec::ops::softmax(&visible.select(&scores, f32::NEG_INFINITY), -1);
    p.matmul(&v).transpose([1, 0, 2]).reshape([t, heads * HEAD])
}

impl Block {
    fn new() -> Block {
        Block {
            q: Linear::new(24, 24),
            k: Linear::new(24, 24),
            v: Linear::new(24, 24),
            out: Linear::new(24, 24),
            mlp_in: Linear::new(24, 72),
            mlp_out: Linear::new(72, 24),
        }
    }

    fn whole(&self, x: &Array) -> Array {
        let h = x.add(self.out.forward(&attend(
            &self.q.forward(x),
            &self.k.forward(x),
            &self.v.forward(x),
        )));
        h.add(
            self.mlp_out
                .forward(&nuvec_nn::silu(&self.mlp_in.forward(&h))),
        )
    }

    fn split(&self, x: &Array, g: &Group) -> Array {
        let col = |l: &Linear| AllToShardedLinear::from_linear(l, g).unwrap();
        let row = |l: &Linear| ShardedToAllLinear::from_linear(l, g).unwrap();
        let a = attend(
            &col(&self.q).forward(x),
            &col(&self.k).forward(x),
            &col(&self.v).forward(x),
        );
        let h = x.add(row(&self.out).forward(&a));
        h.add(row(&self.mlp_out).forward(&nuvec_nn::silu(&col(&self.mlp_in).forward(&h))))
    }
}

fn block(g: Group) {
    random::seed(5);
    let b = Block::new();
    let head = Linear::new(24, 31);
    let x = random::normal([7, 24], DType::F32, 0.0, 1.0, None);
    let want = head.forward(&b.whole(&x));
    let got = head.forward(&b.split(&x, &g));
    near("block logits", &got, &want, 1e-4);
    assert_eq!(
        got.argmax(-1).to_vec::<u32>().unwrap(),
        want.argmax(-1).to_vec::<u32>().unwrap(),
        "greedy tokens"
    );
}

#[test]
fn a_tensor_parallel_block_equals_the_whole_block() {
    for n in [2, 4] {
        if ranks("a_tensor_parallel_block_equals_the_whole_block", n, block).is_none() {
            return;
        }
    }
}

crate::matrix!(
    sharded_layers_equal_the_whole_layers,
    a_tensor_parallel_block_equals_the_whole_block
);
