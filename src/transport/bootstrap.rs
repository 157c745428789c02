//! The bootstrap's wire (length-prefixed frames over TCP) and the side channel: the rendezvous'
//! connections (rank 0 to every rank), kept open for barriers, aborts, stall reports and
//! goodbyes. The rendezvous itself is [`crate::transport::rendezvous`].

use crate::error::{Error, Result};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

pub(crate) const MAGIC: u32 = 0x5244_4d43; // "RDMC"
/// The wire protocol's version (5: a challenge first; the HELLO carries the job, the shared
/// settings, a configuration error and a MAC; with a secret, the card only after rank 0 proved
/// it; per-rank tables with a session key; operation descriptors on the data path; a key per
/// peer over RDMA), checked at the rendezvous so that mixed builds fail with a
/// clear error instead of misreading each other.
pub(crate) const VERSION: u16 = 5;
pub(crate) const HELLO: u8 = 1;
pub(crate) const REJECT: u8 = 2;
pub(crate) const TABLE: u8 = 3;
const READY: u8 = 4;
const GO: u8 = 5;
pub(crate) const ABORT: u8 = 6;
const BYE: u8 = 7;
/// A rank's wait ran out: it names the rank it waits on (to rank 0, which judges).
const STALLED: u8 = 8;
const MAX_FRAME: usize = 64 << 20;

/// How long rank 0 gathers stall reports before it names the rank the waits lead to (the ranks
/// waiting on a stopped one run out of time within milliseconds of each other).
pub const STALL_WINDOW: Duration = Duration::from_millis(400);

/// How a stall verdict begins.
pub const STALL_VERDICT: &str = "stopped making progress";

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
    /// Rank 0: whom each rank said it waits on after its wait ran out.
    stalls: Vec<Option<usize>>,
    /// Rank 0: when the first stall report came.
    stall_since: Option<Instant>,
    /// Whom this rank waits on now, if it is inside an operation.
    pub(crate) waiting: Option<usize>,
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

pub(crate) fn send_frame(s: &mut TcpStream, kind: u8, body: &[u8]) -> std::io::Result<()> {
    let mut f = Vec::with_capacity(body.len() + 5);
    f.extend_from_slice(&(body.len() as u32 + 1).to_le_bytes());
    f.push(kind);
    f.extend_from_slice(body);
    s.write_all(&f)
}

/// [`send_frame`] by `deadline` at the latest (a socket's write timeout bounds each write call,
/// not the frame: a reader taking a few bytes at a time could stretch it without end).
pub(crate) fn send_frame_by(
    s: &mut TcpStream,
    kind: u8,
    body: &[u8],
    deadline: Instant,
) -> std::io::Result<()> {
    let mut f = Vec::with_capacity(body.len() + 5);
    f.extend_from_slice(&(body.len() as u32 + 1).to_le_bytes());
    f.push(kind);
    f.extend_from_slice(body);
    let mut at = 0;
    while at < f.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                ErrorKind::TimedOut,
                format!("{} of {} bytes written by the deadline", at, f.len()),
            ));
        }
        s.set_write_timeout(Some(left))?;
        match s.write(&f[at..]) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(k) => at += k,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

pub(crate) fn recv_frame(s: &mut TcpStream, deadline: Instant) -> std::io::Result<(u8, Vec<u8>)> {
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
        if self.rank == 0 {
            self.judge_stalls();
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
                STALLED if self.rank == 0 => {
                    let on = Reader(&body).u32().map_or(usize::MAX, |w| w as usize);
                    if on < self.stalls.len() {
                        self.stalls[r] = Some(on);
                        self.stall_since.get_or_insert_with(Instant::now);
                    }
                }
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

    /// The side channel over the rendezvous' connections (`streams[r]`: to rank r, if held).
    pub(crate) fn new(
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
            stalls: vec![None; n],
            stall_since: None,
            waiting: None,
        }
    }

    /// This rank's wait on `waiting_on` ran out: tell rank 0 (or, on rank 0, note it), which
    /// names the rank the waits lead to once the reports are in ([`STALL_WINDOW`]).
    pub fn report_stall(&mut self, waiting_on: usize) {
        if self.rank == 0 {
            self.stalls[0] = Some(waiting_on);
            self.stall_since.get_or_insert_with(Instant::now);
        } else if let Some(s) = self.streams[0].as_mut() {
            let _ = send_frame(s, STALLED, &(waiting_on as u32).to_le_bytes());
        }
    }

    /// Rank 0, once stall reports have gathered for [`STALL_WINDOW`]: follows the waits from
    /// the first reporter to a rank that waits on nobody, and tells the group it stopped.
    fn judge_stalls(&mut self) {
        let Some(since) = self.stall_since else {
            return;
        };
        if self.failure.is_some() || since.elapsed() < STALL_WINDOW {
            return;
        }
        let mut waits = self.stalls.clone();
        if waits[0].is_none() {
            waits[0] = self.waiting; // rank 0 itself, waiting but not yet out of time
        }
        let Some(first) = (0..waits.len()).find(|&r| self.stalls[r].is_some()) else {
            return;
        };
        let mut chain = vec![first];
        let mut cycle = false;
        while let Some(next) = waits[*chain.last().expect("one")] {
            if chain.contains(&next) {
                cycle = true;
                break;
            }
            chain.push(next);
        }
        let path = chain
            .iter()
            .map(|r| r.to_string())
            .collect::<Vec<_>>()
            .join(" -> ");
        let (culprit, why) = if cycle {
            (
                waits[first].expect("a reporter"),
                format!(
                    "{STALL_VERDICT}: ranks {path} wait on each other (do their sends and \
                     receives match?)"
                ),
            )
        } else {
            let c = *chain.last().expect("one");
            (
                c,
                format!(
                    "{STALL_VERDICT}: ranks waited on it for the timeout (waits: {path}) while it \
                     waits on nobody: stopped (SIGSTOP, a debugger), hung, or busy outside \
                     rdmacomm"
                ),
            )
        };
        self.record_failure(culprit, why.clone());
        self.abort(culprit, &why);
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
/// Tag of a shared-memory card.
pub(crate) const TAG_SHM: u32 = 0x204d_4853; // "SHM "
/// Tag of the prefix a network transport's card carries (shared memory to same-host peers or
/// not), ahead of its own tag.
pub(crate) const TAG_HYBRID: u32 = 0x4e54_454e; // "NETN"

/// Checks that every rank's card starts with `tag` (all ranks chose the same transport).
pub(crate) fn check_tags(cards: &[Vec<u8>], addrs: &[String], me: usize, tag: u32) -> Result<()> {
    let name = |t: u32| {
        if t == TAG_RDMA {
            "RDMA"
        } else if t == TAG_TCP {
            "TCP"
        } else if t == TAG_SHM {
            "shared memory"
        } else if t == TAG_HYBRID {
            "RDMA or TCP with shared memory to same-host peers (RDMACOMM_SHM)"
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_on_another_transport_is_named() {
        let card = |t: u32| t.to_le_bytes().to_vec();
        let addrs: Vec<String> = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
            .map(String::from)
            .into();
        let same = vec![card(TAG_RDMA); 3];
        assert!(check_tags(&same, &addrs, 0, TAG_RDMA).is_ok());
        for (other, name) in [
            (TAG_TCP, "uses TCP"),
            (TAG_SHM, "uses shared memory"),
            (TAG_HYBRID, "uses RDMA or TCP with shared memory"),
            (7, "uses an unknown transport"),
        ] {
            let mixed = vec![card(TAG_RDMA), card(TAG_RDMA), card(other)];
            let e = check_tags(&mixed, &addrs, 1, TAG_RDMA)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("rank 2 (10.0.0.3)")
                    && e.contains(name)
                    && e.contains("rank 1 uses RDMA"),
                "{e}"
            );
        }
        let empty = vec![card(TAG_TCP), Vec::new()];
        let e = check_tags(&empty, &addrs[..2], 0, TAG_TCP)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rank 1") && e.contains("unknown transport"),
            "{e}"
        );
    }
}
