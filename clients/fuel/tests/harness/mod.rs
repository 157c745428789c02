//! fuel's code as N rank processes over rdmacomm: this test binary re-executed by rdmacomm's
//! own test harness (same transports, VM hosts and deadlines), each rank running `body` with
//! its own `rdmacomm::fuel::Transport`.
#![allow(dead_code)]

#[path = "../../../../tests/common/mod.rs"]
pub mod common;

#[allow(unused_imports)]
pub use common::tagged;
use rdmacomm::fuel::Transport;

fn init() -> Transport {
    Transport::from_env().expect("rdmacomm::fuel::Transport::from_env")
}

/// `body` as `n` ranks (see `common::ranks_of`).
pub fn ranks(name: &str, n: usize, body: fn(Transport)) -> Option<Vec<String>> {
    common::ranks_of(name, n, &[], init, body)
}
