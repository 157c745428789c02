//! nuvec's code as N rank processes over rdmacomm: this test binary re-executed by rdmacomm's
//! own test harness (same transports, VM hosts and deadlines), each rank running `body` with
//! rdmacomm installed as nuvec's default group by `rdmacomm::nuvec::init`.
#![allow(dead_code)]

#[path = "../../../../tests/common/mod.rs"]
pub mod common;

use common::{assert_all_ok, is_child, spawn, transport_ready, Placement};
use nuvec_core::distributed::Group;
use std::time::Duration;

/// In a rank child of `name`: runs `body` on the installed group and returns `None`. In the
/// parent: runs `n` ranks, asserts each exited 0 and returns their outputs (`None` where the
/// transport is not usable here, after saying why).
pub fn ranks(name: &str, n: usize, body: fn(Group)) -> Option<Vec<String>> {
    ranks_with(name, n, &[], body)
}

/// As [`ranks`], with variables `env` added to every rank.
pub fn ranks_with(
    name: &str,
    n: usize,
    env: &[(&str, &str)],
    body: fn(Group),
) -> Option<Vec<String>> {
    if is_child(name) {
        let g = rdmacomm::nuvec::init(true).expect("rdmacomm::nuvec::init");
        body(g);
        return None;
    }
    if !transport_ready() {
        return None;
    }
    let mut vars = vec![("RDMACOMM_TIMEOUT".to_string(), "30".to_string())];
    vars.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let out = spawn(
        name,
        n,
        Placement::Hosts,
        &|_| vars.clone(),
        Duration::from_secs(240),
    );
    assert_all_ok(&out);
    Some(out.into_iter().map(|r| r.output).collect())
}

/// What follows `tag` on each line of `out` that has it (the test harness may print before it).
pub fn tagged<'a>(out: &'a str, tag: &str) -> Vec<&'a str> {
    out.lines()
        .filter_map(|l| l.find(tag).map(|i| &l[i..]))
        .collect()
}

/// As [`ranks_with`], but `body` builds what it needs from the environment itself.
pub fn ranks_raw(name: &str, n: usize, env: &[(&str, &str)], body: fn()) -> Option<Vec<String>> {
    if is_child(name) {
        body();
        return None;
    }
    if !transport_ready() {
        return None;
    }
    let mut vars = vec![("RDMACOMM_TIMEOUT".to_string(), "30".to_string())];
    vars.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let out = spawn(
        name,
        n,
        Placement::Hosts,
        &|_| vars.clone(),
        Duration::from_secs(240),
    );
    assert_all_ok(&out);
    Some(out.into_iter().map(|r| r.output).collect())
}
