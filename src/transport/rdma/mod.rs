//! The RDMA transport: one reliable-connected QP per peer, connected when an operation first
//! exchanges with it (`connect.rs`; all at creation with `RDMACOMM_CONNECT=eager`), a registered
//! buffer per connected peer holding its receive slots, credit word and mailboxes and our send
//! staging slots to it, and RDMA WRITE_WITH_IMM into the peer's slots with credit-based flow
//! control (never RNR).
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
//!   `RDMACOMM_ZERO_COPY_MIN` bytes ([`Lending::lend`]), it is registered for that operation and
//!   chunks above [`MAX_INLINE`] posted from it are written straight from it, skipping the
//!   staging slot; a range is not landed into before the writes reading it completed
//!   ([`Lending::settle`]), and the registration ends with the operation. (Not cached across
//!   calls: without memory hooks a cache keyed by address would send stale pages after the
//!   caller frees and reallocates.)
//! - Registered buffers ([`Lending::register`], scoped by `Communicator::with_registered`): the
//!   same zero-copy path for every chunk above [`MAX_INLINE`] posted from inside one, with no
//!   registration per operation; at most [`MAX_REGISTERED`] at once.
//! - Mailboxes: a chunk of at most [`mailbox::MAX_PAYLOAD`] bytes goes instead as a plain inline
//!   RDMA WRITE into r's 64-byte mailbox `k % S` for w (same credits as slot `k % S`), laid out
//!   by [`mailbox`]: the payload, w's consumed count, and a tag naming `k`, ending at the
//!   entry's end. r finds it by reading the tag in memory: no receive work request, no
//!   completion to poll, and credits ride along as with an immediate. A writer that waits for
//!   credits also reads them from mailbox chunks that arrived but are not taken yet, as it
//!   would see an immediate's on polling (measured: docs/DESIGN.md).

mod completions;
mod connect;
mod faces;
mod keep;
mod landing;
mod layout;
mod link;
mod protocol;
mod setup;
mod zero_copy;

use crate::bootstrap::rendezvous::{Card, Rendezvous};
use crate::bootstrap::{check_tags, Reader, TAG_RDMA};
use crate::config::{Config, Connect};
use crate::error::{Error, Peer, Result};
use crate::transport::dial::{Dialer, Lookout};
use crate::transport::mailbox::{self, ENTRY};
use crate::transport::numbering::Numbering;
use crate::transport::op::{self, OpDesc, Partners};
use crate::transport::pacer::{self, oversubscribed, Pacer, Wait};
use crate::transport::reach;
use crate::transport::watch::Watch;
use crate::transport::{copy_chunk, Ledger, Lending, Link, Medium, Pass, Props};
use crate::verbs::queue::MAX_INLINE;
use crate::verbs::{
    self, AsyncEvent, CompletionQueue, Device, Endpoint, LentRegion, RcQueuePair, RegisteredBuffer,
    RetryPolicy, Sge,
};
#[cfg(feature = "unstable")]
pub use connect::{info, INFO, READY};
pub(crate) use keep::KeptQps;
use layout::Layout;
use protocol::FREE_AT_POST;
use sideway::ibverbs::device_context::{DeviceContext, PortState};
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::QueuePairState;
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A back-off sleeps until a completion's event, or this long at first, twice as long each
/// idle round after up to [`MAX_NAP`]: mailbox chunks and credit words land in memory without
/// an event, so the nap bounds how late they are seen.
const MIN_NAP: Duration = Duration::from_micros(50);
const MAX_NAP: Duration = Duration::from_millis(1);
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
/// Most buffers registered at once with one communicator (`Communicator::with_registered`).
pub const MAX_REGISTERED: usize = 64;
/// `lens` of a slot that holds no arrived chunk.
const EMPTY: u32 = u32::MAX;

fn wr_id(kind: u64, peer: usize, index: u64) -> u64 {
    (kind << 62) | ((peer as u64) << 48) | (index & 0xffff_ffff_ffff)
}

/// The remote half of a link: where to write on the peer.
#[derive(Debug, Clone, Copy, Default)]
struct Remote {
    addr: u64,
    rkey: u32,
}

/// One connected peer. Field order is drop order: the QP before the buffer it points into.
struct PeerState {
    qp: RcQueuePair,
    /// The queue pair's number (completions are routed by it).
    qpn: u32,
    remote: Remote,
    /// The peer's READY came: its queue pair takes our writes.
    ready: bool,
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
    /// Its block (which only it may write), our send slots to it and a scratch line.
    buf: RegisteredBuffer,
}

impl PeerState {
    /// Advances `send_done` over the chunks, in order, whose staging slots are free: written
    /// (their WR completed) or sent inline.
    fn retire_sends(&mut self) {
        self.send_done = protocol::retired(self.send_done, self.sent, &self.chunk_wr, self.wr_done);
    }
}

/// The RDMA transport of one rank. Field order is drop order: QPs before the CQ.
pub struct RdmaTransport {
    /// Peers whose queue pair is connected (ready once their READY came).
    peers: Vec<Option<PeerState>>,
    /// Peers whose queue pair is being connected, and their ranks.
    coming: Vec<Option<Box<connect::Coming>>>,
    pending: Vec<usize>,
    /// Ranks of the ready peers, in the order they came up.
    up: Vec<usize>,
    /// The buffer the current operation lent for zero-copy sends, registered.
    lent: Option<LentRegion>,
    /// Buffers registered across operations ([`Lending::register`]), by id.
    registered: Vec<(u64, LentRegion)>,
    next_registration: u64,
    /// Zero-copy writes in flight: (peer, chunk number, source start, source end).
    zc: VecDeque<(usize, u64, usize, usize)>,
    /// Smallest buffer worth registering for one operation (0: never).
    zc_min: usize,
    cq: CompletionQueue,
    /// The first peer's buffer, registered at creation so that a locked-memory limit too low
    /// for one peer fails there, before any traffic.
    spare: Option<RegisteredBuffer>,
    _pd: Arc<ProtectionDomain>,
    _ctx: Arc<DeviceContext>,
    /// The side channel and the first failure.
    watch: Watch,
    /// The open device (shared with the process's other communicators) and its events.
    opened: Device,
    /// The listener and the TCP connections that carry each pair's endpoints.
    dialer: Dialer,
    dial_events: Vec<crate::transport::dial::Event>,
    /// When a wait looks at the listener (a peer may dial while we wait on another).
    lookout: Lookout,
    fds: Vec<libc::pollfd>,
    policy: RetryPolicy,
    /// The completion queue's largest size on this device.
    max_cqe: u32,
    sel: verbs::Selected,
    layout: Layout,
    rank: usize,
    timeout: Duration,
    /// How waits spin, yield and nap, and when they time out.
    pacer: Pacer,
    /// The next back-off's longest sleep ([`MIN_NAP`] doubling to [`MAX_NAP`] while idle).
    nap: Duration,
    device: String,
    port: u8,
    /// The operation under way and its numbers with each peer: an operation's first chunk
    /// each way carries its descriptor.
    numbering: Numbering,
    props: Props,
    /// What its posts and takes did to the bytes.
    ledger: Ledger,
    /// The operation's windows ([`landing`]).
    landing: landing::Landing,
}

impl RdmaTransport {
    /// Something moved: reset the no-progress clock and the idle streak.
    fn made_progress(&mut self) {
        self.pacer.progress();
        self.nap = MIN_NAP;
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
        let mut moved = self.poll()?;
        if self.connecting() || self.lookout.due() {
            moved |= self.connect_step()?;
        }
        if moved {
            self.made_progress();
        }
        Ok(moved)
    }

    /// Something outside this transport moved (the no-progress clock restarts).
    pub(crate) fn note_progress(&mut self) {
        self.made_progress();
    }
}
