//! The RDMA transport: one reliable-connected QP per peer, one registered buffer holding every
//! peer's receive slots, send staging slots and credit words, and RDMA WRITE_WITH_IMM into the
//! peer's slots with credit-based flow control (never RNR).
//!
//! Protocol, per ordered pair (writer w, reader r), with S slots of B bytes:
//! - chunk number k goes to r's slot `k % S` (a WRITE_WITH_IMM; the immediate's low 16 bits are
//!   `k`, its high 16 bits the count of w's own chunks that w has consumed from r, so credits
//!   ride along with data; the receive completion's byte count is the length);
//! - w may post chunk k only when r has consumed chunk k-S: r reports its consumed count by an
//!   8-byte inline RDMA WRITE into w's credit word for r once S/2 chunks went unreported (a data
//!   write from r to w reports them too, so exchanges between two ranks need no credit writes);
//! - w reuses its staging slot `k % S` only after the write of chunk k-S completed, or at once
//!   for a chunk sent inline (its bytes were copied into the work request when posted).
//! - Writes that need nothing after they are posted (credit words, and data of at most
//!   [`MAX_INLINE`] bytes, both copied at post time) go unsignaled, at most [`QUIET_MAX`] in a
//!   row: the completion of a later signaled write (RC completes in order) retires them, and
//!   the send queue has room for that many and the chunks that hold slots.
//! - Zero copy (opt-in): while an operation lends a buffer of at least
//!   `RDMACOMM_ZERO_COPY_MIN` bytes ([`Link::lend`]), it is registered for that operation and
//!   chunks above [`MAX_INLINE`] posted from it are written straight from it, skipping the
//!   staging slot; a range is not landed into before the writes reading it completed
//!   ([`Link::settle`]), and the registration ends with the operation. (Not cached across
//!   calls: without memory hooks a cache keyed by address would send stale pages after the
//!   caller frees and reallocates.)
//! - Registered buffers ([`Link::register`], scoped by `Communicator::with_registered`): the
//!   same zero-copy path for every chunk above [`MAX_INLINE`] posted from inside one, with no
//!   registration per operation; at most [`MAX_REGISTERED`] at once.
//! - Mailboxes: a chunk of at most [`mailbox::MAX_PAYLOAD`] bytes goes instead as a plain inline
//!   RDMA WRITE into r's 64-byte mailbox `k % S` for w (same credits as slot `k % S`), laid out
//!   by [`mailbox`]: the payload, w's consumed count, and a tag naming `k`, ending at the
//!   entry's end. r finds it by reading the tag in memory: no receive work request, no
//!   completion to poll, and credits ride along as with an immediate. A writer that waits for
//!   credits also reads them from mailbox chunks that arrived but are not taken yet, as it
//!   would see an immediate's on polling (measured: docs/DESIGN.md).

use crate::config::Config;
use crate::error::{Error, Peer, Result};
use crate::transport::bootstrap::{check_tags, Reader, TAG_RDMA};
use crate::transport::mailbox::{self, ENTRY};
use crate::transport::op::{self, OpDesc, OpKind, Scope};
use crate::transport::pacer::{self, oversubscribed, Pacer, Wait};
use crate::transport::rendezvous::{Card, Rendezvous};
use crate::transport::watch::Watch;
use crate::transport::{copy_chunk, Link};
use crate::verbs::queue::MAX_INLINE;
use crate::verbs::{
    self, AsyncEvent, AsyncEvents, CompletionQueue, Endpoint, LentRegion, RcQueuePair,
    RegisteredBuffer, RetryPolicy, Sge,
};
use sideway::ibverbs::device_context::{DeviceContext, PortState};
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::QueuePairState;
use std::collections::VecDeque;
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Idle time spent spinning, then yielding, before napping.
const SPIN: Duration = Duration::from_micros(100);
const YIELD: Duration = Duration::from_millis(2);
const KIND_DATA: u64 = 0;
const KIND_CREDIT: u64 = 1;
const KIND_RECV: u64 = 2;
const KIND_PROBE: u64 = 3;
/// Most unsignaled writes in a row (each signaled completion costs the device a completion
/// entry and the poller a read).
pub const QUIET_MAX: u32 = 8;
/// `chunk_wr` of a chunk whose staging slot is free once posted (sent inline).
const FREE_AT_POST: u64 = u64::MAX;
/// Most buffers registered at once with one communicator ([`Link::register`]).
pub const MAX_REGISTERED: usize = 64;
/// `lens` of a slot that holds no arrived chunk.
const EMPTY: u32 = u32::MAX;

/// A peer's consumed count of our chunks from its low 16 bits (an immediate's or a mailbox
/// tag's): it lies at most `slots` below `sent`, the chunks we posted.
fn below(sent: u64, low: u16) -> u64 {
    let behind = sent.wrapping_sub(u64::from(low)) & 0xffff;
    sent - behind.min(sent)
}

fn wr_id(kind: u64, peer: usize, index: u64) -> u64 {
    (kind << 62) | ((peer as u64) << 48) | (index & 0xffff_ffff_ffff)
}

/// The remote half of a link: where to write on the peer.
#[derive(Debug, Clone, Copy, Default)]
struct Remote {
    addr: u64,
    rkey: u32,
}

struct PeerState {
    qp: RcQueuePair,
    remote: Remote,
    /// Chunks posted to this peer.
    sent: u64,
    /// Data writes completed.
    send_done: u64,
    /// WRs posted on this QP, and completed (all WRs before a completed signaled one are done).
    wr_posted: u64,
    wr_done: u64,
    /// Unsignaled WRs posted since the last signaled one.
    unsignaled: u32,
    /// The WR number of each chunk in flight, by slot (to retire unsignaled ones).
    chunk_wr: Vec<u64>,
    /// The lowest chunk number the next receive completion from this peer may carry.
    cq_next: u64,
    /// Chunks consumed from this peer.
    consumed: u64,
    /// The consumed count last reported to the writer.
    returned: u64,
    /// This peer's consumed count of our chunks, as its data writes reported it.
    peer_consumed: u64,
    /// Length of the chunk that arrived in each slot by WRITE_WITH_IMM and is unconsumed, by
    /// slot ([`EMPTY`] when none: the chunk is yet to come or comes through the mailbox).
    lens: Vec<u32>,
    /// When the outstanding health probe (a zero-byte RDMA write) was posted.
    probe: Option<Instant>,
    /// The next chunk posted to this peer is the operation's first to it: it carries the
    /// operation's descriptor.
    head_out: bool,
    /// The next chunk taken from this peer is its first of the operation: it must carry a
    /// descriptor equal to ours.
    head_in: bool,
    /// The numbers of the latest operation that sent to this peer, and that received from it
    /// (see [`OpDesc::seq`]).
    seq_out: u64,
    seq_in: u64,
}

impl PeerState {
    /// Advances `send_done` over the chunks, in order, whose staging slots are free: written
    /// (their WR completed) or sent inline.
    fn retire_sends(&mut self, slots: u64) {
        while self.send_done < self.sent {
            let wr = self.chunk_wr[(self.send_done % slots) as usize];
            if wr != FREE_AT_POST && wr >= self.wr_done {
                break;
            }
            self.send_done += 1;
        }
    }
}

/// Bytes before each slot's data, where the operation header of an operation's first chunk
/// lands (just ahead of the data, which stays 64-byte aligned).
const PRE: usize = 64;

/// Buffer layout: for each rank p (own index unused) a block that only p may write, under a key
/// of its own: recv slots, a credit line, mailboxes; then the send slots for every rank, which
/// no peer may write. A slot is [`PRE`] bytes, then `slot` bytes of data.
#[derive(Debug, Clone, Copy)]
struct Layout {
    n: usize,
    slots: usize,
    slot: usize,
}

impl Layout {
    fn region(&self) -> usize {
        self.slots * (PRE + self.slot)
    }
    /// Bytes of the block each peer writes.
    fn block(&self) -> usize {
        self.region() + 64 + self.slots * ENTRY
    }
    /// The block `p` writes.
    fn window(&self, p: usize) -> std::ops::Range<usize> {
        p * self.block()..(p + 1) * self.block()
    }
    /// Where chunk `k` from `p` lands: the data's offset.
    fn recv_off(&self, p: usize, k: u64) -> usize {
        p * self.block() + (k as usize % self.slots) * (PRE + self.slot) + PRE
    }
    /// Where chunk `k` to `p` is staged: the data's offset.
    fn send_off(&self, p: usize, k: u64) -> usize {
        self.n * self.block()
            + p * self.region()
            + (k as usize % self.slots) * (PRE + self.slot)
            + PRE
    }
    fn credit_off(&self, p: usize) -> usize {
        p * self.block() + self.region()
    }
    fn mailbox_off(&self, p: usize, k: u64) -> usize {
        p * self.block() + self.region() + 64 + (k as usize % self.slots) * ENTRY
    }
    fn total(&self) -> usize {
        self.n * (self.block() + self.region())
    }
}

/// The RDMA transport of one rank. Field order is drop order: QPs before the CQ and the buffer.
pub struct RdmaTransport {
    peers: Vec<Option<PeerState>>,
    /// The buffer the current operation lent for zero-copy sends, registered.
    lent: Option<LentRegion>,
    /// Buffers registered across operations ([`Link::register`]), by id.
    registered: Vec<(u64, LentRegion)>,
    next_registration: u64,
    /// Zero-copy writes in flight: (peer, chunk number, source start, source end).
    zc: VecDeque<(usize, u64, usize, usize)>,
    /// Smallest buffer worth registering for one operation (0: never).
    zc_min: usize,
    cq: CompletionQueue,
    buf: RegisteredBuffer,
    _pd: Arc<ProtectionDomain>,
    _ctx: Arc<DeviceContext>,
    /// The side channel and the first failure.
    watch: Watch,
    events: AsyncEvents,
    layout: Layout,
    rank: usize,
    timeout: Duration,
    /// How waits spin, yield and nap, and when they time out.
    pacer: Pacer,
    device: String,
    port: u8,
    /// The operation under way, and its descriptor's bytes (numbered per peer when sent).
    op: OpDesc,
    op_wire: [u8; op::WIRE],
}

impl RdmaTransport {
    /// Opens the device, registers memory, creates one QP per peer, meets every rank through
    /// `meet` (which exchanges cards and returns the side channel: the bootstrap, or a parent
    /// communicator for `split`), and connects. Every rank of `cfg.world_size` must call this.
    pub fn connect_with(
        cfg: &Config,
        meet: &mut dyn FnMut(&Card) -> Result<Rendezvous>,
    ) -> Result<Self> {
        cfg.validate()?;
        let n = cfg.world_size;
        let (ctx, sel) = verbs::open(&cfg.device)?;
        let pd = ctx.alloc_pd().map_err(|e| Error::Verbs {
            op: "allocate protection domain",
            detail: e.to_string(),
            source: Some(Box::new(e)),
        })?;
        let layout = Layout {
            n,
            slots: cfg.slots,
            slot: cfg.slot_bytes,
        };
        let windows: Vec<_> = (0..n)
            .filter(|&p| p != cfg.rank)
            .map(|p| layout.window(p))
            .collect();
        let buf = RegisteredBuffer::with_windows(&pd, layout.total(), &windows)?;
        let s = cfg.slots as u32;
        let send_depth = 2 * s + 16;
        let cq_depth = ((send_depth + s) * (n as u32 - 1).max(1)).max(64);
        let cq = CompletionQueue::new(&ctx, cq_depth)?;
        let mut qps: Vec<Option<RcQueuePair>> = Vec::with_capacity(n);
        for p in 0..n {
            qps.push(if p == cfg.rank {
                None
            } else {
                Some(RcQueuePair::new(&pd, &cq, &sel, send_depth, s)?)
            });
        }
        // Our card: geometry and buffer address for every rank; for each rank, the endpoint of
        // its queue pair and the key of the one block it may write.
        let mut common = Vec::new();
        common.extend_from_slice(&TAG_RDMA.to_le_bytes());
        common.extend_from_slice(&(cfg.slots as u32).to_le_bytes());
        common.extend_from_slice(&(cfg.slot_bytes as u32).to_le_bytes());
        common.extend_from_slice(&buf.addr().to_le_bytes());
        let mut each = Vec::with_capacity(n * (Endpoint::BYTES + 4));
        for (p, qp) in qps.iter().enumerate() {
            let e = qp.as_ref().map(|q| q.endpoint()).unwrap_or_default();
            each.extend_from_slice(&e.to_bytes());
            let key = if p == cfg.rank {
                0
            } else {
                buf.rkey_at(layout.window(p).start)
            };
            each.extend_from_slice(&key.to_le_bytes());
        }
        let card = Card {
            common,
            entry: Endpoint::BYTES + 4,
            each,
        };
        let rv = meet(&card)?;
        check_tags(&rv.cards, &rv.addrs, cfg.rank, TAG_RDMA)?;
        let mut side = rv.side;
        let policy = RetryPolicy::for_limit(cfg.timeout, cfg.ib_timeout, cfg.ib_retry);
        let mut peers: Vec<Option<PeerState>> = Vec::with_capacity(n);
        for (p, qp) in qps.into_iter().enumerate() {
            let Some(mut qp) = qp else {
                peers.push(None);
                continue;
            };
            let addr_p = &rv.addrs[p];
            let mut r = Reader(&rv.cards[p][4..]);
            let (slots, slot) = (r.u32()? as usize, r.u32()? as usize);
            if slots != cfg.slots || slot != cfg.slot_bytes {
                return Err(Error::Config(format!(
                    "rank {p} ({addr_p}) uses {slots} slots of {slot} bytes but rank {} uses {} of {}: \
                     set RDMACOMM_SLOTS / RDMACOMM_SLOT_BYTES alike on every rank",
                    cfg.rank, cfg.slots, cfg.slot_bytes
                )));
            }
            let addr = r.u64()?;
            // The endpoint of p's queue pair for us, and the key of our block in p's buffer.
            let mine = Endpoint::from_bytes(r.take(Endpoint::BYTES)?).expect("BYTES taken");
            let remote = Remote {
                addr,
                rkey: r.u32()?,
            };
            for k in 0..cfg.slots as u64 {
                qp.post_recv(wr_id(KIND_RECV, p, k))?;
            }
            qp.connect(&mine, policy).map_err(|e| Error::PeerFailed {
                peer: Peer {
                    rank: p,
                    addr: addr_p.clone(),
                },
                reason: format!("connecting the queue pair: {e}"),
            })?;
            peers.push(Some(PeerState {
                qp,
                remote,
                sent: 0,
                send_done: 0,
                wr_posted: 0,
                wr_done: 0,
                unsignaled: 0,
                chunk_wr: vec![0; cfg.slots],
                cq_next: 0,
                consumed: 0,
                returned: 0,
                peer_consumed: 0,
                lens: vec![EMPTY; cfg.slots],
                probe: None,
                head_out: false,
                head_in: false,
                seq_out: u64::MAX,
                seq_in: u64::MAX,
            }));
        }
        // Nobody writes before every QP is ready to receive.
        side.barrier()?;
        side.set_async()?;
        let events = AsyncEvents::new(&ctx)?;
        // Spin for the first 100 us of idleness (a round trip; not at all with more local ranks
        // than cores), yield up to 2 ms, then nap 50 us at a time: no core burnt on a long
        // wait. RDMACOMM_POLL=spin never stops spinning; =yield never spins.
        let crowded = oversubscribed(&rv.addrs, cfg.rank, cfg.local_world);
        let pacer = pacer::for_setting(cfg.poll, cfg.timeout, crowded, SPIN, YIELD);
        let zc_min = cfg.zero_copy_min;
        Ok(RdmaTransport {
            peers,
            lent: None,
            registered: Vec::new(),
            next_registration: 0,
            zc: VecDeque::with_capacity(n * cfg.slots),
            zc_min,
            cq,
            buf,
            _pd: pd,
            _ctx: ctx,
            watch: Watch::new(side, cfg.rank, rv.addrs),
            events,
            layout,
            rank: cfg.rank,
            timeout: cfg.timeout,
            pacer,
            device: format!("{} port {} GID[{}]", sel.device, sel.port, sel.gid_index),
            port: sel.port,
            op: OpDesc::new(OpKind::Barrier, 0),
            op_wire: OpDesc::new(OpKind::Barrier, 0).encode(),
        })
    }

    /// Something moved: reset the no-progress clock and the idle streak.
    fn made_progress(&mut self) {
        self.pacer.progress();
    }

    /// Whether our port is ACTIVE (queried from the device).
    fn port_active(&self) -> bool {
        self._ctx
            .query_port(self.port)
            .is_ok_and(|a| a.port_state() == PortState::Active)
    }

    /// The device, port and GID in use, in words.
    pub fn device(&self) -> &str {
        &self.device
    }

    fn state(&mut self, p: usize) -> &mut PeerState {
        self.peers[p].as_mut().expect("no link to self")
    }

    /// Records the first failure, tells the group, and returns it as an error.
    fn fail(&mut self, p: usize, reason: String) -> Error {
        self.watch.fail(p, reason)
    }

    /// This rank failed: tell every peer.
    pub fn abort(&mut self, reason: String) {
        self.watch.abort_self(reason);
    }

    /// Failures learned from the side channel (a peer's abort, a closed connection).
    fn check_side(&mut self) -> Result<()> {
        self.watch.poll()
    }

    /// The side channel and failure record (for the group's addresses).
    pub(crate) fn watch(&self) -> &Watch {
        &self.watch
    }

    /// The side channel and failure record, to record a failure.
    pub(crate) fn watch_mut(&mut self) -> &mut Watch {
        &mut self.watch
    }

    /// Polls completions and the side channel now, without waiting: whether anything happened.
    pub(crate) fn poll_now(&mut self) -> Result<bool> {
        self.watch.poll_sometimes()?;
        let moved = self.poll()?;
        if moved {
            self.made_progress();
        }
        Ok(moved)
    }

    /// Something outside this transport moved (the no-progress clock restarts).
    pub(crate) fn note_progress(&mut self) {
        self.made_progress();
    }

    /// Whether every peer is still reachable, without blocking: the side channel, the device's
    /// async events, each QP's state, and a zero-byte RDMA write probe per peer whose
    /// completion is checked on the next call.
    pub fn health(&mut self) -> Result<()> {
        self.check_side()?;
        self.poll()?;
        for ev in self.events.drain() {
            if ev.is_fatal() {
                let who = match ev {
                    AsyncEvent::QpFatal(qpn) => (0..self.peers.len()).find(|&p| {
                        self.peers[p]
                            .as_ref()
                            .is_some_and(|s| s.qp.endpoint().qpn == qpn)
                    }),
                    _ => None,
                };
                // A QP's event blames its peer; port, CQ and device events are this rank's own.
                let p = who.unwrap_or(self.rank);
                return Err(self.fail(p, format!("device event on {}: {ev:?}", self.device)));
            }
        }
        let sq_limit = 2 * self.layout.slots as u64 + 16;
        for p in 0..self.peers.len() {
            let Some(st) = self.peers[p].as_ref() else {
                continue;
            };
            if st.qp.query_state()? == QueuePairState::Error {
                return Err(self.fail(p, "its queue pair is in the error state".into()));
            }
            match st.probe {
                Some(t) if t.elapsed() > self.timeout => {
                    let why = format!("a probe write went unanswered for {:?}", self.timeout);
                    return Err(self.fail(p, why));
                }
                Some(_) => {}
                None if st.wr_posted - st.wr_done + 2 < sq_limit => {
                    self.post(p, KIND_PROBE, 0, 0, self.layout.credit_off(self.rank), None)?;
                    self.state(p).probe = Some(Instant::now());
                }
                None => {}
            }
        }
        Ok(())
    }

    /// Polls the CQ once; returns whether anything completed.
    fn poll(&mut self) -> Result<bool> {
        let mut events: [(u64, u32, u32, u32); 64] = [(0, 0, 0, 0); 64];
        let mut m = 0;
        self.cq.poll(|c| {
            if m < events.len() {
                events[m] = (c.wr_id, c.status, c.byte_len, c.imm);
                m += 1;
            }
        })?;
        for &(id, status, len, imm) in &events[..m] {
            let kind = id >> 62;
            let p = ((id >> 48) & 0x3fff) as usize;
            let index = id & 0xffff_ffff_ffff;
            if status != 0 {
                let what = match kind {
                    KIND_DATA => "an RDMA write of data",
                    KIND_CREDIT => "an RDMA write of credits",
                    KIND_PROBE => "a probe write",
                    _ => "a receive",
                };
                // A local error, or our own port down, is this rank's failure (its link or
                // device), not the peer's: blame ourselves so every rank names the right one.
                let local = matches!(status, 1 | 2 | 4 | 8 | 19 | 21);
                let port_down = !self.port_active();
                let why = format!("{what} to rank {p} failed: {}", verbs::status_str(status));
                if local || port_down {
                    let why = format!(
                        "{why}; {} is {}",
                        self.device,
                        if port_down { "DOWN" } else { "in error" }
                    );
                    return Err(self.fail(self.rank, why));
                }
                return Err(self.fail(p, why));
            }
            let slots = self.layout.slots as u64;
            let st = self.state(p);
            match kind {
                KIND_RECV => {
                    // The chunk's number from its low 16 bits: at or above the next expected,
                    // within `slots` of the consumed count (credits), into an empty slot.
                    let k =
                        st.consumed + (u64::from(imm & 0xffff).wrapping_sub(st.consumed) & 0xffff);
                    if k < st.cq_next
                        || k >= st.consumed + slots
                        || st.lens[(k % slots) as usize] != EMPTY
                    {
                        let e = format!(
                            "protocol error: chunk {} arrived where {} (at most {}) was expected",
                            imm & 0xffff,
                            st.cq_next,
                            st.consumed + slots - 1
                        );
                        return Err(self.fail(p, e));
                    }
                    // The peer's consumed count of our chunks, from its low 16 bits: it lies
                    // within `slots` below what we sent.
                    st.peer_consumed = st.peer_consumed.max(below(st.sent, (imm >> 16) as u16));
                    st.lens[(k % slots) as usize] = len;
                    st.cq_next = k + 1;
                    st.qp.post_recv(wr_id(KIND_RECV, p, k + slots))?;
                }
                _ => {
                    // Every WR up to this one is done (in order), signaled or not.
                    st.wr_done = st.wr_done.max(index + 1);
                    st.retire_sends(slots);
                    if kind == KIND_PROBE {
                        st.probe = None;
                    }
                }
            }
        }
        Ok(m > 0)
    }

    /// Posts a WR on `p`'s QP, signaling when needed so the send queue never fills.
    fn post(
        &mut self,
        p: usize,
        kind: u64,
        off: usize,
        len: usize,
        remote_off: usize,
        imm: Option<u32>,
    ) -> Result<()> {
        let sge = Sge {
            lkey: self.buf.lkey_at(off, len),
            addr: self.buf.addr() + off as u64,
            len: len as u32,
        };
        self.post_from(p, kind, &[sge], remote_off, imm, false)
    }

    /// [`RdmaTransport::post`] from the ranges `local`: our buffer, then possibly the lent one.
    /// A `quiet` data write (inline from the staging slot) may go unsignaled.
    fn post_from(
        &mut self,
        p: usize,
        kind: u64,
        local: &[Sge],
        remote_off: usize,
        imm: Option<u32>,
        quiet: bool,
    ) -> Result<()> {
        let st = self.peers[p].as_mut().expect("no link to self");
        // A WR that needs nothing after posting may go unsignaled (see the module notes).
        let fire_and_forget = kind == KIND_CREDIT || (kind == KIND_DATA && quiet);
        let signaled = !fire_and_forget || st.unsignaled >= QUIET_MAX;
        let id = wr_id(kind, p, st.wr_posted);
        let remote_addr = st.remote.addr + remote_off as u64;
        // SAFETY: the local range lies in our registered buffer (off/len from the layout), which
        // outlives every QP (field order), or in the lent buffer, which stays registered and
        // unwritten until the write completes (settle, finish) or the operation failed and
        // release() deregistered it (the WR then fails; the memory is never touched after); the
        // data slot is not reused before this write completes (send_done); credit words are sent
        // inline (copied at post time).
        let r = unsafe {
            st.qp
                .post_write(id, local, st.remote.rkey, remote_addr, imm, signaled)
        };
        if let Err(e) = r {
            return Err(self.fail(p, e.to_string()));
        }
        let st = self.state(p);
        st.wr_posted += 1;
        st.unsignaled = if signaled { 0 } else { st.unsignaled + 1 };
        Ok(())
    }

    /// Chunk `k` from `p`, if it has landed in its mailbox: (length, offset of the entry, the low
    /// 16 bits of `p`'s consumed count of our chunks).
    fn landed(&self, p: usize, k: u64) -> Option<(usize, usize, u16)> {
        let entry = self.layout.mailbox_off(p, k);
        let ptr = self.buf.ptr_at(entry + ENTRY - 8) as *const u64;
        // SAFETY: an aligned u64 inside our buffer (entries are 64-byte aligned), written only
        // by the peer's RDMA writes; read volatile since the device changes it behind the
        // compiler's back.
        let tag = u64::from_le(unsafe { std::ptr::read_volatile(ptr) });
        let len = mailbox::tag_len(tag, k)?;
        // The tag is read before the bytes written ahead of it.
        fence(Ordering::Acquire);
        Some((len, entry, mailbox::tag_consumed(tag)))
    }

    /// The highest consumed count of our chunks that `p` reported in a mailbox chunk that
    /// arrived and is not taken yet (0 if none).
    fn mailbox_credits(&self, p: usize) -> u64 {
        let st = self.peers[p].as_ref().expect("no link to self");
        (st.consumed..st.consumed + self.layout.slots as u64)
            .filter_map(|k| self.landed(p, k))
            .map(|(.., low)| below(st.sent, low))
            .max()
            .unwrap_or(0)
    }

    fn credits_from(&self, p: usize) -> u64 {
        let ptr = self.buf.ptr_at(self.layout.credit_off(p)) as *const u64;
        // SAFETY: an aligned u64 inside our buffer, written only by the peer's RDMA writes;
        // read volatile since the HCA changes it behind the compiler's back.
        let v = unsafe { std::ptr::read_volatile(ptr) };
        fence(Ordering::Acquire);
        v
    }

    /// Forgets the zero-copy writes that completed.
    fn retire_zero_copy(&mut self) {
        let peers = &self.peers;
        self.zc
            .retain(|&(p, k, ..)| peers[p].as_ref().is_some_and(|s| s.send_done <= k));
    }

    /// Registers `buf` as a source of zero-copy sends (a lending or a registration).
    fn register_source(&self, buf: &[u8]) -> Result<LentRegion> {
        // SAFETY: the device only reads this memory (sends from it) and the registration pins
        // its pages while it lives, so a buffer freed too early gets stale bytes sent, never
        // freed memory touched. Its key is used only while it lives: a lending ends in
        // release(), a registration in unregister(), both between operations, after finish()
        // completed their writes (after a failure, a WR still using it fails locally).
        unsafe { LentRegion::new(&self._pd, buf.as_ptr() as usize, buf.len()) }
    }

    /// Waits (bounded) until every posted work request has completed, e.g. before teardown.
    pub fn flush(&mut self) -> Result<()> {
        self.begin();
        // A signaled probe behind any unsignaled tail, so its completion retires the tail
        // (inline writes free their slots when posted, so only completions show they landed).
        for p in 0..self.peers.len() {
            if self.peers[p].as_ref().is_some_and(|s| s.unsignaled > 0) {
                self.post(p, KIND_PROBE, 0, 0, self.layout.credit_off(self.rank), None)?;
                self.state(p).probe = Some(Instant::now());
            }
        }
        loop {
            let pending = (0..self.peers.len()).find(|&p| {
                self.peers[p]
                    .as_ref()
                    .is_some_and(|s| s.wr_done < s.wr_posted)
            });
            match pending {
                None => return Ok(()),
                Some(p) => self.progress(p)?,
            }
        }
    }
}

impl Link for RdmaTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.layout.n
    }

    fn peer(&self, rank: usize) -> Peer {
        self.watch.peer(rank)
    }

    fn max_chunk(&self) -> usize {
        self.layout.slot
    }

    fn medium(&self) -> super::Medium {
        super::Medium::Rdma
    }

    fn takes_return_credits(&self) -> bool {
        // A peer waits for our credits once its slots are full; we return them only as we take.
        true
    }

    fn try_post(&mut self, p: usize, data: &[u8]) -> Result<bool> {
        debug_assert!(data.len() <= self.layout.slot);
        let slots = self.layout.slots as u64;
        let word = self.credits_from(p);
        let st = self.state(p);
        if word > st.sent {
            // A peer cannot have consumed what was never sent: it is misbehaving.
            let e = format!(
                "protocol error: its credit word says {word} chunks consumed of {} sent",
                st.sent
            );
            return Err(self.fail(p, e));
        }
        let mut credits = word.max(st.peer_consumed);
        let (k, consumed) = (st.sent, st.consumed);
        if k >= credits + slots {
            // Credits ride on chunks that arrived but are not taken yet: on receive
            // completions (seen when polled) and in mailbox trailers (seen only here).
            credits = credits.max(self.mailbox_credits(p));
            self.state(p).peer_consumed = credits;
        }
        let st = self.state(p);
        let sq_room = st.wr_posted - st.wr_done + 2 < 2 * slots + 16;
        if k >= credits + slots || k >= st.send_done + slots || !sq_room {
            return Ok(false);
        }
        // The operation's first chunk to p carries its descriptor just ahead of the data.
        let wire = self.op_wire;
        let st = self.state(p);
        let head = if st.head_out { op::WIRE } else { 0 };
        let desc = OpDesc::numbered(wire, st.seq_out);
        // A lent or registered buffer sends straight from memory, but a chunk small enough to
        // go inline is copied at post time (by mailbox up to 56 bytes) and needs no settling.
        let region = if data.len() > MAX_INLINE as usize {
            self.lent
                .iter()
                .chain(self.registered.iter().map(|(_, r)| r))
                .find(|r| r.contains(data))
        } else {
            None
        };
        let to_mailbox = region.is_none() && head + data.len() <= mailbox::MAX_PAYLOAD;
        let off = self.layout.send_off(p, k);
        let staging_key = self.buf.lkey_at(off, 0);
        let staged_head = Sge {
            lkey: staging_key,
            addr: self.buf.addr() + (off - head) as u64,
            len: head as u32,
        };
        if head > 0 {
            self.buf.slice_mut(off - head, head).copy_from_slice(&desc);
        }
        let mut len = head + data.len();
        let (sges, zero_copy) = match region {
            // The descriptor from the staging slot, then the data from the caller's memory.
            Some(r) => {
                let from = Sge {
                    lkey: r.lkey(),
                    addr: data.as_ptr() as u64,
                    len: data.len() as u32,
                };
                ([staged_head, from], true)
            }
            None => {
                let none = Sge {
                    len: 0,
                    ..staged_head
                };
                if to_mailbox {
                    let mut payload = [0u8; mailbox::MAX_PAYLOAD];
                    payload[..head].copy_from_slice(&desc[..head]);
                    payload[head..len].copy_from_slice(data);
                    let out = self.buf.slice_mut(off, ENTRY);
                    len = mailbox::encode(k, consumed, &payload[..len], out);
                    let at = Sge {
                        lkey: staging_key,
                        addr: self.buf.addr() + off as u64,
                        len: len as u32,
                    };
                    ([at, none], false)
                } else {
                    crate::copy::copy(self.buf.slice_mut(off, data.len()), data);
                    let whole = Sge {
                        len: len as u32,
                        ..staged_head
                    };
                    ([whole, none], false)
                }
            }
        };
        let (remote_off, imm) = if to_mailbox {
            let entry = self.layout.mailbox_off(self.rank, k);
            (entry + mailbox::write_offset(len), None)
        } else {
            let imm = (k & 0xffff) as u32 | ((consumed & 0xffff) as u32) << 16;
            (self.layout.recv_off(self.rank, k) - head, Some(imm))
        };
        let quiet = !zero_copy && len <= MAX_INLINE as usize;
        let wr = self.state(p).wr_posted;
        self.state(p).chunk_wr[(k % slots) as usize] = if quiet { FREE_AT_POST } else { wr };
        self.post_from(p, KIND_DATA, &sges, remote_off, imm, quiet)?;
        if zero_copy {
            if self.zc.len() == self.zc.capacity() {
                self.retire_zero_copy(); // at most slots per peer remain: no reallocation
            }
            let a = data.as_ptr() as usize;
            self.zc.push_back((p, k, a, a + data.len()));
        }
        let st = self.state(p);
        st.head_out = false;
        st.returned = consumed;
        st.sent += 1;
        st.retire_sends(slots);
        self.made_progress();
        // Look at the completion queue (a user-space read) after every post, so a caller that
        // keeps posting still sees, and takes, what arrived meanwhile (on rxe a post takes long
        // enough for the peer's chunks to land); idle turns poll in `progress`.
        self.poll()?;
        Ok(true)
    }

    fn try_take(&mut self, p: usize, f: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<bool> {
        let slots = self.layout.slots as u64;
        let st = self.state(p);
        let k = st.consumed;
        let slot = (k % slots) as usize;
        let head = if st.head_in { op::WIRE } else { 0 };
        let (by_imm, seq, sent) = (st.lens[slot], st.seq_in, st.sent);
        // The chunk's bytes as written (the descriptor first, if any): where, how many, and
        // the credits a mailbox trailer carries.
        let (off, len, mailbox_consumed) = if by_imm != EMPTY {
            (self.layout.recv_off(p, k) - head, by_imm as usize, None)
        } else {
            let Some((len, entry, low)) = self.landed(p, k) else {
                return Ok(false);
            };
            let consumed = Some(below(sent, low));
            (
                entry + mailbox::payload(len.min(mailbox::MAX_PAYLOAD)).start,
                len,
                consumed,
            )
        };
        let limit = if by_imm != EMPTY {
            self.layout.slot + head
        } else {
            mailbox::MAX_PAYLOAD
        };
        // Nothing a peer writes is trusted: a length past what it may write, or short of the
        // descriptor it owes, fails that peer.
        if len > limit || len < head {
            let e = format!(
                "protocol error: chunk {k} has {len} bytes (at least {head}, at most {limit} allowed)"
            );
            return Err(self.fail(p, e));
        }
        if head > 0 {
            let got = self.buf.slice(off, head);
            if got != OpDesc::numbered(self.op_wire, seq) {
                let mine = OpDesc { seq, ..self.op };
                if let Err(why) = mine.check(got, p, self.rank) {
                    return Err(self.watch.mismatch(p, why));
                }
            }
        }
        f(self.buf.slice(off + head, len - head))?;
        let st = self.state(p);
        st.head_in = false;
        st.lens[slot] = EMPTY;
        if let Some(c) = mailbox_consumed {
            st.peer_consumed = st.peer_consumed.max(c);
        }
        let st = self.state(p);
        st.consumed += 1;
        let consumed = st.consumed;
        // Return credits in batches of half the slots: the writer then always has half its
        // slots free or unconsumed data waiting here, so batching cannot deadlock, and most
        // small operations finish without a credit write on their critical path.
        if consumed - st.returned < (slots / 2).max(1) {
            self.made_progress();
            return Ok(true);
        }
        st.returned = consumed;
        // Our consumed count into the writer's credit word for us (inline).
        let credit_remote = self.layout.credit_off(self.rank);
        let tmp_off = self.layout.credit_off(p) + 8; // a scratch word beside p's credit word
        self.buf
            .slice_mut(tmp_off, 8)
            .copy_from_slice(&consumed.to_le_bytes());
        self.post(p, KIND_CREDIT, tmp_off, 8, credit_remote, None)?;
        self.made_progress();
        Ok(true)
    }

    fn try_take_into(&mut self, p: usize, dst: &mut [u8]) -> Result<bool> {
        self.settle(dst)?;
        self.try_take(p, &mut |src: &[u8]| copy_chunk(src, dst, p))
    }

    fn lend(&mut self, buf: &[u8]) {
        debug_assert!(self.lent.is_none() && self.zc.is_empty());
        if self.zc_min == 0
            || buf.len() < self.zc_min
            || self.registered.iter().any(|(_, r)| r.contains(buf))
        {
            return;
        }
        // A failed registration (e.g. the locked-memory limit) only means copying.
        self.lent = self.register_source(buf).ok();
    }

    unsafe fn register(&mut self, buf: &[u8]) -> Result<Option<u64>> {
        if buf.is_empty() {
            return Ok(None); // nothing to send from (and verbs refuse an empty region)
        }
        if self.registered.len() >= MAX_REGISTERED {
            return Err(Error::InvalidArgument(format!(
                "{MAX_REGISTERED} buffers are registered with this communicator already: \
                 register fewer at once (one large buffer can hold several tensors)"
            )));
        }
        let region = self.register_source(buf)?;
        let id = self.next_registration;
        self.next_registration += 1;
        self.registered.push((id, region));
        Ok(Some(id))
    }

    fn unregister(&mut self, id: u64) {
        self.registered.retain(|(i, _)| *i != id);
    }

    fn settle(&mut self, range: &[u8]) -> Result<()> {
        let (a, b) = (
            range.as_ptr() as usize,
            range.as_ptr() as usize + range.len(),
        );
        while !self.zc.is_empty() {
            self.retire_zero_copy();
            match self.zc.iter().find(|e| e.2 < b && a < e.3) {
                Some(&(p, ..)) => self.progress(p)?,
                None => break,
            }
        }
        Ok(())
    }

    fn release(&mut self) {
        self.zc.clear();
        self.lent = None;
    }

    fn finish(&mut self) -> Result<()> {
        // Every zero-copy write completes before the caller gets its buffer back.
        while let Some(&(p, k, ..)) = self.zc.front() {
            if self.state(p).send_done > k {
                self.zc.pop_front();
            } else {
                self.progress(p)?;
            }
        }
        Ok(())
    }

    fn progress(&mut self, waiting_on: usize) -> Result<()> {
        self.watch.waiting_on(Some(waiting_on));
        self.watch.poll_sometimes()?;
        if self.poll()? {
            self.made_progress();
            return Ok(());
        }
        match self.pacer.idle() {
            Wait::Spin => std::hint::spin_loop(),
            Wait::Yield => std::thread::yield_now(),
            Wait::BackOff => {
                self.watch.poll()?;
                std::thread::sleep(Duration::from_micros(50));
            }
            Wait::Expired => return Err(self.watch.stalled(waiting_on, self.timeout)),
        }
        Ok(())
    }

    fn begin(&mut self) {
        self.pacer.begin();
    }

    fn start(&mut self, op: &OpDesc, scope: Scope) {
        self.op = *op;
        self.op_wire = op.encode();
        self.watch.waiting_on(None);
        for (p, st) in self.peers.iter_mut().enumerate() {
            let Some(st) = st.as_mut() else { continue };
            if scope.counts(p, true) {
                st.seq_out = st.seq_out.wrapping_add(1);
                st.head_out = true;
            }
            if scope.counts(p, false) {
                st.seq_in = st.seq_in.wrapping_add(1);
                st.head_in = true;
            }
        }
    }
}

impl Drop for RdmaTransport {
    fn drop(&mut self) {
        self.timeout = self.timeout.min(Duration::from_secs(10));
        self.pacer.set_timeout(self.timeout);
        if self.watch.healthy() {
            // Let posted writes land, then wait (bounded) at the close barrier, so no QP is
            // destroyed while a peer still writes to it.
            let _ = self.flush();
        }
        self.watch.close(self.timeout);
    }
}
