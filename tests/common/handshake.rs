//! The one message two raw-verbs processes swap to connect (tests and `benches/wire_floor.rs`):
//! a queue pair's endpoint, then the address and key of the buffer the peer may write.
#![allow(dead_code)]

use rdmacomm::verbs::Endpoint;

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
