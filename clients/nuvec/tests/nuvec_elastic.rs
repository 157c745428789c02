//! nuvec's own collectives go on after a lost rank: 4 ranks sum with `distributed::all_sum` on
//! nuvec's default group; rank 2 starts its replacement and SIGKILLs itself at step 3; the
//! survivors shrink the transport, install the new one as the default group, agree on the last
//! step all completed and go on; at step 5 they grow by the replacement, which takes the step
//! and the members' ids from an all_sum. Every sum is checked against the scalar sum over the
//! members of that moment.

mod harness;

use harness::common::{require_rdma, spawn, transport_ready, Placement, CHILD};
use nuvec_core::distributed::{self, Group};
use nuvec_core::Array;
use rdmacomm::nuvec::Transport;
use rdmacomm::Communicator as _;
use std::sync::Arc;
use std::time::Duration;

const NAME: &str = "nuvec_training_goes_on_after_a_lost_rank";

/// Installs `t` as nuvec's default group.
fn install(t: &Arc<Transport>) {
    distributed::set_default_group(Group::new(t.clone()));
}

/// Rank 0's step and ids on every rank, through nuvec's all_sum (the others bring zeros).
fn share(rank: usize, step: &mut usize, ids: &mut Vec<f32>) {
    let mut v = [0f32; 9];
    if rank == 0 {
        v[0] = *step as f32;
        v[1] = ids.len() as f32;
        v[2..2 + ids.len()].copy_from_slice(ids);
    }
    let s = distributed::all_sum(&Array::from_slice(&v, [9]), None)
        .to_vec::<f32>()
        .unwrap();
    *step = s[0] as usize;
    *ids = s[2..2 + s[1] as usize].to_vec();
}

fn body() {
    let newcomer = std::env::var("ELASTIC_NEWCOMER").is_ok();
    let mut t = Arc::new(if newcomer {
        Transport::rejoin().unwrap()
    } else {
        Transport::new(rdmacomm::Comm::from_env().unwrap())
    });
    install(&t);
    let n = nuvec_core::distributed::Communicator::size(&*t);
    let mut ids: Vec<f32> = (0..n).map(|r| r as f32).collect();
    let (mut step, mut last) = (1usize, 0u64);
    let mut grown = newcomer;
    if newcomer {
        share(t.comm().rank(), &mut step, &mut ids);
        println!("REJOINED at step {step} with ids {ids:?}");
    }
    let mut shrunk = false;
    while step <= 8 {
        let rank = t.comm().rank();
        if step == 3 && rank == 2 && !newcomer && !shrunk {
            std::process::Command::new(std::env::current_exe().unwrap())
                .args(std::env::args().skip(1))
                .env("ELASTIC_NEWCOMER", "1")
                .env("RDMACOMM_TIMEOUT", if require_rdma() { "60" } else { "30" })
                .spawn()
                .map(std::mem::forget) // it outlives this process
                .unwrap();
            // The others are in step 3 already, or about to be: they wait on this rank.
            // SAFETY: kill(2) on this process; no memory is involved.
            unsafe { libc::kill(std::process::id() as i32, libc::SIGKILL) };
        }
        if step == 5 && shrunk && !grown {
            t = Arc::new(t.grow(1).unwrap());
            install(&t);
            ids.push(100.0);
            share(t.comm().rank(), &mut step, &mut ids);
            grown = true;
            println!("GREW to {} at step {step}", ids.len());
        }
        let mine = ids[t.comm().rank()];
        let x = Array::from_slice(&[mine, 1.0, step as f32, mine * step as f32], [4]);
        match distributed::all_sum(&x, None).to_vec::<f32>() {
            Ok(s) => {
                let want = [
                    ids.iter().sum::<f32>(),
                    ids.len() as f32,
                    (step * ids.len()) as f32,
                    ids.iter().map(|q| q * step as f32).sum::<f32>(),
                ];
                assert_eq!(s, want, "step {step}, ids {ids:?}");
                last = step as u64;
                step += 1;
            }
            Err(e) => {
                println!("FAILED step {step}: {e}");
                let (next, agreed) = t.shrink(last).unwrap();
                ids = agreed.members.iter().map(|&q| ids[q]).collect();
                t = Arc::new(next);
                install(&t);
                shrunk = true;
                step = agreed.least as usize + 1;
                println!("SHRUNK to ids {ids:?}, on from step {step}");
            }
        }
    }
    println!("DONE ids {ids:?}");
}

#[test]
fn nuvec_training_goes_on_after_a_lost_rank() {
    if std::env::var(CHILD).is_ok_and(|v| v == NAME) {
        body();
        return;
    }
    if !transport_ready() {
        return;
    }
    // The VM's processes start slowly: a longer timeout there (a dead rank costs none of it).
    let timeout = if require_rdma() { "30" } else { "5" };
    let out = spawn(
        NAME,
        4,
        Placement::Local,
        &|_| vec![("RDMACOMM_TIMEOUT".to_string(), timeout.to_string())],
        Duration::from_secs(120),
    );
    let done = "DONE ids [0.0, 1.0, 3.0, 100.0]";
    for x in &out {
        for l in x.output.lines().filter(|l| {
            ["FAILED", "SHRUNK", "GREW", "REJOINED", "DONE"]
                .iter()
                .any(|t| l.contains(t))
        }) {
            println!("rank {}: {l}", x.rank);
        }
        // Rank 2 was killed; its replacement shares its output.
        if x.rank != 2 {
            assert_eq!(x.code, Some(0), "rank {}: {}", x.rank, x.output);
        }
        assert!(x.output.contains(done), "rank {}: {}", x.rank, x.output);
    }
}
