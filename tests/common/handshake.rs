//! How two raw-verbs processes meet (tests and `benches/wire_floor.rs`): a TCP line between
//! them, and the one message they swap on it to connect: a queue pair's endpoint, then the
//! address and key of the buffer the peer may write.
#![allow(dead_code)]

use rdmacomm::unstable::verbs::Endpoint;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// A TCP line between ranks 0 and 1: rank 0 listens on `at`, rank 1 connects to it, retrying
/// for up to 30 s; reads on it time out after 60 s.
pub fn pair_line(rank: usize, at: &str) -> TcpStream {
    let s = if rank == 0 {
        let l = TcpListener::bind(at).unwrap_or_else(|e| panic!("rank 0: listen on {at}: {e}"));
        l.accept()
            .unwrap_or_else(|e| panic!("rank 0: accept on {at}: {e}"))
            .0
    } else {
        let t0 = Instant::now();
        loop {
            match TcpStream::connect(at) {
                Ok(s) => break s,
                Err(_) if t0.elapsed() < Duration::from_secs(30) => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(e) => panic!("rank {rank}: connect to rank 0 at {at}: {e}"),
            }
        }
    };
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s
}

/// Sends `mine` and returns the peer's message of the same length.
pub fn swap(s: &mut TcpStream, mine: &[u8]) -> Vec<u8> {
    s.write_all(mine).expect("send to the peer");
    let mut theirs = vec![0u8; mine.len()];
    s.read_exact(&mut theirs)
        .expect("the peer's message (did it die?)");
    theirs
}

/// Our endpoint, then the buffer's address and key.
pub fn encode(e: &Endpoint, addr: u64, rkey: u32) -> Vec<u8> {
    let mut v = e.to_bytes().to_vec();
    v.extend_from_slice(&addr.to_le_bytes());
    v.extend_from_slice(&rkey.to_le_bytes());
    v
}

/// Reads what [`encode`] wrote.
pub fn decode(v: &[u8]) -> (Endpoint, u64, u32) {
    let n = Endpoint::BYTES;
    (
        Endpoint::from_bytes(v).expect("a whole endpoint"),
        u64::from_le_bytes(v[n..n + 8].try_into().unwrap()),
        u32::from_le_bytes(v[n + 8..n + 12].try_into().unwrap()),
    )
}
