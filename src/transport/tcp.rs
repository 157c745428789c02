//! The TCP transport: the same [`Link`] over a full mesh of non-blocking TCP connections, for
//! hosts without RDMA. Flow control is a bounded queue of unsent chunks per peer (like the RDMA
//! transport's slots) and TCP's own window. Failures and health use the same side channel as
//! RDMA.
//!
//! Framing: a chunk travels as a `HDR`-byte header (its length, little-endian u32, then
//! zeros, with the operation's descriptor at `OP_AT`: every frame is checked against the
//! receiver's operation), the payload, and zeros up to a multiple of 64 bytes. Every frame is a multiple of 64
//! bytes, so a payload starts 64-byte aligned in the sender's socket pages as well as in the
//! stream, and the kernel's copies into and out of those pages run at full speed (a 4-byte
//! header left them misaligned: 15-25% slower from 512 KiB, see `HDR`).

use crate::config::{Config, Poll};
use crate::error::{Error, Peer, Result};
use crate::transport::bootstrap::{check_tags, Reader, TAG_TCP};
use crate::transport::op::{self, OpDesc, OpKind, Scope};
use crate::transport::pacer::{oversubscribed, Pacer, Wait};
use crate::transport::rendezvous::{mac, mac_ok, Card, Rendezvous, KEY};
use crate::transport::watch::Watch;
use crate::transport::Link;
use std::io::{ErrorKind, IoSlice, IoSliceMut, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// What is left of the last chunk after a non-blocking write took only part of it. The socket's
/// own buffer is the send queue: a new chunk is accepted only when this is empty, so at most
/// one partial chunk is ever copied, and a full socket turns into back-pressure on the caller.
#[derive(Default)]
struct OutQueue {
    buf: Vec<u8>,
    /// Bytes of `buf` already written.
    head: usize,
}

impl OutQueue {
    fn is_empty(&self) -> bool {
        self.head == self.buf.len()
    }

    /// Notes `k` more bytes written.
    fn advance(&mut self, k: usize) {
        self.head += k;
        if self.is_empty() {
            self.buf.clear();
            self.head = 0;
        }
    }

    /// Keeps what is left of a frame (`parts` in order) after `done` of its bytes were written.
    fn keep_rest(&mut self, parts: &[&[u8]], mut done: usize) {
        for part in parts {
            let skip = done.min(part.len());
            self.buf.extend_from_slice(&part[skip..]);
            done -= skip;
        }
    }
}

/// Bytes of a frame's header: the payload's length (u32, little-endian), then zeros. 64, so that
/// payloads start 64-byte aligned in the socket's pages (measured: docs/DESIGN.md, "Measured
/// reasons in the code").
const HDR: usize = 64;

/// Where the operation's descriptor ([`op::WIRE`] bytes) sits in a frame's header.
const OP_AT: usize = 8;

/// Zeros that pad a frame to a multiple of 64 bytes.
const PAD: [u8; 64] = [0; 64];

/// Zero bytes after a `len`-byte payload.
fn pad(len: usize) -> usize {
    len.next_multiple_of(64) - len
}

/// Bytes received on one connection and not yet taken, in a buffer of fixed capacity that is
/// read into directly (no intermediate copy); unconsumed bytes move to its front only when the
/// room behind them is too small for a whole chunk.
struct InQueue {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl InQueue {
    fn new(cap: usize) -> InQueue {
        InQueue {
            buf: vec![0; cap],
            start: 0,
            end: 0,
        }
    }

    fn pending(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// The length of the next chunk, once its header is here; an error if it exceeds `max`.
    fn next_len(&self, max: usize) -> std::result::Result<Option<usize>, String> {
        let p = self.pending();
        if p.len() < HDR {
            return Ok(None);
        }
        let len = u32::from_le_bytes(p[..4].try_into().expect("4 bytes")) as usize;
        if len > max {
            return Err(format!(
                "sent a {len}-byte chunk, more than the {max} agreed: corrupt stream"
            ));
        }
        Ok(Some(len))
    }

    fn consume(&mut self, k: usize) {
        self.start += k;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    /// The free room to read into, making room for `want` bytes first if needed; empty when
    /// the buffer is full of unconsumed bytes (back-pressure: TCP's window then holds the sender).
    fn room(&mut self, want: usize) -> &mut [u8] {
        if self.buf.len() - self.end < want && self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        &mut self.buf[self.end..]
    }
}

/// How long an idle rank yields its core before blocking in poll(2).
const YIELD_FOR: Duration = Duration::from_micros(200);

/// Payload bytes read together with a header by `try_take_into`: a chunk this small is copied
/// from the receive buffer; of a larger one, the rest is read straight into its destination.
const DIRECT_PEEK: usize = 4096;

/// A receive placed straight into the caller's buffer, past the receive buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direct {
    /// None: the pump reads this connection into its receive buffer.
    Off,
    /// The caller waits for the next chunk to land in its buffer: the pump leaves the socket
    /// alone so that the payload is read once, into its destination.
    Armed,
    /// The chunk's header is consumed and this many of its `len` bytes and padding after them
    /// are read.
    Placing { placed: usize, len: usize },
}

/// One peer's connection and buffers.
struct Conn {
    sock: TcpStream,
    out: OutQueue,
    inp: InQueue,
    direct: Direct,
    closed: bool,
    /// The numbers of the latest operation that sent to this peer, and that received from it
    /// (see [`OpDesc::seq`]).
    seq_out: u64,
    seq_in: u64,
    /// A frame of the current operation from this peer passed [`TcpTransport::check_op`]: its
    /// later frames may be read straight into place with their header (before the check).
    verified: bool,
}

/// The TCP transport of one rank.
pub struct TcpTransport {
    conns: Vec<Option<Conn>>,
    /// The side channel and the first failure.
    watch: Watch,
    rank: usize,
    n: usize,
    max_chunk: usize,
    /// How long to spin before blocking in poll(2).
    timeout: Duration,
    /// How waits spin, yield and block, and when they time out.
    pacer: Pacer,
    /// poll(2)'s array, kept between calls.
    fds: Vec<libc::pollfd>,
    /// The operation under way, and its descriptor's bytes as every frame carries them.
    op: OpDesc,
    op_wire: [u8; op::WIRE],
}

/// What rank `from` sends rank `to` to show it holds the group's session key.
fn proof(session: &[u8; KEY], from: usize, to: usize) -> [u8; KEY] {
    let (f, t) = ((from as u32).to_le_bytes(), (to as u32).to_le_bytes());
    mac(session, &[b"rdmacomm tcp", &f, &t])
}

/// Whether `tag` is [`proof`]`(session, from, to)`, compared in constant time.
fn proof_ok(session: &[u8; KEY], from: usize, to: usize, tag: &[u8]) -> bool {
    let (f, t) = ((from as u32).to_le_bytes(), (to as u32).to_le_bytes());
    mac_ok(session, &[b"rdmacomm tcp", &f, &t], tag)
}

fn tune(s: &TcpStream) -> Result<()> {
    s.set_nodelay(true)?;
    let sr = socket2::SockRef::from(s);
    let _ = sr.set_send_buffer_size(4 << 20);
    let _ = sr.set_recv_buffer_size(4 << 20);
    Ok(())
}

impl TcpTransport {
    /// Meets every rank through `meet` (which exchanges cards and returns the side channel: the
    /// bootstrap, or a parent communicator for `split`) and connects a TCP mesh (rank j connects
    /// to every rank i < j). Every rank of `cfg.world_size` must call this.
    pub fn connect_with(
        cfg: &Config,
        meet: &mut dyn FnMut(&Card) -> Result<Rendezvous>,
    ) -> Result<Self> {
        cfg.validate()?;
        let n = cfg.world_size;
        let ip: std::net::IpAddr = match &cfg.bind_addr {
            Some(a) => a.parse().map_err(|_| {
                Error::Config(format!("RDMACOMM_BIND_ADDR={a:?} is not an IP address"))
            })?,
            None => {
                // The address we reach the coordinator from is one peers can reach us at.
                let sa: SocketAddr = cfg
                    .coordinator
                    .parse()
                    .or_else(|_| {
                        use std::net::ToSocketAddrs;
                        cfg.coordinator
                            .to_socket_addrs()
                            .ok()
                            .and_then(|mut i| i.next())
                            .ok_or(())
                    })
                    .map_err(|_| {
                        Error::Config(format!(
                            "coordinator address {:?} does not resolve",
                            cfg.coordinator
                        ))
                    })?;
                if sa.ip().is_loopback() {
                    sa.ip()
                } else {
                    // The coordinator's address family: an IPv6 coordinator, an IPv6 data path.
                    let any = if sa.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" };
                    std::net::UdpSocket::bind(any)
                        .and_then(|u| u.connect(sa).and_then(|_| u.local_addr()))
                        .map(|a| a.ip())
                        .unwrap_or(sa.ip())
                }
            }
        };
        let listener = TcpListener::bind(SocketAddr::new(ip, 0)).map_err(|e| {
            Error::Bootstrap(format!("rank {} cannot listen on {ip}: {e}", cfg.rank))
        })?;
        let me = listener.local_addr()?;
        let text = me.to_string();
        let mut common = Vec::new();
        common.extend_from_slice(&TAG_TCP.to_le_bytes());
        common.extend_from_slice(&(cfg.tcp_chunk as u32).to_le_bytes());
        common.extend_from_slice(&(text.len() as u32).to_le_bytes());
        common.extend_from_slice(text.as_bytes());
        let card = Card {
            common,
            entry: 0,
            each: Vec::new(),
        };
        let rv = meet(&card)?;
        check_tags(&rv.cards, &rv.addrs, cfg.rank, TAG_TCP)?;
        let mut side = rv.side;
        let mut addrs_data = Vec::with_capacity(n);
        for (p, c) in rv.cards.iter().enumerate() {
            let mut r = Reader(&c[4..]);
            let chunk = r.u32()? as usize;
            if chunk != cfg.tcp_chunk {
                return Err(Error::Config(format!(
                    "rank {p} uses RDMACOMM_TCP_CHUNK={chunk} but rank {} uses {}: set it alike everywhere",
                    cfg.rank, cfg.tcp_chunk
                )));
            }
            let a = String::from_utf8_lossy(r.bytes()?).into_owned();
            addrs_data.push(
                a.parse::<SocketAddr>()
                    .map_err(|_| Error::Bootstrap(format!("rank {p} sent a bad address {a:?}")))?,
            );
        }
        let deadline = Instant::now() + cfg.timeout;
        let peer = |p: usize| Peer {
            rank: p,
            addr: rv.addrs[p].clone(),
        };
        let mut socks: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
        // Connect to lower ranks, announcing our rank.
        for (p, sa) in addrs_data.iter().enumerate().take(cfg.rank) {
            let mut s = loop {
                match TcpStream::connect_timeout(sa, Duration::from_secs(1)) {
                    Ok(s) => break s,
                    Err(e) if Instant::now() >= deadline => {
                        return Err(Error::PeerFailed {
                            peer: peer(p),
                            reason: format!("cannot connect the data connection to {sa}: {e}"),
                        })
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            };
            // Our rank, and the proof that we were at the rendezvous.
            let mut hello = (cfg.rank as u32).to_le_bytes().to_vec();
            hello.extend_from_slice(&proof(&rv.session, cfg.rank, p));
            s.write_all(&hello)?;
            tune(&s)?;
            socks[p] = Some(s);
        }
        // Accept from higher ranks: a connection counts once it names a rank that has yet to
        // connect and proves the session key; any other is dropped, without holding up the rest.
        listener.set_nonblocking(true)?;
        let mut pending: Vec<(TcpStream, Vec<u8>, Instant)> = Vec::new();
        let mut waiting = n - 1 - cfg.rank;
        let want = 4 + KEY;
        while waiting > 0 {
            let mut busy = false;
            match listener.accept() {
                Ok((s, _)) if pending.len() < 1024 => {
                    busy = true;
                    s.set_nonblocking(true)?;
                    pending.push((s, Vec::new(), Instant::now() + Duration::from_secs(5)));
                }
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
            let mut i = 0;
            while i < pending.len() {
                let (s, buf, until) = &mut pending[i];
                let mut b = [0u8; 64];
                let mut drop_it = Instant::now() >= *until;
                match s.read(&mut b[..want - buf.len()]) {
                    Ok(0) => drop_it = true,
                    Ok(k) => {
                        busy = true;
                        buf.extend_from_slice(&b[..k]);
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                    Err(_) => drop_it = true,
                }
                if buf.len() == want {
                    let (s, buf, _) = pending.swap_remove(i);
                    let p = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
                    if p > cfg.rank
                        && p < n
                        && socks[p].is_none()
                        && proof_ok(&rv.session, p, cfg.rank, &buf[4..])
                    {
                        s.set_nonblocking(false)?;
                        tune(&s)?;
                        socks[p] = Some(s);
                        waiting -= 1;
                    }
                    continue;
                }
                if drop_it {
                    pending.swap_remove(i);
                    continue;
                }
                i += 1;
            }
            if waiting > 0 && !busy {
                if Instant::now() >= deadline {
                    let missing = (cfg.rank + 1..n).find(|&p| socks[p].is_none()).unwrap_or(0);
                    return Err(Error::Timeout {
                        peer: peer(missing),
                        what: "data connection".into(),
                        after: cfg.timeout,
                    });
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        side.barrier()?;
        side.set_async()?;
        // Received chunks are read into a buffer of four chunks and reduced from there: small
        // chunks keep it in the cache (see `Config::tcp_chunk`).
        let chunk = cfg.tcp_chunk;
        // Spin while waiting only as long as it cannot take a core another local rank needs.
        let spin_for = match cfg.poll {
            Poll::Spin => Duration::MAX,
            Poll::Yield => Duration::ZERO,
            Poll::Auto if oversubscribed(&rv.addrs, cfg.rank, cfg.local_world) => Duration::ZERO,
            Poll::Auto => Duration::from_micros(50),
        };
        let mut conns = Vec::with_capacity(n);
        for s in socks {
            conns.push(match s {
                Some(s) => {
                    s.set_read_timeout(None)?;
                    s.set_nonblocking(true)?;
                    Some(Conn {
                        sock: s,
                        out: OutQueue::default(),
                        inp: InQueue::new(4 * (chunk + HDR)),
                        direct: Direct::Off,
                        closed: false,
                        seq_out: u64::MAX,
                        seq_in: u64::MAX,
                        verified: false,
                    })
                }
                None => None,
            });
        }
        Ok(TcpTransport {
            conns,
            watch: Watch::new(side, cfg.rank, rv.addrs),
            rank: cfg.rank,
            n,
            max_chunk: chunk,
            pacer: Pacer::new(cfg.timeout, spin_for, YIELD_FOR.max(spin_for)),
            timeout: cfg.timeout,
            fds: Vec::with_capacity(n),
            op: OpDesc::new(OpKind::Barrier, 0),
            op_wire: OpDesc::new(OpKind::Barrier, 0).encode(),
        })
    }

    /// What this transport is, in words.
    pub fn device(&self) -> String {
        "TCP".into()
    }

    /// Records the first failure, tells the group, and returns it as an error.
    fn fail(&mut self, p: usize, reason: String) -> Error {
        self.watch.fail(p, reason)
    }

    /// Failures learned from the side channel (a peer's abort, a closed connection).
    fn check_side(&mut self) -> Result<()> {
        self.watch.poll()
    }

    /// Checks the operation descriptor in the header of the next frame from `p` (buffered)
    /// against this rank's operation: a mismatch fails the link, naming both calls.
    fn check_op(&mut self, p: usize) -> Result<()> {
        let c = self.conns[p].as_ref().expect("present");
        let hdr = &c.inp.pending()[OP_AT..OP_AT + op::WIRE];
        if hdr == OpDesc::numbered(self.op_wire, c.seq_in) {
            self.conns[p].as_mut().expect("present").verified = true;
            return Ok(());
        }
        let mine = OpDesc {
            seq: c.seq_in,
            ..self.op
        };
        match mine.check(hdr, p, self.rank) {
            Ok(()) => {
                self.conns[p].as_mut().expect("present").verified = true;
                Ok(())
            }
            Err(why) => {
                self.conns[p].as_mut().expect("present").direct = Direct::Off;
                Err(self.watch.mismatch(p, why))
            }
        }
    }

    /// This rank failed: tell every peer.
    pub fn abort(&mut self, reason: String) {
        self.watch.abort_self(reason);
    }

    /// Moves bytes: writes what is queued, reads what has arrived. Returns whether any moved.
    fn pump(&mut self) -> Result<bool> {
        let mut moved = false;
        for p in 0..self.n {
            moved |= self.pump_one(p)?;
        }
        Ok(moved)
    }

    /// [`Self::pump`] for one peer's connection: writes what is queued, then reads straight
    /// into the receive buffer while the socket has bytes and the buffer has room.
    fn pump_one(&mut self, p: usize) -> Result<bool> {
        let want = HDR + self.max_chunk;
        let Some(c) = self.conns[p].as_mut() else {
            return Ok(false);
        };
        let mut moved = false;
        let mut err = None;
        while !c.out.is_empty() {
            match c.sock.write(&c.out.buf[c.out.head..]) {
                Ok(0) => break,
                Ok(k) => {
                    c.out.advance(k);
                    moved = true;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    err = Some(format!("TCP send failed: {e}"));
                    break;
                }
            }
        }
        while err.is_none() && !c.closed && c.direct == Direct::Off {
            let room = c.inp.room(want);
            let space = room.len();
            if space == 0 {
                break;
            }
            match c.sock.read(room) {
                Ok(0) => c.closed = true,
                Ok(k) => {
                    c.inp.end += k;
                    moved = true;
                    if k < space {
                        break; // drained: skip the read that would say EAGAIN
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => err = Some(format!("TCP receive failed: {e}")),
            }
        }
        match err {
            Some(why) => Err(self.fail(p, why)),
            None => Ok(moved),
        }
    }

    /// Waits up to `d` for any socket to become readable (or writable when output is queued).
    fn wait(&mut self, d: Duration) {
        self.fds.clear();
        for c in self.conns.iter().flatten() {
            self.fds.push(libc::pollfd {
                fd: c.sock.as_raw_fd(),
                events: libc::POLLIN | if c.out.is_empty() { 0 } else { libc::POLLOUT },
                revents: 0,
            });
        }
        // SAFETY: fds is a valid array of pollfd for the duration of the call.
        unsafe {
            libc::poll(
                self.fds.as_mut_ptr(),
                self.fds.len() as libc::nfds_t,
                d.as_millis().max(1) as i32,
            )
        };
    }

    /// The side channel and failure record (for the group's addresses).
    pub(crate) fn watch(&self) -> &Watch {
        &self.watch
    }

    /// The side channel and failure record, to record a failure.
    pub(crate) fn watch_mut(&mut self) -> &mut Watch {
        &mut self.watch
    }

    /// Moves what the sockets allow and reads the side channel now, without waiting: whether
    /// anything happened.
    pub(crate) fn poll_now(&mut self) -> Result<bool> {
        self.watch.poll_sometimes()?;
        let moved = self.pump()?;
        if moved {
            self.pacer.progress();
        }
        Ok(moved)
    }

    /// Something outside this transport moved (the no-progress clock restarts).
    pub(crate) fn note_progress(&mut self) {
        self.pacer.progress();
    }

    /// Whether every peer is still reachable, without blocking.
    pub fn health(&mut self) -> Result<()> {
        self.check_side()?;
        self.pump()?;
        for p in 0..self.n {
            if self.conns[p].as_ref().is_some_and(|c| c.closed) {
                return Err(self.fail(p, "its data connection closed".into()));
            }
        }
        Ok(())
    }

    /// Writes everything queued (bounded by the timeout).
    pub fn flush(&mut self) -> Result<()> {
        self.begin();
        while let Some(p) =
            (0..self.n).find(|&p| self.conns[p].as_ref().is_some_and(|c| !c.out.is_empty()))
        {
            self.progress(p)?;
        }
        Ok(())
    }
}

impl Link for TcpTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.n
    }

    fn peer(&self, rank: usize) -> Peer {
        self.watch.peer(rank)
    }

    fn max_chunk(&self) -> usize {
        self.max_chunk
    }

    fn medium(&self) -> super::Medium {
        super::Medium::Tcp
    }

    fn try_post(&mut self, p: usize, data: &[u8]) -> Result<bool> {
        if !self.conns[p]
            .as_ref()
            .expect("no link to self")
            .out
            .is_empty()
        {
            self.pump_one(p)?;
        }
        let c = self.conns[p].as_mut().expect("no link to self");
        if !c.out.is_empty() {
            return Ok(false);
        }
        self.pacer.progress();
        let mut header = [0u8; HDR];
        header[..4].copy_from_slice(&(data.len() as u32).to_le_bytes());
        header[OP_AT..OP_AT + op::WIRE].copy_from_slice(&OpDesc::numbered(self.op_wire, c.seq_out));
        let parts = [&header[..], data, &PAD[..pad(data.len())]];
        let mut done = 0;
        // Write straight from the caller's buffer; only what the socket does not take now is
        // copied.
        let iov = parts.map(IoSlice::new);
        match c.sock.write_vectored(&iov) {
            Ok(k) => done = k,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
            Err(e) => return Err(self.fail(p, format!("TCP send failed: {e}"))),
        }
        if done < parts.iter().map(|x| x.len()).sum() {
            c.out.keep_rest(&parts, done);
        }
        Ok(true)
    }

    fn try_take(&mut self, p: usize, f: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<bool> {
        let max = self.max_chunk;
        let c = self.conns[p].as_mut().expect("no link to self");
        match c.direct {
            Direct::Off => {}
            Direct::Armed => c.direct = Direct::Off,
            Direct::Placing { .. } => {
                return Err(Error::InvalidArgument(format!(
                    "a chunk from rank {p} is half placed by try_take_into: finish it first"
                )))
            }
        }
        let len = match c.inp.next_len(max) {
            Ok(Some(len)) => len,
            Ok(None) => return Ok(false),
            Err(why) => return Err(self.fail(p, why)),
        };
        self.check_op(p)?;
        let c = self.conns[p].as_mut().expect("present");
        let avail = c.inp.pending();
        let frame = HDR + len + pad(len);
        if avail.len() < frame {
            return Ok(false);
        }
        f(&avail[HDR..HDR + len])?;
        c.inp.consume(frame);
        self.pacer.progress();
        Ok(true)
    }

    fn try_take_into(&mut self, p: usize, dst: &mut [u8]) -> Result<bool> {
        let max = self.max_chunk;
        let c = self.conns[p].as_mut().expect("no link to self");
        let mut err = None;
        // The frame's zero padding after the payload, read and dropped.
        let mut sink = [0u8; 64];
        let tail = pad(dst.len());
        // Payload and padding bytes read into place together with the header.
        let mut early = 0;
        if let Direct::Off | Direct::Armed = c.direct {
            // The header: from the receive buffer; or, when nothing is buffered and the chunk
            // is large, read in one readv with as much payload (and padding) as has arrived,
            // straight into place (a header that then disagrees with `dst` is an error either
            // way); or read with at most 4 KiB of payload (all of a small chunk in one read).
            let have = c.inp.pending().len();
            if have < HDR && !c.closed {
                let room = c.inp.room(HDR + max);
                // Only once this operation's descriptor from p was checked: no byte of a
                // mismatched operation may land in the caller's buffer.
                let vectored =
                    have == 0 && c.verified && dst.len() > DIRECT_PEEK && room.len() >= HDR;
                let got = if vectored {
                    let (head, _) = room.split_at_mut(HDR);
                    let mut iov = [
                        IoSliceMut::new(head),
                        IoSliceMut::new(dst),
                        IoSliceMut::new(&mut sink[..tail]),
                    ];
                    c.sock.read_vectored(&mut iov)
                } else {
                    let n = (HDR + DIRECT_PEEK - have).min(room.len());
                    c.sock.read(&mut room[..n])
                };
                match got {
                    Ok(0) => c.closed = true,
                    Ok(k) if vectored => {
                        c.inp.end += k.min(HDR);
                        early = k.saturating_sub(HDR);
                    }
                    Ok(k) => c.inp.end += k,
                    Err(e)
                        if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
                    Err(e) => err = Some(format!("TCP receive failed: {e}")),
                }
            }
            if let Some(why) = err {
                return Err(self.fail(p, why));
            }
            let c = self.conns[p].as_mut().expect("present");
            let len = match c.inp.next_len(max) {
                Ok(Some(len)) => len,
                Ok(None) => {
                    c.direct = Direct::Armed;
                    return Ok(false);
                }
                Err(why) => return Err(self.fail(p, why)),
            };
            self.check_op(p)?;
            let c = self.conns[p].as_mut().expect("present");
            let avail = c.inp.pending();
            if len != dst.len() {
                c.direct = Direct::Off;
                return Err(Error::length_mismatch(len, dst.len(), p));
            }
            // What already sits in the receive buffer is copied (its padding dropped); the
            // rest is read in place.
            let k = (avail.len() - HDR).min(len + tail);
            let copied = k.min(len);
            crate::copy::copy(&mut dst[..copied], &avail[HDR..HDR + copied]);
            c.inp.consume(HDR + k);
            c.direct = Direct::Placing {
                placed: k + early,
                len,
            };
        }
        let c = self.conns[p].as_mut().expect("present");
        let Direct::Placing { mut placed, len } = c.direct else {
            unreachable!("placing");
        };
        if len != dst.len() {
            return Err(Error::length_mismatch(len, dst.len(), p));
        }
        let was = placed;
        let frame = len + tail;
        while placed < frame && !c.closed {
            let got = if placed < len {
                let mut iov = [
                    IoSliceMut::new(&mut dst[placed..]),
                    IoSliceMut::new(&mut sink[..tail]),
                ];
                c.sock.read_vectored(&mut iov)
            } else {
                c.sock.read(&mut sink[placed - len..tail])
            };
            match got {
                Ok(0) => c.closed = true,
                Ok(k) => placed += k,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    err = Some(format!("TCP receive failed: {e}"));
                    break;
                }
            }
        }
        if let Some(why) = err {
            return Err(self.fail(p, why));
        }
        if placed > was {
            self.pacer.progress();
        }
        let c = self.conns[p].as_mut().expect("present");
        if placed < frame {
            c.direct = Direct::Placing { placed, len };
            return Ok(false);
        }
        c.direct = Direct::Off;
        self.pacer.progress();
        Ok(true)
    }

    fn progress(&mut self, waiting_on: usize) -> Result<()> {
        self.watch.waiting_on(Some(waiting_on));
        self.watch.poll_sometimes()?;
        if self.pump()? {
            self.pacer.progress();
            return Ok(());
        }
        if self.conns[waiting_on]
            .as_ref()
            .is_some_and(|c| c.closed && c.inp.pending().len() < HDR)
        {
            return Err(self.fail(waiting_on, "its data connection closed".into()));
        }
        // Spin briefly (not at all when more local ranks than cores share the CPU), then yield
        // the core to whichever local rank has work, and only after 200 us of idleness block in
        // poll(2), which wakes as soon as data arrives: no core burnt on a long wait.
        match self.pacer.idle() {
            Wait::Spin => std::hint::spin_loop(),
            Wait::Yield => std::thread::yield_now(),
            Wait::BackOff => {
                self.watch.poll()?;
                self.wait(Duration::from_millis(1));
            }
            Wait::Expired => return Err(self.watch.stalled(waiting_on, self.timeout)),
        }
        Ok(())
    }

    fn start(&mut self, op: &OpDesc, scope: Scope) {
        self.op = *op;
        self.watch.waiting_on(None);
        self.op_wire = op.encode();
        for (p, c) in self.conns.iter_mut().enumerate() {
            let Some(c) = c.as_mut() else { continue };
            if scope.counts(p, true) {
                c.seq_out = c.seq_out.wrapping_add(1);
            }
            if scope.counts(p, false) {
                c.seq_in = c.seq_in.wrapping_add(1);
                c.verified = false;
            }
        }
    }

    fn begin(&mut self) {
        self.pacer.begin();
        for c in self.conns.iter_mut().flatten() {
            if c.direct == Direct::Armed {
                c.direct = Direct::Off;
            }
        }
    }

    fn finish(&mut self) -> Result<()> {
        self.flush()
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.timeout = self.timeout.min(Duration::from_secs(10));
        self.pacer.set_timeout(self.timeout);
        if self.watch.healthy() {
            let _ = self.flush();
        }
        self.watch.close(self.timeout);
    }
}

#[cfg(test)]
mod tests {
    use super::{pad, InQueue, OutQueue, HDR};

    #[test]
    fn out_queue_keeps_exactly_the_unwritten_rest() {
        let (header, data, tail) = (7u32.to_le_bytes(), *b"abcdefg", [0u8; 3]);
        let parts = [&header[..], &data[..], &tail[..]];
        let want = parts.concat();
        for done in 0..=want.len() {
            let mut q = OutQueue::default();
            if done < want.len() {
                q.keep_rest(&parts, done);
            }
            assert_eq!(
                &q.buf[q.head..],
                &want[done..],
                "after {done} bytes written"
            );
            q.advance(q.buf.len() - q.head);
            assert!(q.is_empty() && q.buf.is_empty() && q.head == 0);
        }
    }

    #[test]
    fn frames_are_whole_multiples_of_64_bytes() {
        for len in [0, 1, 8, 63, 64, 65, 4096, 65407, 65408] {
            let frame = HDR + len + pad(len);
            assert_eq!(frame % 64, 0, "{len}-byte payload");
            assert!(pad(len) < 64, "{len}-byte payload");
        }
    }

    #[test]
    fn in_queue_compacts_only_when_a_chunk_would_not_fit() {
        let mut q = InQueue::new(16);
        q.room(8)[..10].copy_from_slice(b"0123456789");
        q.end += 10;
        q.consume(6);
        // 6 bytes free behind the 4 pending: enough for 6, so nothing moves.
        assert_eq!(q.room(6).len(), 6);
        assert_eq!((q.start, q.pending()), (6, &b"6789"[..]));
        // 8 do not fit behind: the pending bytes move to the front.
        assert_eq!(q.room(8).len(), 12);
        assert_eq!((q.start, q.pending()), (0, &b"6789"[..]));
        q.consume(4);
        assert_eq!((q.start, q.end), (0, 0));
    }
}
