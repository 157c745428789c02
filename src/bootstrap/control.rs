//! A rank's control port, as a shrink uses it (`shrink.rs`, `retired.rs`): its messages, sealed
//! with the group's session key and the epoch; reading the port (`Door`: bounded, strangers
//! closed, never fatal); reaching another rank's (`reach`: a refusal means nobody listens); and
//! surveying the ports of ranks not heard from (`survey`).

use super::auth::{mac, mac_ok, KEY};
use super::outcome::Control;
use super::wire::{read_some, recv_frame, send_frame, whole_frame, Reader};
use std::io::ErrorKind;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

// Frame kinds of a control connection (its own connection: they may repeat the rendezvous').
pub(super) const SHRINK: u8 = 40;
pub(super) const DECIDE: u8 = 41;
pub(super) const ACK: u8 = 42;
pub(super) const GO: u8 = 43;
/// The coordinator went on without this member (body: why, in words).
pub(super) const DROPPED: u8 = 44;
/// Did a group go on without me? (A coordinator about to decide with ranks missing asks them;
/// a retired port answers DROPPED, anything else closes.)
pub(super) const PROBE: u8 = 45;
/// This rank follows coordinator c (body: c), or coordinates (c is itself): the answer to a
/// SHRINK or a PROBE at a port its rank does not read meanwhile, and a coordinator's to a PROBE.
pub(super) const FOLLOWING: u8 = 46;
/// The largest control frame read (a DECIDE of 16 384 members is 64 KiB).
const LIMIT: usize = 1 << 20;
/// Connections to the control port not yet known to be members, at most (past it the oldest
/// that has sent nothing is closed), and how long one may take to send its frame (a rank sends
/// it whole as it connects).
pub(super) const MAX_PENDING: usize = 64;
const SILENT_FOR: Duration = Duration::from_secs(2);

/// A message of kind `kind` and `body` at epoch `epoch`, sealed with the session key.
pub(super) fn seal(key: &[u8; KEY], kind: u8, epoch: u32, body: &[u8]) -> Vec<u8> {
    let e = epoch.to_le_bytes();
    let mut v = e.to_vec();
    v.extend_from_slice(body);
    v.extend_from_slice(&mac(key, &[b"rdmacomm shrink", &[kind], &e, body]));
    v
}

/// The body of a sealed message of kind `kind` at `epoch`: `None` for a forged one, or one of
/// another epoch.
pub(super) fn open<'a>(key: &[u8; KEY], kind: u8, epoch: u32, m: &'a [u8]) -> Option<&'a [u8]> {
    if m.len() < 4 + KEY || m[..4] != epoch.to_le_bytes() {
        return None;
    }
    let (body, tag) = m[4..].split_at(m.len() - 4 - KEY);
    mac_ok(key, &[b"rdmacomm shrink", &[kind], &m[..4], body], tag).then_some(body)
}

pub(super) fn put_ranks(v: &mut Vec<u8>, ranks: &[usize]) {
    v.extend_from_slice(&(ranks.len() as u32).to_le_bytes());
    for &r in ranks {
        v.extend_from_slice(&(r as u32).to_le_bytes());
    }
}

/// Ranks as [`put_ranks`] wrote them, each below `n`; `None` otherwise.
pub(super) fn get_ranks(r: &mut Reader, n: usize) -> Option<Vec<usize>> {
    let k = r.u32().ok()? as usize;
    if k > n {
        return None;
    }
    (0..k)
        .map(|_| r.u32().ok().map(|q| q as usize).filter(|&q| q < n))
        .collect()
}

/// A SHRINK as read.
pub(super) struct Ask {
    pub(super) rank: usize,
    pub(super) value: u64,
    pub(super) suspects: Vec<usize>,
}

pub(super) fn encode_ask(rank: usize, value: u64, suspects: &[usize]) -> Vec<u8> {
    let mut v = (rank as u32).to_le_bytes().to_vec();
    v.extend_from_slice(&value.to_le_bytes());
    put_ranks(&mut v, suspects);
    v
}

pub(super) fn decode_ask(b: &[u8], n: usize) -> Option<Ask> {
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

/// Why a control port could not be reached.
pub(super) enum Reach {
    /// Nobody listens there (the connection was refused).
    Refused,
    /// Anything else, in words.
    Failed(String),
}

impl std::fmt::Display for Reach {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reach::Refused => f.write_str("nobody listens there (connection refused)"),
            Reach::Failed(why) => f.write_str(why),
        }
    }
}

/// A connection to `addr`:`port` (a rank's listener) by `until`: a refusal is final (nobody
/// listens there), a slow network is tried again.
pub(super) fn reach(
    addr: &str,
    port: u16,
    until: Instant,
) -> std::result::Result<TcpStream, Reach> {
    if port == 0 {
        return Err(Reach::Failed("it has no port to reach".into()));
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
pub(super) struct Door {
    callers: Vec<Caller>,
}

impl Door {
    /// The asks (kind, what was asked, the connection, non-blocking) whole since the last
    /// call on `ctl`'s port at `epoch`, and whether anything came.
    pub(super) fn poll(&mut self, ctl: &Control, epoch: u32) -> (Vec<(u8, Ask, TcpStream)>, bool) {
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
            if self.callers.len() >= MAX_PENDING {
                // Full: close the oldest that has sent nothing, else leave the next connections
                // in the kernel's backlog until one is done.
                let cs = &self.callers;
                match (0..cs.len())
                    .filter(|&i| cs[i].buf.is_empty())
                    .min_by_key(|&i| cs[i].since)
                {
                    Some(i) => {
                        self.callers.swap_remove(i);
                    }
                    None => break,
                }
            }
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
                Read::Wait => self.callers.push(c),
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

/// What it takes to ask the other ranks (a copy of a [`Control`] without its listener).
#[derive(Clone)]
pub(super) struct Roster {
    pub(super) rank: usize,
    pub(super) addrs: Vec<String>,
    pub(super) ports: Vec<u16>,
    pub(super) session: [u8; KEY],
}

impl Roster {
    pub(super) fn of(ctl: &Control) -> Roster {
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
pub(super) struct Survey {
    /// A coordinator some asked rank follows (or is), if any.
    pub(super) following: Option<usize>,
    /// Why a group of this epoch went on without this rank, if one did, and the rank whose
    /// retired port said so.
    pub(super) left_out: Option<(usize, String)>,
    /// Ranks whose port refused the connection: nobody listens there any more.
    pub(super) gone: Vec<usize>,
}

/// Ranks a survey asks at once.
const SURVEYED_AT_ONCE: usize = 32;

/// Asks every rank in `others` (PROBE), [`SURVEYED_AT_ONCE`] at a time, each for about a second
/// at most.
pub(super) fn survey(who: &Roster, epoch: u32, others: &[usize]) -> Survey {
    let mut out = Survey::default();
    for some in others.chunks(SURVEYED_AT_ONCE) {
        let part = survey_some(who, epoch, some);
        out.gone.extend(part.gone);
        out.following = out.following.or(part.following);
        if out.left_out.is_none() {
            out.left_out = part.left_out;
        }
        if out.left_out.is_some() {
            break;
        }
    }
    out
}

/// What one rank's port answered a PROBE.
enum Answer {
    /// The connection was refused: nobody listens there.
    Gone,
    /// Its group went on without the asker: why.
    WentOn(String),
    /// It follows (or is) this coordinator.
    Following(usize),
    /// Nothing that tells (silent, closed, or not of this group).
    Nothing,
}

fn probe_one(who: &Roster, epoch: u32, q: usize, probe: &[u8]) -> Answer {
    let until = Instant::now() + Duration::from_millis(500);
    let sock = match reach(&who.addrs[q], who.ports[q], until) {
        Ok(s) => s,
        Err(Reach::Refused) => return Answer::Gone,
        Err(Reach::Failed(_)) => return Answer::Nothing,
    };
    let _ = sock.set_write_timeout(Some(Duration::from_millis(200)));
    if send_frame(&sock, PROBE, probe).is_err() {
        return Answer::Nothing;
    }
    let Ok((kind, m)) = recv_frame(&sock, Instant::now() + Duration::from_millis(500)) else {
        return Answer::Nothing;
    };
    match (kind, open(&who.session, kind, epoch, &m)) {
        (DROPPED, Some(b)) => Answer::WentOn(String::from_utf8_lossy(b).into_owned()),
        (FOLLOWING, Some(b)) => b
            .try_into()
            .map(|c: [u8; 4]| u32::from_le_bytes(c) as usize)
            .ok()
            .filter(|&c| c < who.ports.len())
            .map_or(Answer::Nothing, Answer::Following),
        _ => Answer::Nothing,
    }
}

fn survey_some(who: &Roster, epoch: u32, others: &[usize]) -> Survey {
    let probe = seal(&who.session, PROBE, epoch, &encode_ask(who.rank, 0, &[]));
    std::thread::scope(|s| {
        let hs: Vec<_> = others
            .iter()
            .map(|&q| {
                let probe = &probe;
                std::thread::Builder::new().spawn_scoped(s, move || probe_one(who, epoch, q, probe))
            })
            .collect();
        let mut out = Survey::default();
        // A thread that could not start asked nothing.
        for (h, &q) in hs.into_iter().zip(others) {
            match h.ok().and_then(|h| h.join().ok()) {
                Some(Answer::Gone) => out.gone.push(q),
                Some(Answer::WentOn(why)) => {
                    out.left_out.get_or_insert((q, why));
                }
                Some(Answer::Following(c)) => {
                    out.following.get_or_insert(c);
                }
                _ => {}
            }
        }
        out
    })
}
