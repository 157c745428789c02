//! The agreement's driver: runs this rank's [`Agreement`] over its control port. Messages come
//! in through the port (`Door`), go out through the `Outbox`, a refused connection is a lost
//! rank, and the clock is milliseconds since the call. Nothing here decides: the machine does.

use super::agreement::{Agreement, Event, Msg, Outcome, Send, Time};
use super::codec::{decode, encode, is_agreement_kind};
use super::outbox::{Outbox, Ports};
use crate::bootstrap::wire::listen;
use crate::bootstrap::wire::port::Control;
use crate::bootstrap::wire::port::Door;
use crate::error::{Error, Peer, Result};
use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, Instant};

/// What the survivors agreed, as the new group needs it.
#[derive(Debug)]
pub(crate) struct Decision {
    /// The ranks that go on, in their new order: the coordinator (where they meet) first, then
    /// the others in their old order.
    pub members: Vec<usize>,
    /// Where their new group meets (the coordinator's listener).
    pub meet: String,
    /// The least of the members' values.
    pub least: u64,
    /// The bitwise AND of the members' values.
    pub all: u64,
    /// The listener the new group meets at (on the coordinator alone).
    pub listener: Option<TcpListener>,
    /// The new group's job identity at its meeting: derived from the old group's session key
    /// and the agreement's tag, so only the old group's members can present it.
    pub identity: String,
}

/// The identity of the generation agreed under `tag` by a group of session key `session`.
fn identity(session: &[u8; crate::bootstrap::wire::auth::KEY], tag: u32) -> String {
    let m =
        crate::bootstrap::wire::auth::mac(session, &[b"rdmacomm generation", &tag.to_le_bytes()]);
    m[..16].iter().map(|b| format!("{b:02x}")).collect()
}

/// An agreement that ended with a decision, to answer latecomers at the old port.
pub(crate) struct Ended {
    pub machine: Agreement,
    /// Where the decided group meets.
    pub meet: String,
    /// The port's callers whose frame was still coming: the answerer reads on.
    pub door: Door,
}

/// How long a message may take to cross and be answered, for a wait of `timeout`: the model
/// checker's grace (`docs/DESIGN.md`).
pub(crate) fn grace(timeout: Duration) -> Duration {
    (timeout / 8).clamp(Duration::from_millis(100), Duration::from_secs(2))
}

/// How long an agreement with `n` ranks and `timeout` takes at most.
pub(crate) fn bound(n: usize, timeout: Duration) -> Duration {
    let ms = |d: Duration| d.as_millis().min(u64::MAX as u128 / 64) as Time;
    Duration::from_millis(Agreement::bound(n, ms(timeout), ms(grace(timeout))))
}

/// One attempt of a generation's agreement: its tag, the next attempt's (if there is one) and
/// frames of this attempt read while the one before ran.
pub(crate) struct Attempt {
    /// The tag this attempt's messages are sealed under.
    pub tag: u32,
    /// The next attempt's tag: a frame of it means the group went on to it.
    pub next: Option<u32>,
    /// Frames (kind, body) of this attempt that came before it began.
    pub carried: Vec<(u8, Vec<u8>)>,
}

/// How an attempt ended for this rank.
pub(crate) enum Step {
    /// It decided: the group meets.
    Decided(Decision, Box<Ended>),
    /// Others are in the next attempt already (their decision's meeting failed): this rank
    /// joins it, with the frames of it that came.
    Moved(Vec<(u8, Vec<u8>)>),
}

/// Agrees with the other survivors of `ctl`'s group on who goes on, this rank suspecting
/// `suspects` and bringing `value`, each wait `timeout`; messages sealed under the attempt's
/// tag (one per generation and attempt); `what` names the call in errors ("a shrink"). An
/// error names whom this rank waited on, or who left it out.
pub(crate) fn agree(
    ctl: &Control,
    attempt: Attempt,
    suspects: &[usize],
    value: u64,
    timeout: Duration,
    what: &str,
) -> Result<Step> {
    let Attempt {
        tag,
        next,
        mut carried,
    } = attempt;
    let tags: Vec<u32> = std::iter::once(tag).chain(next).collect();
    let (n, me) = (ctl.ports.len(), ctl.rank);
    let start = Instant::now();
    let clock = || start.elapsed().as_millis().min(u64::MAX as u128) as Time;
    let ms = |d: Duration| d.as_millis().min(u64::MAX as u128 / 64) as Time;
    // This rank's meeting point, used if it decides.
    let at = SocketAddr::new(ctl.listener.local_addr()?.ip(), 0);
    let own = listen(at)
        .map_err(|e| Error::Bootstrap(format!("rank {me}: cannot listen on {at}: {e}")))?;
    let mut meets: BTreeMap<usize, String> = BTreeMap::new();
    meets.insert(me, own.local_addr()?.to_string());
    let g = grace(timeout);
    let ports = Ports {
        addrs: ctl.addrs.clone(),
        ports: ctl.ports.clone(),
    };
    let out = Outbox::new(ports, timeout.min(g.max(Duration::from_secs(1))), n - 1);
    let post = |sends: Vec<Send>, meets: &BTreeMap<usize, String>, now: Time| {
        post_all(&out, ctl, tag, sends, meets, now)
    };
    let (mut a, first) = Agreement::start(me, n, suspects, value, clock(), ms(timeout), ms(g));
    post(first, &meets, clock());
    if crate::diag::test_fault("exit-in-shrink") {
        out.flush(Instant::now() + Duration::from_secs(1));
        std::process::exit(9);
    }
    ctl.listener.set_nonblocking(true)?;
    let mut door = Door::default();
    // Where the machine was before the clock ended it (for a timeout's error).
    let mut was = a.describe();
    let mut stalled = false;
    let outcome = loop {
        if let Some(o) = a.outcome() {
            break o.clone();
        }
        for q in out.lost() {
            log::info!("rank {me}: rank {q}'s control port refused: it is gone");
            let sends = a.handle(clock(), Event::Lost(q));
            post(sends, &meets, clock());
        }
        // What has arrived is read before the clock is looked at.
        let (mut frames, busy) = door.poll(&ctl.listener, &tags, is_agreement_kind);
        frames.splice(0..0, carried.drain(..));
        let polled = clock();
        let mut moved = Vec::new();
        for (kind, body) in frames {
            let now = clock();
            let Some(r) = decode(&ctl.session, tag, kind, &body, n, now) else {
                if next.is_some_and(|t| decode(&ctl.session, t, kind, &body, n, now).is_some()) {
                    moved.push((kind, body));
                } else {
                    log::debug!("rank {me}: ignored a control frame not of this agreement");
                }
                continue;
            };
            if let (Msg::Decide(d) | Msg::Go(d) | Msg::Out(d), Some(m)) = (&r.msg, r.meet) {
                meets.entry(d.coordinator).or_insert(m);
            }
            let sends = a.handle(
                now,
                Event::Recv {
                    from: r.from,
                    msg: r.msg,
                },
            );
            post(sends, &meets, now);
        }
        if !moved.is_empty() && a.outcome().is_none() {
            // Only a rank whose decision's meeting failed goes on to the next attempt: this
            // one's outcome no longer matters (a member still pledged would wait out its
            // coordinator while the others collect without it).
            log::info!("rank {me}: the others went on to the next attempt; so does this rank");
            out.flush(Instant::now() + g);
            return Ok(Step::Moved(moved));
        }
        if a.is_deciding() && !stalled {
            stalled = after_decide_hooks(&out, timeout);
        }
        let now = clock();
        if now.saturating_sub(polled) > ms(g) {
            // This thread was held (a stopped process, a starved CPU) since it last read the
            // port: what arrived meanwhile is read before the clock ends a wait.
            continue;
        }
        if a.deadline().is_some_and(|d| d <= now) {
            was = a.describe();
            let sends = a.handle(now, Event::Timer);
            post(sends, &meets, now);
        } else if !busy {
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    match outcome {
        Outcome::Decided(d) => {
            let Some(meet) = meets.get(&d.coordinator).cloned().filter(|m| !m.is_empty()) else {
                return Err(Error::Bootstrap(format!(
                    "rank {me}: {what}'s decision by rank {} came without its meeting point",
                    d.coordinator
                )));
            };
            let mut members = vec![d.coordinator];
            members.extend(d.members.iter().copied().filter(|&q| q != d.coordinator));
            let decision = Decision {
                members,
                meet: meet.clone(),
                least: d.least,
                all: d.all,
                listener: (d.coordinator == me).then_some(own),
                identity: identity(&ctl.session, tag),
            };
            Ok(Step::Decided(
                decision,
                Box::new(Ended {
                    machine: a,
                    meet,
                    door,
                }),
            ))
        }
        o => Err(failed(
            ctl,
            o,
            &format!("{what}'s agreement"),
            &was,
            start.elapsed(),
        )),
    }
}

/// Seals `sends` under `tag` and hands them to `out`; a decision's frames say where its
/// group meets (`meets`).
fn post_all(
    out: &Outbox,
    ctl: &Control,
    tag: u32,
    sends: Vec<Send>,
    meets: &BTreeMap<usize, String>,
    now: Time,
) {
    let mut gos = 0;
    for s in sends {
        // The test hook: a coordinator killed while it sends GO (one member has it).
        gos += usize::from(matches!(s.msg, Msg::Go(_)));
        if gos == 2 && crate::diag::test_fault("exit-while-go") {
            out.flush(Instant::now() + Duration::from_secs(1));
            std::process::exit(9);
        }
        let meet = match &s.msg {
            Msg::Decide(d) | Msg::Go(d) | Msg::Out(d) => meets.get(&d.coordinator),
            _ => None,
        };
        let meet = meet.map_or("", String::as_str);
        let (kind, frame) = encode(&ctl.session, tag, ctl.rank, &s.msg, meet, now);
        out.send(s.to, kind, frame);
    }
}

/// The test hooks of a coordinator whose decision went out: it stops reading (whether it
/// did), or dies.
fn after_decide_hooks(out: &Outbox, timeout: Duration) -> bool {
    if crate::diag::test_fault("exit-after-decide") {
        out.flush(Instant::now() + Duration::from_secs(1));
        std::process::exit(9);
    }
    let stall = crate::diag::test_fault("stall-after-decide");
    if stall {
        std::thread::sleep(3 * timeout);
    }
    stall
}

/// The error of an agreement (`what`) that ended without a decision for this rank: who left
/// it out, or whom it waited on last (`was`: where it stood), after `after`.
fn failed(ctl: &Control, outcome: Outcome, what: &str, was: &str, after: Duration) -> Error {
    let me = ctl.rank;
    let peer = |q: usize| Peer {
        rank: q,
        addr: ctl.addrs.get(q).cloned().unwrap_or_default(),
    };
    match outcome {
        Outcome::LeftOut { by, members } => Error::LeftOut {
            by: peer(by),
            reason: format!(
                "rank {me}: the group went on as ranks {members:?} without this rank (rank {by} \
                 said so)"
            ),
        },
        Outcome::TimedOut { waited_on } => Error::Timeout {
            peer: peer(waited_on),
            what: format!("{what}, seen from rank {me} (it {was} last)"),
            after,
        },
        Outcome::Decided(d) => Error::Bootstrap(format!(
            "rank {me}: {what} decided {:?} (not a failure)",
            d.members
        )),
    }
}
