//! split(), the tensor-level API and the typed Group, multi-process: 6 ranks split into
//! {even, odd} and into {0..2, 3..5}, then collectives in both subgroups and the parent,
//! interleaved, every result checked against a reference; nested splits; a negative color; the
//! tensor collectives on dims other than 0; IdentityComm.

mod common;
use common::*;
use rdmacomm::tensor::Communicator as TensorComm;
use rdmacomm::{AllReduce, Comm, Communicator, DType, Group, IdentityComm, ReduceOp, Tensor};
use std::sync::Arc;
use std::time::Duration;

/// Sum over `ranks` of the value each contributes at element i.
fn val(r: usize, i: usize) -> f32 {
    ((r * 7 + i * 3) % 11) as f32
}

fn check_sum(g: &Group, parent_ranks: &[usize], what: &str) {
    // Each member contributes val(parent rank, i); the sum must match on every member.
    let me = parent_ranks[g.rank()];
    eprintln!("rank {me}: {what}");
    let mut d: Vec<f32> = (0..1000).map(|i| val(me, i)).collect();
    g.all_reduce(&mut d, AllReduce::Sum).unwrap();
    for (i, &x) in d.iter().enumerate() {
        let want: f32 = parent_ranks.iter().map(|&p| val(p, i)).sum();
        assert_eq!(x, want, "{what}: element {i}");
    }
}

fn split_body() {
    let (r, n) = rank_size();
    let parent = Group::from_env().unwrap();
    assert_eq!((parent.rank(), parent.size()), (r, n));
    // Even / odd, ordered by rank.
    let parity = parent.split((r % 2) as i32, r as i32).unwrap();
    let parity_ranks: Vec<usize> = (0..n).filter(|q| q % 2 == r % 2).collect();
    assert_eq!(parity.size(), parity_ranks.len());
    assert_eq!(parity.rank(), r / 2);
    // Halves, ordered by key = -rank (so reversed).
    let half = parent.split((r / 3) as i32, -(r as i32)).unwrap();
    let mut half_ranks: Vec<usize> = (0..n).filter(|q| q / 3 == r / 3).collect();
    half_ranks.reverse();
    assert_eq!(half_ranks[half.rank()], r, "key orders the subgroup");
    // Interleave collectives on the three groups.
    for round in 0..3 {
        check_sum(
            &parity,
            &parity_ranks,
            &format!("round {round}: parity all_reduce"),
        );
        check_sum(
            &parent,
            &(0..n).collect::<Vec<_>>(),
            &format!("round {round}: parent all_reduce"),
        );
        check_sum(
            &half,
            &half_ranks,
            &format!("round {round}: half all_reduce"),
        );
        let mine = [r as u32 * 10 + round];
        let mut got = vec![0u32; half.size()];
        half.all_gather(&mine, &mut got).unwrap();
        let want: Vec<u32> = half_ranks.iter().map(|&p| p as u32 * 10 + round).collect();
        assert_eq!(got, want, "half all_gather in key order");
        let mut b = [if parity.rank() == 1 {
            42u64 + round as u64
        } else {
            0
        }; 3];
        parity.broadcast(&mut b, 1).unwrap();
        assert_eq!(
            b,
            [42 + round as u64; 3],
            "parity broadcast from sub-rank 1"
        );
        parent.barrier().unwrap();
    }
    // Nested: split the parity group again, by rank / 4.
    let nested = parity.split((r / 4) as i32, 0).unwrap();
    let nested_ranks: Vec<usize> = parity_ranks
        .iter()
        .copied()
        .filter(|q| q / 4 == r / 4)
        .collect();
    check_sum(&nested, &nested_ranks, "nested all_reduce");
    nested.health().unwrap();
    // A negative color: a world of one for rank 5, the rest together.
    let some = parent.split(if r == 5 { -1 } else { 0 }, 0).unwrap();
    if r == 5 {
        assert_eq!((some.rank(), some.size()), (0, 1));
    } else {
        check_sum(&some, &(0..5).collect::<Vec<_>>(), "split without rank 5");
    }
    // Drop the parent first: the subgroups stay usable.
    drop(parent);
    check_sum(&half, &half_ranks, "half after the parent is gone");
    parity.barrier().unwrap();
    println!("rank {r}: split checks passed");
}

#[test]
fn split_six_ranks_interleaved() {
    const NAME: &str = "split_six_ranks_interleaved";
    if !parent_ready(NAME, split_body) {
        return;
    }
    spawn_local_ok(NAME, 6, &[], Duration::from_secs(400));
}

fn tensor_body() {
    let (r, n) = rank_size();
    let c = Comm::from_env().unwrap();
    let t: &dyn TensorComm = &c;
    assert_eq!((t.info().rank, t.info().world_size), (r, n));
    // all_reduce Avg of f32 [2, 3].
    let mine: Vec<f32> = (0..6).map(|i| (r * 6 + i) as f32).collect();
    let x = Tensor::from_slice(&mine, &[2, 3]).unwrap();
    let avg = t
        .all_reduce(&x, ReduceOp::Avg)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    for (i, &v) in avg.iter().enumerate() {
        let want = (0..n).map(|q| (q * 6 + i) as f32).sum::<f32>() / n as f32;
        assert_eq!(v, want, "Avg element {i}");
    }
    assert!(
        t.all_reduce(&Tensor::from_slice(&[1i32], &[1]).unwrap(), ReduceOp::Avg)
            .is_err(),
        "Avg of ints"
    );
    // all_gather along dim 1: [2, 3] -> [2, 3n]; row i, column q*3 + j is rank q's (i, j).
    let g = t.all_gather(&x, 1).unwrap();
    assert_eq!(g.shape(), &[2, 3 * n]);
    let gv = g.to_vec::<f32>().unwrap();
    for i in 0..2 {
        for q in 0..n {
            for j in 0..3 {
                assert_eq!(
                    gv[i * 3 * n + q * 3 + j],
                    (q * 6 + i * 3 + j) as f32,
                    "all_gather dim 1 ({i},{q},{j})"
                );
            }
        }
    }
    let g0 = t.all_gather(&x, 0).unwrap();
    assert_eq!(g0.shape(), &[2 * n, 3]);
    // reduce_scatter along dim 1: [2, 2n] -> [2, 2]; rank r keeps columns 2r, 2r+1 of the sum.
    let w: Vec<i64> = (0..4 * n).map(|i| (r * 100 + i) as i64).collect();
    let y = Tensor::from_slice(&w, &[2, 2 * n]).unwrap();
    for op in [ReduceOp::Sum, ReduceOp::Max] {
        let s = t.reduce_scatter(&y, op, 1).unwrap();
        assert_eq!(s.shape(), &[2, 2]);
        let sv = s.to_vec::<i64>().unwrap();
        for i in 0..2 {
            for j in 0..2 {
                let col = 2 * r + j;
                let vals = (0..n).map(|q| (q * 100 + i * 2 * n + col) as i64);
                let want = if op == ReduceOp::Sum {
                    vals.sum()
                } else {
                    vals.max().unwrap()
                };
                assert_eq!(sv[i * 2 + j], want, "{op:?} reduce_scatter dim 1 ({i},{j})");
            }
        }
    }
    // A 3-D tensor on every dim, values checked element by element by index arithmetic:
    // all_gather concatenates the ranks' tensors along `dim`; reduce_scatter of a tensor n
    // times longer along `dim` leaves rank r the sum of every rank's r-th block along it.
    let dims = [2usize, 3, 4];
    let at = |ix: [usize; 3], shape: [usize; 3]| (ix[0] * shape[1] + ix[1]) * shape[2] + ix[2];
    let v3 = |q: usize, ix: [usize; 3]| (q * 1000 + ix[0] * 100 + ix[1] * 10 + ix[2]) as i32;
    let grid = |shape: [usize; 3]| {
        (0..shape[0]).flat_map(move |a| {
            (0..shape[1]).flat_map(move |b| (0..shape[2]).map(move |c| [a, b, c]))
        })
    };
    let mine3: Vec<i32> = grid(dims).map(|ix| v3(r, ix)).collect();
    // On a graph of its own: every result must come back on it.
    let graph = rdmacomm::GraphId::new();
    let x3 = Tensor::from_slice_on(graph, &mine3, &dims).unwrap();
    assert_eq!(t.all_reduce(&x3, ReduceOp::Sum).unwrap().graph(), graph);
    assert_eq!(t.broadcast(&x3, 0).unwrap().graph(), graph);
    for dim in 0..3 {
        let g = t.all_gather(&x3, dim).unwrap();
        assert_eq!(g.graph(), graph, "all_gather dim {dim}");
        let mut gshape = dims;
        gshape[dim] *= n;
        assert_eq!(g.shape(), &gshape[..]);
        let gv = g.to_vec::<i32>().unwrap();
        for ix in grid(gshape) {
            let (q, mut local) = (ix[dim] / dims[dim], ix);
            local[dim] %= dims[dim];
            assert_eq!(
                gv[at(ix, gshape)],
                v3(q, local),
                "all_gather dim {dim} at {ix:?}"
            );
        }
        let mut big = dims;
        big[dim] *= n;
        let values: Vec<i32> = grid(big).map(|ix| v3(r, ix)).collect();
        let y3 = Tensor::from_slice_on(graph, &values, &big).unwrap();
        let s3 = t.reduce_scatter(&y3, ReduceOp::Sum, dim).unwrap();
        assert_eq!(s3.graph(), graph, "reduce_scatter dim {dim}");
        assert_eq!(s3.shape(), &dims[..]);
        let sv = s3.to_vec::<i32>().unwrap();
        for ix in grid(dims) {
            let mut src = ix;
            src[dim] += r * dims[dim];
            let want: i32 = (0..n).map(|q| v3(q, src)).sum();
            assert_eq!(sv[at(ix, dims)], want, "reduce_scatter dim {dim} at {ix:?}");
        }
    }
    let bad = Tensor::from_slice(&vec![0f32; 2 * (n + 1)], &[2, n + 1]).unwrap();
    let e = t
        .reduce_scatter(&bad, ReduceOp::Sum, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not divisible by the world size"), "{e}");
    // all_to_all and reduce (beyond the spec) on every dim of a tensor n times longer there:
    // part q along `dim` goes to rank q; the result holds, along `dim`, each rank's part r.
    for dim in 0..3 {
        let mut big = dims;
        big[dim] *= n;
        let values: Vec<i32> = grid(big).map(|ix| v3(r, ix)).collect();
        let y3 = Tensor::from_slice_on(graph, &values, &big).unwrap();
        let a = t.all_to_all(&y3, dim).unwrap();
        assert_eq!(
            (a.graph(), a.shape()),
            (graph, &big[..]),
            "all_to_all dim {dim}"
        );
        let av = a.to_vec::<i32>().unwrap();
        for ix in grid(big) {
            // Position q*k + j along dim holds rank q's entry r*k + j.
            let (q, j) = (ix[dim] / dims[dim], ix[dim] % dims[dim]);
            let mut src = ix;
            src[dim] = r * dims[dim] + j;
            assert_eq!(
                av[at(ix, big)],
                v3(q, src),
                "all_to_all dim {dim} at {ix:?}"
            );
        }
        let root = dim % n;
        let red = t.reduce(&y3, ReduceOp::Max, root).unwrap();
        let rv = red.to_vec::<i32>().unwrap();
        for ix in grid(big) {
            let want = if r == root {
                (0..n).map(|q| v3(q, ix)).max().unwrap()
            } else {
                v3(r, ix)
            };
            assert_eq!(
                rv[at(ix, big)],
                want,
                "reduce to {root}, dim {dim} at {ix:?}"
            );
        }
    }
    // broadcast from the last rank, and barrier.
    let b = t
        .broadcast(&Tensor::from_slice(&[r as u8; 5], &[5]).unwrap(), n - 1)
        .unwrap();
    assert_eq!(b.to_vec::<u8>().unwrap(), vec![(n - 1) as u8; 5]);
    t.barrier().unwrap();
    // Box<dyn ...> works (object safety).
    let boxed: Box<dyn TensorComm> = Box::new(IdentityComm);
    assert_eq!(boxed.info().world_size, 1);
    println!("rank {r}: tensor checks passed");
}

#[test]
fn tensor_collectives_four_ranks() {
    const NAME: &str = "tensor_collectives_four_ranks";
    if !parent_ready(NAME, tensor_body) {
        return;
    }
    spawn_local_ok(NAME, 4, &[], Duration::from_secs(300));
}

#[test]
fn identity_comm_is_a_world_of_one() {
    let id = IdentityComm;
    let t = Tensor::from_slice(&[1.5f32, -2.0, 3.0, 4.0], &[2, 2]).unwrap();
    assert_eq!(TensorComm::all_reduce(&id, &t, ReduceOp::Avg).unwrap(), t);
    assert_eq!(TensorComm::all_gather(&id, &t, 1).unwrap(), t);
    assert_eq!(
        TensorComm::reduce_scatter(&id, &t, ReduceOp::Sum, 0).unwrap(),
        t
    );
    assert_eq!(TensorComm::broadcast(&id, &t, 0).unwrap(), t);
    TensorComm::barrier(&id).unwrap();
    let g = Group::new(Arc::new(IdentityComm));
    assert!(g.broadcast(&mut [0u8; 2], 1).is_err(), "root out of range");
    let mut x = [1.0f64, 2.0];
    g.all_reduce(&mut x, AllReduce::Max).unwrap();
    assert_eq!(x, [1.0, 2.0]);
    assert_eq!(g.split(-1, 0).unwrap().size(), 1);
    let e = Communicator::all_reduce(&IdentityComm, AllReduce::Sum, DType::f64, &mut [0u8; 12])
        .unwrap_err();
    assert!(e.to_string().contains("not a multiple"), "{e}");
}

fn bcast_body() {
    let (r, n) = rank_size();
    let g = Group::from_env().unwrap();
    for root in 0..n {
        for len in [0usize, 1, 4097, (1 << 20) + 3] {
            let mut d: Vec<u8> = if r == root {
                (0..len).map(|i| (i * 31 + root) as u8).collect()
            } else {
                vec![0; len]
            };
            g.broadcast(&mut d, root).unwrap();
            assert!(
                d.iter()
                    .enumerate()
                    .all(|(i, &b)| b == (i * 31 + root) as u8),
                "broadcast of {len} B from {root}"
            );
        }
    }
    println!("rank {r}: broadcast checks passed");
}

#[test]
fn broadcast_chain_and_tree_five_ranks() {
    const NAME: &str = "broadcast_chain_and_tree_five_ranks";
    if !parent_ready(NAME, bcast_body) {
        return;
    }
    for algo in ["chain", "tree"] {
        spawn_local_ok(
            NAME,
            5,
            &[("RDMACOMM_BCAST", algo)],
            Duration::from_secs(300),
        );
    }
}
