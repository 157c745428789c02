//! Collectives over RDMA, multi-process: world sizes 2, 3, 4, 5, 8; every dtype with Sum and one
//! other op; lengths 0, 1, 7, 4097 elements and 16 MiB. Results are checked element by element
//! against an independent f64 / exact-integer reference, and bit identity across ranks is checked
//! by all-gathering a hash of every rank's result. The registered_* tests run every collective from
//! buffers registered once (`with_registered`), their contents changed every round.

mod common;
use common::reference::*;
use common::*;
use rdmacomm::{Algo, AllReduce, Comm, Communicator, DType};
use std::time::Duration;

fn same_everywhere(c: &Comm, what: &str, data: &[u8]) {
    let h = hash(data).to_le_bytes();
    let mut all = vec![0u8; 8 * c.size()];
    c.all_gather(&h, &mut all).unwrap();
    for (r, hr) in all.chunks(8).enumerate() {
        assert_eq!(
            hr,
            h,
            "{what}: rank {r}'s result differs from rank {}'s (bits not identical)",
            c.rank()
        );
    }
}

/// The all_reduce algorithms to run (alike on every rank): the flat ones, and the hierarchical
/// one where ranks are grouped into hosts (`RXE_TEST_RANKS_PER_HOST` or `RXE_TEST_HOSTS`; it
/// runs flat where the layout is not regular). With 2 ranks on each of 2 or 4 hosts, the layout
/// must be seen.
fn algos(c: &Comm) -> Vec<Algo> {
    let mut v = vec![Algo::Ring, Algo::Halving, Algo::Doubling, Algo::Direct];
    let per_host = std::env::var("RXE_TEST_RANKS_PER_HOST").ok();
    if per_host.is_some() || std::env::var("RXE_TEST_HOSTS").is_ok() {
        v.push(Algo::Hierarchical);
    }
    let dev = c.device().unwrap_or_default();
    if per_host.as_deref() == Some("2") && c.size() % 2 == 0 && c.size() >= 4 {
        let want = format!("{} hosts of 2 ranks", c.size() / 2);
        assert!(
            dev.contains(&want),
            "rank {}: {dev:?} lacks {want:?}",
            c.rank()
        );
    }
    if std::env::var("RXE_TEST_HOSTS").as_deref() == Ok("a,b,b,c") && [1, 2].contains(&c.rank()) {
        assert!(
            dev.contains("hosts of 1, 2, 1 ranks"),
            "rank {}: {dev:?}",
            c.rank()
        );
    }
    v
}

fn other_op(dtype: DType) -> AllReduce {
    match dtype {
        DType::f32 | DType::i8 | DType::u32 => AllReduce::Prod,
        DType::f64 | DType::bf16 | DType::i32 | DType::u64 => AllReduce::Min,
        _ => AllReduce::Max,
    }
}

fn body() {
    let (r, n) = rank_size();
    let c = Comm::from_env().unwrap_or_else(|e| panic!("rank {r}: {e}"));
    eprintln!("rank {r}/{n}: {:?}", c.device());
    // First, before any other traffic (so no credits are owed): mixed sizes back to back,
    // mailbox chunks (up to 48 B) and chunks written with an immediate interleaved, more
    // messages than slots. With 3 ranks or more, rank 0 posts one message more to rank 1 than
    // it has slots, while rank 1, after its first receive and an answer, waits on rank 2, which
    // waits on rank 0: the credit rank 0 needs rides only in that answer, not yet taken
    // (credits are otherwise returned half the slots at a time).
    if r < 3 {
        let slots: usize = std::env::var("RDMACOMM_SLOTS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(rdmacomm::config::DEFAULT_SLOTS);
        let lens = [8usize, 48, 49, 0, 64, 3, 5000, 47, 1, 48, 700, 16];
        let burst = if n >= 3 { slots + 1 } else { lens.len() };
        assert!(
            burst <= lens.len(),
            "RDMACOMM_SLOTS={slots}: too many for this test"
        );
        let msg = |from: usize, i: usize| -> Vec<u8> {
            (0..lens[i % lens.len()])
                .map(|j| (int_val(from, j * 31 + i) >> 3) as u8)
                .collect()
        };
        let recv_check = |from: usize, i: usize| {
            let mut got = vec![0u8; lens[i % lens.len()]];
            c.recv(from, &mut got).unwrap();
            assert!(
                got == msg(from, i),
                "message {i} from rank {from}: wrong bytes"
            );
        };
        match r {
            0 => {
                for i in 0..burst {
                    c.send(1, &msg(0, i)).unwrap();
                }
                if n >= 3 {
                    c.send(2, &msg(0, 0)).unwrap();
                }
                recv_check(1, 0);
            }
            1 => {
                recv_check(0, 0);
                c.send(0, &msg(1, 0)).unwrap();
                if n >= 3 {
                    recv_check(2, 0);
                }
                for i in 1..burst {
                    recv_check(0, i);
                }
            }
            _ if n >= 3 => {
                recv_check(0, 0);
                c.send(1, &msg(2, 0)).unwrap();
            }
            _ => {}
        }
    }
    let big_elems = |d: DType| (16 << 20) / d.size();
    let full = std::env::var("RXE_TEST_FULL16").is_ok_and(|v| v == "1") || n == 2;
    // all_reduce, with every algorithm (doubling and direct only up to mid sizes)
    // The one-step algorithm runs over RDMA only when forced: there f32 alone (every dtype on
    // the host, over TCP and shared memory, where it is also auto's choice), to keep the VM
    // stage's time.
    let over_rdma = c.device().is_some_and(|d| d.starts_with("RDMA"));
    for algo in algos(&c) {
        c.set_algorithm(algo);
        for dtype in DType::ALL {
            if algo == Algo::Direct && over_rdma && dtype != DType::f32 {
                continue;
            }
            for op in [AllReduce::Sum, other_op(dtype)] {
                let mut lens = vec![0usize, 1, 7, 4097];
                let small_only = matches!(algo, Algo::Doubling | Algo::Direct);
                let big = (full && !small_only)
                    || (algo == Algo::Ring && dtype == DType::f32 && op == AllReduce::Sum)
                    || (algo == Algo::Hierarchical && dtype == DType::f64 && op == AllReduce::Sum)
                    || (algo == Algo::Halving && dtype == DType::bf16 && op != AllReduce::Sum);
                if big {
                    lens.push(big_elems(dtype));
                }
                if small_only && matches!(dtype, DType::f32 | DType::bf16) {
                    lens.push(300_001); // many segments, the last one short
                }
                for &elems in &lens {
                    let mut data = fill(dtype, op, r, elems);
                    c.all_reduce(op, dtype, &mut data)
                        .unwrap_or_else(|e| panic!("rank {r}: all_reduce: {e}"));
                    let what = format!(
                        "{algo:?} all_reduce {} {} x{elems} on {n} ranks",
                        dtype.name(),
                        op.name()
                    );
                    if let Err(e) = check_all_reduce(dtype, op, n, &data) {
                        panic!("rank {r}: {what}: {e}");
                    }
                    same_everywhere(&c, &what, &data);
                }
            }
        }
    }
    // Every reduction of every dtype over the wire (the loop above runs two per dtype, with
    // every algorithm): auto's choice at a short length and past the doubling range.
    for dtype in DType::ALL {
        for op in AllReduce::ALL {
            if op == AllReduce::Sum || op == other_op(dtype) {
                continue;
            }
            for elems in [7usize, 20_000] {
                let mut data = fill(dtype, op, r, elems);
                c.all_reduce(op, dtype, &mut data)
                    .unwrap_or_else(|e| panic!("rank {r}: all_reduce: {e}"));
                let what = format!("auto all_reduce {} {} x{elems}", dtype.name(), op.name());
                if let Err(e) = check_all_reduce(dtype, op, n, &data) {
                    panic!("rank {r}: {what}: {e}");
                }
                same_everywhere(&c, &what, &data);
            }
        }
    }
    // Operand order: under Min, op(+0, -0) and op(-0, +0) differ in sign; under Sum, two NaNs
    // yield the payload of one of them. Ranks that combined in different orders would end with
    // different bits, so every algorithm must combine alike everywhere.
    for algo in algos(&c) {
        c.set_algorithm(algo);
        for elems in [7usize, 300_001] {
            let zero = |i: usize| if (r + i) % 2 == 0 { 0.0f32 } else { -0.0 };
            let mut z: Vec<u8> = (0..elems).flat_map(|i| zero(i).to_le_bytes()).collect();
            c.all_reduce(AllReduce::Min, DType::f32, &mut z).unwrap();
            let vals = z
                .chunks(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()));
            assert!(vals.into_iter().all(|v| v == 0.0), "{algo:?} min of zeros");
            same_everywhere(&c, &format!("{algo:?} min of signed zeros x{elems}"), &z);
            let nan = |i: usize| f32::from_bits(0x7fc0_0000 | ((r * 7919 + i) as u32 & 0x3f_ffff));
            let mut q: Vec<u8> = (0..elems).flat_map(|i| nan(i).to_le_bytes()).collect();
            c.all_reduce(AllReduce::Sum, DType::f32, &mut q).unwrap();
            let vals = q
                .chunks(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()));
            assert!(vals.into_iter().all(f32::is_nan), "{algo:?} sum of NaNs");
            same_everywhere(&c, &format!("{algo:?} sum of NaN payloads x{elems}"), &q);
        }
    }
    c.set_algorithm(Algo::Auto);
    // A buffer the transport may run in slices (TCP: 2 MiB), the last one short.
    let elems = (5 << 20) / 4 + 3;
    let mut data = fill(DType::f32, AllReduce::Sum, r, elems);
    c.all_reduce(AllReduce::Sum, DType::f32, &mut data)
        .unwrap_or_else(|e| panic!("rank {r}: all_reduce of 5 MiB + 12 B: {e}"));
    if let Err(e) = check_all_reduce(DType::f32, AllReduce::Sum, n, &data) {
        panic!("rank {r}: auto all_reduce f32 sum x{elems} on {n} ranks: {e}");
    }
    same_everywhere(&c, "auto all_reduce of 5 MiB + 12 B", &data);
    // all_gather
    for bytes in [0usize, 1, 7, 4097 * 4, (1 << 20) + 3] {
        let input: Vec<u8> = (0..bytes).map(|i| (int_val(r, i) & 0xff) as u8).collect();
        let mut out = vec![0u8; bytes * n];
        c.all_gather(&input, &mut out).unwrap();
        for q in 0..n {
            let want: Vec<u8> = (0..bytes).map(|i| (int_val(q, i) & 0xff) as u8).collect();
            assert!(
                out[q * bytes..(q + 1) * bytes] == want[..],
                "all_gather {bytes} B: rank {q}'s part is wrong"
            );
        }
    }
    // sum_scatter
    for dtype in [DType::f32, DType::bf16, DType::i64, DType::u8] {
        for elems in [0usize, 1, 7, 4097] {
            let input = fill(dtype, AllReduce::Sum, r, elems * n);
            let mut out = vec![0u8; elems * dtype.size()];
            c.sum_scatter(dtype, &input, &mut out).unwrap();
            // Reference: the full sum, then this rank's chunk.
            let off = r * elems;
            for (j, b) in out.chunks(dtype.size()).enumerate() {
                let i = off + j;
                if dtype.is_float() {
                    assert_eq!(
                        read_elem(dtype, b),
                        float_ref(AllReduce::Sum, n, i),
                        "sum_scatter {} elem {j}",
                        dtype.name()
                    );
                } else {
                    assert_eq!(
                        read_int(dtype, b),
                        int_ref(dtype, AllReduce::Sum, n, i),
                        "sum_scatter {} elem {j}",
                        dtype.name()
                    );
                }
            }
        }
    }
    // send / recv around the ring, even ranks send first (lengths beyond the slots included)
    for bytes in [0usize, 1, 7, (3 << 20) + 5] {
        let to = (r + 1) % n;
        let from = (r + n - 1) % n;
        let mine: Vec<u8> = (0..bytes).map(|i| (int_val(r, i) >> 8) as u8).collect();
        let mut got = vec![0u8; bytes];
        if r % 2 == 0 {
            c.send(to, &mine).unwrap();
            c.recv(from, &mut got).unwrap();
        } else {
            c.recv(from, &mut got).unwrap();
            c.send(to, &mine).unwrap();
        }
        let want: Vec<u8> = (0..bytes).map(|i| (int_val(from, i) >> 8) as u8).collect();
        assert!(got == want, "recv {bytes} B from rank {from}: wrong bytes");
    }
    // Bad input: clear errors, before any traffic. With peers that ends the communicator on
    // every rank (they may be in the call), so a dup takes them; the world works after.
    let d = c.dup().unwrap();
    let mut odd = vec![0u8; 6];
    let e = d
        .all_reduce(AllReduce::Sum, DType::f32, &mut odd)
        .unwrap_err()
        .to_string();
    assert!(e.contains("multiple of the f32 element size 4"), "{e}");
    let e = d
        .all_gather(&[1, 2], &mut [0u8; 3])
        .unwrap_err()
        .to_string();
    assert!(e.contains("all_gather: output has 3 bytes"), "{e}");
    let e = d.send(r, &[1]).unwrap_err().to_string();
    assert!(e.contains("itself"), "{e}");
    let e = d.recv(n, &mut [0]).unwrap_err().to_string();
    assert!(e.contains("out of range"), "{e}");
    if n > 1 {
        let later = d.barrier().unwrap_err().to_string();
        assert!(later.contains("refused its call"), "{later}");
    }
    drop(d);
    let mut one = fill(DType::i32, AllReduce::Sum, r, 3);
    c.all_reduce(AllReduce::Sum, DType::i32, &mut one).unwrap();
    check_all_reduce(DType::i32, AllReduce::Sum, n, &one).unwrap();
    eprintln!("rank {r}/{n}: all checks passed");
}

/// f32 values that change every round, so a send of stale bytes (a zero-copy write that read a
/// buffer before or after the round's contents) shows; sums stay exact.
fn round_val(r: usize, i: usize, round: usize) -> f32 {
    ((r + 3 * i + 5 * round) % 16) as f32
}

fn round_fill(buf: &mut [u8], r: usize, round: usize) {
    for (i, e) in buf.chunks_mut(4).enumerate() {
        e.copy_from_slice(&round_val(r, i, round).to_le_bytes());
    }
}

fn round_check(buf: &[u8], n: usize, round: usize, what: &str) {
    for (i, e) in buf.chunks(4).enumerate() {
        let got = f32::from_le_bytes(e.try_into().unwrap());
        let want: f32 = (0..n).map(|q| round_val(q, i, round)).sum();
        assert_eq!(got, want, "{what}: element {i}");
    }
}

/// Buffers registered once (`with_registered`): every collective sends straight from
/// them; contents change each round and are checked against a scalar re-computation.
fn body_registered() {
    let (r, n) = rank_size();
    let c = std::sync::Arc::new(Comm::from_env().unwrap_or_else(|e| panic!("rank {r}: {e}")));
    let mut buf = vec![0u8; 8 << 20];
    let mut other = vec![0u8; 3 << 20];
    c.with_registered(&mut buf, &mut |buf| {
        c.with_registered(&mut other, &mut |other| {
            for round in 0..3 {
                for algo in algos(&c) {
                    c.set_algorithm(algo);
                    let mut lens = vec![1usize, 4097, 300_001];
                    if !matches!(algo, Algo::Doubling | Algo::Direct) {
                        lens.push((1 << 20) + 7); // 4 MiB: beyond every rank's slots
                    }
                    for elems in lens {
                        // Offset by a few elements: a registered range need not start a part.
                        let part = &mut buf[12..12 + 4 * elems];
                        round_fill(part, r, round);
                        c.all_reduce(AllReduce::Sum, DType::f32, part).unwrap();
                        let what = format!("registered {algo:?} all_reduce x{elems} round {round}");
                        round_check(part, n, round, &what);
                        same_everywhere(&c, &what, part);
                    }
                }
                c.set_algorithm(Algo::Auto);
                // all_gather into the registered buffer, from the other one.
                let per = 4 * 70_001;
                round_fill(&mut other[..per], r, round);
                c.all_gather(&other[..per], &mut buf[..per * n]).unwrap();
                for q in 0..n {
                    let got = &buf[q * per..(q + 1) * per];
                    for (i, e) in got.chunks(4).enumerate() {
                        let v = f32::from_le_bytes(e.try_into().unwrap());
                        assert_eq!(v, round_val(q, i, round), "registered all_gather: rank {q}");
                    }
                }
                // broadcast from rank 1 and a ring of sends, both from registered memory.
                let bytes = (3 << 20) - 5;
                let pattern = |q: usize, i: usize| ((q * 31 + i * 7 + round) % 251) as u8;
                for (i, b) in buf[..bytes].iter_mut().enumerate() {
                    *b = if r == 1 { pattern(1, i) } else { 0 };
                }
                c.broadcast(1, &mut buf[..bytes]).unwrap();
                assert!(
                    buf[..bytes]
                        .iter()
                        .enumerate()
                        .all(|(i, &b)| b == pattern(1, i)),
                    "registered broadcast round {round}"
                );
                let (to, from) = ((r + 1) % n, (r + n - 1) % n);
                for (i, b) in other[..bytes].iter_mut().enumerate() {
                    *b = pattern(r, i);
                }
                if r % 2 == 0 {
                    c.send(to, &other[..bytes]).unwrap();
                    c.recv(from, &mut buf[..bytes]).unwrap();
                } else {
                    c.recv(from, &mut buf[..bytes]).unwrap();
                    c.send(to, &other[..bytes]).unwrap();
                }
                assert!(
                    buf[..bytes]
                        .iter()
                        .enumerate()
                        .all(|(i, &b)| b == pattern(from, i)),
                    "registered recv from rank {from} round {round}"
                );
            }
            Ok(())
        })
    })
    .unwrap();
    // The same memory after its registration ended, through staging again.
    round_fill(&mut buf[..4 * 4097], r, 7);
    c.all_reduce(AllReduce::Sum, DType::f32, &mut buf[..4 * 4097])
        .unwrap();
    round_check(&buf[..4 * 4097], n, 7, "after the registration ended");
    // An empty buffer registers nothing and still runs the closure.
    let ran = c.with_registered(&mut [], &mut |b| {
        assert!(b.is_empty());
        Ok(())
    });
    assert!(ran.is_ok(), "empty registration: {ran:?}");
    // The typed front: Group::with_registered hands `f` the elements and returns its value.
    let g = rdmacomm::Group::new(c.clone());
    let mut v = vec![0f32; 100_003];
    let total = g
        .with_registered(&mut v, |v| {
            for (i, e) in v.iter_mut().enumerate() {
                *e = round_val(r, i, 9);
            }
            g.all_reduce(v, AllReduce::Sum)?;
            Ok(v.iter().map(|&e| e as f64).sum::<f64>())
        })
        .unwrap();
    let want: f64 = (0..v.len())
        .map(|i| (0..n).map(|q| round_val(q, i, 9) as f64).sum::<f64>())
        .sum();
    assert_eq!(total, want, "Group::with_registered all_reduce");
    // A bounded number at once over RDMA (TCP registers nothing).
    if c.device().is_some_and(|d| d.starts_with("RDMA")) {
        let limit = rdmacomm::unstable::MAX_REGISTERED;
        let mut small: Vec<Vec<u8>> = (0..=limit).map(|_| vec![0u8; 4096]).collect();
        let mut depth = 0;
        let e = nest(&c, &mut small, &mut depth).unwrap_err().to_string();
        assert!(
            e.contains(&format!("{limit} buffers are registered")),
            "{e}"
        );
        // Exactly `limit` at once: the earlier registrations (buf, other) have ended.
        assert_eq!(
            depth, limit,
            "registrations that succeeded before the limit"
        );
    }
    eprintln!("rank {r}/{n}: registered buffers: all checks passed");
}

/// Registers every buffer of `bufs`, nested, counting in `depth` those that succeeded.
fn nest(c: &Comm, bufs: &mut [Vec<u8>], depth: &mut usize) -> rdmacomm::Result<()> {
    match bufs.split_first_mut() {
        None => Ok(()),
        Some((first, rest)) => c.with_registered(first, &mut |_| {
            *depth += 1;
            nest(c, rest, depth)
        }),
    }
}

fn run(name: &str, n: usize, placement: Placement, body: fn()) {
    run_with(name, n, placement, body, &[]);
}

/// [`run`], every rank with the variables `vars` too.
fn run_with(name: &str, n: usize, placement: Placement, body: fn(), vars: &[(&str, &str)]) {
    if !parent_ready(name, body) {
        return;
    }
    if placement == Placement::Hosts && vm_hosts() < 2 {
        if std::env::var("RDMACOMM_REQUIRE_RDMA").is_ok_and(|v| v == "1") {
            panic!("RDMACOMM_REQUIRE_RDMA=1 needs tools/rxe-vm --hosts 3 for {name}");
        }
        eprintln!("SKIPPED: needs soft-RoCE hosts (tools/rxe-vm --hosts 3)");
        return;
    }
    let r = spawn(
        name,
        n,
        placement,
        &|_| {
            let mut v = vec![("RDMACOMM_TIMEOUT".to_string(), "60".to_string())];
            v.extend(vars.iter().map(|(k, x)| (k.to_string(), x.to_string())));
            v
        },
        Duration::from_secs(900),
    );
    assert_all_ok(&r);
}

#[test]
fn world_2() {
    run("world_2", 2, Placement::Local, body);
}
#[test]
fn world_3() {
    run("world_3", 3, Placement::Local, body);
}
#[test]
fn world_4() {
    run("world_4", 4, Placement::Local, body);
}
#[test]
fn world_5() {
    run("world_5", 5, Placement::Local, body);
}
#[test]
fn world_8() {
    run("world_8", 8, Placement::Local, body);
}
#[test]
fn world_3_across_hosts() {
    run("world_3_across_hosts", 3, Placement::Hosts, body);
}
#[test]
fn registered_world_3() {
    run("registered_world_3", 3, Placement::Local, body_registered);
}
#[test]
fn registered_world_4() {
    run("registered_world_4", 4, Placement::Local, body_registered);
}

/// World 4 on hosts of 1, 2 and 1 ranks (uneven: the flat algorithms, shared memory between
/// ranks 1 and 2).
#[test]
fn world_4_over_uneven_hosts() {
    over(Net::Hosts("a,b,b,c"), world_4);
}

/// World 4, two ranks a host, with chunks as large as RDMA's (rings of few slots): a same-host
/// peer must buffer as many as others.
#[test]
fn world_4_mixed_with_large_chunks() {
    over(Net::Mixed, || {
        run_with(
            "world_4",
            4,
            Placement::Local,
            body,
            &[("RDMACOMM_TCP_CHUNK", "1048576")],
        )
    });
}

crate::matrix!(
    world_2,
    world_3,
    world_4,
    world_5,
    world_8,
    world_3_across_hosts,
    registered_world_3,
    registered_world_4
);
