//! Transports: move chunks between ranks. The collectives see only [`Link`], a narrow per-peer
//! interface (post a chunk, take a chunk, make progress), as NCCL's net plugins
//! (isend/irecv/test) and Gloo's transport pairs are kept apart from algorithms.

mod descriptors;
pub mod dial;
pub mod hybrid;
pub mod mailbox;
mod numbering;
pub mod op;
pub mod pacer;
pub mod rdma;
pub(crate) mod reach;
pub mod shm;
pub mod shm_slots;
pub mod tcp;
#[cfg(test)]
mod test_rng;
pub mod watch;

use crate::bootstrap::rendezvous::{self, discover};
use crate::error::{Peer, Result};
pub(crate) use crate::ledger::{Ledger, Pass};

/// What a link is: the facts it reports once, from which the core chooses its algorithms and
/// thresholds (`collectives/tuning.rs`), as NCCL's net plugins report their properties.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Props {
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub size: usize,
    /// The largest chunk one post can carry.
    pub max_chunk: usize,
    /// What carries this link's chunks to its network peers (or to all, without a network).
    pub medium: Medium,
    /// Whether every peer is reached through memory this rank maps (shared memory): a copy to
    /// a peer then costs about what a local copy does.
    pub shares_memory: bool,
    /// Every rank's host (numbered from 0), where this link reaches the peers on its host
    /// through shared memory and some peers through a network: the facts a hierarchical
    /// algorithm needs. `None` where all peers are reached alike.
    pub hosts: Option<Vec<usize>>,
    /// Whether a take hands back what a peer's next post waits for (RDMA credits, a ring's
    /// slot), so that a peer out of room is held up until this rank takes.
    pub takes_return_credits: bool,
    /// The most peers this rank can hold connections to within its memory bound (the buffers a
    /// connection costs: [`PEER_MEMORY`] over one connection's); `usize::MAX` where a peer costs
    /// none of its own. An operation that would exchange with more (an all_to_all, a gather or
    /// a scatter on a wide world) runs as a tree of log2(n) peers instead.
    pub peers_max: usize,
    /// Whether a post copies into the link's own send memory (an RDMA staging slot, a peer's
    /// shared-memory slot) and the link can fill that memory from a received chunk in the same
    /// step ([`Link::try_relay`]), between some peers at least ([`Link::relays_between`]).
    pub relays: bool,
    /// With [`Props::relays`]: the chunks a rank may have posted to a peer and not yet seen
    /// taken, past which a post may wait on that peer's takes (credits come back in batches).
    /// A relay that keeps fewer than this ahead can never wait in a circle.
    pub window: usize,
}

/// Bytes of per-peer buffers (registered RDMA slots, TCP receive buffers) a rank's
/// connections may hold together with the defaults, whatever the world size.
pub const PEER_MEMORY: usize = 64 << 20;

impl Props {
    /// A link of `size` ranks over `medium` whose peers are reached alike and whose takes
    /// return no credit.
    pub fn new(rank: usize, size: usize, max_chunk: usize, medium: Medium) -> Props {
        Props {
            rank,
            size,
            max_chunk,
            medium,
            shares_memory: false,
            hosts: None,
            takes_return_credits: false,
            peers_max: usize::MAX,
            relays: false,
            window: 0,
        }
    }
}

/// A chunk-granular, per-peer, ordered, flow-controlled link to every other rank: what the
/// collectives see of a transport (Gloo's pair, NCCL's isend/irecv/test).
///
/// Chunks to one peer arrive in the order posted. `try_post` and `try_take` never block;
/// `progress` polls completions and waits a little, failing after the configured timeout
/// without progress, naming the peer waited on.
///
/// # The order of calls
/// Every rank runs the same operations in the same order; for each, the core calls:
/// 1. [`Link::start`] once, with the peers the operation exchanges with;
/// 2. where the link has a [`Link::lending`], [`Lending::lend`] with the buffer posts may come
///    from;
/// 3. for each step of the algorithm, [`Link::begin`], then [`Link::try_post`],
///    [`Link::try_take`] and [`Link::try_take_into`] to and from peers of that scope, with
///    [`Link::progress`] while nothing moves (and [`Link::resume`] after its caller held it);
///    a range posted from a lent buffer is written only after [`Lending::settle`] on it;
/// 4. [`Link::unsent`] until it names no peer (waiting with [`Link::progress`]), then
///    [`Link::finish`];
/// 5. [`Lending::release`] on every exit, an error's included.
///
/// After an error the core makes no further call but dropping it. The peers are every rank
/// `0..size` of [`Props`]: how a transport reaches one (a connection made at set-up or at the
/// first post, see `docs/DESIGN.md`) is its own affair, behind these calls.
pub trait Link {
    /// What this link is (fixed for its life).
    fn props(&self) -> &Props;
    /// This rank ([`Props::rank`]).
    fn rank(&self) -> usize {
        self.props().rank
    }
    /// Number of ranks ([`Props::size`]).
    fn size(&self) -> usize {
        self.props().size
    }
    /// A peer's identity (rank and address), for errors.
    fn peer(&self, rank: usize) -> Peer;
    /// Posts `data` (at most `max_chunk` bytes) to `peer` if a slot is free; `Ok(false)` if not.
    fn try_post(&mut self, peer: usize, data: &[u8]) -> Result<bool>;
    /// If the next chunk from `peer` has arrived, hands it to `f` and frees its slot.
    fn try_take(&mut self, peer: usize, f: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<bool>;
    /// If the next chunk from `peer` has arrived, copies it into `dst` (whose length must be the
    /// chunk's) and frees its slot. A transport may place it there directly, a part per call:
    /// until it returns true, the caller passes the same `dst`.
    fn try_take_into(&mut self, peer: usize, dst: &mut [u8]) -> Result<bool> {
        let took = self.try_take(peer, &mut |src: &[u8]| copy_chunk(src, dst, peer))?;
        if took {
            self.count(Pass::CopyOut, dst.len());
        }
        Ok(took)
    }
    /// Takes the next chunk from `from` and, in the same step, posts to `to` a chunk of `len`
    /// bytes that `f` writes from it (`f(received, slot)`) straight into the link's send memory:
    /// a reduction and the copy-in of the next send fused into one pass. With `at`, the chunk
    /// lands at byte `at` of `to`'s window where `to` offered one ([`Link::try_post_at`]).
    /// `Ok(false)` while the chunk has not arrived or no slot to `to` is free (then neither
    /// happened). Only where [`Props::relays`]; elsewhere it fails.
    fn try_relay(
        &mut self,
        from: usize,
        to: usize,
        len: usize,
        at: Option<usize>,
        f: &mut crate::transport::Relay<'_>,
    ) -> Result<bool> {
        let _ = (from, to, len, at, f);
        Err(crate::Error::InvalidArgument(
            "this link has no relay (Props::relays)".into(),
        ))
    }
    /// Whether [`Link::try_relay`] can take from `from` and post to `to` (a link that reaches
    /// peers through two transports relays only within one). Only where [`Props::relays`].
    fn relays_between(&self, from: usize, to: usize) -> bool {
        let _ = (from, to);
        self.props().relays
    }
    /// Whether a post from `data` goes out without a CPU copy (a registered or lent buffer, a
    /// socket write), so that staging it through [`Link::try_relay`] would add a pass.
    fn sends_in_place(&self, data: &[u8]) -> bool {
        let _ = data;
        !self.props().relays
    }
    /// Whether chunks between this rank and `peer` can land straight in the receiver's memory
    /// (an RDMA write into a window the receiver offered); both ends of a pair agree. Where it
    /// does, an operation that lands uses [`Link::try_offer`], [`Link::try_accept`],
    /// [`Link::try_post_at`] (or [`Link::try_relay`] with an offset) and
    /// [`Link::try_take_landed`].
    fn lands(&self, peer: usize) -> bool {
        let _ = peer;
        false
    }
    /// Posts to `peer` this rank's window onto `dst` for this operation (where `dst` lies in
    /// memory the link may let a peer write, else word that there is none): `peer`'s
    /// [`Link::try_post_at`] then write into `dst` directly. A window is offered only onto a
    /// buffer that [`Link::sends_in_place`] (which is never relayed into). Posted before any
    /// other chunk to `peer` in the operation. `Ok(false)` while no slot is free. Only where
    /// [`Link::lands`].
    fn try_offer(&mut self, peer: usize, dst: &[u8]) -> Result<bool> {
        let _ = (peer, dst);
        Err(crate::Error::InvalidArgument(
            "this link lands nothing (Link::lands)".into(),
        ))
    }
    /// Takes `peer`'s offer ([`Link::try_offer`]), before any other chunk from `peer` in the
    /// operation. `Ok(false)` until it came. Only where [`Link::lands`].
    fn try_accept(&mut self, peer: usize) -> Result<bool> {
        let _ = peer;
        Err(crate::Error::InvalidArgument(
            "this link lands nothing (Link::lands)".into(),
        ))
    }
    /// [`Link::try_post`], landing `data` at byte `at` of `peer`'s window where it offered one
    /// (the receiver then takes it with [`Link::try_take_landed`]).
    fn try_post_at(&mut self, peer: usize, data: &[u8], at: usize) -> Result<bool> {
        let _ = at;
        self.try_post(peer, data)
    }
    /// [`Link::try_take_into`] of a chunk `peer` posted with [`Link::try_post_at`]: where this
    /// rank offered `peer` a window, the chunk was written into `dst` already and only its
    /// arrival is taken (no copy).
    fn try_take_landed(&mut self, peer: usize, dst: &mut [u8]) -> Result<bool> {
        self.try_take_into(peer, dst)
    }
    /// This link's pass ledger, where it keeps one.
    fn ledger_mut(&mut self) -> Option<&mut Ledger> {
        None
    }
    /// Counts `bytes` of `pass` in the ledger, where the link keeps one.
    fn count(&mut self, pass: Pass, bytes: usize) {
        if let Some(l) = self.ledger_mut() {
            l.count(pass, bytes);
        }
    }
    /// Polls for completions; when nothing happened, backs off briefly. Fails when nothing has
    /// happened for the timeout, naming `waiting_on`.
    fn progress(&mut self, waiting_on: usize) -> Result<()>;
    /// Marks the start of an operation's step (resets the no-progress clock).
    fn begin(&mut self);
    /// The operation goes on after its caller held it (`RDMACOMM_PROGRESS=caller`): the time
    /// held is not a peer's silence, so the no-progress clock starts again.
    fn resume(&mut self) {
        self.begin();
    }
    /// Starts operation `op` with the peers of `scope`. Its descriptor, numbered in each
    /// direction between two ranks ([`op::OpDesc::seq`], kept by the numbering every transport
    /// shares), rides on the first chunk posted to each peer, and the first chunk taken from
    /// each peer must carry an equal one (else the take fails with [`crate::Error::Mismatch`],
    /// naming both calls, before it lands a byte).
    fn start(&mut self, op: &op::OpDesc, scope: op::Partners);
    /// The zero-copy interface, where this link sends straight from the caller's memory.
    fn lending(&mut self) -> Option<&mut dyn Lending> {
        None
    }
    /// A peer for which posted data still waits in this rank's queue (a transport whose posts
    /// only queue data: TCP), or None. The caller waits on that peer ([`Link::progress`], which
    /// pushes it out) until there is none.
    fn unsent(&mut self) -> Result<Option<usize>> {
        Ok(None)
    }
    /// Completes everything posted so far before an operation returns (a transport whose posts
    /// only queue data must push it out, or a peer would wait on a rank that has moved on).
    fn finish(&mut self) -> Result<()> {
        Ok(())
    }
}

/// Zero-copy sends: a link that can send straight from the caller's memory (RDMA) lends it
/// for an operation or registers it across operations.
pub trait Lending {
    /// Offers `buf`, which the operation's posts may come from, as the source of zero-copy sends
    /// until [`Lending::release`]; a transport may register it or ignore it. While lent, a range
    /// that was posted must not be written before [`Lending::settle`] on it returns. Peers write
    /// into it only where the operation offers a range of it as a window ([`Link::try_offer`]),
    /// which it does only for a buffer it holds mutably.
    fn lend(&mut self, buf: &[u8]);
    /// Registers `buf` for zero-copy sends across operations, until [`Lending::unregister`] with
    /// the returned id (`None` where nothing was registered). Posts from inside it then send
    /// straight from it. [`crate::Communicator::with_registered`] scopes this safely.
    ///
    /// # Safety
    /// `buf` must stay allocated and in place until [`Lending::unregister`] with the returned
    /// id, or later sends from its addresses read memory that belongs to something else. (It may
    /// be written between operations: every send from it completes before its operation
    /// returns.)
    unsafe fn register(&mut self, buf: &[u8]) -> Result<Option<u64>>;
    /// Ends a registration made by [`Lending::register`] (between operations).
    fn unregister(&mut self, id: u64);
    /// Waits (bounded by the timeout) until no send still in flight reads from `range`.
    fn settle(&mut self, range: &[u8]) -> Result<()>;
    /// Ends a lending: after it the transport holds nothing of the lent buffer (called on every
    /// operation's exit, after [`Link::finish`] or an error).
    fn release(&mut self);
}

/// Waits until no send in flight reads from `range`, where `link` lends.
pub(crate) fn settle(link: &mut dyn Link, range: &[u8]) -> Result<()> {
    match link.lending() {
        Some(l) => l.settle(range),
        None => Ok(()),
    }
}

/// What a relay does ([`Link::try_relay`]): writes the next send from a received chunk
/// (`f(received, slot)`).
pub type Relay<'a> = dyn FnMut(&[u8], &mut [u8]) -> Result<()> + 'a;

/// What carries a link's chunks: a fact transports report, from which the collectives choose
/// their algorithms and thresholds (`collectives/tuning.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Medium {
    /// RDMA writes (InfiniBand, RoCE, soft-RoCE).
    Rdma,
    /// TCP streams.
    Tcp,
    /// Shared memory between the ranks of one host.
    SharedMemory,
    #[cfg(test)]
    /// Memory within one process (tests).
    Memory,
}

/// Copies a chunk from `peer` into `dst`, whose length must be the chunk's (else the ranks
/// passed buffers of different lengths).
pub(crate) fn copy_chunk(src: &[u8], dst: &mut [u8], peer: usize) -> Result<()> {
    if src.len() != dst.len() {
        return Err(crate::Error::length_mismatch(src.len(), dst.len(), peer));
    }
    crate::copy::copy(dst, src);
    Ok(())
}

/// What a transport holds: the facts its memory and connection bounds are checked against,
/// and the `info` summary prints.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Holdings {
    /// Registered (pinned) bytes of its own (not the caller's registered buffers).
    pub pinned: usize,
    /// Bytes of per-connection buffers of its own that are not pinned (TCP's receive buffers
    /// and send queues).
    pub buffered: usize,
    /// Bytes of the shared-memory segment this rank created.
    pub shared: usize,
    /// Bytes of same-host peers' segments this rank maps.
    pub mapped: usize,
    /// Network connections (queue pairs or sockets) to peers.
    pub connections: usize,
}

impl std::ops::Add for Holdings {
    type Output = Holdings;
    fn add(self, o: Holdings) -> Holdings {
        Holdings {
            pinned: self.pinned + o.pinned,
            buffered: self.buffered + o.buffered,
            shared: self.shared + o.shared,
            mapped: self.mapped + o.mapped,
            connections: self.connections + o.connections,
        }
    }
}

impl std::fmt::Display for Holdings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: usize| b as f64 / (1 << 20) as f64;
        write!(
            f,
            "{:.1} MiB pinned, {:.1} MiB in connection buffers, {:.1} MiB shared (and {:.1} MiB \
             of peers' mapped), {} connections",
            mib(self.pinned),
            mib(self.buffered),
            mib(self.shared),
            mib(self.mapped),
            self.connections
        )
    }
}

/// A transport a communicator can own: a [`Link`] that can also check its peers' health and say
/// what it runs on.
pub trait Transport: Link + Send {
    /// Whether every peer is still reachable, without blocking; an error names a lost peer.
    fn health(&mut self) -> Result<()>;
    /// What this transport runs on (device, port and GID for RDMA; "TCP").
    fn describe(&self) -> String;
    /// This rank's index among the ranks on its host, and their number.
    fn local_rank(&self) -> (usize, usize);
    /// Records that this rank failed (`reason`) and tells every peer, whose operations then
    /// fail naming this rank.
    fn abort(&mut self, reason: String);
    /// The side channel and failure record.
    fn watch_mut(&mut self) -> &mut watch::Watch;
    /// Moves what can move now and reads the side channel, without waiting: whether anything
    /// happened.
    fn poll_now(&mut self) -> Result<bool>;
    /// Something outside this transport moved (its no-progress clock restarts).
    fn note_progress(&mut self);
    /// What it holds now.
    fn holds(&self) -> Holdings;
    /// Its pass ledger since it was made.
    fn ledger(&self) -> Ledger;
    /// Hands over, drained, the connections to `members` (ranks of this link, in the order of
    /// the next generation, `epoch`) that can serve it, within `until`; each member calls it at
    /// once (`Comm::shrink`). None by default (a transport whose connections cannot move).
    fn keep(&mut self, members: &[usize], epoch: u32, until: std::time::Instant) -> Kept {
        let _ = (members, epoch, until);
        Kept::default()
    }
}

/// Connections a communicator's next generation starts with ([`Transport::keep`]), by its
/// ranks.
#[derive(Default)]
pub(crate) struct Kept {
    /// TCP data connections, drained.
    pub(crate) tcp: Vec<(usize, tcp::KeptConn)>,
    /// RDMA queue pairs, drained, with their completion queue.
    pub(crate) rdma: Option<rdma::KeptQps>,
}

impl Kept {
    /// How many connections it holds.
    pub(crate) fn len(&self) -> usize {
        self.tcp.len() + self.rdma.as_ref().map_or(0, rdma::KeptQps::len)
    }
}

pub use crate::config::TransportKind;

/// Whether `kind` resolves to RDMA here (for `Auto`: a usable device with an ACTIVE port;
/// otherwise logs once why TCP is used).
pub fn resolves_to_rdma(kind: TransportKind) -> bool {
    match kind {
        TransportKind::Rdma => true,
        TransportKind::Tcp | TransportKind::Shm => false,
        TransportKind::Auto => match crate::verbs::list_ports() {
            Ok(ports) if ports.iter().any(|p| p.active) => true,
            other => {
                let why = match other {
                    Ok(_) => "no RDMA port is ACTIVE".to_string(),
                    Err(e) => e.to_string(),
                };
                static SAID: std::sync::Once = std::sync::Once::new();
                SAID.call_once(|| {
                    log::info!("using TCP ({why}); set RDMACOMM_TRANSPORT=rdma to require RDMA")
                });
                false
            }
        },
    }
}

/// Connects the transport `kind` names for `cfg` (every rank must resolve to the same one).
pub fn connect(cfg: &crate::Config, kind: TransportKind) -> Result<Box<dyn Transport>> {
    // Rank 0's address first: a transport's card names the address it reaches rank 0 from.
    let mut meet = discover::meeting_point(cfg)?;
    let mut listener = meet.listener.take();
    let cfg = &meet.cfg;
    connect_with(cfg, kind, &mut |card| {
        rendezvous::rendezvous_on(cfg, card, listener.take())
    })
}

/// [`connect`], meeting the other ranks through `meet`.
pub fn connect_with(
    cfg: &crate::Config,
    kind: TransportKind,
    meet: &mut dyn FnMut(&rendezvous::Card) -> Result<rendezvous::Rendezvous>,
) -> Result<Box<dyn Transport>> {
    connect_keeping(cfg, kind, Kept::default(), meet)
}

/// [`connect_with`], starting with the connections `kept` from a generation before.
pub(crate) fn connect_keeping(
    cfg: &crate::Config,
    kind: TransportKind,
    kept: Kept,
    meet: &mut dyn FnMut(&rendezvous::Card) -> Result<rendezvous::Rendezvous>,
) -> Result<Box<dyn Transport>> {
    descriptors::ensure(cfg.rank, cfg.world_size)?;
    if kind == TransportKind::Shm || kind == TransportKind::Auto && cfg.all_local() {
        return Ok(Box::new(shm::ShmTransport::connect_with(cfg, meet)?));
    }
    hybrid::connect_with(cfg, resolves_to_rdma(kind), kept, meet)
}
