//! fuel's own tensors and tensor-parallel layers across processes over rdmacomm: RowParallel
//! and ColumnParallel against the whole layer, every dtype x reduction against fuel's
//! single-process DeviceGroup fold and a scalar reference, gathers and reduce-scatters along
//! every dim of 3-D tensors, graph affinity, and mismatches named on every rank.

mod harness;

use harness::common::{over, Net};

use fuel::lazy::Tensor;
use fuel::{DType, Device, Shape};
use fuel_parallel::comm::{Communicator, ReduceOp};
use fuel_parallel::device_group::DeviceGroup;
use fuel_parallel::tensor_parallel::{ColumnParallel, Linear, RowParallel, ShardDim, TensorShard};
use harness::common::Rng;
use harness::{ranks, tagged};
use rdmacomm::fuel::Transport;

/// A tensor's elements as f64 (fuel's own cast, then its bytes).
fn f64s(t: &Tensor) -> Vec<f64> {
    try_f64s(t).unwrap()
}

fn try_f64s(t: &Tensor) -> fuel::Result<Vec<f64>> {
    let t = t.to_dtype(DType::F64)?;
    let b = fuel::pipelined_bridge::realize_one_bytes(t.graph(), t.node_id(), &Device::cpu())?;
    Ok(bytemuck::pod_collect_to_vec(&b))
}

/// A new graph's f32 tensor.
fn f32_tensor(v: &[f32], dims: &[usize]) -> Tensor {
    Tensor::from_f32(v.to_vec(), Shape::from_dims(dims), &Device::cpu()).unwrap()
}

/// `v` as a tensor of `dtype` on `anchor`'s graph (or a new one), through fuel's casts.
fn typed(anchor: Option<&Tensor>, v: &[f64], dims: &[usize], dtype: DType) -> Tensor {
    let f: Vec<f32> = v.iter().map(|&x| x as f32).collect();
    let t = match anchor {
        Some(a) => a.const_f32_like(f, Shape::from_dims(dims)).unwrap(),
        None => f32_tensor(&f, dims),
    };
    t.to_dtype(dtype).unwrap()
}

/// Rank r's values: small integers, exact in every dtype, in every sum, product and order.
fn values(r: usize, n: usize, unsigned: bool) -> Vec<f64> {
    (0..n)
        .map(|i| {
            let k = ((i * 5 + r * 3) % 5) as f64;
            if unsigned {
                (k % 4.0).min(3.0)
            } else {
                k - 2.0
            }
        })
        .collect()
}

const DTYPES: [DType; 11] = [
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
    DType::U8,
    DType::I8,
    DType::I16,
    DType::U32,
    DType::I32,
    DType::I64,
    DType::F8E4M3,
];
const OPS: [ReduceOp; 4] = [
    ReduceOp::Sum,
    ReduceOp::Product,
    ReduceOp::Min,
    ReduceOp::Max,
];

/// Every dtype x reduction: the result equals the scalar fold of every rank's values, and
/// fuel's own DeviceGroup fold of the same shards on one graph; it lives on the input's graph.
fn matrix(c: Transport) {
    let info = c.info();
    let (rank, n) = (info.rank, info.world_size);
    let dims = [3, 7];
    for dtype in DTYPES {
        let unsigned = matches!(dtype, DType::U8 | DType::U32);
        let is_float = matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16);
        let all: Vec<Vec<f64>> = (0..n).map(|r| values(r, 21, unsigned)).collect();
        let mine = typed(None, &all[rank], &dims, dtype);
        // The reference shards, on one graph, as DeviceGroup wants them.
        let first = typed(None, &all[0], &dims, dtype);
        let mut shards = vec![first.clone()];
        for v in &all[1..] {
            shards.push(typed(Some(&first), v, &dims, dtype));
        }
        let group = DeviceGroup::new(vec![Device::cpu(); n]).unwrap();
        for op in OPS {
            let name = format!("{dtype:?} {op:?}");
            let out = c.all_reduce(&mine, op).unwrap();
            assert_eq!(out.graph_id(), mine.graph_id(), "{name}: graph");
            assert_eq!(out.dtype(), dtype, "{name}: dtype");
            assert_eq!(out.shape().dims(), &dims, "{name}: shape");
            let f: fn(f64, f64) -> f64 = match op {
                ReduceOp::Sum => |a, b| a + b,
                ReduceOp::Product => |a, b| a * b,
                ReduceOp::Min => f64::min,
                ReduceOp::Max => f64::max,
            };
            let want: Vec<f64> = (0..21)
                .map(|i| all.iter().map(|v| v[i]).reduce(f).unwrap())
                .collect();
            let got = f64s(&out);
            assert_eq!(got, want, "{name}: against the scalar fold");
            // fuel's CPU backend folds the floats (for the integer dtypes it has no add or
            // multiply kernel: there the scalar fold above is the reference).
            match group.all_reduce(&shards, op).and_then(|t| try_f64s(&t)) {
                Ok(folded) => assert_eq!(got, folded, "{name}: against DeviceGroup"),
                Err(e) if is_float => panic!("{name}: DeviceGroup failed: {e}"),
                Err(_) => {}
            }
            // The result is usable with its input on one graph.
            let as64 = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
            let sum = f64s(&as64(&out).add(&as64(&mine)).unwrap());
            let mine64 = f64s(&mine);
            assert!(
                sum.iter()
                    .zip(&mine64)
                    .zip(&got)
                    .all(|((s, m), g)| *s == m + g),
                "{name}"
            );
        }
    }
    // Bool: Max is or, Min is and; Sum is refused (on every rank alike).
    let b: Vec<f64> = (0..10)
        .map(|i| ((i + rank) % 3 == 0) as u8 as f64)
        .collect();
    let mask = typed(None, &b, &[10], DType::Bool);
    let any = f64s(&c.all_reduce(&mask, ReduceOp::Max).unwrap());
    let every = f64s(&c.all_reduce(&mask, ReduceOp::Min).unwrap());
    for i in 0..10 {
        let bits: Vec<bool> = (0..n).map(|r| (i + r) % 3 == 0).collect();
        assert_eq!(any[i] == 1.0, bits.iter().any(|&x| x), "or {i}");
        assert_eq!(every[i] == 1.0, bits.iter().all(|&x| x), "and {i}");
    }
    let err = c.all_reduce(&mask, ReduceOp::Sum).unwrap_err().to_string();
    assert!(err.contains("Bool"), "{err}");
}

#[test]
fn every_dtype_and_reduction_equals_fuels_own_fold() {
    for n in [2, 3, 4] {
        if ranks("every_dtype_and_reduction_equals_fuels_own_fold", n, matrix).is_none() {
            return;
        }
    }
}

/// NaN in Max and Min propagates, as fuel's `maximum`.
fn nans(c: Transport) {
    let r = c.info().rank;
    let v = [if r == 0 { f32::NAN } else { 1.0 }, 2.0 + r as f32];
    let t = f32_tensor(&v, &[2]);
    for op in [ReduceOp::Max, ReduceOp::Min] {
        let got = f64s(&c.all_reduce(&t, op).unwrap());
        assert!(got[0].is_nan(), "{op:?}");
        assert!(!got[1].is_nan(), "{op:?}");
    }
}

#[test]
fn max_and_min_propagate_nan() {
    ranks("max_and_min_propagate_nan", 3, nans);
}

/// Deterministic weights and inputs, the same on every rank.
fn draws(seed: u64, n: usize) -> Vec<f32> {
    let mut g = Rng(seed);
    (0..n)
        .map(|_| (g.below(2001) as f32 - 1000.0) / 1000.0)
        .collect()
}

/// RowParallel (input features split, partial products summed) and ColumnParallel followed by
/// an all_gather of the last dim, against the whole layer in this process.
fn layers(c: Transport) {
    let info = c.info();
    let (rank, n) = (info.rank, info.world_size);
    let (batch, fin, fout) = (5, 48, 24);
    let w = draws(7, fin * fout); // [in, out], row-major
    let bias = draws(11, fout);
    let x = draws(13, batch * fin);
    let whole = Linear::from_f32(w.clone(), fin, fout, Some(bias.clone().into())).unwrap();
    let want = f64s(&whole.forward(&f32_tensor(&x, &[batch, fin])).unwrap());
    // Row-parallel: this rank's input features (rows of W, columns of x); the bias once.
    let per = fin / n;
    let (a, b) = (rank * per, (rank + 1) * per);
    let w_rows: Vec<f32> = w[a * fout..b * fout].to_vec();
    let x_cols: Vec<f32> = (0..batch)
        .flat_map(|i| x[i * fin + a..i * fin + b].to_vec())
        .collect();
    let mine =
        Linear::from_f32(w_rows, per, fout, (rank == 0).then(|| bias.clone().into())).unwrap();
    let shard = TensorShard {
        rank,
        world_size: n,
        dim: ShardDim::Row,
        original_shape: [fin, fout],
    };
    let row = RowParallel::new(mine, shard, c.clone());
    let input = f32_tensor(&x_cols, &[batch, per]);
    let y = row.forward(&input).unwrap();
    assert_eq!(y.graph_id(), input.graph_id());
    let got = f64s(&y);
    let worst = got
        .iter()
        .zip(&want)
        .map(|(g, w)| (g - w).abs())
        .fold(0.0, f64::max);
    assert!(worst < 1e-4, "RowParallel off by {worst}");
    // Bits equal on every rank: printed for the parent to compare.
    let h = got
        .iter()
        .fold(0u64, |h, v| h.rotate_left(7) ^ (*v as f32).to_bits() as u64);
    println!("ROWBITS {h:016x}");
    // Column-parallel: this rank's output features; gathered along the last dim.
    let per_out = fout / n;
    let (a, b) = (rank * per_out, (rank + 1) * per_out);
    let w_cols: Vec<f32> = (0..fin)
        .flat_map(|i| w[i * fout + a..i * fout + b].to_vec())
        .collect();
    let col = ColumnParallel::new(
        Linear::from_f32(w_cols, fin, per_out, Some(bias[a..b].to_vec().into())).unwrap(),
        TensorShard {
            rank,
            world_size: n,
            dim: ShardDim::Column,
            original_shape: [fin, fout],
        },
    );
    let xin = f32_tensor(&x, &[batch, fin]);
    let part = col.forward(&xin).unwrap();
    let full = c.all_gather(&part, 1).unwrap();
    assert_eq!(full.graph_id(), xin.graph_id());
    assert_eq!(full.shape().dims(), &[batch, fout]);
    let got = f64s(&full);
    let worst = got
        .iter()
        .zip(&want)
        .map(|(g, w)| (g - w).abs())
        .fold(0.0, f64::max);
    assert!(worst < 1e-4, "ColumnParallel + all_gather off by {worst}");
}

#[test]
fn tensor_parallel_layers_equal_the_whole_layer() {
    for n in [2, 3, 4] {
        let Some(outs) = ranks("tensor_parallel_layers_equal_the_whole_layer", n, layers) else {
            return;
        };
        let bits: Vec<Vec<&str>> = outs.iter().map(|o| tagged(o, "ROWBITS")).collect();
        assert_eq!(bits[0].len(), 1, "{outs:?}");
        assert!(
            bits.iter().all(|b| b == &bits[0]),
            "ranks' bits differ: {bits:?}"
        );
    }
}

/// all_gather and reduce_scatter along dims 0, 1 and 2 of a 3-D tensor, against index
/// arithmetic; broadcast from the last rank; every result on its input's graph.
fn along_dims(c: Transport) {
    let info = c.info();
    let (rank, n) = (info.rank, info.world_size);
    let dims = [12usize, 12, 12];
    let value = |r: usize, i: usize| (r * 10_000 + i) as f64;
    let mine: Vec<f64> = (0..1728).map(|i| value(rank, i)).collect();
    let t = typed(None, &mine, &dims, DType::F64);
    for dim in 0..3 {
        // all_gather: index (a, b, c) of the result along dim holds rank (idx / 12) at idx % 12.
        let g = c.all_gather(&t, dim).unwrap();
        assert_eq!(g.graph_id(), t.graph_id());
        let mut gd = dims;
        gd[dim] *= n;
        assert_eq!(g.shape().dims(), &gd);
        let got = f64s(&g);
        for (k, v) in got.iter().enumerate() {
            let idx = [k / (gd[1] * gd[2]), (k / gd[2]) % gd[1], k % gd[2]];
            let r = idx[dim] / 12;
            let mut local = idx;
            local[dim] %= 12;
            let want = value(r, (local[0] * 12 + local[1]) * 12 + local[2]);
            assert_eq!(*v, want, "all_gather dim {dim} at {idx:?}");
        }
        // reduce_scatter (Sum): this rank's chunk along dim of the sum over ranks.
        let s = c.reduce_scatter(&t, ReduceOp::Sum, dim).unwrap();
        assert_eq!(s.graph_id(), t.graph_id());
        let mut sd = dims;
        sd[dim] /= n;
        assert_eq!(s.shape().dims(), &sd);
        let got = f64s(&s);
        for (k, v) in got.iter().enumerate() {
            let mut idx = [k / (sd[1] * sd[2]), (k / sd[2]) % sd[1], k % sd[2]];
            idx[dim] += rank * sd[dim];
            let i = (idx[0] * 12 + idx[1]) * 12 + idx[2];
            let want: f64 = (0..n).map(|r| value(r, i)).sum();
            assert_eq!(*v, want, "reduce_scatter dim {dim} at {idx:?}");
        }
    }
    // reduce_scatter with Max, on i16 (widened on the wire).
    let small: Vec<f64> = (0..24)
        .map(|i| ((i * 7 + rank * 5) % 13) as f64 - 6.0)
        .collect();
    let ti = typed(None, &small, &[4, 6], DType::I16);
    if 6 % n == 0 {
        let m = f64s(&c.reduce_scatter(&ti, ReduceOp::Max, 1).unwrap());
        let k = 6 / n;
        for (j, v) in m.iter().enumerate() {
            let (row, col) = (j / k, rank * k + j % k);
            let want = (0..n)
                .map(|r| ((((row * 6 + col) * 7 + r * 5) % 13) as f64) - 6.0)
                .fold(f64::MIN, f64::max);
            assert_eq!(*v, want, "i16 max at {row},{col}");
        }
    }
    // broadcast: the last rank's tensor everywhere, on each rank's own graph.
    let b = c.broadcast(&t, n - 1).unwrap();
    assert_eq!(b.graph_id(), t.graph_id());
    let got = f64s(&b);
    assert!(got.iter().enumerate().all(|(i, v)| *v == value(n - 1, i)));
    c.barrier().unwrap();
}

#[test]
fn gathers_and_scatters_along_every_dim() {
    for n in [2, 3, 4] {
        if ranks("gathers_and_scatters_along_every_dim", n, along_dims).is_none() {
            return;
        }
    }
}

/// A reduce_scatter that does not divide is refused on every rank, naming the dim.
fn not_divisible(c: Transport) {
    let t = f32_tensor(&[1.0; 10], &[2, 5]);
    let err = c
        .reduce_scatter(&t, ReduceOp::Sum, 1)
        .unwrap_err()
        .to_string();
    assert!(err.contains("not divisible"), "{err}");
}

#[test]
fn a_reduce_scatter_that_does_not_divide_is_named() {
    ranks(
        "a_reduce_scatter_that_does_not_divide_is_named",
        3,
        not_divisible,
    );
}

/// Ranks passing different shapes: every rank fails naming both, and refuses further work.
fn shapes_differ(c: Transport) {
    let r = c.info().rank;
    let t = if r == 1 {
        f32_tensor(&[1.0; 6], &[3, 2])
    } else {
        f32_tensor(&[1.0; 6], &[2, 3])
    };
    let err = c.all_reduce(&t, ReduceOp::Sum).unwrap_err().to_string();
    assert!(err.contains("rank 1 passed F32 [3, 2]"), "{err}");
    assert!(err.contains("rank 0 passed F32 [2, 3]"), "{err}");
    let again = c.all_reduce(&t, ReduceOp::Sum).unwrap_err().to_string();
    assert!(again.contains("unusable"), "{again}");
}

#[test]
fn ranks_passing_different_shapes_fail_on_every_rank() {
    ranks(
        "ranks_passing_different_shapes_fail_on_every_rank",
        3,
        shapes_differ,
    );
}

/// A broadcast whose non-root passes another dtype: named on every rank.
fn broadcast_differs(c: Transport) {
    let r = c.info().rank;
    let t = f32_tensor(&[1.0; 4], &[4]);
    let t = if r == 0 {
        t
    } else {
        t.to_dtype(DType::F16).unwrap()
    };
    let err = c.broadcast(&t, 0).unwrap_err().to_string();
    assert!(err.contains("F16 [4]") && err.contains("F32 [4]"), "{err}");
}

#[test]
fn a_broadcast_of_another_dtype_fails_on_every_rank() {
    ranks(
        "a_broadcast_of_another_dtype_fails_on_every_rank",
        2,
        broadcast_differs,
    );
}

crate::matrix!(
    every_dtype_and_reduction_equals_fuels_own_fold,
    max_and_min_propagate_nan,
    tensor_parallel_layers_equal_the_whole_layer,
    gathers_and_scatters_along_every_dim,
    a_reduce_scatter_that_does_not_divide_is_named,
    ranks_passing_different_shapes_fail_on_every_rank,
    a_broadcast_of_another_dtype_fails_on_every_rank
);
