//! The driver over real sockets on loopback: ranks as threads, each with its own control port;
//! a rank that does not run keeps its port open and unread (stopped, or busy elsewhere), a dead
//! one's port is closed (connections refused).

use super::driver::{agree, bound, Attempt, Decision, Step};
use crate::bootstrap::elastic::retired::Answerer;
use crate::bootstrap::wire::auth::KEY;
use crate::bootstrap::wire::port::seal;
use crate::bootstrap::wire::port::Control;
use crate::bootstrap::wire::{listen, send_frame};
use crate::error::{Error, Result};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

fn group(n: usize) -> Vec<Option<Control>> {
    let session = [7u8; KEY];
    let ls: Vec<_> = (0..n).map(|_| listen("127.0.0.1:0").unwrap()).collect();
    let ports: Vec<u16> = ls.iter().map(|l| l.local_addr().unwrap().port()).collect();
    ls.into_iter()
        .enumerate()
        .map(|(rank, listener)| {
            Some(Control {
                rank,
                listener,
                addrs: vec!["127.0.0.1".into(); n],
                ports: ports.clone(),
                session,
            })
        })
        .collect()
}

/// A rank's part: it calls after `delay`, suspecting `suspects`.
struct Part {
    rank: usize,
    delay: Duration,
    suspects: Vec<usize>,
}

fn part(rank: usize, delay_ms: u64, suspects: &[usize]) -> Part {
    Part {
        rank,
        delay: Duration::from_millis(delay_ms),
        suspects: suspects.to_vec(),
    }
}

/// A rank's result, and what answers at its port since (as `Comm::shrink` leaves it).
type Got = (usize, Result<Decision>, Option<Answerer>);

/// An attempt tagged `tag`, the last of its generation.
fn once(tag: u32) -> Attempt {
    Attempt {
        tag,
        next: None,
        carried: Vec::new(),
    }
}

/// Runs `parts` on `ctls` (taking their ports) with timeout `t`; the value of rank r is 100 + r.
/// A rank that decided answers at its port as an ended agreement from then on.
fn run(ctls: &mut [Option<Control>], parts: Vec<Part>, t: Duration) -> Vec<Got> {
    let hs: Vec<_> = parts
        .into_iter()
        .map(|p| {
            let c = ctls[p.rank].take().unwrap();
            std::thread::spawn(move || {
                std::thread::sleep(p.delay);
                match agree(&c, once(5), &p.suspects, 100 + p.rank as u64, t, "a shrink") {
                    Ok(Step::Decided(d, ended)) => {
                        (p.rank, Ok(d), Some(Answerer::start(c, 5, *ended)))
                    }
                    Ok(Step::Moved(_)) => unreachable!("an attempt without a next one"),
                    Err(e) => (p.rank, Err(e), None),
                }
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

fn members(got: &[Got]) -> Vec<(usize, std::result::Result<Vec<usize>, String>)> {
    got.iter()
        .map(|(r, g, _)| {
            let m = g.as_ref().map(|d| {
                let mut m = d.members.clone();
                m.sort_unstable();
                m
            });
            (*r, m.map_err(|e| e.to_string()))
        })
        .collect()
}

#[test]
fn survivors_agree_without_the_lost_rank_and_rank_0() {
    // Ranks 0 and 3 of 5 are lost (their ports open, nobody reading); 3 is suspected.
    let t = Duration::from_millis(600);
    let mut ctls = group(5);
    let got = run(
        &mut ctls,
        vec![part(1, 0, &[3]), part(2, 0, &[3]), part(4, 0, &[3])],
        t,
    );
    let meet = &got[0].1.as_ref().unwrap().meet;
    for (r, g, _) in &got {
        let d = g.as_ref().unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(d.members, vec![1, 2, 4], "rank {r}");
        assert_eq!(d.least, 101);
        assert_eq!(d.all, 101 & 102 & 104);
        assert_eq!(d.listener.is_some(), *r == 1);
        assert_eq!(&d.meet, meet);
    }
}

#[test]
fn a_silent_coordinator_leaves_the_others_a_group() {
    // The first case: rank 3 is dead (its port refuses), rank 0 is alive and never
    // calls (its port accepts and says nothing), ranks 1 and 2 call apart. They go on as
    // [1, 2], instead of following each other back to rank 0 until the bound.
    let t = Duration::from_millis(800);
    let mut ctls = group(4);
    ctls[3].take();
    let start = Instant::now();
    let got = run(&mut ctls, vec![part(1, 0, &[3]), part(2, 300, &[3])], t);
    for (r, m) in members(&got) {
        assert_eq!(m, Ok(vec![1, 2]), "rank {r}");
    }
    assert!(start.elapsed() < bound(4, t), "{:?}", start.elapsed());
}

#[test]
fn survivors_suspecting_differently_form_one_group() {
    // The second case: rank 0 stalls past the timeout (ranks 1 and 2 name it), rank 3
    // calls early suspecting nobody, rank 0 wakes and calls too. One group, with every rank
    // that called in time; rank 0 is in it or told it was left out.
    let t = Duration::from_millis(800);
    let mut ctls = group(4);
    let got = run(
        &mut ctls,
        vec![
            part(0, 1100, &[]),
            part(1, 100, &[0]),
            part(2, 100, &[0]),
            part(3, 0, &[]),
        ],
        t,
    );
    let ms = members(&got);
    let group: Vec<usize> = ms[1].1.clone().unwrap_or_else(|e| panic!("rank 1: {e}"));
    for (r, m) in &ms {
        match m {
            Ok(m) => assert_eq!(m, &group, "rank {r}"),
            Err(e) => assert!(*r == 0 && e.contains("without this rank"), "rank {r}: {e}"),
        }
    }
    assert!(
        group.starts_with(&[1, 2, 3]) || group == [0, 1, 2, 3],
        "{group:?}"
    );
}

#[test]
fn a_rank_that_asks_after_the_decision_is_told_it_was_left_out() {
    // Ranks 0 and 1 agree without rank 2 (silent); their ports then answer as ended
    // agreements. Rank 2 wakes and calls: it is told, naming the group, and forms none.
    let t = Duration::from_millis(500);
    let mut ctls = group(3);
    let two = ctls[2].take();
    let got = run(&mut ctls, vec![part(0, 0, &[]), part(1, 0, &[])], t);
    for (r, m) in members(&got) {
        assert_eq!(m, Ok(vec![0, 1]), "rank {r}");
    }
    match agree(&two.unwrap(), once(5), &[], 102, t, "a shrink") {
        Err(Error::LeftOut { by, reason }) => {
            assert!(by.rank < 2 && reason.contains("[0, 1]"), "{reason}")
        }
        Err(e) => panic!("rank 2: {e}"),
        Ok(_) => panic!("rank 2 went on"),
    }
    drop(got);
}

#[test]
fn strangers_at_the_control_port_are_ignored() {
    // A forged message, junk, a frame of another kind and a flood of connections that send one
    // byte each wait at rank 0's port before the members call.
    let t = Duration::from_millis(800);
    let mut ctls = group(3);
    let c0 = ctls[0].as_ref().unwrap();
    let at = SocketAddr::new("127.0.0.1".parse().unwrap(), c0.ports[0]);
    let mut strangers: Vec<TcpStream> = Vec::new();
    for i in 0..3 {
        let s = TcpStream::connect(at).unwrap();
        match i {
            0 => send_frame(&s, 50, &seal(&[9; KEY], 50, 5, &[2, 0, 0, 0])).unwrap(),
            1 => send_frame(&s, 50, b"junk").unwrap(),
            _ => send_frame(&s, 7, &[0; 64]).unwrap(),
        }
        strangers.push(s);
    }
    for _ in 0..1000 {
        match TcpStream::connect(at) {
            Ok(mut s) => {
                use std::io::Write;
                let _ = s.write_all(&[1]);
                strangers.push(s);
            }
            Err(_) => break,
        }
    }
    let start = Instant::now();
    let got = run(
        &mut ctls,
        vec![part(0, 0, &[]), part(1, 0, &[]), part(2, 0, &[])],
        t,
    );
    for (r, m) in members(&got) {
        assert_eq!(m, Ok(vec![0, 1, 2]), "rank {r}");
    }
    // Every rank called: nobody is waited on for a timeout.
    assert!(start.elapsed() < t, "{:?}", start.elapsed());
    drop(strangers);
}

#[test]
fn a_frame_half_read_when_the_agreement_ends_is_answered() {
    // Rank 2 (silent) begins a JOIN to rank 0 while ranks 0 and 1 agree, and ends it once they
    // have: the ended agreement takes over the connection half read, and rank 2 is told.
    use super::agreement::Msg;
    use super::codec::{decode, encode, is_agreement_kind};
    use crate::bootstrap::wire::port::Door;
    use std::io::Write;
    let t = Duration::from_millis(500);
    let mut ctls = group(3);
    let two = ctls[2].take().unwrap();
    let at = SocketAddr::new("127.0.0.1".parse().unwrap(), two.ports[0]);
    let join = Msg::Join {
        value: 102,
        named: vec![],
    };
    let (kind, body) = encode(&two.session, 5, 2, &join, "", 0);
    let mut wire = (body.len() as u32 + 1).to_le_bytes().to_vec();
    wire.push(kind);
    wire.extend_from_slice(&body);
    let mut s = TcpStream::connect(at).unwrap();
    s.write_all(&wire[..9]).unwrap();
    let got = run(&mut ctls, vec![part(0, 0, &[]), part(1, 0, &[])], t);
    for (r, m) in members(&got) {
        assert_eq!(m, Ok(vec![0, 1]), "rank {r}");
    }
    s.write_all(&wire[9..]).unwrap();
    two.listener.set_nonblocking(true).unwrap();
    let mut door = Door::default();
    let until = Instant::now() + Duration::from_secs(2);
    let told = loop {
        let (frames, _) = door.poll(&two.listener, &[5], is_agreement_kind);
        // The collectors' INVITEs came while rank 2 was silent: the answer is what counts.
        let answer = frames
            .into_iter()
            .filter_map(|(k, b)| decode(&two.session, 5, k, &b, 3, 0))
            .find(|r| matches!(r.msg, Msg::Out(_) | Msg::Go(_)));
        if let Some(r) = answer {
            break Some(r.msg);
        }
        assert!(Instant::now() < until, "rank 2 was never answered");
        std::thread::sleep(Duration::from_millis(5));
    };
    match told {
        Some(Msg::Out(d)) => assert_eq!(d.members, vec![0, 1]),
        other => panic!("rank 2 was told {other:?}"),
    }
    drop(got);
}
