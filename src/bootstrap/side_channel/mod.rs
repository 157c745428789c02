//! The side channel: the rendezvous' connections, kept open for the close barrier, aborts,
//! stall reports (rank 0 judges whom the waits lead to) and goodbyes.

mod relay;
pub(crate) mod stalls;
use self::relay::{Event, Relay, Shared};
use self::stalls::{verdict, STALL_VERDICT, STALL_WINDOW};
use crate::bootstrap::wire::*;
use crate::error::{Error, Result};
use std::io::{ErrorKind, Read};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A rank's wait on a peer, told to that peer ([`SideChannel::probe`]).
#[derive(Debug, Clone, Copy)]
pub struct Probe {
    /// The rank that waits (as received; as sent, the rank waited on).
    pub from: usize,
    /// Its operations from the rank it waits on, this one included if it receives from there.
    pub seq_in: u64,
    /// Its operations toward that rank, this one included if it sends there.
    pub seq_out: u64,
    /// Its operation's descriptor (the number in it is not read).
    pub desc: [u8; crate::bootstrap::DESC_BYTES],
    /// Whether its operation sends to the rank it waits on (as number `seq_out`).
    pub sends: bool,
    /// Whether its operation receives from the rank it waits on (as number `seq_in`).
    pub recvs: bool,
}

/// Most probes kept unread (and held by a watch); the buffers are made this large at once, so
/// that a slow wait that probes allocates nothing.
pub const MAX_PROBES: usize = 64;

/// Bytes read from a side-channel stream at once.
const SIDE_READ: usize = 4096;

/// The open TCP connections: rank 0 holds one per other rank, every other rank one to rank 0.
pub struct SideChannel {
    rank: usize,
    /// Shared with rank 0's relay, which reads and writes them too (no second descriptor).
    streams: Vec<Option<Arc<TcpStream>>>,
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
    /// The abort flag and write lock this side channel shares with its relay.
    shared: Arc<Shared>,
    /// Rank 0, once non-blocking: the thread that reads and relays ([`Relay`]).
    relay: Option<Relay>,
    /// Rank 0: whom each rank said it waits on after its wait ran out.
    stalls: Vec<Option<usize>>,
    /// Rank 0: when the first stall report came.
    stall_since: Option<Instant>,
    /// Whom this rank waits on now, if it is inside an operation.
    waiting: Option<usize>,
    /// When each rank was learned to be closing its communicator.
    leaving: Vec<Option<Instant>>,
    /// Probes addressed to this rank, not yet read.
    probes: Vec<Probe>,
    /// What the rendezvous left to reach the group without this channel, until taken.
    control: Option<crate::bootstrap::wire::port::Control>,
}

impl SideChannel {
    fn peer(&self, r: usize) -> crate::Peer {
        crate::Peer {
            rank: r,
            addr: self.addrs[r].clone(),
        }
    }

    /// Every rank waits until every rank has called this (over TCP, through rank 0). An abort
    /// that arrives meanwhile (a rank that could not set up) is recorded and, on rank 0, passed
    /// on to every rank, so each names the rank and cause it names.
    pub fn barrier(&mut self) -> Result<()> {
        let deadline = Instant::now() + self.timeout;
        if self.rank == 0 {
            for r in 1..self.streams.len() {
                if let Err((failed, why)) = self.await_frame(r, READY, deadline) {
                    self.record_failure(failed, why.clone());
                    self.abort(failed, &why);
                    return Err(self.barrier_error(failed, why));
                }
            }
            for r in 1..self.streams.len() {
                let peer = self.peer(r);
                let s = self.streams[r]
                    .as_deref()
                    .expect("rank 0 holds every stream");
                send_frame(s, GO, &[]).map_err(|e| Error::PeerFailed {
                    peer,
                    reason: format!("side channel: {e}"),
                })?;
            }
            Ok(())
        } else {
            let peer = self.peer(0);
            let s = self.streams[0].as_deref().expect("a stream to rank 0");
            send_frame(s, READY, &[]).map_err(|e| Error::PeerFailed {
                peer: peer.clone(),
                reason: format!("side channel: {e}"),
            })?;
            // Rank 0 judges a rank that never comes at its own deadline and tells this one:
            // the wait for its word lasts a grace longer, so that word names the true cause.
            let grace = (self.timeout / 4).max(Duration::from_secs(2));
            match self.await_frame(0, GO, deadline + grace) {
                Ok(()) => Ok(()),
                Err((failed, why)) => {
                    self.record_failure(failed, why.clone());
                    Err(self.barrier_error(failed, why))
                }
            }
        }
    }

    /// Reads frames from rank `r` (blocking) until one of kind `want`: or the rank to blame and
    /// why (an abort's own, a time-out, a connection that ended).
    fn await_frame(
        &mut self,
        r: usize,
        want: u8,
        deadline: Instant,
    ) -> std::result::Result<(), (usize, String)> {
        let n = self.streams.len();
        let Some(s) = self.streams[r].as_deref() else {
            return Err((r, "its side channel had closed".into()));
        };
        match recv_frame(s, deadline) {
            Ok((k, _)) if k == want => Ok(()),
            Ok((ABORT, body)) => Err(parse_abort(&body, r, n)),
            Ok((k, _)) => Err((
                r,
                format!("unexpected side-channel message {k} at a barrier"),
            )),
            Err(e) if e.kind() == ErrorKind::TimedOut => Err((
                r,
                format!(
                    "{STALL_VERDICT}: did not reach the set-up barrier within {:?}",
                    self.timeout
                ),
            )),
            Err(e) => Err((r, format!("side channel: {e} (during set-up)"))),
        }
    }

    /// A barrier's failure as an error naming `failed`.
    fn barrier_error(&self, failed: usize, why: String) -> Error {
        match why.strip_prefix(STALL_VERDICT) {
            Some(_) => Error::Timeout {
                peer: self.peer(failed),
                what: why,
                after: self.timeout,
            },
            None => Error::PeerFailed {
                peer: self.peer(failed),
                reason: why,
            },
        }
    }

    /// A set-up step's result, told to the group when it failed here (a queue pair that cannot
    /// connect, a segment that cannot be mapped, a data connection): the others then name the
    /// rank to blame (the one the error names, or this one) and the cause, instead of a
    /// connection that closed. Nothing is told if a failure was already learned.
    pub fn told<T>(&mut self, r: Result<T>) -> Result<T> {
        self.told_during(r, "set up its transport")
    }

    /// [`SideChannel::told`] for another set-up step (`step`, as in "rank 3 could not
    /// {step}").
    pub(crate) fn told_during<T>(&mut self, r: Result<T>, step: &str) -> Result<T> {
        let Err(e) = r else { return r };
        if self.failure.is_none() {
            let blamed = e.peer().map_or(self.rank, |p| p.rank);
            let why = format!("rank {} could not {step}: {e}", self.rank);
            self.record_failure(blamed, why.clone());
            self.abort(blamed, &why);
        }
        Err(e)
    }

    /// [`SideChannel::told`] for a step whose failure may be the echo of another rank's (a
    /// peer's segment gone with the peer that failed first): what that rank told arrives within
    /// moments (250 ms are allowed), and is then the error, naming that rank and its cause.
    pub fn told_or_echo<T>(&mut self, r: Result<T>) -> Result<T> {
        if r.is_err() && self.failure.is_none() {
            self.learn_for(Duration::from_millis(250));
            if let Some((failed, why)) = self.failure.clone() {
                return Err(Error::PeerFailed {
                    peer: self.peer(failed),
                    reason: why,
                });
            }
        }
        self.told(r)
    }

    /// Reads (rank 0: and relays) what arrives for up to `d` or until a failure is learned,
    /// during set-up (the connections block then: they are read without blocking meanwhile).
    fn learn_for(&mut self, d: Duration) {
        if self.relay.is_some() {
            return;
        }
        let set = |streams: &[Option<Arc<TcpStream>>], nb: bool| {
            for s in streams.iter().flatten() {
                let _ = s.set_nonblocking(nb);
            }
        };
        set(&self.streams, true);
        let until = Instant::now() + d;
        loop {
            self.poll();
            if self.failure.is_some() || Instant::now() >= until {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        set(&self.streams, false);
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
            socket2::SockRef::from(&**s).set_tcp_keepalive(&ka)?;
        }
        if self.rank == 0 && self.streams.len() > 1 {
            self.relay = Some(Relay::start(&self.streams, self.shared.clone())?);
        }
        Ok(())
    }

    /// Writes one frame to rank `r`, if connected (never interleaved with the relay's).
    fn send(&mut self, r: usize, kind: u8, body: &[u8]) {
        let _g = self
            .shared
            .write_lock
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(s) = self.streams.get(r).and_then(Option::as_ref) {
            let _ = send_frame_nb(s, kind, body);
        }
    }

    /// Writes one frame to every connected rank but `except`.
    fn send_all(&mut self, kind: u8, body: &[u8], except: Option<usize>) {
        for r in (0..self.streams.len()).filter(|&r| Some(r) != except) {
            self.send(r, kind, body);
        }
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
        if self.relay.is_some() {
            for e in self.shared.take() {
                match e {
                    Event::Frame(r, kind, body) => self.handle(r, kind, &body),
                    Event::Ended(r, why) => {
                        self.streams[r] = None;
                        if !why.is_empty() && !self.left[r] {
                            self.record_failure(r, why);
                        }
                    }
                }
            }
            return;
        }
        let mut buf = [0u8; SIDE_READ];
        for r in 0..self.streams.len() {
            while let Some(mut s) = self.streams[r].as_deref() {
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
        // Frames are handled in place (no copy each): the buffer is put back, keeping its room.
        let mut p = std::mem::take(&mut self.pending[r]);
        let mut at = 0;
        while p.len() - at >= 4 {
            let len = u32::from_le_bytes(p[at..at + 4].try_into().expect("4 bytes")) as usize;
            if len == 0 || len > MAX_FRAME {
                self.record_failure(
                    r,
                    format!("sent a malformed side-channel frame ({len} bytes)"),
                );
                at = p.len();
                break;
            }
            if p.len() - at < 4 + len {
                break;
            }
            self.handle(r, p[at + 4], &p[at + 5..at + 4 + len]);
            at += 4 + len;
        }
        p.drain(..at);
        self.pending[r] = p;
    }

    /// A frame from stream `r`. Rank 0 passes on what every rank must learn, unless its relay
    /// did already.
    fn handle(&mut self, r: usize, kind: u8, body: &[u8]) {
        let relays = self.rank == 0 && self.relay.is_none();
        match kind {
            ABORT => {
                let (failed, why) = parse_abort(body, r, self.addrs.len());
                self.record_failure(failed, why.clone());
                if relays {
                    self.abort(failed, &why);
                }
            }
            BYE => self.left[r] = true,
            LEAVING => {
                let who = Reader(body).u32().map_or(r, |w| w as usize);
                let who = if who < self.leaving.len() { who } else { r };
                if self.leaving[who].is_none() {
                    self.leaving[who] = Some(Instant::now());
                    if relays {
                        self.send_all(LEAVING, body, Some(who));
                    }
                }
            }
            PROBE => self.take_probe(r, body),
            STALLED if self.rank == 0 && self.relay.is_none() => {
                let on = Reader(body).u32().map_or(usize::MAX, |w| w as usize);
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

    /// A probe from stream `r`: kept if for this rank, relayed by rank 0 if for another. The
    /// sender is the stream's own rank unless rank 0 relayed it.
    fn take_probe(&mut self, r: usize, body: &[u8]) {
        let mut rd = Reader(body);
        let (Ok(to), Ok(from), Ok(seq_in), Ok(seq_out), Ok(desc), Ok(dirs)) = (
            rd.u32(),
            rd.u32(),
            rd.u64(),
            rd.u64(),
            rd.take(16),
            rd.take(1),
        ) else {
            return;
        };
        let (to, from) = (to as usize, from as usize);
        if to >= self.streams.len() || from >= self.streams.len() || (r != 0 && from != r) {
            return;
        }
        if to == self.rank {
            if self.probes.len() < MAX_PROBES {
                self.probes.push(Probe {
                    from,
                    seq_in,
                    seq_out,
                    desc: desc.try_into().expect("16 bytes"),
                    sends: dirs[0] & 1 != 0,
                    recvs: dirs[0] & 2 != 0,
                });
            }
        } else if self.rank == 0 {
            self.send(to, PROBE, body);
        }
    }

    /// Tells the group that `failed` failed (non-zero ranks tell rank 0, which tells everyone).
    pub fn abort(&mut self, failed: usize, reason: &str) {
        if self.shared.abort_sent.swap(true, Ordering::SeqCst) {
            return;
        }
        let mut body = Vec::new();
        body.extend_from_slice(&(failed as u32).to_le_bytes());
        put_bytes(&mut body, reason.as_bytes());
        self.send_all(ABORT, &body, None);
    }

    /// Close barrier, bounded by `limit`: returns when every rank has reached it (so no rank
    /// tears down queue pairs a peer still writes to), or on failure or time-out.
    pub fn close_barrier(&mut self, limit: Duration) -> Result<()> {
        let deadline = Instant::now() + limit;
        if self.rank != 0 {
            self.send(0, READY, &[]);
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
            self.send_all(GO, &[], None);
        }
        Ok(())
    }

    /// Says goodbye: closing after this is not a failure.
    pub fn bye(&mut self) {
        self.send_all(BYE, &[], None);
    }

    /// The side channel over the rendezvous' connections (`streams[r]`: to rank r, if held).
    pub(crate) fn new(
        rank: usize,
        streams: Vec<Option<TcpStream>>,
        addrs: Vec<String>,
        timeout: Duration,
    ) -> Self {
        let n = streams.len();
        // Until they turn non-blocking, a frame to a peer that reads nothing fails after this
        // rather than blocking (send_frame_nb then shuts a half-written one down).
        for s in streams.iter().flatten() {
            let _ = s.set_write_timeout(Some(FRAME_WITHIN));
        }
        SideChannel {
            rank,
            streams: streams.into_iter().map(|s| s.map(Arc::new)).collect(),
            addrs,
            timeout,
            // A rank's one stream (to rank 0) has room for two reads from the start: frames
            // that pile up in a long wait (probes) are read without allocating.
            pending: (0..n)
                .map(|r| {
                    let room = if rank != 0 && r == 0 {
                        2 * SIDE_READ
                    } else {
                        0
                    };
                    Vec::with_capacity(room)
                })
                .collect(),
            left: vec![false; n],
            ready: vec![false; n],
            go: false,
            failure: None,
            shared: Arc::default(),
            relay: None,
            stalls: vec![None; n],
            stall_since: None,
            waiting: None,
            leaving: vec![None; n],
            probes: Vec::with_capacity(MAX_PROBES),
            control: None,
        }
    }

    /// Keeps `c` until the communicator takes it ([`SideChannel::take_control`]).
    pub(crate) fn keep_control(&mut self, c: crate::bootstrap::wire::port::Control) {
        self.control = Some(c);
    }

    /// The control port and the group's ports, once.
    pub(crate) fn take_control(&mut self) -> Option<crate::bootstrap::wire::port::Control> {
        self.control.take()
    }

    /// Tells rank `p.from` (through rank 0) that this rank waits on it (`p`, with `from` the
    /// rank waited on).
    pub fn probe(&mut self, p: &Probe) {
        let to = p.from;
        let mut body = [0u8; 41];
        body[..4].copy_from_slice(&(to as u32).to_le_bytes());
        body[4..8].copy_from_slice(&(self.rank as u32).to_le_bytes());
        body[8..16].copy_from_slice(&p.seq_in.to_le_bytes());
        body[16..24].copy_from_slice(&p.seq_out.to_le_bytes());
        body[24..40].copy_from_slice(&p.desc);
        body[40] = p.sends as u8 | (p.recvs as u8) << 1;
        let via = if self.rank == 0 { to } else { 0 };
        self.send(via, PROBE, &body);
    }

    /// The probes that reached this rank since the last call, into `out` (cleared first; the
    /// two buffers swap, so neither allocates again).
    pub fn take_probes(&mut self, out: &mut Vec<Probe>) {
        out.clear();
        std::mem::swap(out, &mut self.probes);
    }

    /// Tells the group that this rank closes its communicator (rank 0 relays it): a rank that
    /// waits on it then fails naming the departure instead of waiting out the timeout.
    pub fn leave(&mut self) {
        let body = (self.rank as u32).to_le_bytes();
        self.send_all(LEAVING, &body, None);
    }

    /// Since when rank `r` has been known to be closing its communicator, if it is.
    pub fn leaving_since(&self, r: usize) -> Option<Instant> {
        self.leaving.get(r).copied().flatten()
    }

    /// This rank's wait on `waiting_on` ran out: tell rank 0 (or, on rank 0, note it), which
    /// names the rank the waits lead to once the reports are in ([`STALL_WINDOW`]).
    pub fn report_stall(&mut self, waiting_on: usize) {
        if self.rank == 0 {
            self.stalls[0] = Some(waiting_on);
            self.stall_since.get_or_insert_with(Instant::now);
            self.shared.stalled_on(waiting_on);
        } else {
            self.send(0, STALLED, &(waiting_on as u32).to_le_bytes());
        }
    }

    /// Rank 0 without a relay, once stall reports have gathered for [`STALL_WINDOW`]: names the
    /// rank the waits lead to ([`verdict`]) and tells the group (the relay does it otherwise).
    fn judge_stalls(&mut self) {
        let Some(since) = self.stall_since else {
            return;
        };
        if self.failure.is_some() || since.elapsed() < STALL_WINDOW {
            return;
        }
        let mut waiting = vec![None; self.stalls.len()];
        waiting[0] = self.waiting;
        if let Some((culprit, why)) = verdict(&self.stalls, &waiting) {
            self.record_failure(culprit, why.clone());
            self.abort(culprit, &why);
        }
    }

    /// Whom this rank waits on now (rank 0's relay reads it when it judges a stall).
    #[inline]
    pub fn set_waiting(&mut self, p: Option<usize>) {
        if self.waiting != p {
            self.waiting = p;
            if self.relay.is_some() {
                self.shared.set_waiting(p);
            }
        }
    }

    /// Whom this rank waits on now, if it is inside an operation.
    #[inline]
    pub fn waiting(&self) -> Option<usize> {
        self.waiting
    }
}

/// An abort's body: the rank that failed (`from` where it names none of the `n`) and why.
pub(super) fn parse_abort(body: &[u8], from: usize, n: usize) -> (usize, String) {
    let mut rd = Reader(body);
    let failed = rd.u32().map_or(from, |f| f as usize);
    let why = rd.string().unwrap_or_default();
    (if failed < n { failed } else { from }, why)
}

impl Drop for SideChannel {
    fn drop(&mut self) {
        // The relay stops before the connections it reads end, so their end is no failure.
        if let Some(r) = &self.relay {
            r.stop();
        }
        for s in self.streams.iter().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
        self.relay = None;
    }
}
