//! A world that needs more file descriptors than the soft limit allows: the soft limit is raised
//! to the hard one; where even the hard one is too low, every rank says so by name, at once.

mod common;
use common::*;
use rdmacomm::{AllReduce, Comm, Communicator, DType};
use std::time::Duration;

/// Sets this process's RLIMIT_NOFILE to `soft` (and `hard`, if given).
fn limit(soft: u64, hard: Option<u64>) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read or write one valid rlimit.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        lim.rlim_cur = soft;
        if let Some(h) = hard {
            lim.rlim_max = h;
        }
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
    }
}

fn soft_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one valid rlimit.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    lim.rlim_cur
}

fn raised_body() {
    // A world of 4 needs about 76 descriptors; the soft limit allows 40 (the hard one more).
    limit(40, None);
    let c = Comm::from_env().unwrap();
    assert!(soft_limit() > 76, "soft limit still {}", soft_limit());
    let mut x = 1.0f32.to_le_bytes().to_vec();
    c.all_reduce(AllReduce::Sum, DType::f32, &mut x).unwrap();
    assert_eq!(x, (c.size() as f32).to_le_bytes());
}

#[test]
fn the_soft_descriptor_limit_is_raised_where_the_world_needs_more() {
    const NAME: &str = "the_soft_descriptor_limit_is_raised_where_the_world_needs_more";
    if !parent_ready(NAME, raised_body) {
        return;
    }
    spawn_local_ok(NAME, 4, &[], Duration::from_secs(60));
}

fn too_low_body() {
    limit(40, Some(40));
    let start = std::time::Instant::now();
    let e = Comm::from_env()
        .err()
        .expect("a world of 4 in 40 descriptors")
        .to_string();
    assert!(
        e.contains("RLIMIT_NOFILE allows 40") && e.contains("world of 4 ranks"),
        "{e}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn a_hard_descriptor_limit_too_low_is_named() {
    const NAME: &str = "a_hard_descriptor_limit_too_low_is_named";
    if !parent_ready(NAME, too_low_body) {
        return;
    }
    spawn_local_ok(NAME, 4, &[], Duration::from_secs(60));
}
