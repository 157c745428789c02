//! Load: thousands of mixed collectives of random sizes on 4 ranks, every result checked; no
//! leaks: communicators created and dropped repeatedly leave no file descriptors, shared-memory
//! mappings, queue pairs, memory regions, CQs or PDs behind (counted from /proc and the kernel's `rdma resource` view);
//! and a hot path without allocation: repeated calls with the same sizes allocate nothing
//! (counted by `allocation-counter`'s allocator, on the calling thread).

mod common;
use common::reference::*;
use common::*;
use rdmacomm::{AllReduce, Comm, Communicator, Config, DType, P2p};
use std::time::{Duration, Instant};

fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

/// How many shared-memory segments this process maps (the transport's anonymous files).
fn shm_maps() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .map(|m| m.lines().filter(|l| l.contains("memfd:rdmacomm")).count())
        .unwrap_or(0)
}

/// How many of `kind` (qp, mr, cq, pd) the kernel lists for this process. The kernel records the
/// id of the thread that created each object, so match any of our thread ids.
fn rdma_objects(kind: &str) -> usize {
    let out = std::process::Command::new("rdma")
        .args(["resource", "show", kind])
        .output()
        .expect("rdma tool (iproute2)");
    let tids: Vec<String> = std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    let mine = |l: &str| {
        l.split_whitespace()
            .collect::<Vec<_>>()
            .windows(2)
            .any(|w| w[0] == "pid" && tids.iter().any(|t| t == w[1]))
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| mine(l))
        .count()
}

fn soak_body() {
    let (r, n) = rank_size();
    let coord = std::env::var("RDMACOMM_COORDINATOR").unwrap();
    let host = coord.rsplit_once(':').unwrap().0;
    // The first rendezvous is the parent's free port; each later one is a port rank 0 finds
    // free just before, sent over the communicator in use (ports chosen all up front were
    // sometimes taken by then, by this test's own connections: "address in use").
    let mut rendezvous = format!("{host}:{}", std::env::var("RXE_TEST_PORT").unwrap());
    let next_rendezvous = |c: &Comm| -> String {
        let mut p = if r == 0 {
            free_port().to_le_bytes()
        } else {
            [0; 2]
        };
        c.broadcast(0, &mut p).unwrap();
        format!("{host}:{}", u16::from_le_bytes(p))
    };

    // Leaks: create, use and drop communicators; nothing may remain.
    let before = (
        fds(),
        shm_maps(),
        rdma_objects("qp"),
        rdma_objects("mr"),
        rdma_objects("cq"),
        rdma_objects("pd"),
    );
    for i in 0..6u16 {
        let cfg = Config::new(r, n, rendezvous.clone()).unwrap();
        let c = Comm::new(&cfg).unwrap();
        let mut d = fill(DType::i64, AllReduce::Sum, r, 100);
        c.all_reduce(AllReduce::Sum, DType::i64, &mut d).unwrap();
        check_all_reduce(DType::i64, AllReduce::Sum, n, &d).unwrap();
        rendezvous = next_rendezvous(&c);
        if i == 0 && c.device().is_some_and(|d| d.starts_with("RDMA")) {
            // The counting sees live objects (so a leak would show): the queue pairs the
            // all_reduce and broadcast connected (on demand: not every peer's).
            let count = rdma_objects("qp");
            assert!(
                (1..n).contains(&count),
                "counted {count} of our QPs in `rdma resource show qp`, for {} peers",
                n - 1
            );
            assert!(rdma_objects("mr") >= 1);
        }
        if i == 0 && c.device().is_some_and(|d| d.starts_with("shared memory")) {
            assert_eq!(shm_maps(), n, "our segment and each peer's are mapped");
        }
    }
    let after = (
        fds(),
        shm_maps(),
        rdma_objects("qp"),
        rdma_objects("mr"),
        rdma_objects("cq"),
        rdma_objects("pd"),
    );
    assert_eq!(
        before, after,
        "rank {r}: (fds, shm maps, qps, mrs, cqs, pds) before vs after 6 communicators"
    );
    println!("rank {r}: no leaks: (fds, shm, qp, mr, cq, pd) = {after:?} before and after");

    // Soak: the same random schedule on every rank (shared seed), every result checked.
    let c = Comm::new(&Config::new(r, n, rendezvous).unwrap()).unwrap();
    let ops: usize = std::env::var("RXE_TEST_SOAK_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5000);
    let budget = Duration::from_secs(240);
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let t0 = Instant::now();
    let mut done = 0;
    let mut bytes = 0usize;
    while done < ops && t0.elapsed() < budget {
        let big = rng.below(50) == 0;
        let elems = if big {
            65536 + rng.below(65536)
        } else {
            rng.below(2048)
        };
        match rng.below(4) {
            0 => {
                let dtype = DType::ALL[rng.below(10)];
                let op = [AllReduce::Sum, AllReduce::Max, AllReduce::Min][rng.below(3)];
                let mut d = fill(dtype, op, r, elems);
                c.all_reduce(op, dtype, &mut d).unwrap();
                check_all_reduce(dtype, op, n, &d).unwrap_or_else(|e| panic!("op {done}: {e}"));
                bytes += d.len();
            }
            1 => {
                let len = elems * 4;
                let input: Vec<u8> = (0..len).map(|i| (int_val(r, i) >> 3) as u8).collect();
                let mut out = vec![0u8; len * n];
                c.all_gather(&input, &mut out).unwrap();
                for q in 0..n {
                    let ok = out[q * len..(q + 1) * len]
                        .iter()
                        .enumerate()
                        .all(|(i, &b)| b == (int_val(q, i) >> 3) as u8);
                    assert!(ok, "op {done}: all_gather part {q}");
                }
                bytes += out.len();
            }
            2 => {
                let input = fill(DType::f32, AllReduce::Sum, r, elems * n);
                let mut out = vec![0u8; elems * 4];
                c.sum_scatter(DType::f32, &input, &mut out).unwrap();
                for (j, b) in out.chunks(4).enumerate() {
                    assert_eq!(
                        read_elem(DType::f32, b),
                        float_ref(AllReduce::Sum, n, r * elems + j),
                        "op {done}: sum_scatter"
                    );
                }
                bytes += input.len();
            }
            _ => {
                let peer = r ^ 1;
                let len = elems;
                let mine: Vec<u8> = (0..len).map(|i| (int_val(r + 100, i)) as u8).collect();
                let mut got = vec![0u8; len];
                if r < peer {
                    c.send(peer, &mine).unwrap();
                    c.recv(peer, &mut got).unwrap();
                } else {
                    c.recv(peer, &mut got).unwrap();
                    c.send(peer, &mine).unwrap();
                }
                assert!(
                    got.iter()
                        .enumerate()
                        .all(|(i, &b)| b == int_val(peer + 100, i) as u8),
                    "op {done}: recv"
                );
                bytes += len;
            }
        }
        done += 1;
    }
    c.health().unwrap();
    println!(
        "rank {r}: soak: {done} checked operations, {} MiB, in {:.1}s",
        bytes >> 20,
        t0.elapsed().as_secs_f64()
    );
    assert!(done >= 500, "too few operations in the time budget: {done}");
}

#[test]
fn soak_mixed_collectives_and_no_leaks() {
    const NAME: &str = "soak_mixed_collectives_and_no_leaks";
    if !parent_ready(NAME, soak_body) {
        return;
    }
    let port = free_port().to_string();
    let res = spawn(
        NAME,
        4,
        Placement::Local,
        &|_| {
            vec![
                ("RDMACOMM_TIMEOUT".into(), "60".into()),
                ("RXE_TEST_PORT".into(), port.clone()),
            ]
        },
        Duration::from_secs(420),
    );
    assert_all_ok(&res);
    for x in &res {
        println!(
            "{}",
            x.output
                .lines()
                .filter(|l| l.contains("soak:") || l.contains("leaks"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}

/// More than 2^16 chunks each way between two ranks: chunk numbers and the credits that ride in
/// a write's immediate carry 16 bits, so both must wrap cleanly. Pairwise all_reduces (credits in
/// the immediate), then one-way sends (credits by explicit writes); every result checked.
fn wrap_body() {
    let (r, _) = rank_size();
    let c = Comm::from_env().unwrap_or_else(|e| panic!("rank {r}: {e}"));
    const OPS: usize = 70_000;
    for i in 0..OPS {
        let mut v = [(r + i % 7) as f32, 1.0];
        let mut bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        c.all_reduce(AllReduce::Sum, DType::f32, &mut bytes)
            .unwrap();
        for (k, b) in bytes.chunks(4).enumerate() {
            v[k] = f32::from_le_bytes(b.try_into().unwrap());
        }
        assert_eq!(v, [(2 * (i % 7) + 1) as f32, 2.0], "all_reduce {i}");
    }
    for i in 0..OPS {
        let x = (i % 251) as u8;
        if r == 0 {
            c.send(1, &[x]).unwrap();
        } else {
            let mut got = [0u8];
            c.recv(0, &mut got).unwrap();
            assert_eq!(got[0], x, "message {i}");
        }
    }
    c.barrier().unwrap();
    println!("rank {r}: {OPS} exchanges and {OPS} one-way messages checked");
}

#[test]
fn chunk_counters_wrap_past_16_bits() {
    const NAME: &str = "chunk_counters_wrap_past_16_bits";
    if !parent_ready(NAME, wrap_body) {
        return;
    }
    spawn_local_ok(NAME, 2, &[], Duration::from_secs(600));
}

/// One round of every operation with fixed sizes, inputs restored from `init` first: small and
/// 1 MiB all_reduce, all_gather, sum_scatter, broadcast, a ring of sends, a barrier, and the
/// exchange-based ones: all_to_all, gather and scatter at rank 0, reduce to rank 0 (tree and,
/// at 1 MiB, reduce-scatter and gather), a ring of sendrecv.
struct Round {
    init: Vec<u8>,
    small: Vec<u8>,
    large: Vec<u8>,
    gathered: Vec<u8>,
    scattered: Vec<u8>,
    bcast: Vec<u8>,
    msg: Vec<u8>,
    got: Vec<u8>,
    a2a_in: Vec<u8>,
    a2a_out: Vec<u8>,
    gat_out: Vec<u8>,
    sca_in: Vec<u8>,
    sca_out: Vec<u8>,
    red_small: Vec<u8>,
    red_large: Vec<u8>,
    sr_got: Vec<u8>,
    /// Two blocks from the previous rank, through one batch.
    batch_got: Vec<u8>,
    /// all_to_allv's send and receive lengths (rank `from` sends `vlen(from, to)` bytes) and
    /// buffers; all_gather_v's and reduce_scatter_v's lengths and buffers.
    send_lens: Vec<usize>,
    recv_lens: Vec<usize>,
    a2av_in: Vec<u8>,
    a2av_out: Vec<u8>,
    v_lens: Vec<usize>,
    agv_out: Vec<u8>,
    rsv_in: Vec<f32>,
    rsv_out: Vec<f32>,
}

/// Rank `r`'s all_to_allv input: its block to each rank in turn.
fn a2av_input(r: usize, n: usize) -> Vec<u8> {
    (0..n)
        .flat_map(|q| (0..vlen(r, q)).map(move |i| pat(r, q, i)))
        .collect()
}

/// Bytes rank `from` sends rank `to` in all_to_allv.
fn vlen(from: usize, to: usize) -> usize {
    8 * (from + 2 * to + 1)
}

/// Rank q's block length (bytes) in all_gather_v and reduce_scatter_v (whole f32s).
fn qlen(q: usize) -> usize {
    16 * (q + 1)
}

/// Byte i of what rank `from` sends rank `to` in the exchange-based operations.
fn pat(from: usize, to: usize, i: usize) -> u8 {
    (from * 31 + to * 7 + i) as u8
}

const BLOCK: usize = 4096;

impl Round {
    fn new(r: usize, n: usize) -> Round {
        let init = fill(DType::f32, AllReduce::Sum, r, 1 << 18);
        let scattered = vec![0; init.len() / n / 4 * 4];
        Round {
            small: init[..8].to_vec(),
            large: init.clone(),
            gathered: vec![0; init.len() * n],
            scattered,
            bcast: vec![0; 64 << 10],
            msg: vec![r as u8; 4096],
            got: vec![0; 4096],
            a2a_in: (0..n)
                .flat_map(|q| (0..BLOCK).map(move |i| pat(r, q, i)))
                .collect(),
            a2a_out: vec![0; n * BLOCK],
            gat_out: vec![0; if r == 0 { n * BLOCK } else { 0 }],
            sca_in: if r == 0 {
                (0..n)
                    .flat_map(|q| (0..BLOCK).map(move |i| pat(0, q, i)))
                    .collect()
            } else {
                Vec::new()
            },
            sca_out: vec![0; BLOCK],
            red_small: init[..8].to_vec(),
            red_large: init.clone(),
            sr_got: vec![0; BLOCK],
            batch_got: vec![0; 2 * BLOCK],
            send_lens: (0..n).map(|q| vlen(r, q)).collect(),
            recv_lens: (0..n).map(|q| vlen(q, r)).collect(),
            a2av_in: a2av_input(r, n),
            a2av_out: vec![0; (0..n).map(|q| vlen(q, r)).sum()],
            v_lens: (0..n).map(qlen).collect(),
            agv_out: vec![0; (0..n).map(qlen).sum()],
            rsv_in: (0..(0..n).map(qlen).sum::<usize>() / 4)
                .map(|i| (r + i) as f32)
                .collect(),
            rsv_out: vec![0.0; qlen(r) / 4],
            init,
        }
    }

    fn run(&mut self, c: &Comm) {
        let (r, n) = (c.rank(), c.size());
        self.small.copy_from_slice(&self.init[..8]);
        self.large.copy_from_slice(&self.init);
        c.all_reduce(AllReduce::Sum, DType::f32, &mut self.small)
            .unwrap();
        c.all_reduce(AllReduce::Sum, DType::f32, &mut self.large)
            .unwrap();
        c.all_gather(&self.init, &mut self.gathered).unwrap();
        let part = self.scattered.len() * n;
        c.sum_scatter(DType::f32, &self.init[..part], &mut self.scattered)
            .unwrap();
        if r == 0 {
            self.bcast.fill(7);
        }
        c.broadcast(0, &mut self.bcast).unwrap();
        self.got.fill(0);
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        if r == 0 {
            c.send(next, &self.msg).unwrap();
            c.recv(prev, &mut self.got).unwrap();
        } else {
            c.recv(prev, &mut self.got).unwrap();
            c.send(next, &self.msg).unwrap();
        }
        c.barrier().unwrap();
        c.all_to_all(&self.a2a_in, &mut self.a2a_out).unwrap();
        c.gather(0, &self.a2a_in[..BLOCK], &mut self.gat_out)
            .unwrap();
        c.scatter(0, &self.sca_in, &mut self.sca_out).unwrap();
        self.red_small.copy_from_slice(&self.init[..8]);
        self.red_large.copy_from_slice(&self.init);
        c.reduce(0, AllReduce::Sum, DType::f32, &mut self.red_small)
            .unwrap();
        c.reduce(0, AllReduce::Sum, DType::f32, &mut self.red_large)
            .unwrap();
        c.sendrecv(
            next,
            &self.a2a_in[next * BLOCK..(next + 1) * BLOCK],
            prev,
            &mut self.sr_got,
        )
        .unwrap();
        c.all_to_allv(
            &self.a2av_in,
            &self.send_lens,
            &mut self.a2av_out,
            &self.recv_lens,
        )
        .unwrap();
        c.all_gather_v(&self.a2av_in[..qlen(r)], &mut self.agv_out, &self.v_lens)
            .unwrap();
        c.reduce_scatter_v(
            AllReduce::Sum,
            DType::f32,
            bytemuck::cast_slice(&self.rsv_in),
            bytemuck::cast_slice_mut(&mut self.rsv_out),
            &self.v_lens,
        )
        .unwrap();
        // Two messages each way with the ring's neighbours, one batch (order kept per peer).
        let (first, second) = self.batch_got.split_at_mut(BLOCK);
        let (one, two) = (
            &self.a2a_in[next * BLOCK..(next + 1) * BLOCK],
            &self.a2a_in[r * BLOCK..(r + 1) * BLOCK],
        );
        c.batch(&mut [
            P2p::Recv {
                peer: prev,
                data: first,
            },
            P2p::Send {
                peer: next,
                data: one,
            },
            P2p::Send {
                peer: next,
                data: two,
            },
            P2p::Recv {
                peer: prev,
                data: second,
            },
        ])
        .unwrap();
    }
}

fn hot_path_body() {
    let (r, n) = rank_size();
    let c = Comm::from_env().unwrap_or_else(|e| panic!("rank {r}: {e}"));
    let mut round = Round::new(r, n);
    // With SOAK_SLOW_RANK set, that rank starts each round late: the others' waits pass the
    // probe threshold (100 ms) and they tell it (the slow path of a wait, which must not
    // allocate either).
    let slow = std::env::var("SOAK_SLOW_RANK")
        .ok()
        .and_then(|v| v.parse::<usize>().ok());
    let run = |round: &mut Round| {
        if slow == Some(r) {
            std::thread::sleep(Duration::from_millis(150));
        }
        round.run(&c);
    };
    run(&mut round); // warm-up: buffers that grow once (scratch, receive state) grow here
    const ROUNDS: usize = 10;
    let info = allocation_counter::measure(|| {
        for _ in 0..ROUNDS {
            run(&mut round);
        }
    });
    // The last round's results are checked, so the counted calls did their work.
    check_all_reduce(DType::f32, AllReduce::Sum, n, &round.small).unwrap();
    check_all_reduce(DType::f32, AllReduce::Sum, n, &round.large).unwrap();
    for (p, part) in round.gathered.chunks(round.init.len()).enumerate() {
        assert_eq!(
            part,
            fill(DType::f32, AllReduce::Sum, p, 1 << 18),
            "all_gather part {p}"
        );
    }
    let per = round.scattered.len() / 4;
    for (j, x) in round.scattered.chunks(4).enumerate() {
        let i = r * per + j;
        let want: f64 = (0..n).map(|p| float_val(AllReduce::Sum, p, i)).sum();
        assert_eq!(read_elem(DType::f32, x), want, "sum_scatter element {i}");
    }
    assert!(round.bcast.iter().all(|&b| b == 7), "broadcast");
    let prev = (r + n - 1) % n;
    assert!(
        round.got.iter().all(|&b| b == prev as u8),
        "message from rank {prev}"
    );
    for q in 0..n {
        let want: Vec<u8> = (0..BLOCK).map(|i| pat(q, r, i)).collect();
        assert_eq!(
            &round.a2a_out[q * BLOCK..(q + 1) * BLOCK],
            &want[..],
            "all_to_all from {q}"
        );
        if r == 0 {
            let want: Vec<u8> = (0..BLOCK).map(|i| pat(q, 0, i)).collect();
            assert_eq!(
                &round.gat_out[q * BLOCK..(q + 1) * BLOCK],
                &want[..],
                "gather of {q}"
            );
        }
    }
    let want: Vec<u8> = (0..BLOCK).map(|i| pat(0, r, i)).collect();
    assert_eq!(round.sca_out, want, "scatter");
    if r == 0 {
        check_all_reduce(DType::f32, AllReduce::Sum, n, &round.red_small).unwrap();
        check_all_reduce(DType::f32, AllReduce::Sum, n, &round.red_large).unwrap();
    }
    let want: Vec<u8> = (0..BLOCK).map(|i| pat(prev, r, i)).collect();
    assert_eq!(round.sr_got, want, "sendrecv from {prev}");
    assert_eq!(
        &round.batch_got[..BLOCK],
        &want[..],
        "batch's first from {prev}"
    );
    let want: Vec<u8> = (0..BLOCK).map(|i| pat(prev, prev, i)).collect();
    assert_eq!(
        &round.batch_got[BLOCK..],
        &want[..],
        "batch's second from {prev}"
    );
    let mut at = 0;
    for q in 0..n {
        let want: Vec<u8> = (0..vlen(q, r)).map(|i| pat(q, r, i)).collect();
        assert_eq!(
            &round.a2av_out[at..at + want.len()],
            &want[..],
            "all_to_allv from {q}"
        );
        at += want.len();
    }
    let mut at = 0;
    for q in 0..n {
        // Rank q's all_gather_v block: the start of its all_to_allv input.
        let want = &a2av_input(q, n)[..qlen(q)];
        assert_eq!(
            &round.agv_out[at..at + qlen(q)],
            want,
            "all_gather_v of {q}"
        );
        at += qlen(q);
    }
    let first: usize = (0..r).map(qlen).sum::<usize>() / 4;
    for (j, x) in round.rsv_out.iter().enumerate() {
        let want: f32 = (0..n).map(|p| (p + first + j) as f32).sum();
        assert_eq!(*x, want, "reduce_scatter_v element {j}");
    }
    println!(
        "rank {r} of {n} ({}): {} allocations, {} bytes in {ROUNDS} rounds of 17 operations",
        c.device().unwrap_or_default(),
        info.count_total,
        info.bytes_total
    );
    assert_eq!(
        info.count_total, 0,
        "rank {r}: repeated calls with the same sizes allocated {} times ({} bytes)",
        info.count_total, info.bytes_total
    );
}

#[test]
fn repeated_calls_allocate_nothing() {
    const NAME: &str = "repeated_calls_allocate_nothing";
    if !parent_ready(NAME, hot_path_body) {
        return;
    }
    // 4 ranks: recursive doubling and halving-doubling; 3: the ring and the non-power-of-two fold.
    for n in [4, 3] {
        spawn_local_ok(NAME, n, &[], Duration::from_secs(300));
    }
}

/// The hot path allocates nothing in the hierarchical all_reduce either (2 hosts of 2 ranks).
#[test]
fn repeated_calls_allocate_nothing_mixed() {
    over(Net::Mixed, repeated_calls_allocate_nothing);
}

/// Nor does a wait that lasts: waiting on a rank that starts each round 150 ms late, the others
/// read the side channel and probe it, and it takes their probes.
#[test]
fn waits_on_a_late_rank_allocate_nothing() {
    const NAME: &str = "waits_on_a_late_rank_allocate_nothing";
    if !parent_ready(NAME, hot_path_body) {
        return;
    }
    spawn_local_ok(
        NAME,
        3,
        &[("SOAK_SLOW_RANK", "2")],
        Duration::from_secs(300),
    );
}

crate::matrix_shm!(
    soak_mixed_collectives_and_no_leaks,
    chunk_counters_wrap_past_16_bits,
    repeated_calls_allocate_nothing,
    waits_on_a_late_rank_allocate_nothing
);
