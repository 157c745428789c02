//! Reduce workers end to end: the same job (2 ranks, an 8 MiB f32 all_reduce of values whose
//! sums round, by ring and by halving-doubling, and a bf16 one) with 1, 2 and 3 threads sharing
//! each large copy and reduction (`RDMACOMM_REDUCE_THREADS`). Every result is held against an
//! f64 re-computation, and the three jobs' results must be the same bits. Over RDMA (the VM),
//! whose 2 MiB slots are split among the workers; over shared memory and TCP, whose chunks are
//! under the split's threshold, the setting must still hold and change nothing.

mod common;
use common::reference::hash;
use common::*;
use rdmacomm::{Algo, AllReduce, Comm, Communicator, DType};
use std::time::Duration;

const ELEMS: usize = 2 << 20;

/// Rank r's element i: fractions, so that the order of a sum shows in its bits.
fn val(r: usize, i: usize) -> f32 {
    (r as f32 + 1.0) / 3.0 + (i % 1000) as f32 * 1e-3
}

fn body() {
    let (r, n) = rank_size();
    let c = Comm::from_env().unwrap_or_else(|e| panic!("rank {r}: {e}"));
    let asked: usize = std::env::var("RDMACOMM_REDUCE_THREADS")
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(rdmacomm::reduce_threads(), asked, "rank {r}");
    let mut all = Vec::new();
    for algo in [Algo::Ring, Algo::Halving] {
        c.set_algorithm(algo);
        let mut data: Vec<u8> = (0..ELEMS).flat_map(|i| val(r, i).to_le_bytes()).collect();
        c.all_reduce(AllReduce::Sum, DType::f32, &mut data).unwrap();
        for (i, b) in data.chunks(4).enumerate() {
            let got = f32::from_le_bytes(b.try_into().unwrap()) as f64;
            let want: f64 = (0..n).map(|q| val(q, i) as f64).sum();
            assert!(
                (got - want).abs() <= 1e-5 * want,
                "rank {r} {algo:?} [{i}]: {got}"
            );
        }
        all.extend_from_slice(&data);
    }
    // bf16: widened, summed and rounded back in every worker's range alike.
    let mut h: Vec<u8> = (0..ELEMS)
        .flat_map(|i| half::bf16::from_f32(val(r, i)).to_le_bytes())
        .collect();
    c.set_algorithm(Algo::Ring);
    c.all_reduce(AllReduce::Sum, DType::bf16, &mut h).unwrap();
    all.extend_from_slice(&h);
    println!("result hash {:016x}", hash(&all));
}

fn run(name: &str) {
    if !parent_ready(name, body) {
        return;
    }
    let mut hashes = Vec::new();
    for threads in 1..=3 {
        let r = spawn(
            name,
            2,
            Placement::Local,
            &|_| {
                vec![
                    ("RDMACOMM_TIMEOUT".to_string(), "60".to_string()),
                    ("RDMACOMM_REDUCE_THREADS".to_string(), threads.to_string()),
                ]
            },
            Duration::from_secs(300),
        );
        assert_all_ok(&r);
        for x in &r {
            let line = x.output.lines().find(|l| l.contains("result hash"));
            hashes.push((threads, x.rank, line.expect("a hash").to_string()));
        }
    }
    for (threads, rank, h) in &hashes {
        assert_eq!(
            h, &hashes[0].2,
            "{threads} threads, rank {rank}: other bits"
        );
    }
}

#[test]
fn one_two_or_three_workers_give_the_same_bits() {
    run("one_two_or_three_workers_give_the_same_bits");
}

crate::matrix_shm!(one_two_or_three_workers_give_the_same_bits);
