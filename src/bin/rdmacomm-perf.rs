//! `rdmacomm-perf`: collective bandwidth and latency in the style of nccl-tests.
//!
//! Per rank under any launcher (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, Open MPI, PMI, Slurm),
//! or `--local N` to start N local ranks itself. Sizes from `-b` to `-e` by factor `-f`; `-n`
//! timed iterations after `-w` warm-ups; `-c 1` checks every result against a reference;
//! `-d` dtype, `-o` op, `--coll all_reduce|all_gather|sum_scatter|sendrecv|broadcast|
//! all_to_all|reduce|gather|scatter`; `--nb 1` runs each operation non-blocking (started in a
//! `Comm::overlap` scope and waited at once); `--nb 2` alternates blocks of blocking and of
//! started-and-waited-at-once all_reduces in one scope and reports their paired ratios;
//! `--overlap 1` measures how much of an all_reduce a
//! compute kernel on the calling thread hides. busbw as nccl-tests: all_reduce algbw x
//! 2(n-1)/n; all_gather, sum_scatter, all_to_all, gather, scatter algbw x (n-1)/n (size: the
//! whole buffer); sendrecv, broadcast and reduce algbw. Time is the slowest rank's mean per
//! iteration.
//!
//! Under each row (unless `--ledger 0`) a `# ledger` line gives rank 0's CPU passes per wire byte over the timed
//! loop (copy-in + reduce + copy-out, from `Comm::ledger`), its user and system CPU
//! nanoseconds per wire byte (`getrusage`), registrations per operation, and the busbw those
//! passes allow on a 24 and a 48 GB/s link (200 and 400 Gb/s) at this host's copy and reduce
//! speeds for buffers larger than its caches (measured once, at start).

use rdmacomm::{Algo, AllReduce, Comm, Communicator, DType};
use std::time::Instant;

#[derive(Debug, Clone)]
struct Opts {
    min: usize,
    max: usize,
    factor: usize,
    iters: usize,
    warmup: usize,
    check: bool,
    dtype: DType,
    op: AllReduce,
    coll: String,
    local: Option<usize>,
    /// `--algo`; otherwise the communicator's (RDMACOMM_ALGO).
    algo: Option<Algo>,
    /// Register the buffers once (`Communicator::with_registered`), as nccl-tests' `-R 1`.
    register: bool,
    /// Run each operation non-blocking, started and waited at once.
    nb: bool,
    /// Alternate blocking and non-blocking blocks, paired (`--nb 2`).
    paired: bool,
    /// Measure overlap of an all_reduce with computation instead.
    overlap: bool,
    /// Print the pass ledger under every row (`--ledger 0`: not, nor time the host's passes).
    ledger: bool,
}

fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>()
        .map(|v| v * mul)
        .map_err(|_| format!("bad size {s:?}"))
}

fn parse() -> Result<Opts, String> {
    let mut o = Opts {
        min: 8,
        max: 64 << 20,
        factor: 2,
        iters: 20,
        warmup: 5,
        check: true,
        dtype: DType::f32,
        op: AllReduce::Sum,
        coll: "all_reduce".into(),
        local: None,
        algo: None,
        register: false,
        nb: false,
        paired: false,
        overlap: false,
        ledger: true,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let a = args[i].as_str();
        let v = args.get(i + 1).cloned().unwrap_or_default();
        match a {
            "-b" | "--minbytes" => o.min = parse_size(&v)?,
            "-e" | "--maxbytes" => o.max = parse_size(&v)?,
            "-f" | "--stepfactor" => o.factor = v.parse().map_err(|_| "bad -f")?,
            "-n" | "--iters" => o.iters = v.parse().map_err(|_| "bad -n")?,
            "-w" | "--warmup_iters" => o.warmup = v.parse().map_err(|_| "bad -w")?,
            "-c" | "--check" => o.check = v != "0",
            "-d" | "--datatype" => o.dtype = DType::parse(&v).map_err(|e| e.to_string())?,
            "-o" | "--op" => o.op = AllReduce::parse(&v).map_err(|e| e.to_string())?,
            "--coll" => o.coll = v.clone(),
            "--algo" => o.algo = Some(Algo::parse(&v).map_err(|e| e.to_string())?),
            "-R" | "--register" => o.register = v != "0",
            "--nb" => {
                o.nb = v != "0";
                o.paired = v == "2";
            }
            "--overlap" => o.overlap = v != "0",
            "--ledger" => o.ledger = v != "0",
            "--local" => o.local = Some(v.parse().map_err(|_| "bad --local")?),
            "-h" | "--help" => {
                println!(
                    "rdmacomm-perf [--local N] [-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] [-w WARMUP] [-c 0|1] [-R 0|1] \
                     [-d f32|f64|f16|bf16|i8|u8|i32|u32|i64|u64] [-o sum|prod|min|max] \
                     [--coll all_reduce|all_gather|sum_scatter|sendrecv|broadcast|all_to_all|reduce|gather|scatter] \
                     [--algo ring|halving|doubling|direct|auto] [--nb 0|1|2] [--overlap 0|1]"
                );
                std::process::exit(0);
            }
            _ => return Err(format!("unknown option {a:?} (see --help)")),
        }
        i += 2;
    }
    if ![
        "all_reduce",
        "all_gather",
        "sum_scatter",
        "sendrecv",
        "broadcast",
        "all_to_all",
        "reduce",
        "gather",
        "scatter",
    ]
    .contains(&o.coll.as_str())
    {
        return Err(format!("unknown --coll {:?}", o.coll));
    }
    if o.nb && o.coll != "all_reduce" {
        return Err("--nb 1 times all_reduce only".into());
    }
    if o.factor < 2 || o.iters == 0 || o.min > o.max {
        return Err("need -f >= 2, -n >= 1 and -b <= -e".into());
    }
    Ok(o)
}

/// Small values that every dtype holds exactly, so sums, products, min and max are exact.
fn value(op: AllReduce, rank: usize, i: usize) -> f64 {
    match op {
        AllReduce::Prod => {
            if (rank + i) % 3 == 0 {
                -1.0
            } else {
                1.0
            }
        }
        _ => ((rank + i) % 8) as f64,
    }
}

fn encode(dtype: DType, v: f64, out: &mut [u8]) {
    match dtype {
        DType::f32 => out.copy_from_slice(&(v as f32).to_le_bytes()),
        DType::f64 => out.copy_from_slice(&v.to_le_bytes()),
        DType::f16 => out.copy_from_slice(&half::f16::from_f64(v).to_le_bytes()),
        DType::bf16 => out.copy_from_slice(&half::bf16::from_f64(v).to_le_bytes()),
        _ => {
            let x = v as i64;
            out.copy_from_slice(&x.to_le_bytes()[..dtype.size()]);
        }
    }
}

fn decode(dtype: DType, b: &[u8]) -> f64 {
    match dtype {
        DType::f32 => f32::from_le_bytes(b.try_into().unwrap()) as f64,
        DType::f64 => f64::from_le_bytes(b.try_into().unwrap()),
        DType::f16 => half::f16::from_le_bytes(b.try_into().unwrap()).to_f64(),
        DType::bf16 => half::bf16::from_le_bytes(b.try_into().unwrap()).to_f64(),
        DType::i8 => b[0] as i8 as f64,
        DType::u8 => b[0] as f64,
        DType::i32 => i32::from_le_bytes(b.try_into().unwrap()) as f64,
        DType::u32 => u32::from_le_bytes(b.try_into().unwrap()) as f64,
        DType::i64 => i64::from_le_bytes(b.try_into().unwrap()) as f64,
        DType::u64 => u64::from_le_bytes(b.try_into().unwrap()) as f64,
    }
}

fn reference(op: AllReduce, n: usize, i: usize) -> f64 {
    let v = (0..n).map(|r| value(op, r, i));
    match op {
        AllReduce::Sum => v.sum(),
        AllReduce::Prod => v.product(),
        AllReduce::Min => v.fold(f64::INFINITY, f64::min),
        AllReduce::Max => v.fold(f64::NEG_INFINITY, f64::max),
    }
}

fn fill(dtype: DType, op: AllReduce, rank: usize, first: usize, buf: &mut [u8]) {
    let s = dtype.size();
    for (j, e) in buf.chunks_mut(s).enumerate() {
        encode(dtype, value(op, rank, first + j), e);
    }
}

/// Runs one size once; returns wrong-element count when checking.
fn run_once(
    c: &Comm,
    o: &Opts,
    bytes: usize,
    a: &mut [u8],
    b: &mut [u8],
    check: bool,
) -> rdmacomm::Result<u64> {
    let (r, n, s) = (c.rank(), c.size(), o.dtype.size());
    let mut wrong = 0u64;
    match o.coll.as_str() {
        "all_reduce" => {
            let buf = &mut a[..bytes];
            if check {
                fill(o.dtype, o.op, r, 0, buf);
            }
            c.all_reduce(o.op, o.dtype, buf)?;
            if check {
                for (i, e) in buf.chunks(s).enumerate() {
                    wrong += u64::from(decode(o.dtype, e) != reference(o.op, n, i));
                }
            }
        }
        "all_gather" => {
            let per = bytes / n;
            if check {
                fill(o.dtype, AllReduce::Sum, r, 0, &mut a[..per]);
            }
            c.all_gather(&a[..per], &mut b[..per * n])?;
            if check {
                for q in 0..n {
                    for (i, e) in b[q * per..(q + 1) * per].chunks(s).enumerate() {
                        wrong += u64::from(decode(o.dtype, e) != value(AllReduce::Sum, q, i));
                    }
                }
            }
        }
        "sum_scatter" => {
            let per = bytes / n;
            if check {
                fill(o.dtype, AllReduce::Sum, r, 0, &mut a[..per * n]);
            }
            c.sum_scatter(o.dtype, &a[..per * n], &mut b[..per])?;
            if check {
                for (j, e) in b[..per].chunks(s).enumerate() {
                    wrong += u64::from(
                        decode(o.dtype, e) != reference(AllReduce::Sum, n, r * per / s + j),
                    );
                }
            }
        }
        "broadcast" => {
            let root = 0;
            if check {
                if r == root {
                    fill(o.dtype, AllReduce::Sum, root, 0, &mut a[..bytes]);
                } else {
                    a[..bytes].fill(0);
                }
            }
            c.broadcast(root, &mut a[..bytes])?;
            if check {
                for (i, e) in a[..bytes].chunks(s).enumerate() {
                    wrong += u64::from(decode(o.dtype, e) != value(AllReduce::Sum, root, i));
                }
            }
        }
        "all_to_all" => {
            let per = bytes / n;
            if check {
                for q in 0..n {
                    fill(
                        o.dtype,
                        AllReduce::Sum,
                        r * n + q,
                        0,
                        &mut a[q * per..(q + 1) * per],
                    );
                }
            }
            c.all_to_all(&a[..per * n], &mut b[..per * n])?;
            if check {
                for q in 0..n {
                    for (i, e) in b[q * per..(q + 1) * per].chunks(s).enumerate() {
                        wrong +=
                            u64::from(decode(o.dtype, e) != value(AllReduce::Sum, q * n + r, i));
                    }
                }
            }
        }
        "reduce" => {
            let root = 0;
            let buf = &mut a[..bytes];
            if check {
                fill(o.dtype, o.op, r, 0, buf);
            }
            c.reduce(root, o.op, o.dtype, buf)?;
            if check && r == root {
                for (i, e) in buf.chunks(s).enumerate() {
                    wrong += u64::from(decode(o.dtype, e) != reference(o.op, n, i));
                }
            }
        }
        "gather" => {
            let (per, root) = (bytes / n, 0);
            if check {
                fill(o.dtype, AllReduce::Sum, r, 0, &mut a[..per]);
            }
            let out = if r == root { per * n } else { 0 };
            c.gather(root, &a[..per], &mut b[..out])?;
            if check && r == root {
                for q in 0..n {
                    for (i, e) in b[q * per..(q + 1) * per].chunks(s).enumerate() {
                        wrong += u64::from(decode(o.dtype, e) != value(AllReduce::Sum, q, i));
                    }
                }
            }
        }
        "scatter" => {
            let (per, root) = (bytes / n, 0);
            if check && r == root {
                for q in 0..n {
                    fill(
                        o.dtype,
                        AllReduce::Sum,
                        q,
                        0,
                        &mut a[q * per..(q + 1) * per],
                    );
                }
            }
            let input = if r == root { per * n } else { 0 };
            c.scatter(root, &a[..input], &mut b[..per])?;
            if check {
                for (i, e) in b[..per].chunks(s).enumerate() {
                    wrong += u64::from(decode(o.dtype, e) != value(AllReduce::Sum, r, i));
                }
            }
        }
        _ => {
            // Pairs (0,1), (2,3), ...: the even rank sends, then receives back. An odd rank out idles.
            let peer = r ^ 1;
            if peer < n {
                if check {
                    fill(o.dtype, AllReduce::Sum, r, 0, &mut a[..bytes]);
                }
                if r % 2 == 0 {
                    c.send(peer, &a[..bytes])?;
                    c.recv(peer, &mut b[..bytes])?;
                } else {
                    c.recv(peer, &mut b[..bytes])?;
                    c.send(peer, &a[..bytes])?;
                }
                if check {
                    for (i, e) in b[..bytes].chunks(s).enumerate() {
                        wrong += u64::from(decode(o.dtype, e) != value(AllReduce::Sum, peer, i));
                    }
                }
            }
        }
    }
    Ok(wrong)
}

/// User and system CPU time of this process so far, in nanoseconds.
fn cpu_ns() -> (u64, u64) {
    // SAFETY: getrusage writes the struct it is given, zeroed here.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a rusage for the call.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let ns = |t: libc::timeval| t.tv_sec as u64 * 1_000_000_000 + t.tv_usec as u64 * 1000;
    (ns(u.ru_utime), ns(u.ru_stime))
}

/// This host's cost of a pass over memory larger than its caches, in ns per byte: (a copy, a
/// two-operand f32 sum), each the best of three over 64 MiB.
fn pass_costs() -> (f64, f64) {
    let n = 16 << 20;
    let src = vec![1.0f32; n];
    let mut dst = vec![2.0f32; n];
    let best = |f: &mut dyn FnMut()| {
        (0..3)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64() * 1e9 / (n * 4) as f64
            })
            .fold(f64::MAX, f64::min)
    };
    let copy = best(&mut || dst.copy_from_slice(std::hint::black_box(&src)));
    let sum = best(&mut || {
        dst.iter_mut().zip(&src).for_each(|(a, b)| *a += *b);
        std::hint::black_box(&dst);
    });
    (copy, sum)
}

/// The busbw (GB/s) the ledger's passes allow on a link of `link` GB/s a direction with
/// `threads` sharing them: the CPU's time per wire byte and the wire's overlap (the NIC moves
/// one chunk while the CPU works on another), so the slower of the two sets the pace.
fn predicted(l: &rdmacomm::Ledger, costs: (f64, f64), link: f64, threads: usize) -> f64 {
    let (cin, red, cout) = l.passes_per_wire_byte();
    let cpu = ((cin + cout) * costs.0 + red * costs.1) / threads.max(1) as f64;
    if cpu <= 0.0 {
        return link;
    }
    link.min(1.0 / cpu)
}

/// Times every size; returns the sum of the bus bandwidths.
fn sweep(
    c: &Comm,
    o: &Opts,
    sizes: &[usize],
    bus: f64,
    a: &mut [u8],
    b: &mut [u8],
) -> rdmacomm::Result<f64> {
    let (r, s) = (c.rank(), o.dtype.size());
    let mut sum_bus = 0.0;
    let costs = if r == 0 && o.ledger {
        pass_costs()
    } else {
        (0.0, 0.0)
    };
    if r == 0 && o.ledger {
        println!(
            "# this host: a copy {:.3} ns/B, a sum {:.3} ns/B over 64 MiB (past the caches)",
            costs.0, costs.1
        );
    }
    for &bytes in sizes {
        let mut ledger = None;
        let mut wrong = if o.check {
            run_once(c, o, bytes, a, b, true)?
        } else {
            0
        };
        let mut us = if o.nb {
            // Started and waited at once, each in the scope's order: the buffer comes back
            // from every wait for the next start.
            c.overlap(|sc| -> rdmacomm::Result<f64> {
                let mut buf = &mut a[..bytes];
                for _ in 0..o.warmup {
                    buf = sc.all_reduce_bytes(o.op, o.dtype, buf)?.wait()?;
                }
                let t0 = Instant::now();
                for _ in 0..o.iters {
                    buf = sc.all_reduce_bytes(o.op, o.dtype, buf)?.wait()?;
                }
                Ok(t0.elapsed().as_secs_f64() * 1e6 / o.iters as f64)
            })??
        } else {
            for _ in 0..o.warmup {
                run_once(c, o, bytes, a, b, false)?;
            }
            let (l0, cpu0) = (c.ledger(), cpu_ns());
            let t0 = Instant::now();
            for _ in 0..o.iters {
                run_once(c, o, bytes, a, b, false)?;
            }
            let us = t0.elapsed().as_secs_f64() * 1e6 / o.iters as f64;
            ledger = Some((c.ledger() - l0, cpu_ns(), cpu0));
            us
        };
        // Slowest rank's time and total wrong count.
        let mut t = us.to_le_bytes();
        c.all_reduce(AllReduce::Max, DType::f64, &mut t)?;
        us = f64::from_le_bytes(t);
        let mut w = wrong.to_le_bytes();
        c.all_reduce(AllReduce::Sum, DType::u64, &mut w)?;
        wrong = u64::from_le_bytes(w);
        let algbw = bytes as f64 / us / 1e3;
        let busbw = algbw * bus;
        sum_bus += busbw;
        if r == 0 {
            println!(
                "  {:>10} {:>12} {:>6} {:>6} {:>11.1} {:>8.4} {:>8.4} {:>7}",
                bytes,
                bytes / s,
                o.dtype.name(),
                if o.coll == "all_reduce" {
                    o.op.name()
                } else {
                    "none"
                },
                us,
                algbw,
                busbw,
                if o.check {
                    wrong.to_string()
                } else {
                    "N/A".into()
                }
            );
        }
        if let (0, true, Some((l, (u1, s1), (u0, s0)))) = (r, o.ledger, ledger) {
            let (cin, red, cout) = l.passes_per_wire_byte();
            let w = l.wire.max(1) as f64;
            let k = rdmacomm::reduce_threads();
            println!(
                "#   ledger: {:.3} passes/wire B (in {cin:.3} + reduce {red:.3} + out {cout:.3}), \
                 cpu user {:.3} sys {:.3} ns/wire B, {:.2} registrations/op, {k} reduce \
                 thread(s); busbw allowed at 24 GB/s {:.1} (4 threads {:.1}), at 48 GB/s {:.1} \
                 (4 threads {:.1})",
                l.passes(),
                (u1 - u0) as f64 / w,
                (s1 - s0) as f64 / w,
                l.registrations as f64 / o.iters.max(1) as f64,
                predicted(&l, costs, 24.0, k),
                predicted(&l, costs, 24.0, 4),
                predicted(&l, costs, 48.0, k),
                predicted(&l, costs, 48.0, 4),
            );
        }
        if wrong > 0 {
            return Err(rdmacomm::Error::InvalidArgument(format!(
                "{wrong} wrong elements at {bytes} bytes"
            )));
        }
    }
    Ok(sum_bus)
}

fn rank_main(o: &Opts) -> rdmacomm::Result<()> {
    let t0 = Instant::now();
    let c = Comm::from_env()?;
    let made = t0.elapsed();
    if let Some(a) = o.algo {
        c.set_algorithm(a);
    }
    let (r, n, s) = (c.rank(), c.size(), o.dtype.size());
    let unit = match o.coll.as_str() {
        "all_gather" | "sum_scatter" | "all_to_all" | "gather" | "scatter" => s * n,
        _ => s,
    };
    let mut sizes = Vec::new();
    let mut sz = o.min.max(unit);
    while sz <= o.max {
        sizes.push(sz / unit * unit);
        sz *= o.factor;
    }
    let cap = sizes.iter().copied().max().unwrap_or(0);
    let mut a = vec![0u8; cap];
    let mut b = vec![0u8; cap];
    let bus = bus_factor(&o.coll, n);
    if o.overlap {
        return overlap_sweep(&c, o, &sizes, &mut a);
    }
    if o.paired {
        return paired_sweep(&c, o, &sizes, &mut a);
    }
    if r == 0 {
        println!(
            "# rdmacomm-perf {} ({}): {} ranks, {}, {} {} {}, algo {:?}, {}{}",
            env!("CARGO_PKG_VERSION"),
            env!("RDMACOMM_BUILD"),
            n,
            c.device().unwrap_or_else(|| "no transport (1 rank)".into()),
            o.coll,
            o.dtype.name(),
            o.op.name(),
            c.algorithm(),
            rdmacomm::kernels(),
            if o.register {
                ", buffers registered"
            } else {
                ""
            }
        );
        println!(
            "# rank 0 made its communicator in {:.1} ms",
            made.as_secs_f64() * 1e3
        );
        println!(
            "# {:>10} {:>12} {:>6} {:>6} {:>11} {:>8} {:>8} {:>7}",
            "size", "count", "type", "redop", "time", "algbw", "busbw", "#wrong"
        );
        println!(
            "# {:>10} {:>12} {:>6} {:>6} {:>11} {:>8} {:>8} {:>7}",
            "(B)", "(elements)", "", "", "(us)", "(GB/s)", "(GB/s)", ""
        );
    }
    let sum_bus = if o.register {
        let mut sum = 0.0;
        c.with_registered(&mut a, &mut |a| {
            c.with_registered(&mut b, &mut |b| {
                sum = sweep(&c, o, &sizes, bus, a, b)?;
                Ok(())
            })
        })?;
        sum
    } else {
        sweep(&c, o, &sizes, bus, &mut a, &mut b)?
    };
    if r == 0 {
        println!(
            "# Avg bus bandwidth    : {:.4} GB/s",
            sum_bus / sizes.len().max(1) as f64
        );
    }
    Ok(())
}

/// A fixed compute kernel: `reps` passes of multiply-adds over `x` (its result kept alive).
fn compute(x: &mut [f32], reps: usize) -> f32 {
    for _ in 0..reps {
        for v in x.iter_mut() {
            *v = *v * 0.999_9 + 0.000_1;
        }
    }
    std::hint::black_box(x[0])
}

/// The slowest rank's value of `v`.
fn slowest(c: &Comm, v: f64) -> rdmacomm::Result<f64> {
    let mut t = v.to_le_bytes();
    c.all_reduce(AllReduce::Max, DType::f64, &mut t)?;
    Ok(f64::from_le_bytes(t))
}

/// For each size, in one scope: `-n` pairs of blocks, a block of blocking all_reduces then one
/// of all_reduces started and waited at once (or the other way round, every other pair), each
/// block about 5 ms long; prints both medians of the per-call means, the median of the pairs'
/// ratios (non-blocking / blocking) and their quartiles. Pairing cancels the drift between
/// rounds that separate runs show.
fn paired_sweep(c: &Comm, o: &Opts, sizes: &[usize], a: &mut [u8]) -> rdmacomm::Result<()> {
    let sorted = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v
    };
    if c.rank() == 0 {
        println!(
            "# rdmacomm-perf paired: {} ranks, {}, all_reduce {} {}, {} pairs of ~5 ms blocks",
            c.size(),
            c.device().unwrap_or_default(),
            o.dtype.name(),
            o.op.name(),
            o.iters
        );
        println!(
            "# {:>10} {:>6} {:>11} {:>11} {:>8} {:>8} {:>8}",
            "size (B)", "calls", "block (us)", "nb (us)", "nb/bl", "q1", "q3"
        );
    }
    for &bytes in sizes {
        // A scope per size: a buffer stays borrowed for its scope.
        c.overlap(|sc| -> rdmacomm::Result<()> {
            let mut buf = &mut a[..bytes];
            // Calls per block, alike on every rank (the slowest rank's estimate, after warm-up).
            for _ in 0..o.warmup {
                c.all_reduce(o.op, o.dtype, buf)?;
            }
            let (mut k, mut est) = (1, 0.0);
            while k <= 4096 {
                let t0 = Instant::now();
                for _ in 0..k {
                    c.all_reduce(o.op, o.dtype, buf)?;
                }
                let took = slowest(c, t0.elapsed().as_secs_f64() * 1e6)?;
                est = took / k as f64;
                if took > 2000.0 {
                    break;
                }
                k *= 4;
            }
            let calls = ((5000.0 / est) as usize).clamp(1, 20_000);
            let (mut bl, mut nb, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
            for pair in 0..o.iters {
                let mut t = [0.0; 2];
                for k in 0..2 {
                    // Which kind goes first alternates, so neither always follows the other.
                    let blocking = (k == 0) == (pair % 2 == 0);
                    c.barrier()?;
                    let t0 = Instant::now();
                    for _ in 0..calls {
                        if blocking {
                            c.all_reduce(o.op, o.dtype, buf)?;
                        } else {
                            buf = sc.all_reduce_bytes(o.op, o.dtype, buf)?.wait()?;
                        }
                    }
                    t[usize::from(!blocking)] = t0.elapsed().as_secs_f64() * 1e6 / calls as f64;
                }
                bl.push(t[0]);
                nb.push(t[1]);
                ratio.push(t[1] / t[0]);
            }
            let (bl, nb, ratio) = (sorted(bl), sorted(nb), sorted(ratio));
            let q = |v: &[f64], f: f64| v[((v.len() - 1) as f64 * f).round() as usize];
            if c.rank() == 0 {
                println!(
                    "  {bytes:>10} {calls:>6} {:>11.3} {:>11.3} {:>8.3} {:>8.3} {:>8.3}",
                    q(&bl, 0.5),
                    q(&nb, 0.5),
                    q(&ratio, 0.5),
                    q(&ratio, 0.25),
                    q(&ratio, 0.75)
                );
            }
            Ok(())
        })??;
    }
    Ok(())
}

/// For each size: an all_reduce alone, a compute kernel alone (calibrated to last about as
/// long), and both at once (started non-blocking, the kernel, then the wait); the share of the
/// communication hidden is (comm + compute - both) / comm. Medians of `-n` runs. The kernel
/// tests the operation between its passes, which is how it moves under
/// `RDMACOMM_PROGRESS=caller` (under a progress thread a test only looks).
fn overlap_sweep(c: &Comm, o: &Opts, sizes: &[usize], a: &mut [u8]) -> rdmacomm::Result<()> {
    let mut x = vec![1f32; 256 << 10];
    let median = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    if c.rank() == 0 {
        println!(
            "# rdmacomm-perf overlap: {} ranks, {}, all_reduce {} sum, medians of {}, \
             progress by {}",
            c.size(),
            c.device().unwrap_or_default(),
            o.dtype.name(),
            o.iters,
            match c.progress() {
                rdmacomm::Progress::Caller => "the caller's tests",
                _ => "a thread",
            }
        );
        println!(
            "# {:>10} {:>11} {:>11} {:>11} {:>8}",
            "size (B)", "comm (us)", "comp (us)", "both (us)", "hidden"
        );
    }
    // One kernel pass, timed, to size the kernel to the communication.
    let t0 = Instant::now();
    compute(&mut x, 4);
    let pass = slowest(c, t0.elapsed().as_secs_f64() * 1e6 / 4.0)?;
    for &bytes in sizes {
        let mut comm = Vec::new();
        for _ in 0..o.warmup + o.iters {
            c.barrier()?;
            let t0 = Instant::now();
            c.all_reduce(AllReduce::Sum, o.dtype, &mut a[..bytes])?;
            comm.push(slowest(c, t0.elapsed().as_secs_f64() * 1e6)?);
        }
        let comm = median(comm.split_off(o.warmup));
        let reps = ((comm / pass).round() as usize).max(1);
        let mut comp = Vec::new();
        for _ in 0..o.warmup + o.iters {
            c.barrier()?;
            let t0 = Instant::now();
            compute(&mut x, reps);
            comp.push(slowest(c, t0.elapsed().as_secs_f64() * 1e6)?);
        }
        // One scope for every run of this size: its progress thread starts once, untimed.
        let both = c.overlap(|s| -> rdmacomm::Result<Vec<f64>> {
            let (mut both, mut buf) = (Vec::new(), &mut a[..bytes]);
            for _ in 0..o.warmup + o.iters {
                c.barrier()?;
                let t0 = Instant::now();
                let p = s.all_reduce_bytes(AllReduce::Sum, o.dtype, buf)?;
                for _ in 0..reps {
                    compute(&mut x, 1);
                    p.test();
                }
                buf = p.wait()?;
                both.push(slowest(c, t0.elapsed().as_secs_f64() * 1e6)?);
            }
            Ok(both)
        })??;
        let mut both = both;
        let (comp, both) = (
            median(comp.split_off(o.warmup)),
            median(both.split_off(o.warmup)),
        );
        if c.rank() == 0 {
            println!(
                "  {bytes:>10} {comm:>11.1} {comp:>11.1} {both:>11.1} {:>7.0}%",
                ((comm + comp - both) / comm * 100.0).clamp(-100.0, 100.0)
            );
        }
    }
    Ok(())
}

fn main() {
    let o = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("rdmacomm-perf: {e}");
            std::process::exit(2);
        }
    };
    if let Some(n) = o.local {
        let exe = std::env::current_exe()
            .expect("own path")
            .to_string_lossy()
            .into_owned();
        let mut args: Vec<String> = std::env::args().skip(1).collect();
        if let Some(p) = args.iter().position(|a| a == "--local") {
            args.drain(p..p + 2);
        }
        match rdmacomm::run_local(n, &exe, &args, false) {
            Ok(code) => std::process::exit(code),
            Err(e) => {
                eprintln!("rdmacomm-perf: {e}");
                std::process::exit(1)
            }
        }
    }
    if let Err(e) = rank_main(&o) {
        let rank = rdmacomm::Config::identity_from_env()
            .map(|(r, _, _)| r.to_string())
            .unwrap_or_else(|_| "?".into());
        eprintln!("rdmacomm-perf (rank {rank}): {e}");
        if matches!(e, rdmacomm::Error::NoDevice(_)) {
            eprintln!(
                "rdmacomm-perf: this host has no usable RDMA device, so ranks cannot connect over RDMA. \
                 Run on an RDMA host, or in the soft-RoCE VM: tools/rxe-vm -- target/release/rdmacomm-perf --local 2"
            );
        }
        std::process::exit(1);
    }
}

/// busbw / algbw for a collective on `n` ranks, as nccl-tests define it: what each rank's link
/// carries relative to the buffer (all_reduce 2(n-1)/n; all_gather and reduce-scatter (n-1)/n;
/// broadcast and point-to-point 1).
fn bus_factor(coll: &str, n: usize) -> f64 {
    let n = n as f64;
    match coll {
        "all_reduce" => 2.0 * (n - 1.0) / n,
        "all_gather" | "sum_scatter" | "all_to_all" | "gather" | "scatter" => (n - 1.0) / n,
        _ => 1.0,
    }
}

#[cfg(test)]
mod tests {
    use super::bus_factor;

    #[test]
    fn bus_factors_are_nccl_tests() {
        assert_eq!(bus_factor("all_reduce", 2), 1.0);
        assert_eq!(bus_factor("all_reduce", 4), 1.5);
        assert_eq!(bus_factor("all_reduce", 8), 1.75);
        assert_eq!(bus_factor("all_gather", 4), 0.75);
        assert_eq!(bus_factor("sum_scatter", 2), 0.5);
        assert_eq!(bus_factor("broadcast", 8), 1.0);
        assert_eq!(bus_factor("sendrecv", 2), 1.0);
        assert_eq!(bus_factor("all_to_all", 4), 0.75);
        assert_eq!(bus_factor("gather", 8), 0.875);
        assert_eq!(bus_factor("scatter", 2), 0.5);
        assert_eq!(bus_factor("reduce", 4), 1.0);
    }
}
