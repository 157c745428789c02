//! The settings' types: what each `RDMACOMM_*` choice can be, and the defaults.

use crate::error::{Error, Result};
use std::time::Duration;

/// The job's shared secret (`RDMACOMM_SECRET`, or the contents of `RDMACOMM_SECRET_FILE`): with
/// it, nobody without it joins the rendezvous or learns its table. Never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub(crate) Vec<u8>);

impl Secret {
    /// A secret of these bytes.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Secret {
        Secret(bytes.into())
    }

    /// Its bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// How broadcast sends (`RDMACOMM_BCAST`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bcast {
    /// A pipelined chain from the root.
    Chain,
    /// A binomial tree of whole messages.
    Tree,
    /// The tree up to 8 KiB on more than two ranks, the chain otherwise.
    Auto,
}

impl Bcast {
    /// Parses `chain`, `tree` or `auto`.
    pub fn parse(v: &str) -> Result<Bcast> {
        match v {
            "chain" => Ok(Bcast::Chain),
            "tree" => Ok(Bcast::Tree),
            "auto" => Ok(Bcast::Auto),
            _ => Err(Error::Config(format!(
                "RDMACOMM_BCAST={v:?}: use chain, tree or auto"
            ))),
        }
    }

    /// This setting as a number (its position in [`BROADCAST_ALGOS`]).
    pub fn code(self) -> u8 {
        self as u8
    }
}

/// How a waiting rank polls (`RDMACOMM_POLL`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Poll {
    /// Spin briefly, then yield, then sleep; never spin where local ranks outnumber cores.
    Auto,
    /// Never stop spinning (lowest latency; burns a core per waiting rank).
    Spin,
    /// Never spin: yield, then sleep.
    Yield,
}

impl Poll {
    /// Parses `auto`, `spin` or `yield`.
    pub fn parse(v: &str) -> Result<Poll> {
        match v {
            "auto" => Ok(Poll::Auto),
            "spin" => Ok(Poll::Spin),
            "yield" => Ok(Poll::Yield),
            _ => Err(Error::Config(format!(
                "RDMACOMM_POLL={v:?}: use auto, spin or yield"
            ))),
        }
    }
}

/// When a rank connects to its peers over TCP or RDMA (`RDMACOMM_CONNECT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Connect {
    /// At the first operation that exchanges with the peer (NCCL's runtime connect): a ring
    /// connects two peers, whatever the world.
    OnDemand = 0,
    /// To every peer while the communicator is created.
    Eager = 1,
}

impl Connect {
    /// Parses `on-demand` (or `demand`, `lazy`) or `eager`.
    pub fn parse(v: &str) -> Result<Connect> {
        match v {
            "on-demand" | "demand" | "lazy" => Ok(Connect::OnDemand),
            "eager" => Ok(Connect::Eager),
            _ => Err(Error::Config(format!(
                "RDMACOMM_CONNECT={v:?}: use on-demand or eager"
            ))),
        }
    }

    /// The setting's word.
    pub fn name(self) -> &'static str {
        match self {
            Connect::OnDemand => "on-demand",
            Connect::Eager => "eager",
        }
    }

    /// The word of a setting sent as a number by a peer.
    pub(crate) fn name_of(v: u32) -> &'static str {
        match v {
            0 => Connect::OnDemand.name(),
            1 => Connect::Eager.name(),
            _ => "by an unknown setting",
        }
    }
}

/// Who moves the operations of a `Comm::overlap` scope (`RDMACOMM_PROGRESS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// A progress thread, sleeping on the completion channel and the sockets between events,
    /// moves them while the caller computes.
    Thread,
    /// They move only inside the caller's calls on them (MPI without asynchronous progress):
    /// `test()` runs them until they would wait on a peer, `wait()` and blocking calls to the end.
    Caller,
}

impl Progress {
    /// Parses `thread` or `caller`.
    pub fn parse(v: &str) -> Result<Progress> {
        match v {
            "thread" => Ok(Progress::Thread),
            "caller" => Ok(Progress::Caller),
            _ => Err(Error::Config(format!(
                "RDMACOMM_PROGRESS={v:?}: use thread or caller"
            ))),
        }
    }
}

/// The default timeout for every wait on a peer.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// The default TCP chunk: a chunk and its 64-byte header fill one 64 KiB loopback segment (lo's
/// MTU is 65536: 65483 bytes of payload per segment), where 64 KiB chunks took two (the second
/// small, with its own wakeup; measured: docs/DESIGN.md).
pub const DEFAULT_TCP_CHUNK: usize = (64 << 10) - 128;

/// The largest world (the RDMA transport's work-request ids name a peer in 14 bits).
pub const MAX_WORLD: usize = 1 << 14;

/// Slots per peer and direction unless `RDMACOMM_SLOTS` says otherwise.
pub const DEFAULT_SLOTS: usize = 4;

/// Registered memory per rank the default slot size aims at: every peer's receive and send slots.
pub const SLOT_BUDGET: usize = 32 << 20;

/// The smallest default slot: [`SLOT_BUDGET`] holds up to 1024 ranks' slots (the cost model in
/// docs/DESIGN.md weighs a write's fixed cost against it).
pub const MIN_DEFAULT_SLOT: usize = 4 << 10;

/// The default slot size: the largest power of two from 4 KiB to 1 MiB (2 MiB for two ranks)
/// whose slots (receive and send, `slots` each, for every rank) fit [`SLOT_BUDGET`]: 2 MiB for 2
/// ranks, 1 MiB up to 4, 512 KiB at 8, 64 KiB at 64, 16 KiB at 256, 4 KiB from 1024 (measured:
/// docs/DESIGN.md).
pub fn default_slot_bytes(world_size: usize, slots: usize) -> usize {
    let fit = SLOT_BUDGET / (2 * world_size.max(1) * slots.max(1));
    let pow2 = if fit == 0 {
        0
    } else {
        1usize << (usize::BITS - 1 - fit.leading_zeros())
    };
    let cap = if world_size == 2 { 2 << 20 } else { 1 << 20 };
    pow2.clamp(MIN_DEFAULT_SLOT, cap)
}

/// How the ranks find rank 0's rendezvous address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Discovery {
    /// `coordinator` says it (or the world is one rank).
    Given,
    /// Rank 0 publishes its address in the launcher's PMIx store (`PMIX_NAMESPACE` is set).
    Pmix,
    /// Slurm without PMIx: `coordinator` is the step's first node at a port derived from the job
    /// and step ids, and rank 0 listens there on every interface.
    Slurm,
}

/// The all_reduce algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algo {
    /// Pipelined ring: reduce-scatter then all-gather (bandwidth-optimal, 2(n-1) steps).
    Ring,
    /// Recursive halving-doubling (Rabenseifner): bandwidth-optimal in 2 log2(n) steps.
    Halving,
    /// Recursive doubling of the whole vector: log2(n) steps, for small messages.
    Doubling,
    /// Chosen by size, world size and link .
    Auto,
    /// One step: every rank sends its whole vector to every other (`collectives/direct.rs`).
    Direct,
    /// Within each host over shared memory, then across hosts (`collectives/hier.rs`): where the link's
    /// hosts form a regular layout ; elsewhere as [`Algo::Auto`] flat.
    Hierarchical,
}

impl Algo {
    /// This setting as a number (its position in [`ALL_REDUCE_ALGOS`]).
    pub fn code(self) -> u8 {
        self as u8
    }

    /// The setting whose [`Algo::code`] is `c` (`Auto` for any other number).
    pub fn from_code(c: u8) -> Algo {
        [
            Algo::Ring,
            Algo::Halving,
            Algo::Doubling,
            Algo::Auto,
            Algo::Direct,
            Algo::Hierarchical,
        ]
        .into_iter()
        .find(|a| a.code() == c)
        .unwrap_or(Algo::Auto)
    }

    /// Parses `ring`, `halving`, `doubling`, `direct` or `auto`.
    pub fn parse(s: &str) -> Result<Algo> {
        Ok(match s {
            "ring" => Algo::Ring,
            "halving" | "rabenseifner" => Algo::Halving,
            "doubling" => Algo::Doubling,
            "direct" => Algo::Direct,
            "hierarchical" => Algo::Hierarchical,
            "auto" => Algo::Auto,
            _ => {
                return Err(Error::Config(format!(
                    "RDMACOMM_ALGO={s:?}: use ring, halving, doubling, direct, hierarchical or \
                     auto"
                )))
            }
        })
    }
}

/// Which transport a communicator uses (`RDMACOMM_TRANSPORT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportKind {
    /// Shared memory when the launcher says every rank is on this host; otherwise RDMA where a
    /// usable device and ACTIVE port exist, TCP where not (logged once), with shared
    /// memory to the peers on this host. `RDMACOMM_SHM=0` turns shared memory off.
    Auto,
    /// RDMA (no device is an error); shared memory to same-host peers only with `RDMACOMM_SHM=1`.
    Rdma,
    /// TCP; shared memory to same-host peers only with `RDMACOMM_SHM=1`.
    Tcp,
    /// Shared memory only: every rank must be on this host.
    Shm,
}

impl TransportKind {
    /// Parses `RDMACOMM_TRANSPORT`'s value (`auto`, `rdma`, `tcp`, `shm`; empty: `auto`).
    pub fn parse(v: &str) -> Result<TransportKind> {
        match v.trim() {
            "" | "auto" => Ok(TransportKind::Auto),
            "rdma" => Ok(TransportKind::Rdma),
            "tcp" => Ok(TransportKind::Tcp),
            "shm" => Ok(TransportKind::Shm),
            v => Err(Error::Config(format!(
                "RDMACOMM_TRANSPORT={v:?}: use auto, rdma, tcp or shm"
            ))),
        }
    }
}

/// Names of `algo` values for all_reduce, in [`crate::Algo`] order.
pub const ALL_REDUCE_ALGOS: [&str; 6] = [
    "ring",
    "halving",
    "doubling",
    "auto",
    "direct",
    "hierarchical",
];
/// Names of `algo` values for broadcast.
pub const BROADCAST_ALGOS: [&str; 3] = ["chain", "tree", "auto"];
