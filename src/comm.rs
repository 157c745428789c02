//! [`Comm`]: the byte-level [`Communicator`] over a transport (RDMA, or TCP where there is none).

use crate::api::{
    check_all_gather, check_all_gather_v, check_all_reduce, check_all_to_all, check_all_to_allv,
    check_batch, check_gather, check_peer, check_reduce_scatter_v, check_root, check_scatter,
    check_sum_scatter, offsets_onto, Communicator, P2p,
};
use crate::collectives::{
    bcast, direct, exchange, halving, hier, p2p, ring, rooted, tuning, Scratch,
};
use crate::config::{Bcast, Config};
use crate::dtype::{AllReduce, DType};
use crate::error::{Error, Peer, Result};
use crate::transport::op::{OpDesc, OpKind, Scope};
use crate::transport::rendezvous::Card;
use crate::transport::watch::AbortRequest;
use crate::transport::{self, Link, Transport};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

struct Inner {
    /// None for a world of one.
    link: Option<Box<dyn Transport>>,
    scratch: crate::collectives::Scratch,
}

pub use crate::collectives::{Algo, DOUBLING_MAX_BYTES};

/// Why a communicator refuses work.
enum Poison {
    /// An operation failed (the error, in words).
    Failed(String),
    /// A rank's application aborted.
    Aborted { by: Peer, reason: String },
}

/// A number for the calling thread, unique for the life of the process.
#[inline]
pub(crate) fn this_thread() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    // Zero until first asked (a const initialiser: no lazy-init check on each call).
    thread_local!(static ID: std::cell::Cell<u64> = const { std::cell::Cell::new(0) });
    ID.with(|id| match id.get() {
        0 => {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            id.set(n);
            n
        }
        n => n,
    })
}

/// A communicator: over RDMA (one reliable-connected queue pair per peer) or, where no RDMA
/// device exists, over TCP (`RDMACOMM_TRANSPORT`).
///
/// Threads: its operations run in the order one thread calls them, the same on every rank, so
/// they belong to one thread: the one that created it (or, after a move, the one that called
/// [`Comm::adopt`]). A call from any other thread fails with [`Error::WrongThread`] before it
/// touches the wire. Give each thread its own with [`Comm::dup`]. [`Communicator::health`],
/// `rank`, `size` and [`Comm::device`] may be called from any thread.
pub struct Comm {
    rank: usize,
    size: usize,
    inner: Mutex<Inner>,
    /// Set by the first failure; every later call returns it (readable while an op runs).
    poisoned: Mutex<Option<Poison>>,
    /// Whether `poisoned` holds a reason (read without the lock on every call).
    is_poisoned: AtomicBool,
    /// Through which [`Comm::abort`] stops an operation that runs (None for a world of one).
    abort_request: Option<Arc<AbortRequest>>,
    /// This rank, as errors name it.
    me: Peer,
    /// The thread that runs the non-blocking operations of an [`Comm::overlap`] scope (0: none).
    pub(crate) executor: AtomicU64,
    /// The open [`Comm::overlap`] scope's queue (null: none), for blocking calls to run the
    /// operations started before them first.
    pub(crate) scope: AtomicPtr<()>,
    /// When they may move (always, or only inside the caller's calls).
    pub(crate) gate: Arc<crate::overlap::gate::Gate>,
    algo: Mutex<Algo>,
    /// Where this rank stands among hosts of equal size, if the link's hosts form one (worked
    /// out once: the hierarchical all_reduce needs it on every call).
    layout: Option<hier::Layout>,
    /// What the link moves bytes over (fixed for its life; `None` alone).
    medium: Option<crate::transport::Medium>,
    /// The transport in words (kept: reading it from the link would wait for an operation, or,
    /// under caller progress, for the caller's next call on one).
    described: Option<String>,
    cfg: Config,
    /// The thread whose operations this communicator runs ([`this_thread`]).
    owner: AtomicU64,
}

impl Comm {
    /// Joins the group described by `cfg` (every rank must call this). A world of one needs no
    /// device. The calling thread owns the communicator.
    pub fn new(cfg: &Config) -> Result<Self> {
        cfg.validate()?;
        crate::diag::install(cfg.debug, cfg.debug_file.as_deref())?;
        // The process's kernels, chosen (and the copy kernel timed, where it is) here, not
        // inside the first operation; a later communicator asking for others is refused.
        let kernels = kernels_as_asked(cfg);
        let mut link = if cfg.world_size > 1 {
            Some(transport::connect(cfg, cfg.transport)?)
        } else {
            None
        };
        let (local, nlocal) = link.as_ref().map_or((0, 1), |l| l.local_rank());
        if let Err(e) = kernels.and_then(|()| cfg.pin.apply(local, nlocal)) {
            // Known only now (it needs the number of local ranks): the group learns it too.
            if let Some(l) = link.as_mut() {
                l.abort(format!("its configuration is invalid: {e}"));
            }
            return Err(e);
        }
        Ok(Comm::with_link_of(cfg.clone(), link, cfg.algo))
    }

    fn with_link_of(cfg: Config, mut link: Option<Box<dyn Transport>>, algo: Algo) -> Comm {
        let layout = link
            .as_ref()
            .and_then(|l| l.hosts().and_then(|h| hier::Layout::of(h, l.rank())));
        let abort_request = link.as_mut().map(|l| l.watch_mut().abort_request());
        let medium = link.as_ref().map(|l| l.medium());
        let described = link.as_ref().map(|l| l.describe());
        if let (Some(l), Some(d)) = (link.as_ref(), described.as_ref()) {
            summarise(&cfg, l.local_rank(), d, algo);
        }
        let me = link.as_ref().map_or(
            Peer {
                rank: cfg.rank,
                addr: String::new(),
            },
            |l| l.peer(cfg.rank),
        );
        Comm {
            layout,
            medium,
            described,
            abort_request,
            me,
            executor: AtomicU64::new(0),
            scope: AtomicPtr::new(std::ptr::null_mut()),
            gate: Default::default(),
            rank: cfg.rank,
            size: cfg.world_size,
            inner: Mutex::new(Inner {
                link,
                scratch: Default::default(),
            }),
            poisoned: Mutex::new(None),
            is_poisoned: AtomicBool::new(false),
            algo: Mutex::new(algo),
            cfg,
            owner: AtomicU64::new(this_thread()),
        }
    }

    /// Joins the group described by the environment (see [`Config::from_env`]). A rank whose
    /// settings are invalid still tells the group (through the rendezvous), so every rank fails
    /// at once with an error naming that rank and variable.
    pub fn from_env() -> Result<Self> {
        let (rank, size, coordinator) = Config::identity_from_env()?;
        match Config::new(rank, size, coordinator.clone()) {
            Ok(cfg) => Comm::new(&cfg),
            Err(e) => {
                if size > 1 && rank < size {
                    transport::rendezvous::refuse(
                        &Config::defaults(rank, size, coordinator),
                        &e.to_string(),
                    );
                }
                Err(e)
            }
        }
    }

    /// Makes the calling thread this communicator's owner, after it was moved here (`&mut`:
    /// no other thread can be using it meanwhile).
    pub fn adopt(&mut self) {
        *self.owner.get_mut() = this_thread();
    }

    /// A new communicator over the same ranks, independent of this one (its own connections,
    /// sequence and failures), owned by the calling thread: one per thread that runs
    /// operations. Collective: every rank must call it, in the same position.
    pub fn dup(&self) -> Result<Comm> {
        self.split_comm(0, self.rank as i32)
    }

    /// Makes the calling thread the owner without `&mut`: for an adapter that serialises its
    /// callers under a lock of its own (a framework's transport called from any thread).
    #[cfg(any(feature = "nuvec", feature = "fuel"))]
    pub(crate) fn claim(&self) {
        self.owner.store(this_thread(), Ordering::Relaxed);
    }

    /// Closes the link now, as dropping the communicator would (the group is told this rank
    /// leaves; a bounded close barrier), for a communicator a framework never drops; every
    /// later call fails. Skipped while an operation holds the link.
    #[cfg(any(feature = "nuvec", feature = "fuel"))]
    pub(crate) fn close(&self, why: &str) {
        self.poison_with(format!("rank {} {why}", self.rank));
        let link = match self.inner.try_lock() {
            Ok(mut g) => g.link.take(),
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner().link.take(),
            Err(std::sync::TryLockError::WouldBlock) => None,
        };
        drop(link);
    }

    /// Refuses every later call with `why` (a failure every rank found alike, as a
    /// mismatch of calls an adapter compared before any data moved).
    #[cfg(feature = "fuel")]
    pub(crate) fn refuse_further(&self, why: &str) {
        self.poison_with(why.to_string());
    }

    /// Fails unless the calling thread owns this communicator (or runs its non-blocking
    /// operations).
    #[inline]
    pub(crate) fn check_thread(&self, what: &dyn std::fmt::Display) -> Result<()> {
        let me = this_thread();
        if self.owner.load(Ordering::Relaxed) == me || self.executor.load(Ordering::Relaxed) == me {
            return Ok(());
        }
        self.wrong_thread(what)
    }

    #[cold]
    fn wrong_thread(&self, what: &dyn std::fmt::Display) -> Result<()> {
        let t = std::thread::current();
        Err(Error::WrongThread(format!(
            "rank {}: {what} was called from thread {:?}, but this communicator runs the \
             operations of the thread that created it (every rank must run them in one order): \
             give each thread its own (Comm::dup), or move it and call Comm::adopt",
            self.rank,
            t.name().unwrap_or("unnamed")
        )))
    }

    /// All-gathers `input` as step `step` of a split.
    fn split_step(&self, step: u8, input: &[u8], output: &mut [u8]) -> Result<()> {
        check_all_gather(self.size, input, output)?;
        let n = input.len();
        let desc = OpDesc {
            algo: step,
            ..OpDesc::new(OpKind::Split, n)
        };
        self.with_link(desc, Scope::All, |l, _| {
            crate::copy::copy(&mut output[l.rank() * n..(l.rank() + 1) * n], input);
            ring::all_gather(l, output)
        })
    }

    /// Splits into subgroups (MPI_Comm_split / MLX's split), collectively over every rank of
    /// this communicator: ranks with the same `color` form one, ordered by `key` (ties by rank
    /// here). A negative color means "in no subgroup": that rank gets a world of one. Queue pair
    /// endpoints are exchanged over this communicator; each subgroup gets its own side channel
    /// (for abort and health) at its first rank, whose address also goes over this
    /// communicator. The result is independent of this one: either can be used or dropped first.
    pub fn split_comm(&self, color: i32, key: i32) -> Result<Comm> {
        if self.size == 1 {
            // A world of one splits (and dups) into a world of one.
            self.alone("split")?;
            return Ok(Comm::with_link_of(self.cfg.clone(), None, self.algorithm()));
        }
        self.check_thread(&"split")?;
        self.split_setup(color, key)
            .map_err(|e| self.set_up_failed(e))
    }

    /// A rank that failed setting up its subgroup (not in this communicator's operations, whose
    /// failures are told already) tells the others, who may wait on it in the split's steps.
    #[cold]
    fn set_up_failed(&self, e: Error) -> Error {
        if self.check_usable().is_ok() {
            let why = format!(
                "rank {} could not set up its subgroup in split: {e}",
                self.rank
            );
            self.end_and_tell(Poison::Failed(why.clone()), &why);
        }
        e
    }

    /// [`Comm::split_comm`] beyond a world of one, from the owning thread.
    fn split_setup(&self, color: i32, key: i32) -> Result<Comm> {
        let (n, r) = (self.size, self.rank);
        let mut mine = [0u8; 8];
        mine[..4].copy_from_slice(&color.to_le_bytes());
        mine[4..].copy_from_slice(&key.to_le_bytes());
        let mut all = vec![0u8; 8 * n];
        self.split_step(1, &mine, &mut all)?;
        let entry = |q: usize| {
            let e = &all[8 * q..8 * q + 8];
            (
                i32::from_le_bytes(e[..4].try_into().unwrap()),
                i32::from_le_bytes(e[4..].try_into().unwrap()),
            )
        };
        let mut members: Vec<usize> = if color < 0 {
            vec![r]
        } else {
            (0..n).filter(|&q| entry(q).0 == color).collect()
        };
        members.sort_by_key(|&q| (entry(q).1, q));
        let sub_rank = members
            .iter()
            .position(|&q| q == r)
            .expect("a member of its own group");
        let grouped = members.len() > 1;
        // The subgroup's first rank listens for its side channel; everyone learns the address.
        let my_ip = match &self.cfg.bind_addr {
            Some(ip) => ip.clone(),
            None => {
                let a = self
                    .lock()
                    .link
                    .as_ref()
                    .map(|l| l.peer(r).addr)
                    .unwrap_or_default();
                if a.is_empty() {
                    "127.0.0.1".into()
                } else {
                    a
                }
            }
        };
        let mut listener = None;
        let mut field = [0u8; 64];
        if grouped && sub_rank == 0 {
            let l = std::net::TcpListener::bind((my_ip.as_str(), 0))
                .map_err(|e| Error::Bootstrap(format!("split: cannot listen on {my_ip}: {e}")))?;
            let text = l.local_addr()?.to_string();
            field[..text.len()].copy_from_slice(text.as_bytes());
            listener = Some(l);
        }
        let mut fields = vec![0u8; 64 * n];
        self.split_step(2, &field, &mut fields)?;
        let lead = members[0];
        let lead_addr = String::from_utf8_lossy(&fields[64 * lead..64 * lead + 64])
            .trim_end_matches('\0')
            .to_string();
        let mut sub_cfg = self.cfg.clone();
        sub_cfg.rank = sub_rank;
        sub_cfg.world_size = members.len();
        sub_cfg.coordinator = lead_addr;
        // The subgroup's own count of members on this host, not the launcher's count for the
        // world: one rank per host of a 2 x 2 job is no group for shared memory alone.
        sub_cfg.local_world = self.members_here(&members);
        // Cards over this communicator: every rank takes part, even one that joins no subgroup.
        let exchange = |card: &[u8]| -> Result<Vec<Vec<u8>>> {
            let mut lens = vec![0u8; 4 * n];
            self.split_step(3, &(card.len() as u32).to_le_bytes(), &mut lens)?;
            let len_of =
                |q: usize| u32::from_le_bytes(lens[4 * q..4 * q + 4].try_into().unwrap()) as usize;
            let max = (0..n).map(len_of).max().unwrap_or(0);
            let mut padded = card.to_vec();
            padded.resize(max, 0);
            let mut cards = vec![0u8; max * n];
            self.split_step(4, &padded, &mut cards)?;
            Ok(members
                .iter()
                .map(|&q| cards[q * max..q * max + len_of(q)].to_vec())
                .collect::<Vec<_>>())
        };
        // A card as bytes: its common part's length and bytes, its entry size, its entries.
        let flatten = |c: &Card| {
            let mut v = (c.common.len() as u32).to_le_bytes().to_vec();
            v.extend_from_slice(&c.common);
            v.extend_from_slice(&(c.entry as u32).to_le_bytes());
            v.extend_from_slice(&c.each);
            v
        };
        let unflatten = |b: &[u8]| -> Result<Card> {
            let mut r = crate::transport::bootstrap::Reader(b);
            let common = r.bytes()?.to_vec();
            let entry = r.u32()? as usize;
            Ok(Card {
                common,
                entry,
                each: r.0.to_vec(),
            })
        };
        if !grouped {
            exchange(&flatten(&Card::default()))?;
            let cfg = Config {
                rank: 0,
                world_size: 1,
                ..sub_cfg
            };
            return Comm::new(&cfg);
        }
        let kind = self.cfg.transport;
        let meet_cfg = sub_cfg.clone();
        let link = transport::connect_with(&sub_cfg, kind, &mut |card| {
            let cards = exchange(&flatten(card))?
                .iter()
                .map(|b| unflatten(b).map(|c| c.for_rank(sub_rank)))
                .collect::<Result<Vec<_>>>()?;
            let mut rv = crate::transport::rendezvous::rendezvous_on(
                &meet_cfg,
                &Card::default(),
                listener.take(),
            )?;
            rv.cards = cards;
            Ok(rv)
        })?;
        Ok(Comm::with_link_of(sub_cfg, Some(link), self.algorithm()))
    }

    /// How many of `members` (ranks of this communicator) share this rank's host, where the
    /// link knows: every one over shared memory alone, else as its hosts say; `None` where it
    /// cannot tell (a subgroup then finds out at its own rendezvous).
    fn members_here(&self, members: &[usize]) -> Option<usize> {
        if self.medium == Some(crate::transport::Medium::SharedMemory) {
            return Some(members.len());
        }
        let g = self.lock();
        let hosts = g.link.as_ref()?.hosts()?;
        let mine = *hosts.get(self.rank)?;
        Some(
            members
                .iter()
                .filter(|&&q| hosts.get(q) == Some(&mine))
                .count(),
        )
    }

    /// Who moves the operations of [`Comm::overlap`] (`RDMACOMM_PROGRESS`).
    pub fn progress(&self) -> crate::config::Progress {
        self.cfg.progress
    }

    /// The core the progress thread of [`Comm::overlap`] runs on (`RDMACOMM_PROGRESS_CPU`).
    pub(crate) fn progress_cpu(&self) -> Option<usize> {
        self.cfg.progress_cpu
    }

    /// Chooses the all_reduce algorithm (every rank must choose the same).
    pub fn set_algorithm(&self, algo: Algo) {
        *self.algo.lock().unwrap_or_else(|e| e.into_inner()) = algo;
    }

    /// The all_reduce algorithm setting.
    pub fn algorithm(&self) -> Algo {
        *self.algo.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The transport in use, in words: `RDMA <device> port <n> GID[<i>] <gid> MTU <bytes>` or
    /// `TCP`, with shared memory where it reaches some peers (None for a world of one).
    pub fn device(&self) -> Option<String> {
        self.described.clone()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs operation `desc` with the peers of `scope` as `f` on the link, from the
    /// owning thread, unless the communicator failed before. A failure poisons it; so does a
    /// panic, which the peers are told of before it goes on unwinding.
    fn with_link<T>(
        &self,
        desc: OpDesc,
        scope: Scope,
        f: impl FnOnce(&mut dyn Link, &mut crate::collectives::Scratch) -> Result<T>,
    ) -> Result<T> {
        self.check_thread(&desc)?;
        self.wait_started_ones();
        let mut g = self.lock();
        self.check_usable()?;
        let inner = &mut *g;
        let Some(link) = inner.link.as_deref_mut() else {
            // A world of one never gets here; a closed communicator is poisoned before.
            return Err(Error::Poisoned(format!("rank {} has no link", self.rank)));
        };
        link.start(&desc, scope);
        link.watch_mut().started(&desc, scope);
        let scratch = &mut inner.scratch;
        let r = catch_unwind(AssertUnwindSafe(|| {
            f(&mut *link, scratch).and_then(|v| crate::collectives::pause::finish(link).map(|_| v))
        }));
        link.release();
        match r {
            Ok(mut r) => {
                if let Err(Error::Aborted { by, reason }) = &mut r {
                    if by.rank != self.rank {
                        // Both sides' calls: the peer's cause, and where this rank stood.
                        *reason = format!("{reason} (rank {} was in {desc})", self.rank);
                    }
                }
                if let Err(e) = &r {
                    if matches!(e, Error::InvalidArgument(_)) {
                        // Found here, inside the operation (a peer's lengths differ from this
                        // rank's): the peers learn the cause now instead of waiting on us.
                        link.abort(format!("rank {} failed inside {desc}: {e}", self.rank));
                    }
                    self.poison(e);
                }
                r
            }
            Err(panic) => {
                let why = format!(
                    "rank {} panicked inside {desc}: {}",
                    self.rank,
                    panic_text(&*panic)
                );
                link.abort(why.clone());
                self.poison_with(why);
                drop(g);
                resume_unwind(panic)
            }
        }
    }

    /// On the owning thread, inside an [`Comm::overlap`] scope: waits until the non-blocking
    /// operations started before have finished (operations run in call order). Each is bounded
    /// by the timeout.
    #[inline]
    fn wait_started_ones(&self) {
        // Only the scope's own thread (the owner) may run its operations.
        if self.owner.load(Ordering::Relaxed) == this_thread() {
            crate::overlap::wait_started(self);
        }
    }

    fn poison(&self, e: &Error) {
        let p = match e {
            Error::Aborted { by, reason } => Poison::Aborted {
                by: by.clone(),
                reason: reason.clone(),
            },
            e => Poison::Failed(e.to_string()),
        };
        self.poison_as(p);
    }

    fn poison_with(&self, why: String) {
        self.poison_as(Poison::Failed(why));
    }

    fn poison_as(&self, why: Poison) {
        let mut p = self.poisoned.lock().unwrap_or_else(|e| e.into_inner());
        if p.is_none() {
            *p = Some(why);
            self.is_poisoned.store(true, Ordering::Release);
        }
    }

    #[inline]
    pub(crate) fn check_usable(&self) -> Result<()> {
        if !self.is_poisoned.load(Ordering::Acquire) {
            return Ok(());
        }
        self.poisoned_error()
    }

    #[cold]
    fn poisoned_error(&self) -> Result<()> {
        match &*self.poisoned.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(Poison::Failed(why)) => Err(Error::Poisoned(why.clone())),
            Some(Poison::Aborted { by, reason }) => Err(Error::Aborted {
                by: by.clone(),
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Aborts this communicator from any thread: an operation running or waiting here returns
    /// [`Error::Aborted`] within moments, as does every later one; every peer is told, and
    /// their pending and later operations end alike, naming this rank and `reason`. Returns
    /// once the peers have been told (or the timeout passed while an operation would not
    /// stop).
    pub fn abort(&self, reason: &str) {
        self.end_and_tell(
            Poison::Aborted {
                by: self.me.clone(),
                reason: reason.to_string(),
            },
            reason,
        );
    }

    /// A call refused on this rank (`e`, found before it reached the wire) while its peers may be
    /// in that call already: they are told the cause, as by an abort, and the communicator
    /// refuses further work, as after any failure. A call from a thread that does not own it, on
    /// a failed communicator or in a world of one ends nothing.
    #[cold]
    pub(crate) fn refused(&self, e: Error) -> Error {
        if !matches!(e, Error::InvalidArgument(_))
            || self.size == 1
            || self.check_thread(&"").is_err()
            || self.check_usable().is_err()
        {
            return e;
        }
        let why = format!("rank {} refused its call: {e}", self.rank);
        self.end_and_tell(Poison::Failed(why.clone()), &why);
        e
    }

    /// Poisons this communicator with `poison` and tells the peers `reason` (see
    /// [`Comm::abort`]).
    fn end_and_tell(&self, poison: Poison, reason: &str) {
        self.poison_as(poison);
        // An operation held between its caller's calls goes on, to see the abort.
        self.gate.hold(false);
        let Some(req) = &self.abort_request else {
            return;
        };
        req.request(reason);
        // An operation that runs sees the request at its next poll; otherwise tell the peers here.
        let until = Instant::now() + self.cfg.timeout + Duration::from_secs(1);
        loop {
            let g = match self.inner.try_lock() {
                Ok(g) => Some(g),
                Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) => None,
            };
            if let Some(mut g) = g {
                if let Some(l) = g.link.as_mut() {
                    let _ = l.watch_mut().poll();
                }
                return;
            }
            if Instant::now() > until {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// For a world of one: the checks an operation makes before it would touch the wire.
    fn alone(&self, what: &str) -> Result<()> {
        self.check_thread(&what)?;
        self.wait_started_ones();
        self.check_usable()
    }
}

/// Each rank's summary of a new communicator at `info` (as `NCCL_DEBUG=INFO` prints), and rank
/// 0's line for the job.
fn summarise(cfg: &Config, (local, nlocal): (usize, usize), described: &str, algo: Algo) {
    if !log::log_enabled!(log::Level::Info) {
        return;
    }
    if cfg.rank == 0 {
        let job = if cfg.job_id.is_empty() {
            "(no job id)".to_string()
        } else {
            format!("{:?}", cfg.job_id)
        };
        log::info!(
            "job {job}: {} ranks, coordinator {}, timeout {:?}, secret {}",
            cfg.world_size,
            cfg.coordinator,
            cfg.timeout,
            if cfg.secret.is_some() { "yes" } else { "no" }
        );
    }
    log::info!(
        "rank {} of {}: {described}; {nlocal} ranks on this host (local rank {local}), host id \
         {:?}; RDMA slots {} x {} B, TCP chunk {} B, zero-copy from {} B; all_reduce {algo:?} \
         (recursive doubling up to {} B), broadcast {:?}; progress {:?}, polling {:?}",
        cfg.rank,
        cfg.world_size,
        cfg.host_id,
        cfg.slots,
        cfg.slot_bytes,
        cfg.tcp_chunk,
        cfg.zero_copy_min,
        crate::collectives::DOUBLING_MAX_BYTES,
        cfg.bcast,
        cfg.progress,
        cfg.poll
    );
}

/// Chooses the process's kernels as `cfg` asks; an error where an earlier communicator chose
/// others (they are chosen once per process).
fn kernels_as_asked(cfg: &Config) -> Result<()> {
    use crate::copy::CopyKernel;
    use crate::reduce::SimdLevel;
    let (copy_before, simd_before) = (crate::copy::chosen(), crate::reduce::chosen());
    let simd = crate::reduce::choose_simd(cfg.simd_baseline);
    let copy = crate::copy::choose(cfg.copy);
    if cfg.simd_baseline && simd != SimdLevel::Baseline && simd_before.is_some() {
        return Err(Error::Config(format!(
            "RDMACOMM_SIMD=baseline: this process's reduction kernels were chosen ({simd:?}) by              its first communicator; they are chosen once per process"
        )));
    }
    let possible = |k: CopyKernel| k != CopyKernel::Simd || simd == SimdLevel::Avx2;
    match cfg.copy {
        Some(k) if k != copy && possible(k) && copy_before.is_some() => Err(Error::Config(format!(
            "RDMACOMM_COPY={k:?}: this process's copy kernel was chosen ({copy:?}) by its first              communicator; it is chosen once per process"
        ))),
        _ => Ok(()),
    }
}

/// A panic's message, if it has one.
fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// Distinct ranks, on the stack up to [`PeerSet::ON_STACK`] (a batch's peers: no allocation for
/// the batches one meets).
#[derive(Default)]
struct PeerSet {
    stack: [usize; PeerSet::ON_STACK],
    len: usize,
    more: Vec<usize>,
}

impl PeerSet {
    const ON_STACK: usize = 32;

    fn insert(&mut self, p: usize) {
        if self.stack[..self.len].contains(&p) || self.more.contains(&p) {
            return;
        }
        if self.len < Self::ON_STACK {
            self.stack[self.len] = p;
            self.len += 1;
        } else {
            self.more.push(p);
        }
    }

    /// The ranks inserted, each once.
    fn ranks(&mut self) -> &[usize] {
        if self.more.is_empty() {
            return &self.stack[..self.len];
        }
        if self.len > 0 {
            // Past the stack: all of them in one list, once.
            self.more
                .splice(0..0, self.stack[..self.len].iter().copied());
            self.len = 0;
        }
        &self.more
    }
}

/// A batch's operations as an exchange plan: `index` holds the sends' positions in `ops`, then
/// the receives' (kept in the communicator's scratch, so a repeated batch allocates nothing).
struct Batch<'s, 'd> {
    ops: &'s mut [P2p<'d>],
    index: &'s [usize],
    sends: usize,
}

impl exchange::Plan for Batch<'_, '_> {
    fn sends(&self) -> usize {
        self.sends
    }
    fn send_peer(&self, i: usize) -> usize {
        self.ops[self.index[i]].peer()
    }
    fn send(&self, i: usize) -> &[u8] {
        match &self.ops[self.index[i]] {
            P2p::Send { data, .. } => data,
            P2p::Recv { .. } => unreachable!("indexed as a send"),
        }
    }
    fn recvs(&self) -> usize {
        self.index.len() - self.sends
    }
    fn recv_peer(&self, i: usize) -> usize {
        self.ops[self.index[self.sends + i]].peer()
    }
    fn recv(&mut self, i: usize) -> &mut [u8] {
        match &mut self.ops[self.index[self.sends + i]] {
            P2p::Recv { data, .. } => data,
            P2p::Send { .. } => unreachable!("indexed as a receive"),
        }
    }
}

impl Comm {
    /// [`Communicator::all_reduce`] once its arguments have passed `check_all_reduce` (a
    /// started one is checked when it starts).
    pub(crate) fn all_reduce_checked(
        &self,
        op: AllReduce,
        dtype: DType,
        data: &mut [u8],
    ) -> Result<()> {
        if self.size == 1 {
            return self.alone("all_reduce");
        }
        let algo = self.algorithm();
        let desc = OpDesc {
            dtype: Some(dtype),
            reduce: Some(op),
            algo: algo.code(),
            ..OpDesc::new(OpKind::AllReduce, data.len())
        };
        self.with_link(desc, Scope::All, |l, scratch| {
            l.lend(data);
            // Whole elements per slice; each slice is an all_reduce of its own, its algorithm
            // chosen by its size, so every rank still gets the same bits, run to run.
            let es = dtype.size();
            let slice = (tuning::slice_bytes(l.medium()) / es).max(1) * es;
            let mut rest = data;
            loop {
                let (part, tail) = rest.split_at_mut(rest.len().min(slice));
                // Every rank has the same host map where it is regular (no rank is alone on
                // its host there), so every rank makes the same choice.
                let layout = self.layout.as_ref();
                let (n, len, dmax, shared) = (
                    l.size(),
                    part.len(),
                    tuning::doubling_max(l.medium(), l.size()),
                    l.shares_memory(),
                );
                match algo.choose(n, len, dmax, shared, layout.is_some()) {
                    Algo::Hierarchical => hier::all_reduce(l, layout, op, dtype, part, scratch)?,
                    Algo::Direct => direct::all_reduce_direct(l, op, dtype, part, scratch)?,
                    Algo::Doubling => halving::all_reduce_doubling(l, op, dtype, part, scratch)?,
                    Algo::Halving => halving::all_reduce_halving(l, op, dtype, part, scratch)?,
                    _ => ring::all_reduce(l, op, dtype, part)?,
                }
                if tail.is_empty() {
                    return Ok(());
                }
                rest = tail;
            }
        })
    }
}

impl Communicator for Comm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce(&self, op: AllReduce, dtype: DType, data: &mut [u8]) -> Result<()> {
        check_all_reduce(dtype, data).map_err(|e| self.refused(e))?;
        self.all_reduce_checked(op, dtype, data)
    }

    fn all_gather(&self, input: &[u8], output: &mut [u8]) -> Result<()> {
        check_all_gather(self.size, input, output).map_err(|e| self.refused(e))?;
        let n = input.len();
        if self.size == 1 {
            self.alone("all_gather")?;
            crate::copy::copy(output, input);
            return Ok(());
        }
        self.with_link(OpDesc::new(OpKind::AllGather, n), Scope::All, |l, _| {
            crate::copy::copy(&mut output[l.rank() * n..(l.rank() + 1) * n], input);
            l.lend(output);
            ring::all_gather(l, output)
        })
    }

    fn send(&self, dst: usize, data: &[u8]) -> Result<()> {
        check_peer("send", self.rank, self.size, dst).map_err(|e| self.refused(e))?;
        self.with_link(
            OpDesc::new(OpKind::SendRecv, data.len()),
            Scope::To(dst),
            |l, _| {
                l.lend(data);
                p2p::send(l, dst, data)
            },
        )
    }

    fn recv(&self, src: usize, data: &mut [u8]) -> Result<()> {
        check_peer("recv", self.rank, self.size, src).map_err(|e| self.refused(e))?;
        self.with_link(
            OpDesc::new(OpKind::SendRecv, data.len()),
            Scope::From(src),
            |l, _| p2p::recv(l, src, data),
        )
    }

    fn sum_scatter(&self, dtype: DType, input: &[u8], output: &mut [u8]) -> Result<()> {
        check_sum_scatter(self.size, dtype, input, output).map_err(|e| self.refused(e))?;
        if self.size == 1 {
            self.alone("sum_scatter")?;
            crate::copy::copy(output, input);
            return Ok(());
        }
        let desc = OpDesc {
            dtype: Some(dtype),
            reduce: Some(AllReduce::Sum),
            ..OpDesc::new(OpKind::SumScatter, input.len())
        };
        self.with_link(desc, Scope::All, |l, scratch| {
            scratch.clear();
            scratch.extend_from_slice(input);
            l.lend(scratch);
            if l.size().is_power_of_two() {
                halving::reduce_scatter_halving(l, AllReduce::Sum, dtype, scratch)?;
            } else {
                ring::reduce_scatter(l, AllReduce::Sum, dtype, scratch)?;
            }
            let (r, m) = (l.rank(), output.len());
            crate::copy::copy(output, &scratch[r * m..(r + 1) * m]);
            Ok(())
        })
    }

    /// Registers `buf` with the transport (fails, without running `f`, when registering fails,
    /// e.g. at the locked-memory limit, whose error says how to raise it, or when
    /// [`crate::transport::rdma::MAX_REGISTERED`] buffers are registered already); the
    /// registration ends however `f` exits. A panic in `f` poisons the communicator and tells
    /// the peers before it goes on unwinding.
    fn with_registered(
        &self,
        buf: &mut [u8],
        f: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<()> {
        self.alone("with_registered")?;
        let id = match self.lock().link.as_deref_mut() {
            // SAFETY: `buf` is borrowed mutably for this whole call, and `_end` below ends the
            // registration before the call returns or unwinds: it stays allocated and in place
            // while registered.
            Some(l) => unsafe { l.register(buf)? },
            None => None,
        };
        /// Ends the registration however `f` exits.
        struct Unregister<'a>(&'a Comm, Option<u64>);
        impl Drop for Unregister<'_> {
            fn drop(&mut self) {
                // Operations `f` left started run first (under caller progress they hold the
                // link until a call moves them).
                self.0.wait_started_ones();
                if let (Some(id), Some(l)) = (self.1, self.0.lock().link.as_deref_mut()) {
                    l.unregister(id);
                }
            }
        }
        let _end = Unregister(self, id);
        match catch_unwind(AssertUnwindSafe(|| f(buf))) {
            Ok(r) => r,
            Err(panic) => {
                let why = format!(
                    "rank {} panicked inside with_registered: {}",
                    self.rank,
                    panic_text(&*panic)
                );
                if let Some(l) = self.lock().link.as_deref_mut() {
                    l.abort(why.clone());
                }
                self.poison_with(why);
                resume_unwind(panic)
            }
        }
    }

    fn split(&self, color: i32, key: i32) -> Result<std::sync::Arc<dyn Communicator>> {
        Ok(std::sync::Arc::new(self.split_comm(color, key)?))
    }

    fn broadcast(&self, root: usize, data: &mut [u8]) -> Result<()> {
        check_root(root, self.size).map_err(|e| self.refused(e))?;
        if self.size == 1 {
            return self.alone("broadcast");
        }
        // Auto (measured, 4 ranks on lo-rxe): the binomial tree up to 8 KiB on more than 2
        // ranks (fewer hops), the pipelined chain above (see docs/DESIGN.md).
        let tree = match self.cfg.bcast {
            Bcast::Tree => true,
            Bcast::Chain => false,
            Bcast::Auto => self.size > 2 && data.len() <= 8 << 10,
        };
        let desc = OpDesc {
            root,
            algo: self.cfg.bcast.code(),
            ..OpDesc::new(OpKind::Broadcast, data.len())
        };
        self.with_link(desc, Scope::All, |l, _| {
            l.lend(data);
            if tree {
                bcast::broadcast_tree(l, root, data)
            } else {
                bcast::broadcast(l, root, data)
            }
        })
    }

    fn barrier(&self) -> Result<()> {
        if self.size == 1 {
            return self.alone("barrier");
        }
        self.with_link(OpDesc::new(OpKind::Barrier, 0), Scope::All, |l, _| {
            bcast::barrier(l)
        })
    }

    fn all_to_all(&self, input: &[u8], output: &mut [u8]) -> Result<()> {
        check_all_to_all(self.size, input, output).map_err(|e| self.refused(e))?;
        if self.size == 1 {
            self.alone("all_to_all")?;
            crate::copy::copy(output, input);
            return Ok(());
        }
        let block = input.len() / self.size;
        let medium = self.medium.expect("a link beyond a world of one");
        let pairwise = block >= tuning::all_to_all_pairwise_min(medium, self.size);
        let desc = OpDesc {
            algo: u8::from(pairwise),
            ..OpDesc::new(OpKind::AllToAll, block)
        };
        self.with_link(desc, Scope::All, |l, scratch| {
            let at = rooted::BlockAt::Equal(block);
            rooted::all_to_all(l, input, at, output, at, pairwise, &mut scratch.counters)
        })
    }

    fn all_to_allv(
        &self,
        input: &[u8],
        send_lens: &[usize],
        output: &mut [u8],
        recv_lens: &[usize],
    ) -> Result<()> {
        check_all_to_allv(self.rank, self.size, input, send_lens, output, recv_lens)
            .map_err(|e| self.refused(e))?;
        if self.size == 1 {
            self.alone("all_to_allv")?;
            crate::copy::copy(output, input);
            return Ok(());
        }
        // Lengths differ by rank, so the choice is all at once (each rank knows only its own).
        self.with_link(
            OpDesc::new(OpKind::AllToAllV, 0),
            Scope::All,
            |l, scratch| {
                let Scratch {
                    index, counters, ..
                } = scratch;
                index.clear();
                offsets_onto(send_lens, index);
                offsets_onto(recv_lens, index);
                let (so, ro) = index.split_at(send_lens.len() + 1);
                let (send_at, recv_at) = (rooted::BlockAt::Listed(so), rooted::BlockAt::Listed(ro));
                rooted::all_to_all(l, input, send_at, output, recv_at, false, counters)
            },
        )
    }

    fn reduce(&self, root: usize, op: AllReduce, dtype: DType, data: &mut [u8]) -> Result<()> {
        check_root(root, self.size).map_err(|e| self.refused(e))?;
        check_all_reduce(dtype, data).map_err(|e| self.refused(e))?;
        if self.size == 1 {
            return self.alone("reduce");
        }
        let medium = self.medium.expect("a link beyond a world of one");
        let tree = self.size == 2 || data.len() <= tuning::reduce_tree_max(medium);
        let desc = OpDesc {
            dtype: Some(dtype),
            reduce: Some(op),
            root,
            algo: u8::from(!tree),
            ..OpDesc::new(OpKind::Reduce, data.len())
        };
        self.with_link(desc, Scope::All, |l, scratch| {
            if tree {
                rooted::reduce_tree(l, root, op, dtype, data, scratch)
            } else {
                rooted::reduce_scatter_gather(l, root, op, dtype, data, scratch)
            }
        })
    }

    fn gather(&self, root: usize, input: &[u8], output: &mut [u8]) -> Result<()> {
        check_gather(self.rank, self.size, root, input, output).map_err(|e| self.refused(e))?;
        if self.size == 1 {
            self.alone("gather")?;
            crate::copy::copy(output, input);
            return Ok(());
        }
        let desc = OpDesc {
            root,
            ..OpDesc::new(OpKind::Gather, input.len())
        };
        self.with_link(desc, Scope::All, |l, scratch| {
            rooted::gather(l, root, input, output, &mut scratch.counters)
        })
    }

    fn scatter(&self, root: usize, input: &[u8], output: &mut [u8]) -> Result<()> {
        check_scatter(self.rank, self.size, root, input, output).map_err(|e| self.refused(e))?;
        if self.size == 1 {
            self.alone("scatter")?;
            crate::copy::copy(output, input);
            return Ok(());
        }
        let desc = OpDesc {
            root,
            ..OpDesc::new(OpKind::Scatter, output.len())
        };
        self.with_link(desc, Scope::All, |l, scratch| {
            rooted::scatter(l, root, input, output, &mut scratch.counters)
        })
    }

    fn all_gather_v(&self, input: &[u8], output: &mut [u8], lens: &[usize]) -> Result<()> {
        check_all_gather_v(self.rank, self.size, input, output, lens)
            .map_err(|e| self.refused(e))?;
        if self.size == 1 {
            self.alone("all_gather_v")?;
            crate::copy::copy(output, input);
            return Ok(());
        }
        let desc = OpDesc::new(OpKind::AllGatherV, output.len());
        self.with_link(desc, Scope::All, |l, scratch| {
            let offs = &mut scratch.index;
            offs.clear();
            offsets_onto(lens, offs);
            let r = l.rank();
            crate::copy::copy(&mut output[offs[r]..offs[r + 1]], input);
            ring::all_gather_in(l, output, ring::Chunks::listed(offs, 1))
        })
    }

    fn reduce_scatter_v(
        &self,
        op: AllReduce,
        dtype: DType,
        input: &[u8],
        output: &mut [u8],
        lens: &[usize],
    ) -> Result<()> {
        check_reduce_scatter_v(self.rank, self.size, dtype, input, output, lens)
            .map_err(|e| self.refused(e))?;
        if self.size == 1 {
            self.alone("reduce_scatter_v")?;
            crate::copy::copy(output, input);
            return Ok(());
        }
        let desc = OpDesc {
            dtype: Some(dtype),
            reduce: Some(op),
            ..OpDesc::new(OpKind::ReduceScatterV, input.len())
        };
        self.with_link(desc, Scope::All, |l, scratch| {
            let Scratch { bytes, index, .. } = scratch;
            index.clear();
            offsets_onto(lens, index);
            bytes.clear();
            bytes.extend_from_slice(input);
            let parts = ring::Chunks::listed(index, dtype.size());
            ring::reduce_scatter_in(l, op, dtype, bytes, parts)?;
            let r = l.rank();
            crate::copy::copy(output, &bytes[index[r]..index[r + 1]]);
            Ok(())
        })
    }

    fn sendrecv(&self, dst: usize, send: &[u8], src: usize, recv: &mut [u8]) -> Result<()> {
        check_peer("send", self.rank, self.size, dst).map_err(|e| self.refused(e))?;
        check_peer("recv", self.rank, self.size, src).map_err(|e| self.refused(e))?;
        // A batch of these two (what the other rank may call), without a batch's lists.
        let (to, from) = ([dst], [src]);
        let scope = Scope::Peers {
            to: &to,
            from: &from,
        };
        self.with_link(OpDesc::new(OpKind::Batch, 0), scope, |l, scratch| {
            exchange::exchange_with(l, &[(dst, send)], &mut [(src, recv)], &mut scratch.counters)
        })
    }

    fn batch(&self, ops: &mut [P2p<'_>]) -> Result<()> {
        check_batch(self.rank, self.size, ops).map_err(|e| self.refused(e))?;
        if ops.is_empty() {
            return self.alone("batch");
        }
        let (mut to, mut from) = (PeerSet::default(), PeerSet::default());
        for op in ops.iter() {
            match op {
                P2p::Send { peer, .. } => to.insert(*peer),
                P2p::Recv { peer, .. } => from.insert(*peer),
            }
        }
        let scope = Scope::Peers {
            to: to.ranks(),
            from: from.ranks(),
        };
        self.with_link(OpDesc::new(OpKind::Batch, 0), scope, |l, scratch| {
            let Scratch {
                index, counters, ..
            } = scratch;
            index.clear();
            index.extend((0..ops.len()).filter(|&i| matches!(ops[i], P2p::Send { .. })));
            let sends = index.len();
            index.extend((0..ops.len()).filter(|&i| matches!(ops[i], P2p::Recv { .. })));
            exchange::run(l, &mut Batch { ops, index, sends }, counters)
        })
    }

    /// Never blocks, from any thread: while another thread runs an operation, reports what is
    /// known (that operation itself fails within the timeout if a peer is lost).
    fn health(&self) -> Result<()> {
        self.check_usable()?;
        let mut g = match self.inner.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return Ok(()),
        };
        let Some(link) = g.link.as_mut() else {
            return Ok(());
        };
        let r = link.health();
        if let Err(e) = &r {
            self.poison(e);
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::PeerSet;

    #[test]
    fn peer_sets_keep_each_rank_once_past_the_stack() {
        for n in [0, 1, 5, PeerSet::ON_STACK, PeerSet::ON_STACK + 1, 100] {
            let mut set = PeerSet::default();
            for _ in 0..3 {
                for p in (0..n).rev() {
                    set.insert(p * 7);
                }
            }
            let mut got = set.ranks().to_vec();
            got.sort_unstable();
            let want: Vec<usize> = (0..n).map(|p| p * 7).collect();
            assert_eq!(got, want, "{n} ranks");
            assert_eq!(set.ranks().len(), n, "asked twice");
        }
    }
}
