//! The fabric's floor for a two-rank 8-byte all_reduce, from raw verbs with nothing of rdmacomm's
//! protocol: what any library's tiny all_reduce on this device can approach, and no faster.
//!
//! Run as two ranks (`rdmacomm-run -n 2 -- target/release/deps/wire_floor-*`; RANK, MASTER_ADDR
//! and MASTER_PORT as torchrun sets them; `RDMACOMM_IB_DEVICE` picks the device). Each mode
//! repeats an 8-byte step `WIRE_FLOOR_ITERS` times (default 20 000, after 1 000 warm-ups) and
//! prints the mean time per step on rank 0:
//! - `exchange write`: both ranks post an inline RDMA WRITE to each other at once and spin on the
//!   word it lands in (no receive queue, no completion read): the floor of an exchange, and what
//!   rdmacomm's mailbox chunks (up to 48 bytes) do.
//! - `exchange imm`: the same with WRITE_WITH_IMM, each rank spinning on its completion queue and
//!   re-posting a receive (what rdmacomm's larger chunks do per message).
//! - `ping-pong write`: rank 0 writes, rank 1 answers when it sees it (`ib_write_lat`'s loop):
//!   one round trip per step, the floor of any scheme in which the ranks take turns.

use rdmacomm::unstable::verbs::{
    self, CompletionQueue, RcQueuePair, RegisteredBuffer, RetryPolicy, Sge,
};
#[path = "../tests/common/handshake.rs"]
mod handshake;
use handshake::{decode, encode, pair_line, swap};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Work requests between signaled ones (each signaled completion retires those before it).
const SIGNAL_EVERY: u64 = 16;
const SEND_DEPTH: u32 = 64;
const RECV_DEPTH: u32 = 64;

struct Side {
    rank: usize,
    /// The peer's address, for errors.
    peer: String,
    buf: RegisteredBuffer,
    cq: CompletionQueue,
    qp: RcQueuePair,
    raddr: u64,
    rkey: u32,
    posted: u64,
    /// Highest signaled write completed.
    sent: u64,
    /// Immediates taken.
    recvs: u64,
    /// Immediates sent (the peer sends as many).
    imms: u64,
    deadline: Instant,
}

impl Side {
    /// Posts the 8 bytes at offset 0 (the step number) to the peer's offset 64.
    fn write(&mut self, imm: bool) {
        self.posted += 1;
        let signaled = self.posted % SIGNAL_EVERY == 0;
        // SAFETY: the source is our registered buffer and the target the peer's (its address and
        // rkey came from it), both alive until the end of the run; 8 bytes go inline.
        unsafe {
            self.qp
                .post_write(
                    self.posted,
                    &[Sge {
                        lkey: self.buf.lkey(),
                        addr: self.buf.addr(),
                        len: 8,
                    }],
                    self.rkey,
                    self.raddr + 64,
                    imm.then_some(7),
                    signaled,
                )
                .expect("post write")
        };
        if signaled {
            let want = self.posted;
            self.wait_cq(|me| me.sent >= want);
        }
    }

    /// Polls the completion queue until `done` holds, counting completed writes and taken
    /// immediates (and re-posting a receive for each).
    fn wait_cq(&mut self, done: impl Fn(&Side) -> bool) {
        while !done(self) {
            let (mut sent, mut recvs) = (self.sent, 0);
            self.cq
                .poll(|c| {
                    assert_eq!(
                        c.status,
                        0,
                        "completion failed: {}",
                        verbs::status_str(c.status)
                    );
                    if c.wr_id == u64::MAX {
                        recvs += 1;
                    } else {
                        sent = sent.max(c.wr_id);
                    }
                })
                .expect("poll");
            self.sent = sent;
            self.recvs += recvs;
            for _ in 0..recvs {
                self.qp.post_recv(u64::MAX).expect("post recv");
            }
            self.check_deadline();
        }
    }

    /// Spins until the peer's word at offset 64 reads `step` or more (it only grows).
    fn wait_word(&mut self, step: u64) {
        let p = self.buf.ptr_at(64) as *const u64;
        let mut spins = 0u32;
        // SAFETY: p points at 8 aligned bytes of our registered buffer, which the peer's
        // writes change under us: read volatile, never through a reference.
        while unsafe { std::ptr::read_volatile(p) } < step {
            spins = spins.wrapping_add(1);
            if spins % 4096 == 0 {
                self.check_deadline();
            }
            std::hint::spin_loop();
        }
    }

    fn check_deadline(&self) {
        assert!(
            Instant::now() < self.deadline,
            "rank {}: no progress within the run's deadline waiting on rank {} ({})",
            self.rank,
            1 - self.rank,
            self.peer
        );
    }

    fn set_step(&mut self, step: u64) {
        // SAFETY: bytes 0..8 are only ever sent from (inline, copied when posted), never
        // written by the peer.
        unsafe { self.buf.slice_mut(0, 8) }.copy_from_slice(&step.to_le_bytes());
    }
}

/// A TCP line to the peer (rank 0 listens on MASTER_ADDR:MASTER_PORT+1, rank 1 connects) and
/// the peer's address, for errors.
fn side_channel(rank: usize) -> (TcpStream, String) {
    let addr = std::env::var("MASTER_ADDR").unwrap_or_else(|_| "127.0.0.1".into());
    let port: u16 = std::env::var("MASTER_PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(29500);
    let s = pair_line(rank, &format!("{addr}:{}", port + 1));
    let peer = s.peer_addr().map_or(addr, |a| a.ip().to_string());
    (s, peer)
}

fn sync(s: &mut TcpStream) {
    s.write_all(b"S").unwrap();
    s.read_exact(&mut [0u8; 1]).expect("peer gone");
}

fn main() {
    let rank: usize = match std::env::var("RANK").ok().and_then(|r| r.parse().ok()) {
        Some(r) => r,
        None => {
            eprintln!("wire_floor: run as two ranks: rdmacomm-run -n 2 -- <this binary>");
            return;
        }
    };
    let iters: u64 = std::env::var("WIRE_FLOOR_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let (ctx, sel) = verbs::open(&rdmacomm::unstable::device_from_env().expect("device choice"))
        .expect("open device");
    let pd = ctx.alloc_pd().expect("pd");
    let buf = RegisteredBuffer::new(&pd, 4096).expect("register");
    let cq = CompletionQueue::new(&ctx, 2 * (SEND_DEPTH + RECV_DEPTH)).expect("cq");
    let mut qp = RcQueuePair::new(&pd, &cq, &sel, SEND_DEPTH, RECV_DEPTH).expect("qp");
    for _ in 0..RECV_DEPTH {
        qp.post_recv(u64::MAX).expect("post recv");
    }
    let (mut s, peer) = side_channel(rank);
    let theirs = swap(&mut s, &encode(&qp.endpoint(), buf.addr(), buf.rkey()));
    let (remote, raddr, rkey) = decode(&theirs);
    qp.connect(&remote, RetryPolicy::default())
        .expect("connect");
    sync(&mut s);
    let mut me = Side {
        rank,
        peer,
        buf,
        cq,
        qp,
        raddr,
        rkey,
        posted: 0,
        sent: 0,
        recvs: 0,
        imms: 0,
        deadline: Instant::now() + Duration::from_secs(600),
    };
    let warm = 1_000;
    let mut step = 0u64;
    let mut run = |me: &mut Side, s: &mut TcpStream, name: &str, f: &dyn Fn(&mut Side, u64)| {
        sync(s);
        for _ in 0..warm {
            step += 1;
            f(me, step);
        }
        sync(s);
        let t0 = Instant::now();
        for _ in 0..iters {
            step += 1;
            f(me, step);
        }
        let us = t0.elapsed().as_secs_f64() * 1e6 / iters as f64;
        if rank == 0 {
            println!("{name:>16}: {us:8.2} us per step ({iters} steps of 8 bytes)");
        }
    };
    run(&mut me, &mut s, "exchange write", &|me, step| {
        me.set_step(step);
        me.write(false);
        me.wait_word(step);
    });
    run(&mut me, &mut s, "exchange imm", &|me, step| {
        me.set_step(step);
        me.imms += 1;
        let want = me.imms;
        me.write(true);
        me.wait_cq(|me| me.recvs >= want);
    });
    run(&mut me, &mut s, "ping-pong write", &|me, step| {
        me.set_step(step);
        if me.rank == 0 {
            me.write(false);
            me.wait_word(step);
        } else {
            me.wait_word(step);
            me.write(false);
        }
    });
    sync(&mut s);
}
