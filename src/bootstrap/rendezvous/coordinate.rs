//! Rank 0's side of the rendezvous: it accepts every connection, serves each as its bytes come
//! (bounded in count, bytes and time before authentication), acts on the admission verdict, and
//! once every rank is in sends each its table.

use super::admission::{Admission, Verdict};
use super::hand_out::{hand_out, Joined};
use super::hello::{decode_card, decode_hello, Card};
use super::outcome::{resolve, Rendezvous};
use crate::bootstrap::wire::auth::{mac, mac_ok, random, KEY};
use crate::bootstrap::wire::*;
use crate::config::Config;
use crate::error::{Error, Result};
use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// Longest a connection may take to send its HELLO.
pub(super) const HELLO_WITHIN: Duration = Duration::from_secs(10);
/// Unauthenticated connections held at once; past it, the oldest is closed for the newest.
const MAX_PENDING: usize = 1024;
/// The most bytes a HELLO may have where the job has a secret (the card comes after rank 0's
/// proof): fixed, whatever the world size.
const HELLO_BYTES: usize = 64 << 10;
/// The most bytes buffered for all unauthenticated connections together; past it, the oldest
/// are closed.
const PENDING_BYTES: usize = 64 << 20;

/// A connection to rank 0 whose HELLO is still coming.
struct Pending {
    sock: TcpStream,
    from: SocketAddr,
    buf: Vec<u8>,
    nonce: [u8; KEY],
    until: Instant,
}

/// Connections rank 0 ignored, each logged (thinned out when many) and remembered for a
/// time-out's words.
#[derive(Default)]
struct Strays(Vec<String>);

impl Strays {
    fn note(&mut self, from: SocketAddr, what: &str) {
        let line = format!("{from}: {what}");
        static SAID: crate::diag::Repeated = crate::diag::Repeated::new();
        if let Some(before) = SAID.allow() {
            log::warn!(
                "ignored a connection to the rendezvous from {line} ({before} ignored before)"
            );
        }
        if self.0.len() < 8 {
            self.0.push(line);
        }
    }

    fn said(&self) -> String {
        if self.0.is_empty() {
            String::new()
        } else {
            format!(" (connections ignored meanwhile: {})", self.0.join("; "))
        }
    }
}

/// The most bytes a card of a world of `n` may have (and a HELLO that carries one, without a
/// secret).
fn card_limit(n: usize) -> usize {
    HELLO_BYTES + n.saturating_mul(256)
}

/// Closes the oldest unauthenticated connection (to make room for a newer one), noting why.
fn evict_oldest(pending: &mut Vec<Pending>, strays: &mut Strays, why: &str) {
    if let Some(i) = (0..pending.len()).min_by_key(|&i| pending[i].until) {
        let p = pending.swap_remove(i);
        strays.note(p.from, why);
    }
}

/// Whether `accept` failed for want of a descriptor or of kernel memory (then accepting pauses
/// instead of ending the rendezvous).
fn out_of_descriptors(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    ) || e.kind() == ErrorKind::ConnectionAborted
}

/// Why rank 0 meets the group only to refuse it.
#[derive(Clone, Copy)]
pub(crate) enum Stop<'a> {
    /// Its configuration is bad (this text).
    Config(&'a str),
    /// The group cannot form, for this reason (a grow whose newcomers did not all come); rank 0
    /// returns once ranks below the count (the members, which all come) were told.
    Group(&'a str, usize),
}

/// Rank 0's side. With `stop`, every rank that joins is refused with it.
pub(super) fn coordinate(
    cfg: &Config,
    card: &Card,
    deadline: Instant,
    listener: Option<TcpListener>,
    stop: Option<Stop>,
) -> Result<Rendezvous> {
    let sa = resolve(&cfg.coordinator)?;
    let listener = open(sa, listener)?;
    // Rank 0's control port (`Control`), beside the coordinator's; it is no condition of the
    // group forming (a rank without one is skipped as a shrink's coordinator).
    let control = if stop.is_none() {
        open_control(cfg, sa)
    } else {
        None
    };
    let ours = cfg.shared_settings();
    let mut g = Gathering::new(cfg, sa, &ours, stop);
    loop {
        match g.settled(deadline, stop) {
            Some(Ok(())) => break,
            Some(Err(e)) => return Err(e),
            None => {}
        }
        let mut busy = g.accept(&listener)?;
        busy |= g.read_hellos();
        busy |= g.read_cards();
        if !busy {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    hand_out(cfg, card, sa, control, g.joined, g.secret, deadline)
}

/// Rank 0's listener at the coordinator address `sa` (or the one given), non-blocking.
fn open(sa: SocketAddr, listener: Option<TcpListener>) -> Result<TcpListener> {
    let listener = match listener {
        Some(l) => l,
        None => listen(sa).map_err(|e| {
            Error::Bootstrap(format!(
                "rank 0 cannot listen on {sa}: {e}{}",
                if e.kind() == ErrorKind::AddrInUse {
                    " (the coordinator port is already in use: pick another MASTER_PORT / \
                     RDMACOMM_COORDINATOR)"
                } else {
                    ""
                }
            ))
        })?,
    };
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// Rank 0's control port (and its number), beside `sa` or on the bound address; none (said at
/// `warn`) where it cannot listen.
fn open_control(cfg: &Config, sa: SocketAddr) -> Option<(TcpListener, u16)> {
    let mut at = match &cfg.bind_addr {
        Some(a) => a
            .parse::<std::net::IpAddr>()
            .map_or(sa, |ip| SocketAddr::new(ip, 0)),
        None => sa,
    };
    at.set_port(0);
    listen(at)
        .and_then(|l| Ok((l.local_addr()?.port(), l)))
        .map(|(p, l)| (l, p))
        .map_err(|e| log::warn!("rank 0 has no control port: {e}"))
        .ok()
}

/// Rank 0's rendezvous while the ranks come: the connections whose HELLO is coming, the ranks
/// in, the judge, and who has been told that the group cannot form.
struct Gathering<'a> {
    cfg: &'a Config,
    n: usize,
    sa: SocketAddr,
    secret: Option<&'a [u8]>,
    pending: Vec<Pending>,
    joined: Vec<Option<Joined>>,
    strays: Strays,
    adm: Admission<'a>,
    told: Vec<bool>,
    /// Ranks below this must be told before rank 0 returns a refusal.
    to_tell: usize,
}

impl<'a> Gathering<'a> {
    fn new(cfg: &'a Config, sa: SocketAddr, ours: &'a str, stop: Option<Stop>) -> Self {
        let n = cfg.world_size;
        let secret = cfg.secret.as_ref().map(|s| s.bytes());
        // Once the group cannot form, every rank still to come is told why as it arrives, so
        // none waits out its timeout; rank 0 returns when all were told or at the deadline.
        let mut adm = Admission::new(n, &cfg.job_id, secret.is_some(), ours);
        adm.fatal = stop.map(|s| match s {
            Stop::Config(e) => format!("rank 0's configuration is invalid: {e}"),
            Stop::Group(why, _) => why.to_string(),
        });
        let mut told = vec![false; n];
        told[0] = true;
        Gathering {
            cfg,
            n,
            sa,
            secret,
            pending: Vec::new(),
            joined: (0..n).map(|_| None).collect(),
            strays: Strays::default(),
            adm,
            told,
            // Who must hear it before rank 0 returns: a newcomer that never came is not waited
            // for.
            to_tell: match stop {
                Some(Stop::Group(_, members)) => members.min(n),
                _ => n,
            },
        }
    }

    /// Whether the rendezvous is over: every rank in (`Ok`), or refused or timed out (`Err`,
    /// every rank in told why).
    fn settled(&mut self, deadline: Instant, stop: Option<Stop>) -> Option<Result<()>> {
        let count = self
            .joined
            .iter()
            .flatten()
            .filter(|j| j.awaiting.is_none())
            .count();
        if self.adm.fatal.is_none() && count == self.n - 1 {
            // A rank whose connection died while it waited (it may be restarted) is not in.
            let mut dead = false;
            for (r, slot) in self.joined.iter_mut().enumerate() {
                if slot.as_ref().is_some_and(|j| peer_closed(&j.sock)) {
                    log::warn!(
                        "rank {r} left the rendezvous before the group formed; waiting for it to \
                         join again"
                    );
                    *slot = None;
                    dead = true;
                }
            }
            if !dead {
                return Some(Ok(()));
            }
        }
        if let Some(f) = &self.adm.fatal {
            if self.told[..self.to_tell].iter().all(|&t| t) || Instant::now() >= deadline {
                return Some(Err(match stop {
                    Some(Stop::Config(e)) => Error::Config(e.to_string()),
                    _ => Error::Bootstrap(f.clone()),
                }));
            }
        }
        if Instant::now() >= deadline {
            let missing: Vec<usize> = (1..self.n).filter(|&r| self.joined[r].is_none()).collect();
            let reason = format!(
                "rank(s) {missing:?} of {} never joined at {} within {:?}{}",
                self.n,
                self.cfg.coordinator,
                self.cfg.timeout,
                self.strays.said()
            );
            for j in self.joined.iter_mut().flatten() {
                let _ = j.sock.set_write_timeout(Some(Duration::from_secs(1)));
                let _ = send_frame(&j.sock, ABORT, reason.as_bytes());
            }
            return Some(Err(Error::Bootstrap(reason)));
        }
        None
    }

    /// New connections: greeted with a challenge, then served as their bytes come; whether
    /// any came.
    fn accept(&mut self, listener: &TcpListener) -> Result<bool> {
        let mut busy = false;
        // When MAX_PENDING are held, the oldest makes room (idle strangers cannot keep a rank
        // out).
        let mut accepted = 0;
        while accepted < MAX_PENDING {
            match listener.accept() {
                Ok((s, from)) => {
                    busy = true;
                    accepted += 1;
                    if self.pending.len() >= MAX_PENDING {
                        evict_oldest(
                            &mut self.pending,
                            &mut self.strays,
                            "closed unauthenticated: oldest of too many",
                        );
                    }
                    let nonce = random::<KEY>();
                    let _ = s.set_nodelay(true);
                    let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
                    if send_frame(&s, CHALLENGE, &nonce).is_err()
                        || s.set_nonblocking(true).is_err()
                    {
                        self.strays.note(from, "closed before the challenge");
                        continue;
                    }
                    self.pending.push(Pending {
                        sock: s,
                        from,
                        buf: Vec::new(),
                        nonce,
                        until: Instant::now() + HELLO_WITHIN,
                    });
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if out_of_descriptors(&e) => {
                    // Pause: the oldest unauthenticated connection gives its descriptor back.
                    static SAID: crate::diag::Repeated = crate::diag::Repeated::new();
                    if let Some(before) = SAID.allow() {
                        log::warn!(
                            "accept on {}: {e}; closing the oldest unauthenticated \
                             connection and pausing ({before} times before)",
                            self.sa
                        );
                    }
                    evict_oldest(
                        &mut self.pending,
                        &mut self.strays,
                        "closed unauthenticated: no descriptor left",
                    );
                    break;
                }
                Err(e) => return Err(Error::Bootstrap(format!("accept on {}: {e}", self.sa))),
            }
        }
        Ok(busy)
    }

    /// Reads what each connection has sent; a whole HELLO is judged at once. Whether any came.
    fn read_hellos(&mut self) -> bool {
        let mut busy = false;
        let hello_limit = if self.secret.is_some() {
            HELLO_BYTES
        } else {
            card_limit(self.n)
        };
        // Read what each has sent; a whole HELLO is judged at once.
        let mut i = 0;
        while i < self.pending.len() {
            let p = &mut self.pending[i];
            let (moved, mut gone) = read_some(&p.sock, &mut p.buf, hello_limit);
            busy |= moved;
            let whole = match whole_frame(&p.buf, hello_limit) {
                Ok(w) => w,
                Err(why) => {
                    gone = gone.or(Some(why));
                    false
                }
            };
            if gone.is_none() && !whole && Instant::now() < p.until {
                i += 1;
                continue;
            }
            let p = self.pending.swap_remove(i);
            if !whole {
                self.strays
                    .note(p.from, gone.unwrap_or("sent no hello within 10 s"));
                continue;
            }
            admit(
                p,
                self.secret,
                &mut self.adm,
                &mut self.joined,
                &mut self.strays,
                &mut self.told,
            );
        }
        while self.pending.iter().map(|p| p.buf.capacity()).sum::<usize>() > PENDING_BYTES {
            evict_oldest(
                &mut self.pending,
                &mut self.strays,
                "closed unauthenticated: too many bytes held",
            );
        }
        busy
    }

    /// With a secret, the cards of ranks that took rank 0's proof; whether any came.
    fn read_cards(&mut self) -> bool {
        let mut busy = false;
        if let Some(k) = self.secret {
            for (r, slot) in self.joined.iter_mut().enumerate() {
                let Some(j) = slot.as_mut() else {
                    continue;
                };
                let Some((buf, challenge, until)) = j.awaiting.as_mut() else {
                    continue;
                };
                let _ = j.sock.set_nonblocking(true);
                let (moved, mut gone) = read_some(&j.sock, buf, card_limit(self.n));
                busy |= moved;
                let mut card = None;
                match whole_frame(buf, card_limit(self.n)) {
                    Ok(true) => {
                        let frame = &buf[5..];
                        card = (buf[4] == CARD && frame.len() >= KEY)
                            .then(|| frame.split_at(frame.len() - KEY))
                            .filter(|(body, tag)| mac_ok(k, &[b"card", &challenge[..], body], tag))
                            .and_then(|(body, _)| decode_card(body, self.n));
                        gone = gone.or(card.is_none().then_some("a bad card"));
                    }
                    Ok(false) if gone.is_none() && Instant::now() < *until => continue,
                    Ok(false) => gone = gone.or(Some("sent no card within 10 s")),
                    Err(why) => gone = gone.or(Some(why)),
                }
                if let Some(c) = card {
                    j.hello.card = c;
                    j.awaiting = None;
                    let _ = j.sock.set_nonblocking(false);
                } else {
                    // It may join again (a restarted rank).
                    let why = gone.unwrap_or("a bad card");
                    self.strays.note(
                        j.sock.peer_addr().unwrap_or(self.sa),
                        &format!("rank {r} authenticated, then {why}"),
                    );
                    *slot = None;
                }
            }
        }
        busy
    }
}

/// Acts on rank 0's verdict ([`Admission::judge`]) on the whole HELLO of `p`: a stranger is
/// refused, noted and closed; a rank of this job joins (with a secret, once rank 0 proved it);
/// a conflict inside the job ends the rendezvous, and every rank that joined is told.
fn admit(
    mut p: Pending,
    secret: Option<&[u8]>,
    adm: &mut Admission,
    joined: &mut [Option<Joined>],
    strays: &mut Strays,
    told: &mut [bool],
) {
    let n = joined.len();
    let len = u32::from_le_bytes(p.buf[..4].try_into().expect("4 bytes")) as usize;
    let frame = &p.buf[4..4 + len];
    if frame[0] != HELLO || frame.len() < 1 + KEY {
        strays.note(p.from, "not a hello");
        return;
    }
    let (body, tag) = frame[1..].split_at(frame.len() - 1 - KEY);
    let Some(mut h) = decode_hello(body) else {
        strays.note(p.from, "a malformed hello");
        return;
    };
    let _ = p.sock.set_nonblocking(false);
    let _ = p.sock.set_write_timeout(Some(Duration::from_secs(1)));
    let refuse = |s: &mut TcpStream, why: &str| {
        let _ = send_frame(s, REJECT, why.as_bytes());
    };
    let authentic = secret.map_or(true, |k| mac_ok(k, &[&p.nonce, body], tag));
    let addr = if h.addr.is_empty() {
        p.from.ip().to_string()
    } else {
        h.addr.clone()
    };
    let rank = h.rank;
    if let Some(old) = joined.get(rank).and_then(|j| j.as_ref()) {
        if adm.of_this_job(&h, authentic) && peer_closed(&old.sock) {
            // A restarted rank: its first connection is dead, the new one takes its place.
            log::warn!("rank {rank} joined again from {addr}; its first connection was closed");
            joined[rank] = None;
        }
    }
    let taken_by = joined
        .get(rank)
        .and_then(|j| j.as_ref())
        .map(|j| j.hello.addr.clone());
    match adm.judge(&h, authentic, &addr, taken_by.as_deref()) {
        Verdict::Stray { reply, note } => {
            refuse(&mut p.sock, &reply);
            strays.note(p.from, &note);
        }
        Verdict::Told(why) => {
            refuse(&mut p.sock, &why);
            if rank < n {
                told[rank] = true;
            }
        }
        Verdict::Fatal(reason) => {
            refuse(&mut p.sock, &reason);
            for (r, j) in joined.iter_mut().enumerate() {
                if let Some(j) = j.take() {
                    let s = j.sock;
                    let _ = send_frame(&s, ABORT, reason.as_bytes());
                    told[r] = true;
                }
            }
            if rank < n {
                told[rank] = true;
            }
        }
        Verdict::Join => {
            h.addr = addr;
            // With a secret, rank 0 proves it before the rank sends its card.
            let awaiting = match secret {
                Some(k) => {
                    let proof = mac(k, &[b"rank 0", &h.nonce, &p.nonce]);
                    if send_frame(&p.sock, PROOF, &proof).is_err()
                        || p.sock.set_nonblocking(true).is_err()
                    {
                        strays.note(p.from, &format!("rank {rank} closed before rank 0's proof"));
                        return;
                    }
                    Some((Vec::new(), p.nonce, Instant::now() + HELLO_WITHIN))
                }
                None => None,
            };
            joined[rank] = Some(Joined {
                sock: p.sock,
                hello: h,
                awaiting,
            });
        }
    }
}
