//! A peer that writes where it may not, over RDMA: rank 1 is a raw-verbs process that joins the
//! rendezvous with a card of the right shape and then writes (a) past a receive slot of its own
//! block, or (b) outside its block, into memory that is some other rank's or nobody's to write.
//! Rank 0 must fail naming rank 1, never compute with the bytes; the device must refuse (b).

mod common;
use common::*;
use rdmacomm::unstable::rendezvous::{rendezvous, Card};
use rdmacomm::unstable::verbs::{
    self, CompletionQueue, Endpoint, RcQueuePair, RegisteredBuffer, RetryPolicy, Sge,
};
use rdmacomm::{Comm, Communicator, Config};
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

/// Rank 1: joins with a hand-made card, connects a queue pair to rank 0, then writes what
/// `RXE_TEST_ATTACK` says and prints the write's completion status.
fn attacker() {
    let cfg = Config::from_env().unwrap();
    let (ctx, sel) = verbs::open(&cfg.device).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let buf = RegisteredBuffer::new(&pd, PRE + cfg.slot_bytes + 4096).unwrap();
    let mut cq = CompletionQueue::new(&ctx, 16).unwrap();
    let mut qp = RcQueuePair::new(&pd, &cq, &sel, 8, 8).unwrap();
    let mut common = TAG_RDMA.to_le_bytes().to_vec();
    common.extend_from_slice(&(cfg.slots as u32).to_le_bytes());
    common.extend_from_slice(&(cfg.slot_bytes as u32).to_le_bytes());
    common.extend_from_slice(&buf.addr().to_le_bytes());
    let mut each = Endpoint::default().to_bytes().to_vec();
    each.extend_from_slice(&buf.rkey().to_le_bytes()); // for rank 0
    each.extend_from_slice(&Endpoint::default().to_bytes());
    each.extend_from_slice(&0u32.to_le_bytes()); // for ourselves
    each[..Endpoint::BYTES].copy_from_slice(&qp.endpoint().to_bytes());
    let card = Card {
        common,
        entry: Endpoint::BYTES + 4,
        each,
    };
    let mut rv = rendezvous(&cfg, &card).unwrap();
    // Rank 0's card: tag, slots, slot bytes, buffer address; then its endpoint and our key.
    let c0 = &rv.cards[0];
    let addr = u64::from_le_bytes(c0[12..20].try_into().unwrap());
    let theirs = Endpoint::from_bytes(&c0[20..]).unwrap();
    let rkey = u32::from_le_bytes(
        c0[20 + Endpoint::BYTES..24 + Endpoint::BYTES]
            .try_into()
            .unwrap(),
    );
    qp.connect(&theirs, RetryPolicy::default()).unwrap();
    rv.side.barrier().unwrap();
    // Rank 0's layout: a block per rank (slots, a credit line, mailboxes); ours is block 1.
    let block = cfg.slots * (PRE + cfg.slot_bytes) + 64 + cfg.slots * ENTRY;
    let attack = std::env::var("RXE_TEST_ATTACK").unwrap();
    let (remote, len, imm) = match attack.as_str() {
        // Slot 0 of our block and on into slot 1: longer than a chunk may be.
        "past_a_slot" => (addr + block as u64, PRE + cfg.slot_bytes + 64, Some(0)),
        // Rank 0's own block, which no peer may write (before: one key for the whole buffer).
        "outside_the_block" => (addr + 64, 4096, None),
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
