//! Frames on the bootstrap's connections, and the tags that say which transport a card is for.

pub(crate) mod auth;
pub(crate) mod port;
use crate::error::{Error, Result};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::Instant;

/// The backlog of every listener of the rendezvous and the TCP mesh: a whole world may connect at
/// once, and a full queue drops connection attempts, each then retried a second later (std's
/// listeners queue 128). The kernel caps it at `net.core.somaxconn`.
const BACKLOG: i32 = 65535;

/// A TCP listener on the first of `addr`'s addresses that binds, as std's (address reuse, close
/// on exec) but with room for a whole world's connections in its queue.
pub(crate) fn listen<A: ToSocketAddrs>(addr: A) -> std::io::Result<TcpListener> {
    let mut last = std::io::Error::new(ErrorKind::InvalidInput, "no address to listen on");
    for sa in addr.to_socket_addrs()? {
        match listen_on(sa) {
            Ok(l) => return Ok(l),
            Err(e) => last = e,
        }
    }
    Err(last)
}

fn listen_on(sa: SocketAddr) -> std::io::Result<TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let s = Socket::new(Domain::for_address(sa), Type::STREAM, Some(Protocol::TCP))?;
    s.set_reuse_address(true)?;
    s.bind(&sa.into())?;
    s.listen(BACKLOG)?;
    Ok(s.into())
}

pub(crate) const MAGIC: u32 = 0x5244_4d43; // "RDMC"
/// The wire protocol's version (5: a challenge first; the HELLO carries the job, the shared
/// settings, a configuration error and a MAC; with a secret, the card only after rank 0 proved
/// it; per-rank tables with a session key; operation descriptors on the data path; a key per
/// peer over RDMA), checked at the rendezvous so that mixed builds fail with a
/// clear error instead of misreading each other; 6: a probe says which ways its operation goes,
/// and the side channel's frame kinds differ from the rendezvous'); 7: one front-coded table for
/// every rank, its MAC over its digest, and cards without per-rank entries (RDMA's queue pairs
/// are set up over the data connection); 8: the table fans out along a tree (`fanout.rs`): each
/// rank's ROUTE from rank 0, a listener's port in the HELLO; 9: descriptors carry the calling
/// communicator's number (shared views), their byte count in 48 bits; 10: every rank's control
/// port in the table (a shrink's messages); 11: a TCP card lists the ranks whose connection it
/// carries over from the generation before; 12: an RDMA card lists the ranks whose queue pair it
/// carries over.
pub(crate) const VERSION: u16 = 12;
// Every frame kind of the bootstrap's connection, rendezvous and side channel alike (one
// connection becomes the other): each number once (`every_kind_is_its_own`).
pub(crate) const HELLO: u8 = 1;
pub(crate) const REJECT: u8 = 2;
pub(crate) const TABLE: u8 = 3;
pub(super) const READY: u8 = 4;
pub(super) const GO: u8 = 5;
pub(crate) const ABORT: u8 = 6;
pub(super) const BYE: u8 = 7;
/// A rank's wait ran out: it names the rank it waits on (to rank 0, which judges).
pub(super) const STALLED: u8 = 8;
/// Frame kind of rank 0's greeting: a nonce to answer.
pub(crate) const CHALLENGE: u8 = 9;
/// With a secret: rank 0's proof that it holds it (a MAC over the joiner's nonce).
pub(super) const PROOF: u8 = 10;
/// With a secret: the joiner's card, sent only after the proof checked out.
pub(super) const CARD: u8 = 11;
/// A rank closes its communicator (body: its rank); rank 0 relays it to every rank.
pub(super) const LEAVING: u8 = 12;
/// A rank has waited on a peer without progress: its operation's numbers in both directions, its
/// descriptor and which ways it goes (body: to, from, in, out, descriptor, directions), relayed
/// by rank 0. The peer compares it with its own call in the same direction: mismatched calls that
/// move no byte (both waiting to receive) are named at once, not after the timeout.
pub(super) const PROBE: u8 = 13;
/// Rank 0 to each joiner once every rank is in: the table's digest and length, the rank that
/// passes it the table and the ports of the ranks it passes it to, and (with a secret) a MAC.
pub(super) const ROUTE: u8 = 14;
pub(super) const MAX_FRAME: usize = 64 << 20;

pub(super) fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
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
    pub(super) fn string(&mut self) -> Result<String> {
        Ok(String::from_utf8_lossy(self.bytes()?).into_owned())
    }
}

/// Whether the other end of `s` has closed it (or it failed): a peek that neither blocks nor
/// changes the socket's mode (a restarted rank's old connection, a member gone from a shrink).
pub(crate) fn peer_closed(s: &TcpStream) -> bool {
    let mut b = [std::mem::MaybeUninit::<u8>::uninit(); 1];
    let flags = libc::MSG_PEEK | libc::MSG_DONTWAIT;
    match socket2::SockRef::from(s).recv_with_flags(&mut b, flags) {
        Ok(k) => k == 0,
        Err(e) => !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted),
    }
}

pub(crate) fn send_frame(mut s: &TcpStream, kind: u8, body: &[u8]) -> std::io::Result<()> {
    let mut f = Vec::with_capacity(body.len() + 5);
    f.extend_from_slice(&(body.len() as u32 + 1).to_le_bytes());
    f.push(kind);
    f.extend_from_slice(body);
    s.write_all(&f)
}

/// How long a side-channel frame may wait for room in a non-blocking socket.
pub(super) const FRAME_WITHIN: std::time::Duration = std::time::Duration::from_secs(1);

/// One frame on a non-blocking socket, whole or not at all: waits for room (a peer that does
/// not read fills the socket) up to [`FRAME_WITHIN`]; a frame still half-written then shuts the
/// connection down, so the reader sees it end instead of a stream gone out of step.
pub(crate) fn send_frame_nb(s: &TcpStream, kind: u8, body: &[u8]) -> std::io::Result<()> {
    // A small frame (a probe, a stall report) is built on the stack: a slow wait allocates nothing.
    let mut small = [0u8; 64];
    let mut big = Vec::new();
    let f: &mut [u8] = if body.len() + 5 <= small.len() {
        &mut small[..body.len() + 5]
    } else {
        big.resize(body.len() + 5, 0);
        &mut big
    };
    f[..4].copy_from_slice(&(body.len() as u32 + 1).to_le_bytes());
    f[4] = kind;
    f[5..].copy_from_slice(body);
    let f = &*f;
    let deadline = Instant::now() + FRAME_WITHIN;
    let mut w = s;
    let mut at = 0;
    while at < f.len() {
        match w.write(&f[at..]) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(k) => at += k,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    if at > 0 {
                        let _ = s.shutdown(std::net::Shutdown::Both);
                    }
                    return Err(std::io::Error::new(
                        ErrorKind::TimedOut,
                        format!(
                            "the peer read nothing for {FRAME_WITHIN:?} ({at} of {} bytes written)",
                            f.len()
                        ),
                    ));
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

pub(crate) fn recv_frame(mut s: &TcpStream, deadline: Instant) -> std::io::Result<(u8, Vec<u8>)> {
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

/// Reads what `sock` (non-blocking) has into `buf`, up to a frame of `limit` bytes: whether
/// anything came, and why the connection is no use if it is not.
pub(super) fn read_some(
    mut sock: &TcpStream,
    buf: &mut Vec<u8>,
    limit: usize,
) -> (bool, Option<&'static str>) {
    let mut chunk = [0u8; 4096];
    let mut busy = false;
    loop {
        match sock.read(&mut chunk) {
            Ok(0) => return (busy, Some("closed before a whole frame")),
            Ok(k) => {
                busy = true;
                buf.extend_from_slice(&chunk[..k]);
                if buf.len() > 4 + limit {
                    return (busy, Some("sent more than the frame expected"));
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => return (busy, None),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return (busy, Some("connection failed")),
        }
    }
}

/// Whether `buf` holds a whole frame of at most `limit` bytes (an error for a bad length).
pub(super) fn whole_frame(buf: &[u8], limit: usize) -> std::result::Result<bool, &'static str> {
    if buf.len() < 4 {
        return Ok(false);
    }
    let len = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
    if len == 0 || len > limit {
        return Err("a malformed frame");
    }
    Ok(buf.len() >= 4 + len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_is_its_own() {
        let kinds = [
            HELLO, REJECT, TABLE, READY, GO, ABORT, BYE, STALLED, CHALLENGE, PROOF, CARD, LEAVING,
            PROBE, ROUTE,
        ];
        for (i, a) in kinds.iter().enumerate() {
            assert!(!kinds[i + 1..].contains(a), "kind {a} twice");
        }
    }

    #[test]
    fn a_listener_queues_a_world_that_connects_at_once() {
        // 200 connections before any accept: std's queue of 128 drops the rest's SYNs, which
        // then wait a second for their retry; ours holds them all at once.
        let l = listen("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        let mut held = Vec::new();
        for i in 0..200 {
            let s = TcpStream::connect_timeout(&at, std::time::Duration::from_millis(300));
            held.push(s.unwrap_or_else(|e| panic!("connection {i} not queued: {e}")));
        }
        l.set_nonblocking(true).unwrap();
        let mut accepted = 0;
        while l.accept().is_ok() {
            accepted += 1;
        }
        assert_eq!(accepted, 200);
    }

    #[test]
    fn a_frame_is_whole_or_the_connection_ends() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let w = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (r, _) = l.accept().unwrap();
        w.set_nonblocking(true).unwrap();
        // The reader reads nothing until the writer gives up: the socket fills mid-frame.
        let body: Vec<u8> = (0..9999u32).map(|i| i as u8).collect();
        let mut sent = 0;
        while send_frame_nb(&w, PROBE, &body).is_ok() {
            sent += 1;
            assert!(sent < 100_000, "never filled");
        }
        let mut got = 0;
        let far = Instant::now() + std::time::Duration::from_secs(5);
        loop {
            match recv_frame(&r, far) {
                Ok((k, b)) => {
                    assert_eq!((k, b.len()), (PROBE, body.len()), "frame {got} out of step");
                    assert_eq!(b, body);
                    got += 1;
                }
                Err(e) => {
                    assert_eq!(e.kind(), ErrorKind::UnexpectedEof, "{e}");
                    break;
                }
            }
        }
        assert_eq!(got, sent, "every whole frame arrives, then the end");
    }

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
