//! [`Comm`]: the byte-level [`Communicator`] over a transport (RDMA, or TCP where there is none).

mod grow;
mod ops;
pub(crate) mod request;
mod shrink;
mod split;
mod summary;
mod view;

use crate::api::{
    check_all_gather, check_all_gather_v, check_all_reduce, check_all_to_all, check_all_to_allv,
    check_batch, check_gather, check_peer, check_reduce_scatter_v, check_root, check_scatter,
    check_sum_scatter, offsets_onto, Communicator, P2p,
};
use crate::bootstrap::rendezvous::Card;
use crate::collectives::{
    bcast, binomial, bruck, direct, exchange, halving, hier, p2p, ring, rooted, tuning, Scratch,
};
use crate::config::{Bcast, Config};
use crate::dtype::{AllReduce, DType};
use crate::error::{Error, Peer, Result};
use crate::transport::op::{self, OpDesc, OpKind, Partners};
use crate::transport::watch::AbortRequest;
use crate::transport::{self, Link, Transport};
pub use shrink::Agreed;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use summary::summarise;

struct Inner {
    /// None for a world of one.
    link: Option<Box<dyn Transport>>,
    scratch: crate::collectives::Scratch,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // What the transport came to hold (connections made on demand included), at `info`.
        if let Some(l) = self
            .link
            .as_ref()
            .filter(|_| log::log_enabled!(log::Level::Info))
        {
            let (r, held) = (l.rank(), l.holds());
            log::info!("rank {r} closes; it holds {held}{}", summary::process());
        }
    }
}

use crate::collectives::Algo;

/// An open [`Comm::overlap`] scope as blocking calls see it: `drain(data)` runs the operations
/// started before the call (the scope registers it in [`Comm`] while it is open).
pub(crate) struct ScopeHook {
    pub(crate) data: *const (),
    pub(crate) drain: unsafe fn(*const ()),
}

/// Why a communicator refuses work: its first error, as later calls return it
/// ([`Error::again`]).
struct Poison(Error);

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
    /// The link and what goes with it: this communicator's own, or, for a shared view
    /// ([`Comm::split_shared`]), the one it shares with the communicator it was split from.
    pub(crate) core: Arc<Core>,
    /// Where this communicator is a shared view: its members among the link's ranks.
    view: Option<view::View>,
    /// This rank, as errors name it.
    me: Peer,
    algo: Mutex<Algo>,
    /// Where this rank stands among hosts of equal size, if the link's hosts form one (worked
    /// out once: the hierarchical all_reduce needs it on every call).
    layout: Option<hier::Layout>,
    /// What the link moves bytes over (fixed for its life; `None` alone).
    medium: Option<crate::transport::Medium>,
    /// The most peers an operation may connect at once: the setting, else the link's bound.
    peers_max: usize,
    /// The transport in words (kept: reading it from the link would wait for an operation, or,
    /// under caller progress, for the caller's next call on one).
    described: Option<String>,
    /// Whether it was made by [`Comm::rejoin`].
    rejoined: bool,
    cfg: Config,
}

/// What the communicators over one link share: the link, its fate, its thread and the scope
/// that runs its non-blocking operations.
pub(crate) struct Core {
    inner: Mutex<Inner>,
    /// Set by the first failure; every later call returns it (readable while an op runs).
    poisoned: Mutex<Option<Poison>>,
    /// Whether `poisoned` holds a reason (read without the lock on every call).
    is_poisoned: AtomicBool,
    /// Through which [`Comm::abort`] stops an operation that runs (None for a world of one).
    abort_request: Option<Arc<AbortRequest>>,
    /// The thread that runs the non-blocking operations of an [`Comm::overlap`] scope (0: none).
    pub(crate) executor: AtomicU64,
    /// The open [`Comm::overlap`] scope (null: none), for blocking calls to run the operations
    /// started before them first.
    pub(crate) scope: AtomicPtr<ScopeHook>,
    /// Held by an open [`Comm::overlap`] scope for its whole life: an adapter's claim of
    /// ownership from another thread is refused meanwhile (the scope's queue lives on its
    /// owner's stack).
    pub(crate) scope_held: Mutex<()>,
    /// When they may move (always, or only inside the caller's calls).
    pub(crate) gate: Arc<crate::collectives::gate::Gate>,
    /// The thread whose operations this communicator runs ([`this_thread`]).
    owner: AtomicU64,
    /// The highest shared view number this link has carried.
    views: view::Views,
    /// What this rank needs to reach the others after a failure ([`Comm::shrink`]).
    control: Mutex<Option<crate::bootstrap::Control>>,
    /// Which generation of its group this link is: 0 for the world, one more for each shrink.
    epoch: u32,
    /// The control ports of the generations before it, answering their late askers.
    answerers: Mutex<Vec<crate::bootstrap::elastic::retired::Answerer>>,
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
        reduce_workers(cfg, local, nlocal);
        Ok(Comm::with_link_of(cfg.clone(), link, cfg.algo))
    }

    fn with_link_of(cfg: Config, mut link: Option<Box<dyn Transport>>, algo: Algo) -> Comm {
        let layout = link.as_ref().and_then(|l| {
            l.props()
                .hosts
                .as_deref()
                .and_then(|h| hier::Layout::of(h, l.rank()))
        });
        let abort_request = link.as_mut().map(|l| l.watch_mut().abort_request());
        let medium = link.as_ref().map(|l| l.props().medium);
        let peers_max = cfg
            .peers_max
            .or(link.as_ref().map(|l| l.props().peers_max))
            .unwrap_or(usize::MAX);
        let described = link.as_ref().map(|l| l.describe());
        let control = link.as_mut().and_then(|l| l.watch_mut().take_control());
        if let (Some(l), Some(d)) = (link.as_ref(), described.as_ref()) {
            summarise(&cfg, l.local_rank(), d, algo, peers_max, l.holds());
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
            peers_max,
            described,
            me,
            rank: cfg.rank,
            size: cfg.world_size,
            core: Arc::new(Core {
                inner: Mutex::new(Inner {
                    link,
                    scratch: Default::default(),
                }),
                poisoned: Mutex::new(None),
                is_poisoned: AtomicBool::new(false),
                abort_request,
                executor: AtomicU64::new(0),
                scope: AtomicPtr::new(std::ptr::null_mut()),
                scope_held: Mutex::new(()),
                gate: Default::default(),
                owner: AtomicU64::new(this_thread()),
                views: Default::default(),
                control: Mutex::new(control),
                epoch: 0,
                answerers: Default::default(),
            }),
            view: None,
            algo: Mutex::new(algo),
            rejoined: false,
            cfg,
        }
    }

    /// Joins the group described by the environment (see [`Config::from_env`]). A rank whose
    /// settings are invalid still tells the group (through the rendezvous), so every rank fails
    /// at once with an error naming that rank and variable. A replacement started by an
    /// elastic launcher (`RDMACOMM_REPLACEMENT=1`) joins the running group instead
    /// ([`Comm::rejoin`]; see [`Comm::rejoined`]).
    pub fn from_env() -> Result<Self> {
        let (rank, size, coordinator) = Config::identity_from_env()?;
        match Config::new(rank, size, coordinator.clone()) {
            Ok(cfg) if cfg.replacement => Comm::rejoin(&cfg),
            Ok(cfg) => Comm::new(&cfg),
            Err(e) => {
                if size > 1 && rank < size {
                    crate::bootstrap::rendezvous::refuse(
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
        match &mut self.view {
            Some(v) => *v.owner.get_mut() = this_thread(),
            None => self.core.owner.store(this_thread(), Ordering::Relaxed),
        }
    }

    /// A new communicator over the same ranks, independent of this one (its own connections,
    /// sequence and failures), owned by the calling thread: one per thread that runs
    /// operations. Collective: every rank must call it, in the same position.
    pub fn dup(&self) -> Result<Comm> {
        self.split_comm(0, self.rank as i32)
    }

    /// Makes the calling thread the owner without `&mut`: for an adapter that serialises its
    /// callers under a lock of its own (a framework's transport called from any thread).
    /// Refused while another thread's [`Comm::overlap`] scope is open (opened through the
    /// adapter's `comm()`): its queue lives on that thread's stack.
    #[cfg(any(feature = "nuvec", feature = "fuel"))]
    pub(crate) fn claim(&self, what: &str) -> Result<()> {
        if self.view.is_some() {
            // Its link runs on its parent's thread, in one order with the parent.
            return Err(Error::WrongThread(format!(
                "{what}: a shared view (Comm::split_shared) cannot serve a framework's \
                 transport, which takes calls from any thread: give it Comm::split_comm or \
                 Comm::dup"
            )));
        }
        let me = this_thread();
        let _held = match self.core.scope_held.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {
                if self.core.owner.load(Ordering::Relaxed) == me {
                    return Ok(()); // the scope's own thread
                }
                return Err(Error::WrongThread(format!(
                    "{what} was called while another thread has an overlap scope open on this \
                     communicator (Comm::overlap through the transport's comm()): call it from \
                     that thread inside the scope, or after the scope"
                )));
            }
        };
        self.core.owner.store(me, Ordering::Relaxed);
        Ok(())
    }

    /// Closes the link now, as dropping the communicator would (the group is told this rank
    /// leaves; a bounded close barrier), for a communicator a framework never drops; every
    /// later call fails. Skipped while an operation holds the link.
    #[cfg(any(feature = "nuvec", feature = "fuel"))]
    pub(crate) fn close(&self, why: &str) {
        if let Some(v) = &self.view {
            // The link is its parent's too: only the view ends.
            v.closed.store(true, Ordering::Relaxed);
            return;
        }
        self.poison_with(format!("rank {} {why}", self.rank));
        let link = match self.core.inner.try_lock() {
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
        let link_owner = self.core.owner.load(Ordering::Relaxed) == me
            || self.core.executor.load(Ordering::Relaxed) == me;
        match &self.view {
            None if link_owner => Ok(()),
            // A shared view runs on its own owner, while that thread owns the link too.
            Some(v) if link_owner && v.owner.load(Ordering::Relaxed) == me => Ok(()),
            _ => self.wrong_thread(what),
        }
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

    /// What the CPU did to the bytes this communicator's link moved since it was made
    /// ([`crate::Ledger`]: copies in, reductions, copies out and wire bytes, counted per chunk),
    /// for every communicator over that link. Call it between operations: it waits for one
    /// under way. All zeros for a world of one.
    pub fn ledger(&self) -> crate::Ledger {
        self.lock()
            .link
            .as_ref()
            .map_or_else(Default::default, |l| l.ledger())
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.core.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs operation `desc` with the peers of `scope` as `f` on the link, from the
    /// owning thread, unless the communicator failed before. A failure poisons it; so does a
    /// panic, which the peers are told of before it goes on unwinding.
    fn with_link<T>(
        &self,
        desc: OpDesc,
        scope: Partners,
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
        // A shared view's operation is the link's, in its ranks and under its number.
        let mut lists = Default::default();
        let (desc, scope) = match &self.view {
            None => (desc, scope),
            Some(v) => (OpDesc { comm: v.id, ..desc }, v.scope(scope, &mut lists)),
        };
        link.start(&desc, scope);
        link.watch_mut().started(&desc, scope);
        let scratch = &mut inner.scratch;
        let view = self.view.as_ref();
        let r = catch_unwind(AssertUnwindSafe(|| {
            match view {
                None => f(&mut *link, scratch),
                Some(v) => f(&mut v.over(&mut *link), scratch),
            }
            .and_then(|v| crate::collectives::pause::finish(link).map(|_| v))
        }));
        if let Some(l) = link.lending() {
            l.release();
        }
        match r {
            Ok(mut r) => {
                if let Err(Error::Aborted { by, reason }) = &mut r {
                    if by.rank != self.me.rank {
                        // Both sides' calls: the peer's cause, and where this rank stood.
                        *reason = format!("{reason} (rank {} was in {desc})", self.me.rank);
                    }
                }
                if let Err(e) = &r {
                    if e.is_argument() {
                        // Found here, inside the operation (a peer's lengths differ from this
                        // rank's): the peers learn the cause now instead of waiting on us.
                        link.abort(format!("rank {} failed inside {desc}: {e}", self.me.rank));
                    }
                    self.poison(e);
                }
                r
            }
            Err(panic) => {
                let why = format!(
                    "rank {} panicked inside {desc}: {}",
                    self.me.rank,
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
        if self.core.owner.load(Ordering::Relaxed) != this_thread() {
            return;
        }
        let h = self.core.scope.load(Ordering::Acquire);
        if !h.is_null() {
            // SAFETY: an open scope registers its hook, which points at its queue, and clears
            // it before either drops; the owner is the thread the scope runs on, so the scope
            // cannot end during this call.
            unsafe { ((*h).drain)((*h).data) }
        }
    }

    fn poison(&self, e: &Error) {
        self.poison_as(Poison(e.again()));
    }

    fn poison_with(&self, why: String) {
        self.poison_as(Poison(Error::Poisoned(why)));
    }

    fn poison_as(&self, why: Poison) {
        let mut p = self.core.poisoned.lock().unwrap_or_else(|e| e.into_inner());
        if p.is_none() {
            *p = Some(why);
            self.core.is_poisoned.store(true, Ordering::Release);
        }
    }

    #[inline]
    pub(crate) fn check_usable(&self) -> Result<()> {
        if !self.core.is_poisoned.load(Ordering::Acquire) && self.view.is_none() {
            return Ok(());
        }
        self.unusable()
    }

    /// [`Comm::check_usable`] for a failed communicator or a shared view.
    #[cold]
    fn unusable(&self) -> Result<()> {
        if let Some(v) = self
            .view
            .as_ref()
            .filter(|v| v.closed.load(Ordering::Relaxed))
        {
            return Err(Error::Poisoned(format!(
                "rank {}: this shared view (number {}) was closed",
                self.rank, v.id
            )));
        }
        if !self.core.is_poisoned.load(Ordering::Acquire) {
            return Ok(());
        }
        self.poisoned_error()
    }

    #[cold]
    fn poisoned_error(&self) -> Result<()> {
        match &*self.core.poisoned.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(Poison(first)) => Err(first.again()),
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
            Poison(Error::Aborted {
                by: self.me.clone(),
                reason: reason.to_string(),
            }),
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
        let why = format!("rank {} refused its call: {e}", self.me.rank);
        self.end_and_tell(Poison(Error::Poisoned(why.clone())), &why);
        e
    }

    /// Poisons this communicator with `poison` and tells the peers `reason` (see
    /// [`Comm::abort`]).
    fn end_and_tell(&self, poison: Poison, reason: &str) {
        self.poison_as(poison);
        // An operation held between its caller's calls goes on, to see the abort.
        self.core.gate.hold(false);
        let Some(req) = &self.core.abort_request else {
            return;
        };
        req.request(reason);
        // An operation that runs sees the request at its next poll; otherwise tell the peers here.
        let until = Instant::now() + self.cfg.timeout + Duration::from_secs(1);
        loop {
            let g = match self.core.inner.try_lock() {
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
            "RDMACOMM_SIMD=baseline: this process's reduction kernels were chosen ({simd:?}) by its first communicator; they are chosen once per process"
        )));
    }
    let possible = |k: CopyKernel| k != CopyKernel::Simd || simd == SimdLevel::Avx2;
    match cfg.copy {
        Some(k) if k != copy && possible(k) && copy_before.is_some() => Err(Error::Config(format!(
            "RDMACOMM_COPY={k:?}: this process's copy kernel was chosen ({copy:?}) by its first communicator; it is chosen once per process"
        ))),
        _ => Ok(()),
    }
}

/// Makes the process's reduce workers once: as many as `cfg` asks, or the cores this rank owns
/// (its share of the allowed ones among `nlocal` ranks on its host) up to 4, about what a
/// 200 Gb/s link's byte work needs at memory speed. Pinned to that share where ranks are
/// pinned (`RDMACOMM_PIN`).
fn reduce_workers(cfg: &Config, local: usize, nlocal: usize) {
    let share = crate::pin::share(local, nlocal);
    let threads = cfg
        .reduce_threads
        .unwrap_or_else(|| share.len().clamp(1, 4));
    let cores = if cfg.pin == crate::pin::Pin::Off {
        Vec::new()
    } else {
        (0..threads).map(|k| share[k % share.len()]).collect()
    };
    let got = crate::workers::configure(threads, cores);
    log::debug!(
        "rank {}: {got} thread(s) share large copies and reductions",
        cfg.rank
    );
}

/// A panic's message, if it has one.
fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}
