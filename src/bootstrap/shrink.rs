//! A shrink's agreement: after a failure, the ranks still alive agree on who goes on, where they
//! meet again and a value, over their control ports (`Control`), without the data path or rank 0.
//!
//! Each survivor sends SHRINK (the epoch, its rank, the ranks it knows failed, its value) to the
//! lowest rank it does not suspect: the coordinator. The coordinator takes SHRINKs until every
//! rank that nobody suspects has spoken, or for the timeout at most; then it sends each a DECIDE
//! (the members in their new order, where their new group meets, the values' least and AND, a
//! round), takes their ACKs for the timeout at most, tells a member that did not ack that it was
//! dropped and decides again without it; then GO. A survivor whose coordinator does not answer
//! suspects it and asks the next. Every message carries a MAC under the group's session key and
//! its epoch: a stranger or a rank of another generation learns nothing and ends nothing.

use super::control::*;
use super::outcome::Control;
use super::retired::{Answerer, Reply};
use super::wire::{listen, peer_closed, put_bytes, recv_frame, send_frame, Reader};
use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// What the survivors agreed.
#[derive(Debug)]
pub(crate) struct Decision {
    /// The ranks that go on, in their new order (the coordinator first).
    pub members: Vec<usize>,
    /// Where their new group meets (the coordinator's listener).
    pub meet: String,
    /// The least and the bitwise AND of the members' values.
    pub least: u64,
    pub all: u64,
    /// The coordinator's listener for the new group's rendezvous (on the coordinator alone).
    pub listener: Option<TcpListener>,
}

fn encode_decide(round: u32, d: &Decision) -> Vec<u8> {
    let mut v = round.to_le_bytes().to_vec();
    v.extend_from_slice(&d.least.to_le_bytes());
    v.extend_from_slice(&d.all.to_le_bytes());
    put_bytes(&mut v, d.meet.as_bytes());
    put_ranks(&mut v, &d.members);
    v
}

fn decode_decide(b: &[u8], n: usize) -> Option<(u32, Decision)> {
    let mut r = Reader(b);
    let round = r.u32().ok()?;
    let least = r.u64().ok()?;
    let all = r.u64().ok()?;
    let meet = String::from_utf8(r.bytes().ok()?.to_vec()).ok()?;
    let members = get_ranks(&mut r, n)?;
    // Members in the old order, each once (the new ranks are their places).
    let ordered = members.windows(2).all(|w| w[0] < w[1]);
    (!members.is_empty() && ordered && r.0.is_empty()).then_some((
        round,
        Decision {
            members,
            meet,
            least,
            all,
            listener: None,
        },
    ))
}

/// Agrees with the other survivors of `ctl`'s group (of `n` ranks, at `epoch`) on who goes on,
/// this rank suspecting `suspects` and bringing `value`; each wait bounded by `timeout`, the
/// whole by `deadline`. An error names whom it waited on.
pub(crate) fn agree(
    ctl: &Control,
    epoch: u32,
    suspects: &[usize],
    value: u64,
    timeout: Duration,
    deadline: Instant,
) -> Result<Decision> {
    let n = ctl.ports.len();
    let mut suspects: Vec<usize> = suspects
        .iter()
        .copied()
        .filter(|&q| q != ctl.rank)
        .collect();
    let mut silent: Vec<String> = Vec::new();
    let mut waited_on: Option<usize> = None;
    let bound = deadline.saturating_duration_since(Instant::now());
    // A coordinator another rank follows, to ask before the lowest this one does not suspect.
    let mut told: Option<usize> = None;
    for _ in 0..4 * n + 4 {
        // This rank never suspects itself: the search ends at it at the latest.
        let c = told
            .take()
            .unwrap_or_else(|| (0..n).find(|q| !suspects.contains(q)).unwrap_or(ctl.rank));
        if c == ctl.rank {
            match coordinate(ctl, epoch, &suspects, value, timeout)? {
                Coordinated::Decided(d) => return Ok(d),
                Coordinated::Follow(c) => {
                    log::info!(
                        "rank {}: joins the shrink coordinated by rank {c}",
                        ctl.rank
                    );
                    told = Some(c);
                    continue;
                }
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match ask(ctl, c, epoch, &suspects, value, timeout, left) {
            Ok(d) => return Ok(d),
            Err(Asked::Silent(why)) => {
                log::warn!(
                    "rank {}: shrink coordinator rank {c} did not answer ({why}); asking the next",
                    ctl.rank
                );
                silent.push(format!("rank {c} ({}): {why}", ctl.addrs[c]));
                waited_on.get_or_insert(c);
                suspects.push(c);
            }
            Err(Asked::Follows(d)) => told = Some(d),
            Err(Asked::Refused(e)) => return Err(e),
        }
    }
    let what = format!(
        "a shrink coordinator, seen from rank {}: {}",
        ctl.rank,
        silent.join("; ")
    );
    Err(match waited_on {
        Some(c) => Error::Timeout {
            peer: peer_of(ctl, c),
            what,
            after: bound,
        },
        None => Error::Bootstrap(format!("no coordinator within the shrink's bound ({what})")),
    })
}

/// Rank `q` of `ctl`'s group, for errors.
fn peer_of(ctl: &Control, q: usize) -> crate::error::Peer {
    crate::error::Peer {
        rank: q,
        addr: ctl.addrs.get(q).cloned().unwrap_or_default(),
    }
}

/// What a coordinator's collecting came to.
enum Coordinated {
    Decided(Decision),
    /// It heard from nobody while others follow this coordinator: it joins them.
    Follow(usize),
}

/// Why asking a coordinator gave no decision.
enum Asked {
    /// It did not answer, or stopped: ask the next.
    Silent(String),
    /// It follows this coordinator itself: ask that one.
    Follows(usize),
    /// It answered that this rank does not go on.
    Refused(Error),
}

/// Rank `ctl.rank` asks rank `c` to coordinate, waiting at most `left` in all.
fn ask(
    ctl: &Control,
    c: usize,
    epoch: u32,
    suspects: &[usize],
    value: u64,
    timeout: Duration,
    left: Duration,
) -> std::result::Result<Decision, Asked> {
    let until = Instant::now() + left;
    let key = &ctl.session;
    // Meanwhile this rank's own port answers that it follows `c`: a rank that finds nobody else
    // joins `c` rather than deciding alone.
    let _serving = ctl
        .try_clone()
        .ok()
        .map(|port| Answerer::start(port, epoch, Reply::Following(c)));
    let s = reach(
        &ctl.addrs[c],
        ctl.ports[c],
        until.min(Instant::now() + timeout),
    )
    .map_err(|e| Asked::Silent(e.to_string()))?;
    let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
    send_frame(
        &s,
        SHRINK,
        &seal(key, SHRINK, epoch, &encode_ask(ctl.rank, value, suspects)),
    )
    .map_err(|e| Asked::Silent(format!("sending: {e}")))?;
    if crate::diag::test_fault("exit-in-shrink") {
        std::process::exit(9);
    }
    // The coordinator may call shrink a timeout late (still in the operation that failed), then
    // collects for a timeout at most; a decision after that comes a timeout apart at most.
    let mut wait = 3 * timeout + Duration::from_secs(1);
    let mut decided: Option<(u32, Decision)> = None;
    loop {
        let by = until.min(Instant::now() + wait);
        let (kind, m) = recv_frame(&s, by).map_err(|e| match e.kind() {
            ErrorKind::TimedOut => Asked::Silent(format!("no word within {wait:?}")),
            _ => Asked::Silent(format!("its connection: {e}")),
        })?;
        wait = timeout + Duration::from_secs(1);
        match kind {
            DECIDE => {
                let Some((round, d)) =
                    open(key, DECIDE, epoch, &m).and_then(|b| decode_decide(b, ctl.ports.len()))
                else {
                    return Err(Asked::Silent("a malformed or forged decision".into()));
                };
                if !d.members.contains(&ctl.rank) {
                    return Err(Asked::Refused(Error::LeftOut {
                        by: peer_of(ctl, c),
                        reason: format!(
                            "rank {}: the shrink it coordinated went on without this rank \
                             (members {:?})",
                            ctl.rank, d.members
                        ),
                    }));
                }
                send_frame(&s, ACK, &seal(key, ACK, epoch, &round.to_le_bytes()))
                    .map_err(|e| Asked::Silent(format!("acknowledging: {e}")))?;
                decided = Some((round, d));
            }
            GO => {
                let ok = open(key, GO, epoch, &m).map(|b| b.to_vec());
                match (ok, decided.take()) {
                    (Some(b), Some((round, d))) if b == round.to_le_bytes() => return Ok(d),
                    _ => return Err(Asked::Silent("a GO without its decision".into())),
                }
            }
            FOLLOWING => {
                // A rank that is no coordinator: it follows this one.
                return Err(
                    match open(key, FOLLOWING, epoch, &m)
                        .and_then(|b| <[u8; 4]>::try_from(b).ok())
                        .map(|b| u32::from_le_bytes(b) as usize)
                        .filter(|&d| d < ctl.ports.len() && d != c)
                    {
                        Some(d) => Asked::Follows(d),
                        None => Asked::Silent("a malformed or forged answer".into()),
                    },
                );
            }
            DROPPED => {
                let why = open(key, DROPPED, epoch, &m)
                    .map(|b| String::from_utf8_lossy(b).into_owned())
                    .ok_or_else(|| Asked::Silent("a forged refusal".into()))?;
                return Err(Asked::Refused(Error::LeftOut {
                    by: peer_of(ctl, c),
                    reason: format!("rank {}: {why}", ctl.rank),
                }));
            }
            _ => return Err(Asked::Silent(format!("a frame of kind {kind}"))),
        }
    }
}

/// A member heard from: its connection, its value.
struct Member {
    sock: TcpStream,
    value: u64,
}

/// The coordinator's side: takes SHRINKs for `timeout` at most (less once every rank nobody
/// suspects has spoken), decides, and commits; or, having heard from nobody while others follow
/// another coordinator, joins that one.
fn coordinate(
    ctl: &Control,
    epoch: u32,
    suspects: &[usize],
    value: u64,
    timeout: Duration,
) -> Result<Coordinated> {
    let (n, me, key) = (ctl.ports.len(), ctl.rank, &ctl.session);
    let l = &ctl.listener;
    let mut suspected = vec![false; n];
    for &q in suspects {
        suspected[q] = true;
    }
    let mut heard: BTreeMap<usize, Member> = BTreeMap::new();
    l.set_nonblocking(true)?;
    let mut door = Door::default();
    let start = Instant::now();
    let until = start + timeout;
    let left_out_by = |(q, why): (usize, String)| Error::LeftOut {
        by: crate::error::Peer {
            rank: q,
            addr: ctl.addrs[q].clone(),
        },
        reason: format!("rank {me}: {why}"),
    };
    // The ports of ranks not heard from are asked in the background, 50 ms after the last: a
    // refusal means nobody is there (a rank killed that nobody named), a retired port that the
    // group went on without this rank (it was stopped, or late).
    let mut probe: Option<std::thread::JoinHandle<Survey>> = None;
    let mut asked = start;
    loop {
        let all_in = (0..n).all(|q| q == me || suspected[q] || heard.contains_key(&q));
        if all_in || Instant::now() >= until {
            break;
        }
        let unheard: Vec<usize> = (0..n)
            .filter(|&q| q != me && !heard.contains_key(&q) && (heard.is_empty() || !suspected[q]))
            .collect();
        if probe.is_none() && asked.elapsed() >= Duration::from_millis(50) && !unheard.is_empty() {
            let who = Roster::of(ctl);
            probe = std::thread::Builder::new()
                .name("rdmacomm-probe".into())
                .spawn(move || survey(&who, epoch, &unheard))
                .ok();
        }
        if let Some(h) = probe.take_if(|h| h.is_finished()) {
            asked = Instant::now();
            let found = h.join().unwrap_or_default();
            if let Some(x) = found.left_out {
                return Err(left_out_by(x));
            }
            // Nobody asked this rank, and others follow another coordinator: join them.
            if let Some(c) = found.following.filter(|&c| c != me && heard.is_empty()) {
                return Ok(Coordinated::Follow(c));
            }
            for q in found.gone {
                if !heard.contains_key(&q) {
                    suspected[q] = true;
                }
            }
        }
        let (asks, busy) = door.poll(ctl, epoch);
        for (kind, a, sock) in asks {
            if kind == PROBE {
                // Another rank asks who coordinates: this one.
                let _ = sock.set_nonblocking(false);
                let _ = sock.set_write_timeout(Some(Duration::from_millis(200)));
                let me32 = (me as u32).to_le_bytes();
                let _ = send_frame(&sock, FOLLOWING, &seal(key, FOLLOWING, epoch, &me32));
                continue;
            }
            for &q in &a.suspects {
                if q != me && !heard.contains_key(&q) {
                    suspected[q] = true;
                }
            }
            suspected[a.rank] = false;
            heard.insert(
                a.rank,
                Member {
                    sock,
                    value: a.value,
                },
            );
        }
        // A member whose connection closed is no longer heard: it died, or it gave up on this
        // rank and asked another (it is not taken for dead: the survey tells which).
        heard.retain(|_, m| !peer_closed(&m.sock));
        if !busy {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    drop(door);
    heard.retain(|_, m| m.sock.set_nonblocking(false).is_ok());
    let silent: Vec<usize> = (0..n)
        .filter(|&q| q != me && !suspected[q] && !heard.contains_key(&q))
        .collect();
    // Before deciding without some ranks: if they went on without this one (it was stopped,
    // or late), it is left out, not the coordinator of a group of its own.
    let missing: Vec<usize> = (0..n)
        .filter(|&q| q != me && !heard.contains_key(&q))
        .collect();
    let found = survey(&Roster::of(ctl), epoch, &missing);
    if let Some(x) = found.left_out {
        return Err(left_out_by(x));
    }
    // Alone, with ranks whose ports still listen: they may be meeting as a group that has not
    // retired its ports yet (milliseconds). Asked once more, a second later.
    let listening: Vec<usize> = missing
        .iter()
        .copied()
        .filter(|q| !found.gone.contains(q))
        .collect();
    if heard.is_empty() && !listening.is_empty() {
        std::thread::sleep(Duration::from_secs(1));
        if let Some(x) = survey(&Roster::of(ctl), epoch, &listening).left_out {
            return Err(left_out_by(x));
        }
    }
    if !silent.is_empty() {
        log::warn!(
            "rank {me}: rank(s) {silent:?} did not ask to shrink within {timeout:?}: the group \
             goes on without them"
        );
    }
    // The new group meets at this rank, beside its control port.
    let at = SocketAddr::new(l.local_addr()?.ip(), 0);
    let meet_l = listen(at)
        .map_err(|e| Error::Bootstrap(format!("rank {me}: cannot listen on {at}: {e}")))?;
    let meet = meet_l.local_addr()?.to_string();
    let mut values: BTreeMap<usize, u64> = heard.iter().map(|(&q, m)| (q, m.value)).collect();
    values.insert(me, value);
    for round in 0u32.. {
        let mut members = vec![me];
        members.extend(heard.keys().copied());
        let d = Decision {
            least: members.iter().map(|q| values[q]).min().unwrap_or(value),
            all: members.iter().fold(u64::MAX, |a, q| a & values[q]),
            members,
            meet: meet.clone(),
            listener: None,
        };
        let decide = seal(key, DECIDE, epoch, &encode_decide(round, &d));
        let mut failed: Vec<(usize, String)> = Vec::new();
        for (&q, m) in &heard {
            let _ = m.sock.set_write_timeout(Some(Duration::from_secs(1)));
            if let Err(e) = send_frame(&m.sock, DECIDE, &decide) {
                failed.push((q, format!("sending the decision: {e}")));
            }
        }
        let by = Instant::now() + timeout;
        for (&q, m) in &heard {
            if failed.iter().any(|(f, _)| *f == q) {
                continue;
            }
            let acked = recv_frame(&m.sock, by).map(|(kind, b)| {
                kind == ACK && open(key, ACK, epoch, &b) == Some(&round.to_le_bytes()[..])
            });
            match acked {
                Ok(true) => {}
                Ok(false) => failed.push((q, "an answer that is no acknowledgement".into())),
                Err(e) => failed.push((q, format!("no acknowledgement: {e}"))),
            }
        }
        if failed.is_empty() {
            let go = seal(key, GO, epoch, &round.to_le_bytes());
            for m in heard.values() {
                // A member that misses it waits, then asks again: the group formed without it
                // is named then.
                let _ = send_frame(&m.sock, GO, &go);
            }
            return Ok(Coordinated::Decided(Decision {
                listener: Some(meet_l),
                ..d
            }));
        }
        for (q, why) in failed {
            log::warn!("rank {me}: rank {q} is dropped from the shrink: {why}");
            if let Some(m) = heard.remove(&q) {
                let text = format!("rank {me} dropped it: {why}");
                let _ = send_frame(
                    &m.sock,
                    DROPPED,
                    &seal(key, DROPPED, epoch, text.as_bytes()),
                );
            }
        }
    }
    unreachable!("rounds end when every member acknowledged")
}

#[cfg(test)]
mod tests {
    use super::super::auth::KEY;
    use super::*;

    #[test]
    fn a_decision_naming_a_rank_twice_or_out_of_order_is_refused() {
        let d = |members: Vec<usize>| Decision {
            members,
            meet: "127.0.0.1:1".into(),
            least: 3,
            all: 1,
            listener: None,
        };
        let (round, back) = decode_decide(&encode_decide(2, &d(vec![0, 2, 3])), 4).unwrap();
        assert_eq!((round, back.members, back.least), (2, vec![0, 2, 3], 3));
        assert!(decode_decide(&encode_decide(2, &d(vec![0, 2, 2])), 4).is_none());
        assert!(decode_decide(&encode_decide(2, &d(vec![2, 0])), 4).is_none());
        assert!(decode_decide(&encode_decide(2, &d(vec![0, 4])), 4).is_none());
    }

    fn group(n: usize) -> Vec<Control> {
        let session = [7u8; KEY];
        let ls: Vec<TcpListener> = (0..n).map(|_| listen("127.0.0.1:0").unwrap()).collect();
        let ports: Vec<u16> = ls.iter().map(|l| l.local_addr().unwrap().port()).collect();
        ls.into_iter()
            .enumerate()
            .map(|(rank, listener)| Control {
                rank,
                listener,
                addrs: vec!["127.0.0.1".into(); n],
                ports: ports.clone(),
                session,
            })
            .collect()
    }

    fn run(
        ctls: Vec<Control>,
        who: &[usize],
        suspects: &[usize],
        t: Duration,
    ) -> Vec<(usize, Result<Decision>)> {
        let mut ctls: Vec<Option<Control>> = ctls.into_iter().map(Some).collect();
        let hs: Vec<_> = who
            .iter()
            .map(|&r| {
                let c = ctls[r].take().unwrap();
                let s = suspects.to_vec();
                std::thread::spawn(move || {
                    let d = agree(&c, 0, &s, 100 + r as u64, t, Instant::now() + 8 * t);
                    (r, d)
                })
            })
            .collect();
        // The listeners of ranks not running stay open: connections to them wait unanswered.
        let r = hs.into_iter().map(|h| h.join().unwrap()).collect();
        drop(ctls);
        r
    }

    #[test]
    fn a_rank_that_asks_a_follower_is_sent_to_its_coordinator() {
        // Rank 2 suspects rank 0 (its error named it) and asks rank 1, which follows rank 0:
        // rank 1's port sends it to rank 0, and the three agree, instead of rank 2 waiting out
        // rank 1 and going on as a group of its own.
        let t = Duration::from_millis(1500);
        let mut ctls: Vec<Option<Control>> = group(3).into_iter().map(Some).collect();
        let start = Instant::now();
        let hs: Vec<_> = [(0, vec![]), (1, vec![]), (2, vec![0])]
            .into_iter()
            .map(|(r, s): (usize, Vec<usize>)| {
                let c = ctls[r].take().unwrap();
                std::thread::spawn(move || {
                    if r == 2 {
                        // Once rank 1 follows rank 0.
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    agree(&c, 0, &s, r as u64, t, Instant::now() + 8 * t)
                })
            })
            .collect();
        for (r, h) in hs.into_iter().enumerate() {
            let d = h
                .join()
                .unwrap()
                .unwrap_or_else(|e| panic!("rank {r}: {e}"));
            assert_eq!(d.members, vec![0, 1, 2], "rank {r}");
        }
        assert!(start.elapsed() < t, "{:?}", start.elapsed());
    }

    #[test]
    fn survivors_agree_without_the_lost_rank_and_rank_0() {
        // Ranks 0 and 3 of 5 are lost (0's port open, nobody reading); 3 is suspected.
        let t = Duration::from_millis(800);
        let got = run(group(5), &[1, 2, 4], &[3], t);
        for (r, d) in &got {
            let d = d.as_ref().unwrap_or_else(|e| panic!("rank {r}: {e}"));
            assert_eq!(d.members, vec![1, 2, 4], "rank {r}");
            assert_eq!(d.least, 101);
            assert_eq!(d.all, 101 & 102 & 104);
            assert_eq!(d.listener.is_some(), *r == 1);
            assert_eq!(d.meet, got[0].1.as_ref().unwrap().meet);
        }
    }

    #[test]
    fn a_rank_nobody_suspects_is_waited_on_then_dropped() {
        let t = Duration::from_millis(500);
        let start = Instant::now();
        let got = run(group(4), &[0, 1, 3], &[], t);
        for (r, d) in &got {
            assert_eq!(d.as_ref().unwrap().members, vec![0, 1, 3], "rank {r}");
        }
        assert!(start.elapsed() >= t, "rank 2 was waited on for the timeout");
    }

    #[test]
    fn a_stranger_at_the_control_port_is_ignored() {
        let t = Duration::from_millis(800);
        let ctls = group(3);
        let at = SocketAddr::new("127.0.0.1".parse().unwrap(), ctls[0].ports[0]);
        let strangers: Vec<TcpStream> = (0..3)
            .map(|i| {
                let s = TcpStream::connect(at).unwrap();
                let forged = seal(&[9; KEY], SHRINK, 0, &encode_ask(2, 0, &[1]));
                match i {
                    0 => send_frame(&s, SHRINK, &forged).unwrap(),
                    1 => send_frame(&s, SHRINK, b"junk").unwrap(),
                    _ => {}
                }
                s
            })
            .collect();
        let got = run(ctls, &[0, 1, 2], &[], t);
        for (r, d) in &got {
            assert_eq!(d.as_ref().unwrap().members, vec![0, 1, 2], "rank {r}");
        }
        drop(strangers);
    }

    #[test]
    fn a_flood_of_idle_strangers_evicts_no_member() {
        // 150 silent connections wait at rank 0's port before the members ask.
        let t = Duration::from_millis(1500);
        let ctls = group(3);
        let at = SocketAddr::new("127.0.0.1".parse().unwrap(), ctls[0].ports[0]);
        let idle: Vec<TcpStream> = (0..150)
            .filter_map(|_| TcpStream::connect(at).ok())
            .collect();
        let start = Instant::now();
        let got = run(ctls, &[0, 1, 2], &[], t);
        for (r, d) in &got {
            assert_eq!(d.as_ref().unwrap().members, vec![0, 1, 2], "rank {r}");
        }
        // An evicted member would wait three timeouts for its coordinator.
        assert!(
            start.elapsed() < 2 * t,
            "{:?}: a member was evicted",
            start.elapsed()
        );
        drop(idle);
    }

    #[test]
    fn a_member_half_way_through_its_ask_outlasts_a_flood_of_idle_strangers() {
        // Rank 1's SHRINK comes in two parts with a flood of silent strangers between: the door,
        // full, closes the oldest caller that sent nothing, never one that sent a part.
        use std::io::Write;
        let ctls = group(2);
        ctls[0].listener.set_nonblocking(true).unwrap(); // as a coordinator sets it
        let at = SocketAddr::new("127.0.0.1".parse().unwrap(), ctls[0].ports[0]);
        let m = seal(&ctls[1].session, SHRINK, 0, &encode_ask(1, 5, &[]));
        let mut frame = ((m.len() + 1) as u32).to_le_bytes().to_vec();
        frame.push(SHRINK);
        frame.extend_from_slice(&m);
        let mut member = TcpStream::connect(at).unwrap();
        member.write_all(&frame[..3]).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let mut door = Door::default();
        assert!(door.poll(&ctls[0], 0).0.is_empty(), "half an ask");
        // In batches, the door taking each (a full backlog would hold a connect up).
        let mut idle = Vec::new();
        for _ in 0..6 {
            idle.extend((0..MAX_PENDING / 2).filter_map(|_| TcpStream::connect(at).ok()));
            std::thread::sleep(Duration::from_millis(10));
            assert!(door.poll(&ctls[0], 0).0.is_empty());
        }
        member.write_all(&frame[3..]).unwrap();
        let until = Instant::now() + Duration::from_secs(1);
        let asks = loop {
            let (asks, _) = door.poll(&ctls[0], 0);
            if !asks.is_empty() || Instant::now() >= until {
                break asks;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        assert_eq!(asks.len(), 1, "the member's ask was dropped");
        assert_eq!((asks[0].0, asks[0].1.rank, asks[0].1.value), (SHRINK, 1, 5));
        drop(idle);
    }

    #[test]
    fn a_forged_or_stale_message_does_not_open() {
        let k = [1u8; KEY];
        let m = seal(&k, GO, 3, b"x");
        assert_eq!(open(&k, GO, 3, &m), Some(&b"x"[..]));
        assert!(open(&k, GO, 2, &m).is_none(), "another epoch");
        assert!(open(&k, ACK, 3, &m).is_none(), "another kind");
        assert!(open(&[2; KEY], GO, 3, &m).is_none(), "another key");
        for cut in 0..m.len() {
            assert!(open(&k, GO, 3, &m[..cut]).is_none());
        }
        assert!(
            decode_ask(&encode_ask(9, 1, &[]), 4).is_none(),
            "a rank past n"
        );
        assert!(
            decode_ask(&encode_ask(1, 1, &[7]), 4).is_none(),
            "a suspect past n"
        );
    }
}
