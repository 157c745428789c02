//! TCP rendezvous: rank 0 accepts every rank, checks world sizes and ranks, and hands everyone
//! every rank's "card" (its queue pair endpoints and memory keys). The connections stay open as
//! the side channel (barrier now; health and abort use it too).

use crate::config::Config;
use crate::error::{Error, Result};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

const MAGIC: u32 = 0x5244_4d43; // "RDMC"
/// The wire protocol's version (2: TCP frames of whole 64-byte multiples), checked at the
/// rendezvous so that mixed builds fail with a clear error instead of misreading each other.
const VERSION: u16 = 2;
const HELLO: u8 = 1;
const REJECT: u8 = 2;
const TABLE: u8 = 3;
const READY: u8 = 4;
const GO: u8 = 5;
const ABORT: u8 = 6;
const BYE: u8 = 7;
const MAX_FRAME: usize = 64 << 20;

/// The open TCP connections: rank 0 holds one per other rank, every other rank one to rank 0.
pub struct SideChannel {
    rank: usize,
    streams: Vec<Option<TcpStream>>,
    addrs: Vec<String>,
    timeout: Duration,
    /// Bytes of a frame read so far, per stream (non-blocking mode).
    pending: Vec<Vec<u8>>,
    /// Ranks that said goodbye (their connection closing is then no failure).
    left: Vec<bool>,
    /// Close barrier: READY seen per rank (rank 0), GO seen (others).
    ready: Vec<bool>,
    go: bool,
    /// The first failure learned here: (failed rank, reason).
    failure: Option<(usize, String)>,
    abort_sent: bool,
}

/// What the rendezvous returns: every rank's card and host address, and the side channel.
pub struct Rendezvous {
    /// Card of each rank, by rank.
    pub cards: Vec<Vec<u8>>,
    /// Host address of each rank, by rank.
    pub addrs: Vec<String>,
    /// The connections, kept open.
    pub side: SideChannel,
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

/// A cursor over a received frame.
pub(crate) struct Reader<'a>(pub &'a [u8]);

impl<'a> Reader<'a> {
    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.0.len() < n {
            return Err(Error::Bootstrap(
                "truncated message from a peer (version mismatch?)".into(),
            ));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    pub(crate) fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    pub(crate) fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    pub(crate) fn bytes(&mut self) -> Result<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    fn string(&mut self) -> Result<String> {
        Ok(String::from_utf8_lossy(self.bytes()?).into_owned())
    }
}

fn send_frame(s: &mut TcpStream, kind: u8, body: &[u8]) -> std::io::Result<()> {
    let mut f = Vec::with_capacity(body.len() + 5);
    f.extend_from_slice(&(body.len() as u32 + 1).to_le_bytes());
    f.push(kind);
    f.extend_from_slice(body);
    s.write_all(&f)
}

fn recv_frame(s: &mut TcpStream, deadline: Instant) -> std::io::Result<(u8, Vec<u8>)> {
    let mut read_exact = |buf: &mut [u8]| -> std::io::Result<()> {
        let mut got = 0;
        while got < buf.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(std::io::Error::new(ErrorKind::TimedOut, "timed out"));
            }
            s.set_read_timeout(Some(left))?;
            match s.read(&mut buf[got..]) {
                Ok(0) => {
                    return Err(std::io::Error::new(
                        ErrorKind::UnexpectedEof,
                        "connection closed",
                    ))
                }
                Ok(n) => got += n,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return Err(std::io::Error::new(ErrorKind::TimedOut, "timed out"))
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    };
    let mut len = [0u8; 4];
    read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len == 0 || len > MAX_FRAME {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            format!("bad frame length {len}"),
        ));
    }
    let mut body = vec![0u8; len];
    read_exact(&mut body)?;
    let kind = body.remove(0);
    Ok((kind, body))
}

fn resolve(addr: &str) -> Result<std::net::SocketAddr> {
    addr.to_socket_addrs()
        .map_err(|e| Error::Config(format!("coordinator address {addr:?}: {e}")))?
        .next()
        .ok_or_else(|| Error::Config(format!("coordinator address {addr:?} resolves to nothing")))
}

/// Joins the group: exchanges `card` with every rank through rank 0.
pub fn rendezvous(cfg: &Config, card: &[u8]) -> Result<Rendezvous> {
    rendezvous_on(cfg, card, None)
}

/// [`rendezvous`], with rank 0 accepting on `listener` when given (already bound, so its
/// address could be shared beforehand).
pub fn rendezvous_on(
    cfg: &Config,
    card: &[u8],
    listener: Option<TcpListener>,
) -> Result<Rendezvous> {
    let deadline = Instant::now() + cfg.timeout;
    if cfg.rank == 0 {
        coordinate(cfg, card, deadline, listener)
    } else {
        join(cfg, card, deadline)
    }
}

fn coordinate(
    cfg: &Config,
    card: &[u8],
    deadline: Instant,
    listener: Option<TcpListener>,
) -> Result<Rendezvous> {
    let n = cfg.world_size;
    let sa = resolve(&cfg.coordinator)?;
    let listener = match listener {
        Some(l) => l,
        None => TcpListener::bind(sa).map_err(|e| {
        Error::Bootstrap(format!(
            "rank 0 cannot listen on {sa}: {e}{}",
            if e.kind() == ErrorKind::AddrInUse {
                " (the coordinator port is already in use: pick another MASTER_PORT / RDMACOMM_COORDINATOR)"
            } else {
                ""
            }
        ))
    })?,
    };

    listener.set_nonblocking(true)?;
    let mut streams: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
    let mut cards: Vec<Vec<u8>> = vec![Vec::new(); n];
    let mut addrs: Vec<String> = vec![String::new(); n];
    cards[0] = card.to_vec();
    addrs[0] = cfg.bind_addr.clone().unwrap_or_else(|| sa.ip().to_string());
    let mut joined = 1;
    let abort_all = |streams: &mut Vec<Option<TcpStream>>, reason: &str| {
        for s in streams.iter_mut().flatten() {
            let _ = send_frame(s, ABORT, reason.as_bytes());
        }
    };
    while joined < n {
        if Instant::now() >= deadline {
            let missing: Vec<usize> = (1..n).filter(|&r| streams[r].is_none()).collect();
            let reason = format!(
                "rank(s) {missing:?} of {n} never joined at {} within {:?}",
                cfg.coordinator, cfg.timeout
            );
            abort_all(&mut streams, &reason);
            return Err(Error::Bootstrap(reason));
        }
        let (mut s, from) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            Err(e) => return Err(Error::Bootstrap(format!("accept on {sa}: {e}"))),
        };
        s.set_nonblocking(false)?;
        s.set_nodelay(true)?;
        let hello_deadline = deadline.min(Instant::now() + Duration::from_secs(10));
        let Ok((HELLO, body)) = recv_frame(&mut s, hello_deadline) else {
            continue; // not one of ours, or gave up: ignore it
        };
        let mut r = Reader(&body);
        let (magic, rank, size) = (r.u32()?, r.u32()?, r.u32()?);
        let their_card = r.bytes()?.to_vec();
        let their_addr = r.string().unwrap_or_default();
        let addr = if their_addr.is_empty() {
            from.ip().to_string()
        } else {
            their_addr
        };
        let problem = if magic != MAGIC ^ VERSION as u32 {
            Some(format!(
                "a process at {addr} speaks another rdmacomm protocol version"
            ))
        } else if size as usize != n {
            Some(format!(
                "world size mismatch: rank {rank} at {addr} has world size {size} but rank 0 has {n}; \
                 every rank must be started with the same WORLD_SIZE"
            ))
        } else if rank == 0 || rank as usize >= n {
            Some(format!(
                "a process at {addr} claims rank {rank}, which is not in 1..{n}"
            ))
        } else if streams[rank as usize].is_some() {
            Some(format!(
                "rank {rank} joined twice (from {} and from {addr}); each rank must be unique",
                addrs[rank as usize]
            ))
        } else {
            None
        };
        if let Some(reason) = problem {
            let _ = send_frame(&mut s, REJECT, reason.as_bytes());
            abort_all(&mut streams, &reason);
            return Err(Error::Bootstrap(reason));
        }
        let rank = rank as usize;
        cards[rank] = their_card;
        addrs[rank] = addr;
        streams[rank] = Some(s);
        joined += 1;
    }
    let mut table = Vec::new();
    for r in 0..n {
        put_bytes(&mut table, addrs[r].as_bytes());
        put_bytes(&mut table, &cards[r]);
    }
    for (r, s) in streams.iter_mut().enumerate() {
        if let Some(s) = s {
            send_frame(s, TABLE, &table).map_err(|e| Error::PeerFailed {
                peer: crate::Peer {
                    rank: r,
                    addr: addrs[r].clone(),
                },
                reason: format!("sending the endpoint table: {e}"),
            })?;
        }
    }
    Ok(Rendezvous {
        cards,
        addrs: addrs.clone(),
        side: SideChannel::new(0, streams, addrs, cfg.timeout),
    })
}

fn join(cfg: &Config, card: &[u8], deadline: Instant) -> Result<Rendezvous> {
    let sa = resolve(&cfg.coordinator)?;
    let bind = match &cfg.bind_addr {
        Some(a) => Some(a.parse::<std::net::IpAddr>().map_err(|_| {
            Error::Config(format!("RDMACOMM_BIND_ADDR={a:?} is not an IP address"))
        })?),
        None => None,
    };
    let connect = || -> std::io::Result<TcpStream> {
        let sock = socket2::Socket::new(
            socket2::Domain::for_address(sa),
            socket2::Type::STREAM,
            None,
        )?;
        if let Some(ip) = bind {
            sock.bind(&std::net::SocketAddr::new(ip, 0).into())?;
        }
        sock.connect_timeout(&sa.into(), Duration::from_secs(1))?;
        Ok(sock.into())
    };
    let mut s = loop {
        match connect() {
            Ok(s) => break s,
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
    s.set_nodelay(true)?;
    let mut hello = Vec::new();
    hello.extend_from_slice(&(MAGIC ^ VERSION as u32).to_le_bytes());
    hello.extend_from_slice(&(cfg.rank as u32).to_le_bytes());
    hello.extend_from_slice(&(cfg.world_size as u32).to_le_bytes());
    put_bytes(&mut hello, card);
    put_bytes(
        &mut hello,
        cfg.bind_addr.as_deref().unwrap_or("").as_bytes(),
    );
    let coord = crate::Peer {
        rank: 0,
        addr: sa.to_string(),
    };
    send_frame(&mut s, HELLO, &hello).map_err(|e| Error::PeerFailed {
        peer: coord.clone(),
        reason: format!("sending hello: {e}"),
    })?;
    // Wait a little past our own deadline: the coordinator's verdict (which names the missing
    // ranks) is sent at its deadline, which started no earlier than ours.
    let grace = (cfg.timeout / 4).max(Duration::from_secs(2));
    let (kind, body) = recv_frame(&mut s, deadline + grace).map_err(|e| {
        if e.kind() == ErrorKind::TimedOut {
            Error::Bootstrap(format!(
                "rank {}: the coordinator {sa} did not complete the rendezvous within {:?} (some rank never joined?)",
                cfg.rank, cfg.timeout
            ))
        } else {
            Error::PeerFailed { peer: coord.clone(), reason: format!("waiting for the endpoint table: {e}") }
        }
    })?;
    match kind {
        TABLE => {}
        REJECT | ABORT => {
            return Err(Error::Bootstrap(format!(
                "rank {}: the coordinator refused the group: {}",
                cfg.rank,
                String::from_utf8_lossy(&body)
            )))
        }
        k => {
            return Err(Error::Bootstrap(format!(
                "unexpected message {k} from the coordinator"
            )))
        }
    }
    let mut r = Reader(&body);
    let mut cards = Vec::with_capacity(cfg.world_size);
    let mut addrs = Vec::with_capacity(cfg.world_size);
    for _ in 0..cfg.world_size {
        addrs.push(r.string()?);
        cards.push(r.bytes()?.to_vec());
    }
    let mut streams: Vec<Option<TcpStream>> = (0..cfg.world_size).map(|_| None).collect();
    streams[0] = Some(s);
    Ok(Rendezvous {
        cards,
        addrs: addrs.clone(),
        side: SideChannel::new(cfg.rank, streams, addrs, cfg.timeout),
    })
}

impl SideChannel {
    fn peer(&self, r: usize) -> crate::Peer {
        crate::Peer {
            rank: r,
            addr: self.addrs[r].clone(),
        }
    }

    /// Every rank waits until every rank has called this (over TCP, through rank 0).
    pub fn barrier(&mut self) -> Result<()> {
        let deadline = Instant::now() + self.timeout;
        if self.rank == 0 {
            for r in 1..self.streams.len() {
                let peer = self.peer(r);
                let s = self.streams[r].as_mut().expect("rank 0 holds every stream");
                match recv_frame(s, deadline) {
                    Ok((READY, _)) => {}
                    Ok((ABORT, why)) => {
                        return Err(Error::PeerFailed {
                            peer,
                            reason: String::from_utf8_lossy(&why).into(),
                        })
                    }
                    Ok((k, _)) => {
                        return Err(Error::PeerFailed {
                            peer,
                            reason: format!("unexpected message {k}"),
                        })
                    }
                    Err(e) if e.kind() == ErrorKind::TimedOut => {
                        return Err(Error::Timeout {
                            peer,
                            what: "barrier".into(),
                            after: self.timeout,
                        })
                    }
                    Err(e) => {
                        return Err(Error::PeerFailed {
                            peer,
                            reason: format!("side channel: {e}"),
                        })
                    }
                }
            }
            for r in 1..self.streams.len() {
                let peer = self.peer(r);
                let s = self.streams[r].as_mut().expect("rank 0 holds every stream");
                send_frame(s, GO, &[]).map_err(|e| Error::PeerFailed {
                    peer,
                    reason: format!("side channel: {e}"),
                })?;
            }
            Ok(())
        } else {
            let peer = self.peer(0);
            let s = self.streams[0].as_mut().expect("a stream to rank 0");
            send_frame(s, READY, &[]).map_err(|e| Error::PeerFailed {
                peer: peer.clone(),
                reason: format!("side channel: {e}"),
            })?;
            match recv_frame(s, deadline) {
                Ok((GO, _)) => Ok(()),
                Ok((ABORT, why)) => Err(Error::PeerFailed {
                    peer,
                    reason: String::from_utf8_lossy(&why).into(),
                }),
                Ok((k, _)) => Err(Error::PeerFailed {
                    peer,
                    reason: format!("unexpected message {k}"),
                }),
                Err(e) if e.kind() == ErrorKind::TimedOut => Err(Error::Timeout {
                    peer,
                    what: "barrier".into(),
                    after: self.timeout,
                }),
                Err(e) => Err(Error::PeerFailed {
                    peer,
                    reason: format!("side channel: {e}"),
                }),
            }
        }
    }

    /// Switches to non-blocking mode (after the connect barrier) with TCP keepalive, so a
    /// vanished host is noticed in about 8 s even without a FIN.
    pub fn set_async(&mut self) -> Result<()> {
        let ka = socket2::TcpKeepalive::new()
            .with_time(Duration::from_secs(5))
            .with_interval(Duration::from_secs(1))
            .with_retries(3);
        for s in self.streams.iter().flatten() {
            s.set_nonblocking(true)?;
            socket2::SockRef::from(s).set_tcp_keepalive(&ka)?;
        }
        Ok(())
    }

    /// The first failure seen (failed rank and reason), if any.
    pub fn failure(&self) -> Option<(usize, String)> {
        self.failure.clone()
    }

    fn record_failure(&mut self, failed: usize, reason: String) {
        if self.failure.is_none() {
            self.failure = Some((failed, reason));
        }
    }

    /// Reads whatever has arrived, without blocking: aborts, goodbyes, barrier messages and
    /// closed connections. Rank 0 relays every failure to all ranks.
    pub fn poll(&mut self) {
        let mut buf = [0u8; 4096];
        for r in 0..self.streams.len() {
            while let Some(s) = self.streams[r].as_mut() {
                match s.read(&mut buf) {
                    Ok(0) => {
                        self.streams[r] = None;
                        if !self.left[r] {
                            let why = format!(
                                "its side-channel connection closed without a goodbye (process died or host unreachable); seen by rank {}",
                                self.rank
                            );
                            self.record_failure(r, why.clone());
                            self.abort(r, &why);
                        }
                        break;
                    }
                    Ok(n) => {
                        self.pending[r].extend_from_slice(&buf[..n]);
                        self.parse(r);
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => {
                        self.streams[r] = None;
                        if !self.left[r] {
                            let why = format!(
                                "side-channel connection failed: {e}; seen by rank {}",
                                self.rank
                            );
                            self.record_failure(r, why.clone());
                            self.abort(r, &why);
                        }
                        break;
                    }
                }
            }
        }
    }

    fn parse(&mut self, r: usize) {
        loop {
            let p = &self.pending[r];
            if p.len() < 4 {
                return;
            }
            let len = u32::from_le_bytes(p[..4].try_into().unwrap()) as usize;
            if len == 0 || len > MAX_FRAME {
                self.record_failure(
                    r,
                    format!("sent a malformed side-channel frame ({len} bytes)"),
                );
                self.pending[r].clear();
                return;
            }
            if p.len() < 4 + len {
                return;
            }
            let kind = p[4];
            let body = p[5..4 + len].to_vec();
            self.pending[r].drain(..4 + len);
            match kind {
                ABORT => {
                    let mut rd = Reader(&body);
                    let failed = rd.u32().unwrap_or(r as u32) as usize;
                    let why = rd.string().unwrap_or_default();
                    let failed = if failed < self.addrs.len() { failed } else { r };
                    self.record_failure(failed, why.clone());
                    if self.rank == 0 {
                        self.abort(failed, &why);
                    }
                }
                BYE => self.left[r] = true,
                READY => self.ready[r] = true,
                GO => self.go = true,
                _ => {}
            }
        }
    }

    /// Tells the group that `failed` failed (non-zero ranks tell rank 0, which tells everyone).
    pub fn abort(&mut self, failed: usize, reason: &str) {
        if self.abort_sent {
            return;
        }
        self.abort_sent = true;
        let mut body = Vec::new();
        body.extend_from_slice(&(failed as u32).to_le_bytes());
        put_bytes(&mut body, reason.as_bytes());
        for s in self.streams.iter_mut().flatten() {
            let _ = send_frame(s, ABORT, &body);
        }
    }

    /// Close barrier, bounded by `limit`: returns when every rank has reached it (so no rank
    /// tears down queue pairs a peer still writes to), or on failure or time-out.
    pub fn close_barrier(&mut self, limit: Duration) -> Result<()> {
        let deadline = Instant::now() + limit;
        if self.rank != 0 {
            if let Some(s) = self.streams[0].as_mut() {
                let _ = send_frame(s, READY, &[]);
            }
        }
        loop {
            self.poll();
            if let Some((r, why)) = self.failure.clone() {
                return Err(Error::PeerFailed {
                    peer: self.peer(r),
                    reason: why,
                });
            }
            let done = if self.rank == 0 {
                (1..self.streams.len()).all(|r| self.ready[r] || self.left[r])
            } else {
                self.go || self.left[0]
            };
            if done {
                break;
            }
            if Instant::now() >= deadline {
                let who = if self.rank == 0 {
                    (1..self.ready.len()).find(|&r| !self.ready[r]).unwrap_or(0)
                } else {
                    0
                };
                return Err(Error::Timeout {
                    peer: self.peer(who),
                    what: "close barrier".into(),
                    after: limit,
                });
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        if self.rank == 0 {
            for s in self.streams.iter_mut().flatten() {
                let _ = send_frame(s, GO, &[]);
            }
        }
        Ok(())
    }

    /// Says goodbye: closing after this is not a failure.
    pub fn bye(&mut self) {
        for s in self.streams.iter_mut().flatten() {
            let _ = send_frame(s, BYE, &[]);
        }
    }

    fn new(
        rank: usize,
        streams: Vec<Option<TcpStream>>,
        addrs: Vec<String>,
        timeout: Duration,
    ) -> Self {
        let n = streams.len();
        SideChannel {
            rank,
            streams,
            addrs,
            timeout,
            pending: vec![Vec::new(); n],
            left: vec![false; n],
            ready: vec![false; n],
            go: false,
            failure: None,
            abort_sent: false,
        }
    }
}

impl Drop for SideChannel {
    fn drop(&mut self) {
        for s in self.streams.iter().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// The tag each transport puts first in its card.
pub(crate) const TAG_RDMA: u32 = 0x4144_4d52; // "RDMA"
/// The tag of a TCP card.
pub(crate) const TAG_TCP: u32 = 0x2050_4354; // "TCP "

/// Checks that every rank's card starts with `tag` (all ranks chose the same transport).
pub(crate) fn check_tags(cards: &[Vec<u8>], addrs: &[String], me: usize, tag: u32) -> Result<()> {
    let name = |t: u32| {
        if t == TAG_RDMA {
            "RDMA"
        } else if t == TAG_TCP {
            "TCP"
        } else {
            "an unknown transport"
        }
    };
    for (p, c) in cards.iter().enumerate() {
        let t = c
            .get(..4)
            .map_or(0, |b| u32::from_le_bytes(b.try_into().expect("4 bytes")));
        if t != tag {
            return Err(Error::Config(format!(
                "rank {p} ({}) uses {} but rank {me} uses {}: set RDMACOMM_TRANSPORT alike on every rank \
                 (auto picks RDMA only where a device is usable)",
                addrs[p],
                name(t),
                name(tag)
            )));
        }
    }
    Ok(())
}
