//! A peer that writes where it may not, over RDMA: rank 1 is a raw-verbs process that joins the
//! rendezvous with a card of the right shape, connects its queue pair as a rank does, and then
//! writes (a) past a receive slot of its own block, or (b) outside its block, into memory that
//! is nobody's to write.
//! Rank 0 must fail naming rank 1, never compute with the bytes; the device must refuse (b).

mod common;
use common::*;
use rdmacomm::unstable::connect;
use rdmacomm::unstable::rendezvous::{rendezvous, Card};
use rdmacomm::unstable::verbs::{
    self, CompletionQueue, Endpoint, RcQueuePair, RegisteredBuffer, RetryPolicy, Sge,
};
use rdmacomm::{Comm, Communicator, Config};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, Instant};

/// "RDMA", the tag an RDMA card starts with.
const TAG_RDMA: u32 = 0x4144_4d52;
/// Bytes ahead of each slot (room for an operation descriptor) and of a mailbox entry.
const PRE: usize = 64;
const ENTRY: usize = 64;

/// Rank 0: receives from rank 1 and reports how that ended.
fn victim() {
    let c = Comm::from_env().unwrap();
    let mut buf = vec![0u8; 1 << 16];
    let t0 = Instant::now();
    match c.recv(1, &mut buf) {
        Ok(()) => println!("RESULT rank 0: RECEIVED {:?}", &buf[..8]),
        Err(e) => println!("RESULT rank 0: ERROR after {:?}: {e}", t0.elapsed()),
    }
}

/// Rank 1: joins with a hand-made card, connects a queue pair to rank 0 over rank 0's data
/// connection (INFO both ways, then READY), then writes what `RXE_TEST_ATTACK` says and prints
/// the write's completion status.
fn attacker() {
    let cfg = Config::from_env().unwrap();
    let (ctx, sel) = verbs::open(&cfg.device).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let buf = RegisteredBuffer::new(&pd, PRE + cfg.slot_bytes + 4096).unwrap();
    let mut cq = CompletionQueue::new(&ctx, 16).unwrap();
    let mut qp = RcQueuePair::new(&pd, &cq, &sel, 8, 8).unwrap();
    // Where rank 0 may dial us: the coordinator's host.
    let host = cfg.coordinator.rsplit_once(':').unwrap().0.to_string();
    let listener = TcpListener::bind((host.as_str(), 0)).unwrap();
    let me = listener.local_addr().unwrap().to_string();
    // An RDMA card: tag, slots, slot bytes, how it connects, its data address, and the ranks
    // it kept a queue pair to from a generation before (none).
    let mut common = TAG_RDMA.to_le_bytes().to_vec();
    common.extend_from_slice(&(cfg.slots as u32).to_le_bytes());
    common.extend_from_slice(&(cfg.slot_bytes as u32).to_le_bytes());
    common.extend_from_slice(&(cfg.connect as u32).to_le_bytes());
    common.extend_from_slice(&(me.len() as u32).to_le_bytes());
    common.extend_from_slice(me.as_bytes());
    common.extend_from_slice(&0u32.to_le_bytes());
    let card = Card {
        common,
        entry: 0,
        each: Vec::new(),
    };
    let mut rv = rendezvous(&cfg, &card).unwrap();
    rv.side.barrier().unwrap();
    let addr_of = |c: &[u8]| {
        let len = u32::from_le_bytes(c[16..20].try_into().unwrap()) as usize;
        let text = std::str::from_utf8(&c[20..20 + len]).unwrap();
        text.parse::<SocketAddr>().unwrap()
    };
    let addrs = vec![addr_of(&rv.cards[0]), addr_of(&rv.cards[1])];
    let mut sock =
        connect::connect_to(1, listener, addrs, rv.session, 0, Duration::from_secs(20)).unwrap();
    sock.write_all(&connect::info(&qp.endpoint(), buf.addr(), buf.rkey()))
        .unwrap();
    // Rank 0's INFO: its endpoint, then the address and key of its block for us.
    let mut theirs = [0u8; connect::INFO];
    sock.read_exact(&mut theirs).unwrap();
    let endpoint = Endpoint::from_bytes(&theirs[..Endpoint::BYTES]).unwrap();
    let at = Endpoint::BYTES;
    let addr = u64::from_le_bytes(theirs[at..at + 8].try_into().unwrap());
    let rkey = u32::from_le_bytes(theirs[at + 8..at + 12].try_into().unwrap());
    qp.connect(&endpoint, RetryPolicy::default()).unwrap();
    sock.write_all(&[connect::READY]).unwrap();
    let mut ready = [0u8; 1];
    sock.read_exact(&mut ready).unwrap();
    // Rank 0's buffer for us: our block (slots, a credit line, mailboxes), then its own send
    // slots to us, which no peer may write.
    let block = cfg.slots * (PRE + cfg.slot_bytes) + 64 + cfg.slots * ENTRY;
    let attack = std::env::var("RXE_TEST_ATTACK").unwrap();
    let (remote, len, imm) = match attack.as_str() {
        // Slot 0 of our block and on into slot 1: longer than a chunk may be.
        "past_a_slot" => (addr, PRE + cfg.slot_bytes + 64, Some(0)),
        // Past our block, into rank 0's send slots (before: one key for the whole buffer).
        "outside_the_block" => (addr + block as u64, 4096, None),
        a => panic!("unknown attack {a}"),
    };
    let sge = Sge {
        lkey: buf.lkey(),
        addr: buf.addr(),
        len: len as u32,
    };
    // SAFETY: the source lies in our registered buffer, which outlives the QP's use of it here.
    unsafe { qp.post_write(1, &[sge], rkey, remote, imm, true) }.unwrap();
    let t0 = Instant::now();
    let mut status = None;
    while status.is_none() && t0.elapsed() < Duration::from_secs(20) {
        cq.poll(|c| status = Some(c.status)).unwrap();
    }
    println!(
        "RESULT rank 1: WRITE STATUS {}",
        status.map_or(-1, |s| s as i64)
    );
    // Rank 0 has time to see the write before our queue pair goes away.
    std::thread::sleep(Duration::from_secs(3));
}

fn body() {
    let (r, _) = rank_size();
    if r == 0 {
        victim()
    } else {
        attacker()
    }
}

fn run(name: &str, attack: &str) -> (String, String) {
    let res = spawn(
        name,
        2,
        Placement::Local,
        &|_| {
            vec![
                ("RDMACOMM_TRANSPORT".to_string(), "rdma".to_string()),
                ("RDMACOMM_TIMEOUT".to_string(), "8".to_string()),
                ("RXE_TEST_ATTACK".to_string(), attack.to_string()),
            ]
        },
        Duration::from_secs(60),
    );
    assert_all_ok(&res);
    let line = |r: usize| {
        let said = format!("RESULT rank {r}:");
        res[r]
            .output
            .lines()
            .find_map(|l| l.find(&said).map(|at| l[at..].to_string()))
            .unwrap_or_else(|| panic!("rank {r} said nothing: {}", res[r].output))
    };
    (line(0), line(1))
}

#[test]
fn a_write_past_a_slot_fails_the_writer_by_name() {
    let name = "a_write_past_a_slot_fails_the_writer_by_name";
    if !parent_ready(name, body) || !rdma_available() {
        return;
    }
    let (victim, attacker) = run(name, "past_a_slot");
    println!("{victim}\n{attacker}");
    assert!(
        victim.contains("ERROR") && victim.contains("rank 1") && victim.contains("protocol error"),
        "{victim}"
    );
}

#[test]
fn a_write_outside_its_block_is_refused_by_the_device() {
    let name = "a_write_outside_its_block_is_refused_by_the_device";
    if !parent_ready(name, body) || !rdma_available() {
        return;
    }
    let (victim, attacker) = run(name, "outside_the_block");
    println!("{victim}\n{attacker}");
    assert!(
        attacker.ends_with("WRITE STATUS 10"),
        "a remote access error at the writer: {attacker}"
    );
    assert!(
        victim.contains("ERROR") && victim.contains("rank 1"),
        "rank 0 names rank 1: {victim}"
    );
}
