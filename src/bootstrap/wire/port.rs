//! A rank's control port (`Control`: kept from the rendezvous for the communicator's life), as
//! the shrink's agreement uses it (`elastic/`): its messages, sealed with the group's session
//! key and the agreement's tag; reading the port (`Door`: bounded, strangers closed at their
//! first bytes, never fatal); reaching another rank's (`reach`: a refusal means nobody
//! listens).

use super::auth::{mac, mac_ok, KEY};
use super::{read_some, whole_frame, Reader};
use std::io::ErrorKind;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// The largest control frame read (a DECIDE of 16 384 members is 64 KiB).
const LIMIT: usize = 1 << 20;
/// Connections to the control port whose frame is not whole, at most (past it the oldest is
/// closed: a rank writes its frame whole as it connects), and how long one may take to send it.
pub(crate) const MAX_PENDING: usize = 64;
const SILENT_FOR: Duration = Duration::from_secs(2);

/// What a rank keeps of the rendezvous to reach the others without the data path or rank 0 (a
/// shrink after a failure): its own open listener and every rank's control port.
pub struct Control {
    /// This rank.
    pub rank: usize,
    /// Its control port, open for the communicator's life (connections wait in its backlog).
    pub listener: TcpListener,
    /// Every rank's host address, by rank.
    pub addrs: Vec<String>,
    /// Every rank's control port, by rank (0: it has none).
    pub ports: Vec<u16>,
    /// The group's session key, which control messages prove.
    pub session: [u8; KEY],
}

impl Control {
    /// A second handle on the same port (its listener's descriptor duplicated), for a thread
    /// that answers on it while this one is kept.
    pub fn try_clone(&self) -> std::io::Result<Control> {
        Ok(Control {
            rank: self.rank,
            listener: self.listener.try_clone()?,
            addrs: self.addrs.clone(),
            ports: self.ports.clone(),
            session: self.session,
        })
    }
}

/// A message of kind `kind` and `body` at epoch `epoch`, sealed with the session key.
pub(crate) fn seal(key: &[u8; KEY], kind: u8, epoch: u32, body: &[u8]) -> Vec<u8> {
    let e = epoch.to_le_bytes();
    let mut v = e.to_vec();
    v.extend_from_slice(body);
    v.extend_from_slice(&mac(key, &[b"rdmacomm shrink", &[kind], &e, body]));
    v
}

/// The body of a sealed message of kind `kind` at `epoch`: `None` for a forged one, or one of
/// another epoch.
pub(crate) fn open<'a>(key: &[u8; KEY], kind: u8, epoch: u32, m: &'a [u8]) -> Option<&'a [u8]> {
    if m.len() < 4 + KEY || m[..4] != epoch.to_le_bytes() {
        return None;
    }
    let (body, tag) = m[4..].split_at(m.len() - 4 - KEY);
    mac_ok(key, &[b"rdmacomm shrink", &[kind], &m[..4], body], tag).then_some(body)
}

pub(crate) fn put_ranks(v: &mut Vec<u8>, ranks: &[usize]) {
    v.extend_from_slice(&(ranks.len() as u32).to_le_bytes());
    for &r in ranks {
        v.extend_from_slice(&(r as u32).to_le_bytes());
    }
}

/// Ranks as [`put_ranks`] wrote them, each below `n`; `None` otherwise.
pub(crate) fn get_ranks(r: &mut Reader, n: usize) -> Option<Vec<usize>> {
    let k = r.u32().ok()? as usize;
    if k > n {
        return None;
    }
    (0..k)
        .map(|_| r.u32().ok().map(|q| q as usize).filter(|&q| q < n))
        .collect()
}

/// Why a control port could not be reached.
pub(crate) enum Reach {
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
pub(crate) fn reach(
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
    /// Of no use (closed, malformed, a stranger's, silent too long): drop it.
    Drop,
    /// A whole frame: its kind and body.
    Frame(u8, Vec<u8>),
}

impl Caller {
    /// Reads what came; a frame whose first bytes are not of kind `kinds` and one of `tags` is
    /// a stranger's, dropped at once.
    fn read(&mut self, tags: &[u32], kinds: fn(u8) -> bool) -> (Read, bool) {
        let (got, bad) = read_some(&self.sock, &mut self.buf, LIMIT);
        let b = &self.buf;
        let stranger = (b.len() > 4 && !kinds(b[4]))
            || (b.len() >= 9 && !tags.iter().any(|t| b[5..9] == t.to_le_bytes()));
        let r = match whole_frame(b, LIMIT) {
            _ if stranger => Read::Drop,
            Err(_) => Read::Drop,
            Ok(true) => {
                let len = u32::from_le_bytes(b[..4].try_into().expect("4 bytes")) as usize;
                Read::Frame(b[4], b[5..4 + len].to_vec())
            }
            Ok(false) if bad.is_some() || self.since.elapsed() > SILENT_FOR => Read::Drop,
            Ok(false) => Read::Wait,
        };
        (r, got)
    }
}

/// A control port as its reader sees it: connections accepted as they come (at most
/// [`MAX_PENDING`] waiting for the rest of their frame; past it the oldest is closed), each read as it is accepted (a rank writes its frame as it connects) and its one
/// frame taken; a caller whose first bytes are not a plausible frame of this group's agreement
/// is closed at once, never fatal.
#[derive(Default)]
pub(crate) struct Door {
    callers: Vec<Caller>,
}

impl Door {
    /// The frames (kind, body) whole since the last call at `listener` (non-blocking), of a
    /// kind `kinds` admits and tagged one of `tags`, and whether anything came.
    pub(crate) fn poll(
        &mut self,
        listener: &TcpListener,
        tags: &[u32],
        kinds: fn(u8) -> bool,
    ) -> (Vec<(u8, Vec<u8>)>, bool) {
        let mut busy = false;
        let mut frames = Vec::new();
        // Bounded per call: a flood cannot keep the caller from its deadline.
        for _ in 0..MAX_PENDING {
            if self.callers.len() >= MAX_PENDING {
                // Full: the oldest is closed (a flood of callers that send a byte each cannot
                // hold the port).
                let cs = &self.callers;
                if let Some(i) = (0..cs.len()).min_by_key(|&i| cs[i].since) {
                    self.callers.swap_remove(i);
                }
            }
            let Ok((s, _)) = listener.accept() else {
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
            match c.read(tags, kinds).0 {
                Read::Frame(kind, m) => frames.push((kind, m)),
                Read::Drop => {}
                Read::Wait => self.callers.push(c),
            }
        }
        let mut i = 0;
        while i < self.callers.len() {
            let (r, got) = self.callers[i].read(tags, kinds);
            busy |= got;
            match r {
                Read::Wait => i += 1,
                Read::Drop => {
                    self.callers.swap_remove(i);
                }
                Read::Frame(kind, m) => {
                    self.callers.swap_remove(i);
                    frames.push((kind, m));
                }
            }
        }
        (frames, busy)
    }
}
