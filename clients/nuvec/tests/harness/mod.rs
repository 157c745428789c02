//! nuvec's code as N rank processes over rdmacomm: this test binary re-executed by rdmacomm's
//! own test harness (same transports, VM hosts and deadlines), each rank running `body` with
//! rdmacomm installed as nuvec's default group by `rdmacomm::nuvec::init`.
#![allow(dead_code)]

#[path = "../../../../tests/common/mod.rs"]
pub mod common;

#[allow(unused_imports)]
pub use common::tagged;
use nuvec_core::distributed::Group;

fn init() -> Group {
    rdmacomm::nuvec::init(true).expect("rdmacomm::nuvec::init")
}

/// `body` as `n` ranks (see `common::ranks_of`).
pub fn ranks(name: &str, n: usize, body: fn(Group)) -> Option<Vec<String>> {
    common::ranks_of(name, n, &[], init, body)
}

/// As [`ranks`], with variables `env` added to every rank.
pub fn ranks_with(
    name: &str,
    n: usize,
    env: &[(&str, &str)],
    body: fn(Group),
) -> Option<Vec<String>> {
    common::ranks_of(name, n, env, init, body)
}

/// As [`ranks_with`], but `body` builds what it needs from the environment itself.
pub fn ranks_raw(name: &str, n: usize, env: &[(&str, &str)], body: fn()) -> Option<Vec<String>> {
    common::ranks_of(name, n, env, || (), |()| body())
}
