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

use super::auth::{mac, mac_ok, KEY};
use super::outcome::Control;
use super::wire::{listen, put_bytes, read_some, recv_frame, send_frame, whole_frame, Reader};
use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

// Frame kinds of a control connection (its own connection: they may repeat the rendezvous').
const SHRINK: u8 = 40;
const DECIDE: u8 = 41;
const ACK: u8 = 42;
const GO: u8 = 43;
/// The coordinator went on without this member (body: why, in words).
const DROPPED: u8 = 44;
/// Did a group go on without me? (A coordinator about to decide with ranks missing asks them;
/// a retired port answers DROPPED, anything else closes.)
const PROBE: u8 = 45;
/// The largest control frame read (a DECIDE of 16 384 members is 64 KiB).
const LIMIT: usize = 1 << 20;
/// Connections to the control port not yet known to be members, at most (past it the oldest
/// that has sent nothing is closed), and how long one may stay silent.
const MAX_PENDING: usize = 64;
const SILENT_FOR: Duration = Duration::from_secs(5);

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

/// A message of kind `kind` and `body` at epoch `epoch`, sealed with the session key.
fn seal(key: &[u8; KEY], kind: u8, epoch: u32, body: &[u8]) -> Vec<u8> {
    let e = epoch.to_le_bytes();
    let mut v = e.to_vec();
    v.extend_from_slice(body);
    v.extend_from_slice(&mac(key, &[b"rdmacomm shrink", &[kind], &e, body]));
    v
}

/// The body of a sealed message of kind `kind` at `epoch`: `None` for a forged one, or one of
/// another epoch.
fn open<'a>(key: &[u8; KEY], kind: u8, epoch: u32, m: &'a [u8]) -> Option<&'a [u8]> {
    if m.len() < 4 + KEY || m[..4] != epoch.to_le_bytes() {
        return None;
    }
    let (body, tag) = m[4..].split_at(m.len() - 4 - KEY);
    mac_ok(key, &[b"rdmacomm shrink", &[kind], &m[..4], body], tag).then_some(body)
}

fn put_ranks(v: &mut Vec<u8>, ranks: &[usize]) {
    v.extend_from_slice(&(ranks.len() as u32).to_le_bytes());
    for &r in ranks {
        v.extend_from_slice(&(r as u32).to_le_bytes());
    }
}

/// Ranks as [`put_ranks`] wrote them, each below `n`; `None` otherwise.
fn get_ranks(r: &mut Reader, n: usize) -> Option<Vec<usize>> {
    let k = r.u32().ok()? as usize;
    if k > n {
        return None;
    }
    (0..k)
        .map(|_| r.u32().ok().map(|q| q as usize).filter(|&q| q < n))
        .collect()
}

/// A SHRINK as read.
struct Ask {
    rank: usize,
    value: u64,
    suspects: Vec<usize>,
}

fn encode_ask(rank: usize, value: u64, suspects: &[usize]) -> Vec<u8> {
    let mut v = (rank as u32).to_le_bytes().to_vec();
    v.extend_from_slice(&value.to_le_bytes());
    put_ranks(&mut v, suspects);
    v
}

fn decode_ask(b: &[u8], n: usize) -> Option<Ask> {
    let mut r = Reader(b);
    let rank = r.u32().ok()? as usize;
    let value = r.u64().ok()?;
    let suspects = get_ranks(&mut r, n)?;
    (rank < n && r.0.is_empty()).then_some(Ask {
        rank,
        value,
        suspects,
    })
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
    (!members.is_empty() && r.0.is_empty()).then_some((
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
    loop {
        // This rank never suspects itself: the search ends at it at the latest.
        let c = (0..n).find(|q| !suspects.contains(q)).unwrap_or(ctl.rank);
        if c == ctl.rank {
            return coordinate(ctl, epoch, &suspects, value, timeout);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Bootstrap(format!(
                "rank {}: the shrink found no coordinator within its bound: {}",
                ctl.rank,
                silent.join("; ")
            )));
        }
        match ask(ctl, c, epoch, &suspects, value, timeout, left) {
            Ok(d) => return Ok(d),
            Err(Asked::Silent(why)) => {
                log::warn!(
                    "rank {}: shrink coordinator rank {c} did not answer ({why}); asking the next",
                    ctl.rank
                );
                silent.push(format!("rank {c} ({}): {why}", ctl.addrs[c]));
                suspects.push(c);
            }
            Err(Asked::Refused(e)) => return Err(e),
        }
    }
}

/// Why asking a coordinator gave no decision.
enum Asked {
    /// It did not answer, or stopped: ask the next.
    Silent(String),
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
                    return Err(Asked::Refused(Error::Bootstrap(format!(
                        "rank {}: the shrink coordinated by rank {c} went on without this rank \
                         (members {:?})",
                        ctl.rank, d.members
                    ))));
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
            DROPPED => {
                let why = open(key, DROPPED, epoch, &m)
                    .map(|b| String::from_utf8_lossy(b).into_owned())
                    .ok_or_else(|| Asked::Silent("a forged refusal".into()))?;
                return Err(Asked::Refused(Error::Bootstrap(format!(
                    "rank {} was left out of the shrink: {why}",
                    ctl.rank
                ))));
            }
            _ => return Err(Asked::Silent(format!("a frame of kind {kind}"))),
        }
    }
}

/// Why a control port could not be reached.
enum Reach {
    /// Nobody listens there (the connection was refused).
    Refused,
    /// Anything else, in words.
    Failed(String),
}

impl std::fmt::Display for Reach {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reach::Refused => f.write_str("nobody listens at its control port"),
            Reach::Failed(why) => f.write_str(why),
        }
    }
}

/// A connection to `addr`:`port` by `until` (a refusal is final: nobody listens there).
fn reach(addr: &str, port: u16, until: Instant) -> std::result::Result<TcpStream, Reach> {
    if port == 0 {
        return Err(Reach::Failed("it has no control port".into()));
    }
    let ip: IpAddr = addr
        .parse()
        .map_err(|_| Reach::Failed(format!("its address {addr:?} is not an IP address")))?;
    let at = SocketAddr::new(ip, port);
    loop {
        let left = until.saturating_duration_since(Instant::now());
        let limit = left
            .min(Duration::from_secs(1))
            .max(Duration::from_millis(1));
        match TcpStream::connect_timeout(&at, limit) {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Err(e) if e.kind() == ErrorKind::TimedOut && !left.is_zero() => {}
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => return Err(Reach::Refused),
            Err(e) => return Err(Reach::Failed(format!("connecting to {at}: {e}"))),
        }
    }
}

/// A connection to the control port, and its bytes so far.
struct Caller {
    sock: TcpStream,
    buf: Vec<u8>,
    since: Instant,
}

/// What one read of a caller shows.
enum Read {
    /// Nothing whole yet: keep it.
    Wait,
    /// Of no use (closed, malformed, silent too long): drop it.
    Drop,
    /// A whole frame: its kind and body.
    Frame(u8, Vec<u8>),
}

impl Caller {
    fn read(&mut self) -> (Read, bool) {
        let (got, bad) = read_some(&self.sock, &mut self.buf, LIMIT);
        let whole = whole_frame(&self.buf, LIMIT);
        let r = match whole {
            Err(_) => Read::Drop,
            Ok(true) => {
                let len = u32::from_le_bytes(self.buf[..4].try_into().expect("4 bytes")) as usize;
                Read::Frame(self.buf[4], self.buf[5..4 + len].to_vec())
            }
            Ok(false) if bad.is_some() || self.since.elapsed() > SILENT_FOR => Read::Drop,
            Ok(false) => Read::Wait,
        };
        (r, got)
    }
}

/// The control port as a shrink reads it: connections accepted as they come (at most
/// [`MAX_PENDING`] accepted a call and waiting; past it the oldest that has sent nothing is
/// closed), each read once as it is accepted (a member's SHRINK comes with its connection) and
/// its first frame taken if it is a SHRINK or a PROBE of this group and epoch; anything else
/// is closed, never fatal.
#[derive(Default)]
struct Door {
    callers: Vec<Caller>,
}

impl Door {
    /// The asks (kind, what was asked, the connection, non-blocking) whole since the last
    /// call on `ctl`'s port at `epoch`, and whether anything came.
    fn poll(&mut self, ctl: &Control, epoch: u32) -> (Vec<(u8, Ask, TcpStream)>, bool) {
        let (n, me) = (ctl.ports.len(), ctl.rank);
        let mut busy = false;
        let mut asks = Vec::new();
        let take = |c: Caller, kind: u8, m: &[u8], asks: &mut Vec<(u8, Ask, TcpStream)>| match [
            SHRINK, PROBE,
        ]
        .contains(&kind)
        .then(|| open(&ctl.session, kind, epoch, m))
        .flatten()
        .and_then(|b| decode_ask(b, n))
        .filter(|a| a.rank != me)
        {
            Some(a) => asks.push((kind, a, c.sock)),
            None => log::debug!(
                "rank {me}: ignored a connection to its control port that is no shrink of \
                     this group"
            ),
        };
        // Bounded per call: a flood cannot keep the caller from its deadline.
        for _ in 0..MAX_PENDING {
            let Ok((s, _)) = ctl.listener.accept() else {
                break;
            };
            busy = true;
            if s.set_nonblocking(true).is_err() {
                continue;
            }
            let mut c = Caller {
                sock: s,
                buf: Vec::new(),
                since: Instant::now(),
            };
            match c.read().0 {
                Read::Frame(kind, m) => take(c, kind, &m, &mut asks),
                Read::Drop => {}
                Read::Wait => {
                    if self.callers.len() >= MAX_PENDING {
                        let cs = &self.callers;
                        let oldest = (0..cs.len())
                            .filter(|&i| cs[i].buf.is_empty())
                            .min_by_key(|&i| cs[i].since);
                        match oldest {
                            Some(i) => {
                                self.callers.swap_remove(i);
                            }
                            None => continue, // every one has begun: the newcomer waits its turn
                        }
                    }
                    self.callers.push(c);
                }
            }
        }
        let mut i = 0;
        while i < self.callers.len() {
            let (r, got) = self.callers[i].read();
            busy |= got;
            match r {
                Read::Wait => i += 1,
                Read::Drop => {
                    self.callers.swap_remove(i);
                }
                Read::Frame(kind, m) => {
                    let c = self.callers.swap_remove(i);
                    take(c, kind, &m, &mut asks);
                }
            }
        }
        (asks, busy)
    }
}

/// A retired control port: its group went on as `members` at the next epoch.
struct Retired {
    id: u64,
    ctl: Control,
    epoch: u32,
    refusal: Vec<u8>,
    door: Door,
}

/// Every retired control port of this process, served by one thread.
static RETIRED: std::sync::Mutex<Vec<Retired>> = std::sync::Mutex::new(Vec::new());

/// After a shrink, a rank's old control port answers the ranks of the old group that ask late
/// (one stopped, or cut off, while the others went on): they were left out, so they fail,
/// named, instead of going on as a group of their own. One thread serves every retired port of
/// the process; a port closes when its answerer drops.
pub(crate) struct Answerer {
    id: u64,
}

impl Answerer {
    /// Answers on `ctl`'s port (of epoch `epoch`) until dropped: the group went on as `members`.
    pub(crate) fn start(ctl: Control, epoch: u32, members: Vec<usize>) -> Answerer {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        static SERVE: std::sync::Once = std::sync::Once::new();
        let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let why = format!(
            "the group went on as epoch {} with ranks {members:?} without it (rank {} answered)",
            epoch + 1,
            ctl.rank
        );
        let refusal = seal(&ctl.session, DROPPED, epoch, why.as_bytes());
        if ctl.listener.set_nonblocking(true).is_ok() {
            let mut all = RETIRED.lock().unwrap_or_else(|e| e.into_inner());
            all.push(Retired {
                id,
                ctl,
                epoch,
                refusal,
                door: Door::default(),
            });
        }
        SERVE.call_once(|| {
            let _ = std::thread::Builder::new()
                .name("rdmacomm-retired".into())
                .spawn(serve_retired);
        });
        Answerer { id }
    }
}

impl Drop for Answerer {
    fn drop(&mut self) {
        let mut all = RETIRED.lock().unwrap_or_else(|e| e.into_inner());
        all.retain(|r| r.id != self.id);
    }
}

/// The thread that answers at every retired port.
fn serve_retired() {
    loop {
        let mut busy = false;
        {
            let mut all = RETIRED.lock().unwrap_or_else(|e| e.into_inner());
            for r in all.iter_mut() {
                let (asks, got) = r.door.poll(&r.ctl, r.epoch);
                busy |= got;
                for (_, a, sock) in asks {
                    log::warn!(
                        "rank {} told rank {} of epoch {} that its group went on without it",
                        r.ctl.rank,
                        a.rank,
                        r.epoch
                    );
                    let _ = sock.set_nonblocking(false);
                    let _ = sock.set_write_timeout(Some(Duration::from_millis(200)));
                    let _ = send_frame(&sock, DROPPED, &r.refusal);
                }
            }
        }
        if !busy {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// What it takes to ask the other ranks (a copy of a [`Control`] without its listener).
#[derive(Clone)]
struct Roster {
    rank: usize,
    addrs: Vec<String>,
    ports: Vec<u16>,
    session: [u8; KEY],
}

impl Roster {
    fn of(ctl: &Control) -> Roster {
        Roster {
            rank: ctl.rank,
            addrs: ctl.addrs.clone(),
            ports: ctl.ports.clone(),
            session: ctl.session,
        }
    }
}

/// What asking other ranks' control ports showed.
#[derive(Default)]
struct Survey {
    /// Why a group of this epoch went on without this rank, if one did (a retired port said).
    left_out: Option<String>,
    /// Ranks whose port refused the connection: nobody listens there any more.
    gone: Vec<usize>,
}

/// Asks every rank in `others` at once (PROBE), for about a second at most.
fn survey(who: &Roster, epoch: u32, others: &[usize]) -> Survey {
    let probe = seal(&who.session, PROBE, epoch, &encode_ask(who.rank, 0, &[]));
    std::thread::scope(|s| {
        let hs: Vec<_> = others
            .iter()
            .map(|&q| {
                let probe = &probe;
                s.spawn(move || -> std::result::Result<Option<String>, ()> {
                    let until = Instant::now() + Duration::from_millis(500);
                    let sock = match reach(&who.addrs[q], who.ports[q], until) {
                        Ok(s) => s,
                        Err(Reach::Refused) => return Err(()),
                        Err(Reach::Failed(_)) => return Ok(None),
                    };
                    let _ = sock.set_write_timeout(Some(Duration::from_millis(200)));
                    if send_frame(&sock, PROBE, probe).is_err() {
                        return Ok(None);
                    }
                    let Ok((kind, m)) =
                        recv_frame(&sock, Instant::now() + Duration::from_millis(500))
                    else {
                        return Ok(None);
                    };
                    Ok((kind == DROPPED)
                        .then(|| open(&who.session, DROPPED, epoch, &m))
                        .flatten()
                        .map(|b| String::from_utf8_lossy(b).into_owned()))
                })
            })
            .collect();
        let mut out = Survey::default();
        for (h, &q) in hs.into_iter().zip(others) {
            match h.join() {
                Ok(Err(())) => out.gone.push(q),
                Ok(Ok(Some(why))) if out.left_out.is_none() => out.left_out = Some(why),
                _ => {}
            }
        }
        out
    })
}

/// A member heard from: its connection, its value.
struct Member {
    sock: TcpStream,
    value: u64,
}

/// Whether the peer closed `s` (non-blocking).
fn closed(s: &TcpStream) -> bool {
    let mut b = [0u8; 1];
    match s.peek(&mut b) {
        Ok(k) => k == 0,
        Err(e) => e.kind() != ErrorKind::WouldBlock,
    }
}

/// The coordinator's side: takes SHRINKs for `timeout` at most (less once every rank nobody
/// suspects has spoken), decides, and commits.
fn coordinate(
    ctl: &Control,
    epoch: u32,
    suspects: &[usize],
    value: u64,
    timeout: Duration,
) -> Result<Decision> {
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
    let left_out_by =
        |why: String| Error::Bootstrap(format!("rank {me} was left out of the shrink: {why}"));
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
            if let Some(why) = found.left_out {
                return Err(left_out_by(why));
            }
            for q in found.gone {
                if !heard.contains_key(&q) {
                    suspected[q] = true;
                }
            }
        }
        let (asks, busy) = door.poll(ctl, epoch);
        for (_, a, sock) in asks.into_iter().filter(|(kind, ..)| *kind == SHRINK) {
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
        // A member that died while the others came in is not waited on.
        heard.retain(|&q, m| {
            let gone = closed(&m.sock);
            if gone {
                suspected[q] = true;
            }
            !gone
        });
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
    if let Some(why) = survey(&Roster::of(ctl), epoch, &missing).left_out {
        return Err(left_out_by(why));
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
            return Ok(Decision {
                listener: Some(meet_l),
                ..d
            });
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
    use super::*;

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
        assert!(
            start.elapsed() < t,
            "{:?}: a member was evicted",
            start.elapsed()
        );
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
