//! The rendezvous: how the ranks of a job find each other through rank 0, and how strangers are
//! kept out of it.
//!
//! Rank 0 listens at the coordinator address and greets every connection with a challenge (a
//! random nonce). A rank answers with its HELLO: protocol version, job identity, rank, world size,
//! its card, the settings every rank must share, a configuration error if it has one, its own
//! nonce, and (with a shared secret) an HMAC-SHA256 over the challenge and all of that. With a
//! secret the card waits: rank 0 first proves the secret (a MAC over the joiner's nonce), so a
//! process that took rank 0's port learns nothing of a rank's memory or queue pairs. Each
//! connection has its own deadline and is served as its bytes arrive, so idle or slow strangers
//! starve nobody; anything that is not a well-formed HELLO of this job is closed and reported once
//! in the log, and the rendezvous goes on. Only conflicts inside the job end it: a rank twice with
//! both connections alive, world sizes or shared settings that disagree, a rank whose
//! configuration is bad. Once every rank is in, rank 0 sends each one its table: a fresh session
//! key (which the data path's connections prove) and, of every rank, the address and the part of
//! its card meant for this rank (so a table grows with the world, not with its square), with an
//! HMAC over the joiner's nonce when there is a secret, so a joiner cannot be fooled by a fake
//! coordinator either.

use crate::bootstrap::discover::meeting_point;
use crate::bootstrap::wire::{put_bytes, CARD, CHALLENGE, PROOF};
use crate::bootstrap::{
    recv_frame, send_frame, send_frame_by, Reader, SideChannel, ABORT, HELLO, MAGIC, REJECT, TABLE,
    VERSION,
};
use crate::config::Config;
use crate::error::{Error, Result};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::io::{ErrorKind, Read};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Bytes of a nonce, a session key and a MAC.
pub const KEY: usize = 32;
/// Longest a connection may take to send its HELLO.
const HELLO_WITHIN: Duration = Duration::from_secs(10);
/// Unauthenticated connections held at once; past it, the oldest is closed for the newest.
const MAX_PENDING: usize = 1024;
/// The most bytes a HELLO may have where the job has a secret (the card comes after rank 0's
/// proof): fixed, whatever the world size.
const HELLO_BYTES: usize = 64 << 10;
/// The most bytes buffered for all unauthenticated connections together; past it, the oldest
/// are closed.
const PENDING_BYTES: usize = 64 << 20;

/// What a transport brings to the rendezvous: bytes for every peer (`common`) and, for each peer
/// in rank order, `entry` bytes meant for it alone (`each`, `n * entry` bytes).
#[derive(Debug, Clone, Default)]
pub struct Card {
    /// Bytes every rank receives.
    pub common: Vec<u8>,
    /// Bytes per peer in `each`.
    pub entry: usize,
    /// `entry` bytes for each rank, in rank order.
    pub each: Vec<u8>,
}

impl Card {
    /// What rank `to` receives of this card: the common bytes, then its entry.
    /// `None` where the card has no entry for `to` (a malformed card from a peer).
    pub fn for_rank(&self, to: usize) -> Option<Vec<u8>> {
        let start = to.checked_mul(self.entry)?;
        let entry = self.each.get(start..start.checked_add(self.entry)?)?;
        let mut v = self.common.clone();
        v.extend_from_slice(entry);
        Some(v)
    }
}

/// What the rendezvous returns: every rank's card as seen by this rank, its host address, the
/// session key and the side channel.
pub struct Rendezvous {
    /// Card of each rank (its common bytes, then its entry for this rank), by rank.
    pub cards: Vec<Vec<u8>>,
    /// Host address of each rank, by rank.
    pub addrs: Vec<String>,
    /// The group's session key: the data path's connections prove it.
    pub session: [u8; KEY],
    /// The connections, kept open.
    pub side: SideChannel,
}

/// HMAC-SHA256 of `parts` under `key`.
pub fn mac(key: &[u8], parts: &[&[u8]]) -> [u8; KEY] {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes any key length");
    for p in parts {
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

/// Whether `tag` is the HMAC of `parts` under `key` (in constant time).
pub fn mac_ok(key: &[u8], parts: &[&[u8]], tag: &[u8]) -> bool {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes any key length");
    for p in parts {
        m.update(p);
    }
    m.verify_slice(tag).is_ok()
}

/// `N` random bytes from the kernel.
pub fn random<const N: usize>() -> [u8; N] {
    crate::sys::random()
}

/// The coordinator's socket address (IPv6 literals in brackets).
pub fn resolve(addr: &str) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .map_err(|e| Error::Config(format!("coordinator address {addr:?}: {e}")))?
        .next()
        .ok_or_else(|| Error::Config(format!("coordinator address {addr:?} resolves to nothing")))
}

/// Joins the group: exchanges `card` with every rank through rank 0 (found as
/// [`crate::config::Discovery`] says).
pub fn rendezvous(cfg: &Config, card: &Card) -> Result<Rendezvous> {
    let mut meet = meeting_point(cfg)?;
    let listener = meet.listener.take();
    rendezvous_on(&meet.cfg, card, listener)
}

/// [`rendezvous`], with rank 0 accepting on `listener` when given (already bound, so its
/// address could be shared beforehand).
pub fn rendezvous_on(
    cfg: &Config,
    card: &Card,
    listener: Option<TcpListener>,
) -> Result<Rendezvous> {
    let deadline = Instant::now() + cfg.timeout;
    if !proven(cfg) {
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            log::info!(
                "this job has no identity (RDMACOMM_JOB_ID, or a launcher's job id) and no \
                 secret (RDMACOMM_SECRET): a rank of another job that reaches {} is refused only \
                 where its call differs, and one that claims a free rank first takes its place; \
                 set either for a shared cluster (rdmacomm-run sets both)",
                cfg.coordinator
            )
        });
    }
    if cfg.rank == 0 {
        coordinate(cfg, card, deadline, listener, None)
    } else {
        join(cfg, card, deadline, None)
    }
}

/// Whether a joiner that passes rank 0's checks is known to be of this job: the job has an
/// identity, or a secret the joiner proved. Only such a joiner's conflict (another world size,
/// a rank taken twice, other settings) ends the rendezvous; otherwise it may be another job's
/// rank, which is refused and noted, never fatal.
fn proven(cfg: &Config) -> bool {
    !cfg.job_id.is_empty() || cfg.secret.is_some()
}

/// Joins the rendezvous only to tell the group that this rank's configuration is bad (`why`),
/// so that every rank fails at once naming it instead of waiting for a rank that never comes.
pub fn refuse(cfg: &Config, why: &str) {
    let deadline = Instant::now() + cfg.timeout;
    let card = Card::default();
    let Ok(mut meet) = meeting_point(cfg) else {
        return;
    };
    let _ = if cfg.rank == 0 {
        coordinate(&meet.cfg, &card, deadline, meet.listener.take(), Some(why)).map(|_| ())
    } else {
        join(&meet.cfg, &card, deadline, Some(why)).map(|_| ())
    };
}

/// A HELLO, as read.
struct Hello {
    version: u16,
    job: String,
    rank: usize,
    size: usize,
    card: Card,
    addr: String,
    settings: String,
    error: String,
    nonce: [u8; KEY],
}

fn encode_hello(cfg: &Config, card: &Card, error: &str, nonce: &[u8; KEY]) -> Vec<u8> {
    let mut h = Vec::new();
    h.extend_from_slice(&(MAGIC ^ VERSION as u32).to_le_bytes());
    put_bytes(&mut h, cfg.job_id.as_bytes());
    h.extend_from_slice(&(cfg.rank as u32).to_le_bytes());
    h.extend_from_slice(&(cfg.world_size as u32).to_le_bytes());
    put_bytes(&mut h, &card.common);
    h.extend_from_slice(&(card.entry as u32).to_le_bytes());
    put_bytes(&mut h, &card.each);
    put_bytes(&mut h, cfg.bind_addr.as_deref().unwrap_or("").as_bytes());
    put_bytes(&mut h, cfg.shared_settings().as_bytes());
    put_bytes(&mut h, error.as_bytes());
    h.extend_from_slice(nonce);
    h
}

/// Reads a HELLO body (without its MAC); `None` for bytes that are not one (of any version:
/// `Some` with another `version` when only the version differs).
fn decode_hello(b: &[u8]) -> Option<Hello> {
    let mut r = Reader(b);
    let magic = r.u32().ok()?;
    if magic & 0xffff_0000 != MAGIC & 0xffff_0000 {
        return None;
    }
    let version = (magic ^ MAGIC) as u16;
    let blank = || Hello {
        version,
        job: String::new(),
        rank: 0,
        size: 0,
        card: Card::default(),
        addr: String::new(),
        settings: String::new(),
        error: String::new(),
        nonce: [0; KEY],
    };
    if version != VERSION {
        return Some(blank());
    }
    let job = String::from_utf8_lossy(r.bytes().ok()?).into_owned();
    let (rank, size) = (r.u32().ok()? as usize, r.u32().ok()? as usize);
    let common = r.bytes().ok()?.to_vec();
    let entry = r.u32().ok()? as usize;
    let each = r.bytes().ok()?.to_vec();
    if entry.checked_mul(size)? != each.len() {
        return None;
    }
    let addr = String::from_utf8_lossy(r.bytes().ok()?).into_owned();
    let settings = String::from_utf8_lossy(r.bytes().ok()?).into_owned();
    let error = String::from_utf8_lossy(r.bytes().ok()?).into_owned();
    let nonce = r.take(KEY).ok()?.try_into().ok()?;
    if !r.0.is_empty() {
        return None;
    }
    Some(Hello {
        job,
        rank,
        size,
        card: Card {
            common,
            entry,
            each,
        },
        addr,
        settings,
        error,
        nonce,
        ..blank()
    })
}

/// The first `NAME=value` word of `theirs` that differs from `ours`, with ours.
fn first_difference(theirs: &str, ours: &str) -> Option<(String, String)> {
    let mine: Vec<&str> = ours.split_whitespace().collect();
    for w in theirs.split_whitespace() {
        let name = w.split('=').next().unwrap_or(w);
        let our = mine
            .iter()
            .find(|m| m.split('=').next() == Some(name))
            .copied()
            .unwrap_or("(unset)");
        if our != w {
            return Some((w.to_string(), our.to_string()));
        }
    }
    (theirs.split_whitespace().count() != mine.len())
        .then(|| (theirs.to_string(), ours.to_string()))
}

/// A connection to rank 0 whose HELLO is still coming.
struct Pending {
    sock: TcpStream,
    from: SocketAddr,
    buf: Vec<u8>,
    nonce: [u8; KEY],
    until: Instant,
}

/// A rank that joined.
struct Joined {
    sock: TcpStream,
    hello: Hello,
    /// With a secret, until its card came: the bytes so far, rank 0's challenge, a deadline.
    awaiting: Option<(Vec<u8>, [u8; KEY], Instant)>,
}

/// Reads what `sock` (non-blocking) has into `buf`, up to a frame of `limit` bytes: whether
/// anything came, and why the connection is no use if it is not.
fn read_some(
    sock: &mut TcpStream,
    buf: &mut Vec<u8>,
    limit: usize,
) -> (bool, Option<&'static str>) {
    let mut chunk = [0u8; 4096];
    let mut busy = false;
    loop {
        match sock.read(&mut chunk) {
            Ok(0) => return (busy, Some("closed without a hello")),
            Ok(k) => {
                busy = true;
                buf.extend_from_slice(&chunk[..k]);
                if buf.len() > 4 + limit {
                    return (busy, Some("sent more than a hello"));
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => return (busy, None),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return (busy, Some("connection failed")),
        }
    }
}

/// Whether `buf` holds a whole frame of at most `limit` bytes (an error for a bad length).
fn whole_frame(buf: &[u8], limit: usize) -> std::result::Result<bool, &'static str> {
    if buf.len() < 4 {
        return Ok(false);
    }
    let len = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
    if len == 0 || len > limit {
        return Err("a malformed frame");
    }
    Ok(buf.len() >= 4 + len)
}

fn encode_card(card: &Card) -> Vec<u8> {
    let mut v = Vec::new();
    put_bytes(&mut v, &card.common);
    v.extend_from_slice(&(card.entry as u32).to_le_bytes());
    put_bytes(&mut v, &card.each);
    v
}

fn decode_card(b: &[u8], n: usize) -> Option<Card> {
    let mut r = Reader(b);
    let common = r.bytes().ok()?.to_vec();
    let entry = r.u32().ok()? as usize;
    let each = r.bytes().ok()?.to_vec();
    (r.0.is_empty() && entry.checked_mul(n)? == each.len()).then_some(Card {
        common,
        entry,
        each,
    })
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

/// Whether the other end of `s` has closed it (a restarted rank's old connection).
fn closed(s: &TcpStream) -> bool {
    let mut b = [0u8; 1];
    let _ = s.set_nonblocking(true);
    let dead = match s.peek(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != ErrorKind::WouldBlock,
    };
    let _ = s.set_nonblocking(false);
    dead
}

/// Rank 0's side. With `own_error` (this rank's configuration is bad), every rank that joins is
/// refused with it.
fn coordinate(
    cfg: &Config,
    card: &Card,
    deadline: Instant,
    listener: Option<TcpListener>,
    own_error: Option<&str>,
) -> Result<Rendezvous> {
    let n = cfg.world_size;
    let sa = resolve(&cfg.coordinator)?;
    let listener = match listener {
        Some(l) => l,
        None => TcpListener::bind(sa).map_err(|e| {
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
    let secret = cfg.secret.as_ref().map(|s| s.bytes());
    let ours = cfg.shared_settings();
    let mut pending: Vec<Pending> = Vec::new();
    let mut joined: Vec<Option<Joined>> = (0..n).map(|_| None).collect();
    let mut strays = Strays::default();
    // Once the group cannot form, every rank still to come is told why as it arrives, so none
    // waits out its timeout; rank 0 returns when all were told or at the deadline.
    let mut fatal: Option<String> =
        own_error.map(|e| format!("rank 0's configuration is invalid: {e}"));
    let mut told = vec![false; n];
    told[0] = true;
    loop {
        let count = joined
            .iter()
            .flatten()
            .filter(|j| j.awaiting.is_none())
            .count();
        if fatal.is_none() && count == n - 1 {
            // A rank whose connection died while it waited (it may be restarted) is not in.
            let mut dead = false;
            for (r, slot) in joined.iter_mut().enumerate() {
                if slot.as_ref().is_some_and(|j| closed(&j.sock)) {
                    log::warn!(
                        "rank {r} left the rendezvous before the group formed; waiting for it to \
                         join again"
                    );
                    *slot = None;
                    dead = true;
                }
            }
            if !dead {
                break;
            }
        }
        if let Some(f) = &fatal {
            if told.iter().all(|&t| t) || Instant::now() >= deadline {
                return Err(match own_error {
                    Some(e) => Error::Config(e.to_string()),
                    None => Error::Bootstrap(f.clone()),
                });
            }
        }
        if Instant::now() >= deadline {
            let missing: Vec<usize> = (1..n).filter(|&r| joined[r].is_none()).collect();
            let reason = format!(
                "rank(s) {missing:?} of {n} never joined at {} within {:?}{}",
                cfg.coordinator,
                cfg.timeout,
                strays.said()
            );
            for j in joined.iter_mut().flatten() {
                let _ = j.sock.set_write_timeout(Some(Duration::from_secs(1)));
                let _ = send_frame(&mut j.sock, ABORT, reason.as_bytes());
            }
            return Err(Error::Bootstrap(reason));
        }
        let mut busy = false;
        // New connections: greeted with a challenge, then served as their bytes come; when
        // MAX_PENDING are held, the oldest makes room (idle strangers cannot keep a rank out).
        let mut accepted = 0;
        while accepted < MAX_PENDING {
            match listener.accept() {
                Ok((s, from)) => {
                    busy = true;
                    accepted += 1;
                    if pending.len() >= MAX_PENDING {
                        evict_oldest(
                            &mut pending,
                            &mut strays,
                            "closed unauthenticated: oldest of too many",
                        );
                    }
                    let nonce = random::<KEY>();
                    let _ = s.set_nodelay(true);
                    let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
                    let mut s = s;
                    if send_frame(&mut s, CHALLENGE, &nonce).is_err()
                        || s.set_nonblocking(true).is_err()
                    {
                        strays.note(from, "closed before the challenge");
                        continue;
                    }
                    pending.push(Pending {
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
                            "accept on {sa}: {e}; closing the oldest unauthenticated \
                             connection and pausing ({before} times before)"
                        );
                    }
                    evict_oldest(
                        &mut pending,
                        &mut strays,
                        "closed unauthenticated: no descriptor left",
                    );
                    break;
                }
                Err(e) => return Err(Error::Bootstrap(format!("accept on {sa}: {e}"))),
            }
        }
        let hello_limit = if secret.is_some() {
            HELLO_BYTES
        } else {
            card_limit(n)
        };
        // Read what each has sent; a whole HELLO is judged at once.
        let mut i = 0;
        while i < pending.len() {
            let p = &mut pending[i];
            let (moved, mut gone) = read_some(&mut p.sock, &mut p.buf, hello_limit);
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
            let p = pending.swap_remove(i);
            if !whole {
                strays.note(p.from, gone.unwrap_or("sent no hello within 10 s"));
                continue;
            }
            judge(
                p,
                n,
                &ours,
                secret,
                cfg,
                &mut joined,
                &mut strays,
                &mut fatal,
                &mut told,
            )?;
        }
        while pending.iter().map(|p| p.buf.capacity()).sum::<usize>() > PENDING_BYTES {
            evict_oldest(
                &mut pending,
                &mut strays,
                "closed unauthenticated: too many bytes held",
            );
        }
        // With a secret, the cards of ranks that took rank 0's proof.
        if let Some(k) = secret {
            for (r, slot) in joined.iter_mut().enumerate() {
                let Some(j) = slot.as_mut() else {
                    continue;
                };
                let Some((buf, challenge, until)) = j.awaiting.as_mut() else {
                    continue;
                };
                let _ = j.sock.set_nonblocking(true);
                let (moved, mut gone) = read_some(&mut j.sock, buf, card_limit(n));
                busy |= moved;
                let mut card = None;
                match whole_frame(buf, card_limit(n)) {
                    Ok(true) => {
                        let frame = &buf[5..];
                        card = (buf[4] == CARD && frame.len() >= KEY)
                            .then(|| frame.split_at(frame.len() - KEY))
                            .filter(|(body, tag)| mac_ok(k, &[b"card", &challenge[..], body], tag))
                            .and_then(|(body, _)| decode_card(body, n));
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
                    strays.note(
                        j.sock.peer_addr().unwrap_or(sa),
                        &format!("rank {r} authenticated, then {why}"),
                    );
                    *slot = None;
                }
            }
        }
        if !busy {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    // Every rank is in: each gets its own table.
    let session = random::<KEY>();
    let mut full: Vec<Card> = vec![card.clone()];
    let mut addrs: Vec<String> = vec![cfg.bind_addr.clone().unwrap_or_else(|| sa.ip().to_string())];
    let mut socks: Vec<(TcpStream, [u8; KEY])> = Vec::with_capacity(n - 1);
    for j in joined.into_iter().skip(1) {
        let j = j.expect("every rank joined");
        full.push(j.hello.card);
        addrs.push(j.hello.addr);
        socks.push((j.sock, j.hello.nonce));
    }
    // Every card was checked for n entries (decode_card; ours is the transport's own).
    let no_entry =
        |q: usize, r: usize| Error::Bootstrap(format!("rank {q}'s card has no entry for rank {r}"));
    let cards: Vec<Vec<u8>> = (0..n)
        .map(|q| full[q].for_rank(0).ok_or_else(|| no_entry(q, 0)))
        .collect::<Result<_>>()?;
    let mut streams: Vec<Option<TcpStream>> = vec![None];
    for (i, (mut sock, nonce)) in socks.into_iter().enumerate() {
        let r = i + 1;
        let mut table = Vec::new();
        table.extend_from_slice(&session);
        for q in 0..n {
            put_bytes(&mut table, addrs[q].as_bytes());
            let entry = full[q].for_rank(r).ok_or_else(|| no_entry(q, r))?;
            put_bytes(&mut table, &entry);
        }
        let tag = secret.map_or([0; KEY], |k| mac(k, &[&nonce, &table]));
        table.extend_from_slice(&tag);
        sock.set_nonblocking(false)?;
        // A joiner that stops reading cannot hold rank 0 past its deadline.
        let by = deadline.max(Instant::now() + Duration::from_secs(1));
        send_frame_by(&mut sock, TABLE, &table, by).map_err(|e| Error::PeerFailed {
            peer: crate::Peer {
                rank: r,
                addr: addrs[r].clone(),
            },
            reason: format!("sending its table: {e} (it stopped reading?)"),
        })?;
        sock.set_write_timeout(None)?;
        streams.push(Some(sock));
    }
    Ok(Rendezvous {
        cards,
        addrs: addrs.clone(),
        session,
        side: SideChannel::new(0, streams, addrs, cfg.timeout),
    })
}

/// Judges a whole HELLO from `p`: a stranger is noted and closed; a rank of this job joins; a
/// conflict inside the job makes the group fail (`fatal`), and every rank is told.
#[allow(clippy::too_many_arguments)]
fn judge(
    mut p: Pending,
    n: usize,
    ours: &str,
    secret: Option<&[u8]>,
    cfg: &Config,
    joined: &mut [Option<Joined>],
    strays: &mut Strays,
    fatal: &mut Option<String>,
    told: &mut [bool],
) -> Result<()> {
    let len = u32::from_le_bytes(p.buf[..4].try_into().expect("4 bytes")) as usize;
    let frame = &p.buf[4..4 + len];
    if frame[0] != HELLO || frame.len() < 1 + KEY {
        strays.note(p.from, "not a hello");
        return Ok(());
    }
    let (body, tag) = frame[1..].split_at(frame.len() - 1 - KEY);
    let Some(h) = decode_hello(body) else {
        strays.note(p.from, "a malformed hello");
        return Ok(());
    };
    let _ = p.sock.set_nonblocking(false);
    let _ = p.sock.set_write_timeout(Some(Duration::from_secs(1)));
    let refuse = |s: &mut TcpStream, why: &str| {
        let _ = send_frame(s, REJECT, why.as_bytes());
    };
    if h.version != VERSION {
        refuse(&mut p.sock, "another rdmacomm protocol version");
        strays.note(
            p.from,
            &format!(
                "rdmacomm protocol version {} (this is {VERSION})",
                h.version
            ),
        );
        return Ok(());
    }
    if h.job != cfg.job_id {
        refuse(
            &mut p.sock,
            &format!("this coordinator runs another job ({:?})", cfg.job_id),
        );
        strays.note(p.from, &format!("a rank of another job ({:?})", h.job));
        return Ok(());
    }
    if let Some(k) = secret {
        if !mac_ok(k, &[&p.nonce, body], tag) {
            refuse(
                &mut p.sock,
                "authentication failed (RDMACOMM_SECRET differs?)",
            );
            strays.note(p.from, "failed authentication");
            return Ok(());
        }
    }
    let addr = if h.addr.is_empty() {
        p.from.ip().to_string()
    } else {
        h.addr.clone()
    };
    let rank = h.rank;
    if let Some(f) = fatal.as_ref() {
        refuse(&mut p.sock, f);
        if rank < n {
            told[rank] = true;
        }
        return Ok(());
    }
    if rank == 0 || rank >= n && h.size == n {
        strays.note(p.from, &format!("claims rank {rank}, not in 1..{n}"));
        refuse(&mut p.sock, &format!("rank {rank} is not in 1..{n}"));
        return Ok(());
    }
    if let Some(old) = joined.get(rank).and_then(|j| j.as_ref()) {
        if closed(&old.sock) {
            // A restarted rank: its first connection is dead, the new one takes its place.
            log::warn!("rank {rank} joined again from {addr}; its first connection was closed");
            joined[rank] = None;
        }
    }
    let problem = if h.size != n {
        Some(format!(
            "world size mismatch: rank {rank} at {addr} has world size {} but rank 0 has {n}; \
             every rank must be started with the same WORLD_SIZE",
            h.size
        ))
    } else if let Some(old) = joined[rank].as_ref() {
        Some(format!(
            "rank {rank} joined twice (from {} and from {addr}, both alive); each rank must be unique",
            old.hello.addr
        ))
    } else if !h.error.is_empty() {
        Some(format!(
            "rank {rank}'s configuration is invalid: {}",
            h.error
        ))
    } else if let Some((theirs, mine)) = first_difference(&h.settings, ours) {
        Some(format!(
            "rank {rank} ({addr}) has {theirs} but rank 0 has {mine}: set it alike everywhere"
        ))
    } else {
        None
    };
    if let Some(reason) = problem.as_ref().filter(|_| !proven(cfg)) {
        // Perhaps not this job's rank at all: it is told why, and the job waits on.
        refuse(&mut p.sock, reason);
        strays.note(
            p.from,
            &format!("{reason} (this job has no identity: ignored)"),
        );
        return Ok(());
    }
    if let Some(reason) = problem {
        refuse(&mut p.sock, &reason);
        for (r, j) in joined.iter_mut().enumerate() {
            if let Some(j) = j.take() {
                let mut s = j.sock;
                let _ = send_frame(&mut s, ABORT, reason.as_bytes());
                told[r] = true;
            }
        }
        if rank < n {
            told[rank] = true;
        }
        *fatal = Some(reason);
        return Ok(());
    }
    let mut h = h;
    h.addr = addr;
    // With a secret, rank 0 proves it before the rank sends its card.
    let awaiting = match secret {
        Some(k) => {
            let proof = mac(k, &[b"rank 0", &h.nonce, &p.nonce]);
            if send_frame(&mut p.sock, PROOF, &proof).is_err()
                || p.sock.set_nonblocking(true).is_err()
            {
                strays.note(p.from, &format!("rank {rank} closed before rank 0's proof"));
                return Ok(());
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
    Ok(())
}

/// A non-zero rank's side; with `own_error`, only to tell rank 0 that this rank's configuration
/// is bad.
fn join(
    cfg: &Config,
    card: &Card,
    deadline: Instant,
    own_error: Option<&str>,
) -> Result<Rendezvous> {
    let sa = resolve(&cfg.coordinator)?;
    let bind = match &cfg.bind_addr {
        Some(a) => Some(a.parse::<std::net::IpAddr>().map_err(|_| {
            Error::Config(format!("RDMACOMM_BIND_ADDR={a:?} is not an IP address"))
        })?),
        None => None,
    };
    let coord = crate::Peer {
        rank: 0,
        addr: sa.to_string(),
    };
    let connect = || -> std::io::Result<TcpStream> {
        let sock = socket2::Socket::new(
            socket2::Domain::for_address(sa),
            socket2::Type::STREAM,
            None,
        )?;
        if let Some(ip) = bind {
            sock.bind(&SocketAddr::new(ip, 0).into())?;
        }
        sock.connect_timeout(&sa.into(), Duration::from_secs(1))?;
        Ok(sock.into())
    };
    // Wait a little past our own deadline for the coordinator's verdict (which names the
    // missing ranks): it is sent at its deadline, which started no earlier than ours.
    let grace = (cfg.timeout / 4).max(Duration::from_secs(2));
    let (mut s, challenge) = loop {
        let attempt = connect().and_then(|mut s| {
            s.set_nodelay(true)?;
            // A listener that is not (yet) a coordinator sends no challenge: try again.
            let until = (Instant::now() + Duration::from_secs(2)).min(deadline + grace);
            match recv_frame(&mut s, until) {
                Ok((CHALLENGE, nonce)) if nonce.len() == KEY => Ok((s, nonce)),
                Ok((REJECT | ABORT, why)) => Err(std::io::Error::other(format!(
                    "refused: {}",
                    String::from_utf8_lossy(&why)
                ))),
                Ok(_) => Err(std::io::Error::other("no challenge")),
                Err(e) => Err(e),
            }
        });
        match attempt {
            Ok(x) => break x,
            Err(e) => {
                if Instant::now() >= deadline {
                    return Err(Error::Bootstrap(format!(
                        "rank {} could not reach the coordinator (rank 0) at {sa} within {:?}: {e}",
                        cfg.rank, cfg.timeout
                    )));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    };
    let nonce = random::<KEY>();
    let secret = cfg.secret.as_ref().map(|s| s.bytes());
    // With a secret, the card goes only to a rank 0 that proved it.
    let blank = Card::default();
    let body = encode_hello(
        cfg,
        if secret.is_some() { &blank } else { card },
        own_error.unwrap_or(""),
        &nonce,
    );
    let tag = secret.map_or([0; KEY], |k| mac(k, &[&challenge, &body]));
    let mut hello = body;
    hello.extend_from_slice(&tag);
    s.set_write_timeout(Some(Duration::from_secs(5)))?;
    send_frame(&mut s, HELLO, &hello).map_err(|e| Error::PeerFailed {
        peer: coord.clone(),
        reason: format!("sending hello: {e}"),
    })?;
    let refused = |body: &[u8]| {
        Error::Bootstrap(format!(
            "rank {}: the coordinator refused the group: {}",
            cfg.rank,
            String::from_utf8_lossy(body)
        ))
    };
    if let Some(k) = secret {
        let (kind, proof) =
            recv_frame(&mut s, deadline + grace).map_err(|e| Error::PeerFailed {
                peer: coord.clone(),
                reason: format!("waiting for rank 0's proof of the secret: {e}"),
            })?;
        match kind {
            PROOF if mac_ok(k, &[b"rank 0", &nonce, &challenge], &proof) => {}
            REJECT | ABORT => return Err(refused(&proof)),
            _ => {
                return Err(Error::Bootstrap(format!(
                    "rank {}: the coordinator at {sa} failed authentication (RDMACOMM_SECRET \
                     differs?); this rank's card was not sent",
                    cfg.rank
                )))
            }
        }
        let c = encode_card(card);
        let tag = mac(k, &[b"card", &challenge, &c]);
        let mut frame = c;
        frame.extend_from_slice(&tag);
        send_frame(&mut s, CARD, &frame).map_err(|e| Error::PeerFailed {
            peer: coord.clone(),
            reason: format!("sending its card: {e}"),
        })?;
    }
    let (kind, body) = recv_frame(&mut s, deadline + grace).map_err(|e| {
        if e.kind() == ErrorKind::TimedOut {
            Error::Bootstrap(format!(
                "rank {}: the coordinator {sa} did not complete the rendezvous within {:?} \
                 (some rank never joined?)",
                cfg.rank, cfg.timeout
            ))
        } else {
            Error::PeerFailed {
                peer: coord.clone(),
                reason: format!("waiting for the endpoint table: {e}"),
            }
        }
    })?;
    match kind {
        TABLE => {}
        REJECT | ABORT => return Err(refused(&body)),
        k => {
            return Err(Error::Bootstrap(format!(
                "unexpected message {k} from the coordinator"
            )))
        }
    }
    if body.len() < 2 * KEY {
        return Err(Error::Bootstrap(
            "a short table from the coordinator".into(),
        ));
    }
    let (table, tag) = body.split_at(body.len() - KEY);
    if let Some(k) = secret {
        if !mac_ok(k, &[&nonce, table], tag) {
            return Err(Error::Bootstrap(format!(
                "rank {}: the coordinator at {sa} failed authentication (RDMACOMM_SECRET differs?)",
                cfg.rank
            )));
        }
    }
    let mut r = Reader(table);
    let session: [u8; KEY] = r.take(KEY)?.try_into().expect("KEY bytes");
    let mut cards = Vec::with_capacity(cfg.world_size);
    let mut addrs = Vec::with_capacity(cfg.world_size);
    for _ in 0..cfg.world_size {
        addrs.push(String::from_utf8_lossy(r.bytes()?).into_owned());
        cards.push(r.bytes()?.to_vec());
    }
    let mut streams: Vec<Option<TcpStream>> = (0..cfg.world_size).map(|_| None).collect();
    s.set_write_timeout(None)?;
    streams[0] = Some(s);
    Ok(Rendezvous {
        cards,
        addrs: addrs.clone(),
        session,
        side: SideChannel::new(cfg.rank, streams, addrs, cfg.timeout),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hello_round_trips_and_garbage_is_no_hello() {
        let mut cfg = Config::defaults(3, 5, "127.0.0.1:1");
        cfg.job_id = "job-7".into();
        let card = Card {
            common: vec![1, 2, 3],
            entry: 2,
            each: (0..10).collect(),
        };
        let b = encode_hello(&cfg, &card, "", &[9; KEY]);
        let h = decode_hello(&b).expect("a hello");
        assert_eq!((h.version, h.rank, h.size), (VERSION, 3, 5));
        assert_eq!(h.job, "job-7");
        assert_eq!(h.card.for_rank(4), Some(vec![1, 2, 3, 8, 9]));
        assert_eq!(h.card.for_rank(5), None, "past the entries");
        assert_eq!(h.nonce, [9; KEY]);
        for cut in [0, 3, 4, 10, b.len() - 1] {
            assert!(decode_hello(&b[..cut]).is_none(), "cut at {cut}");
        }
        assert!(
            decode_hello(&[2, 0, 0, 0, 1, 0]).is_none(),
            "six stray bytes"
        );
        let mut other = b.clone();
        other[0] ^= 1; // another version
        assert_eq!(decode_hello(&other).map(|h| h.version), Some(VERSION ^ 1));
    }

    #[test]
    fn macs_bind_key_and_every_byte() {
        let t = mac(b"k", &[b"ab", b"c"]);
        assert!(mac_ok(b"k", &[b"abc"], &t));
        assert!(!mac_ok(b"K", &[b"abc"], &t));
        assert!(!mac_ok(b"k", &[b"abd"], &t));
        assert_ne!(random::<KEY>(), random::<KEY>());
    }
}
