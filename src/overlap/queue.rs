//! The operations of one scope in call order, and the token that runs them one at a time:
//! whoever holds it (the progress thread, or the caller waiting on an operation not yet begun)
//! runs the next one. Started and taken without a lock (the starting thread alone appends, the
//! token's holder alone takes), so an operation started and waited at once costs one atomic
//! exchange and one allocation more than a blocking call.

use super::job::Job;
use crate::comm::Comm;
use std::cell::UnsafeCell;
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// Operations in flight at most; the next start runs or waits for the oldest first.
const RING: usize = 1024;
/// How long a waiter polls before it sleeps (a hand-over then costs about a microsecond
/// instead of a thread wake-up).
const SPIN: Duration = Duration::from_micros(20);
/// A sleeping waiter looks again this often (whether the token came free).
const NAP: Duration = Duration::from_millis(1);
/// While operations come, the progress thread looks for one this often instead of being woken
/// by each start: a start then costs no wake-up, which a waiter that runs its operation itself
/// (started and waited at once) would pay for nothing.
const LOOK_EVERY: Duration = Duration::from_millis(1);
/// Without a start for this long, the progress thread dozes: a start wakes it.
const DOZE_AFTER: Duration = Duration::from_millis(20);
/// A dozing progress thread looks this often all the same (a start that raced its dozing off
/// waits no longer).
const DOZE_LOOK: Duration = Duration::from_millis(50);
/// While every operation is run by its own waiter, the progress thread looks this seldom: its
/// wake-ups would be all it adds. An operation then left to it begins within this long, and
/// from the next one it looks every [`LOOK_EVERY`] again.
const LOOK_SELDOM: Duration = Duration::from_millis(20);
/// Operations in a row run by their waiters after which the progress thread looks seldom.
const HELPED_SELDOM: u32 = 16;

type JobPtr<'env> = NonNull<dyn Job<'env> + 'env>;

/// A scope's queue (see the module's text).
pub(crate) struct Queue<'env> {
    pub(super) comm: &'env Comm,
    ring: Box<[UnsafeCell<Option<JobPtr<'env>>>]>,
    /// Operations started: written by the starting thread only.
    tail: AtomicUsize,
    /// Operations taken to run: written by the token's holder only.
    head: AtomicUsize,
    /// Operations finished: written by the token's holder only.
    finished: AtomicUsize,
    token: AtomicBool,
    closed: AtomicBool,
    /// Operations in a row that their waiters ran (written by the token's holder).
    helped: AtomicU32,
    /// The progress thread's naps, and whether it naps or dozes (then a start wakes it).
    idle: Mutex<()>,
    wake: Condvar,
    napping: AtomicBool,
    dozing: AtomicBool,
    /// The waiting caller's sleep (one: operations are waited on by the thread that starts
    /// them).
    waiter: Mutex<()>,
    woken: Condvar,
    sleeping: AtomicBool,
    /// The first failure of an operation, in words.
    first_error: Mutex<Option<String>>,
}

// SAFETY: the ring's slots are written by the starting thread before it publishes them through
// `tail` (release) and read by the token's holder after it acquires `tail`; a slot is written
// again only after `head` (release, after the read) has passed it. The jobs they point to are
// `Send + Sync`.
unsafe impl Sync for Queue<'_> {}
// SAFETY: as above; the queue holds no thread-bound state.
unsafe impl Send for Queue<'_> {}

impl<'env> Queue<'env> {
    pub(super) fn new(comm: &'env Comm) -> Self {
        Queue {
            comm,
            ring: (0..RING).map(|_| UnsafeCell::new(None)).collect(),
            tail: AtomicUsize::new(0),
            head: AtomicUsize::new(0),
            finished: AtomicUsize::new(0),
            token: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            helped: AtomicU32::new(0),
            idle: Mutex::new(()),
            wake: Condvar::new(),
            napping: AtomicBool::new(false),
            dozing: AtomicBool::new(true),
            waiter: Mutex::new(()),
            woken: Condvar::new(),
            sleeping: AtomicBool::new(false),
            first_error: Mutex::new(None),
        }
    }

    /// Appends `job` and returns its position. Only the scope's thread calls this.
    ///
    /// # Safety
    /// `job` stays valid until the queue has finished it ([`Queue::is_finished`]).
    pub(super) unsafe fn push(&self, job: JobPtr<'env>) -> usize {
        let t = self.tail.load(Ordering::Relaxed);
        if t - self.head.load(Ordering::Acquire) >= RING {
            self.wait_until(|| t - self.head.load(Ordering::Acquire) < RING);
        }
        // SAFETY: slot `t` was read (and `head` moved past it) before, or never used; the
        // token's holder reads it only once `tail` below says it is there.
        unsafe { *self.ring[t % RING].get() = Some(job) };
        self.tail.store(t + 1, Ordering::Release);
        if self.dozing.load(Ordering::Relaxed) {
            let _g = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            self.wake.notify_all();
        }
        t
    }

    /// Whether the operation at `pos` has finished (then its job is no longer touched).
    #[inline]
    pub(super) fn is_finished(&self, pos: usize) -> bool {
        self.finished.load(Ordering::Acquire) > pos
    }

    /// Whether every operation started has finished.
    fn drained(&self) -> bool {
        self.finished.load(Ordering::Acquire) == self.tail.load(Ordering::Acquire)
    }

    /// No more operations will come.
    pub(super) fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let _g = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        self.wake.notify_all();
    }

    /// Records a failed operation (the first failure is kept).
    fn failed(&self, why: String) {
        self.first_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert(why);
    }

    /// The first failure of an operation, in words.
    pub(super) fn failure(&self) -> Option<String> {
        self.first_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Takes the token and runs the next operation, if there is one and nobody runs one;
    /// whether it ran one. `waiter`: the caller is the scope's thread, waiting.
    fn run_next(&self, waiter: bool) -> bool {
        if self.head.load(Ordering::Relaxed) == self.tail.load(Ordering::Acquire)
            || self
                .token
                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
        {
            return false;
        }
        let h = self.head.load(Ordering::Relaxed);
        if h == self.tail.load(Ordering::Acquire) {
            self.token.store(false, Ordering::Release);
            return false;
        }
        // SAFETY: `tail` (acquired) says slot `h` holds a job; the token makes us its only
        // reader; the starting thread writes it again only after `head` passes it.
        let job = unsafe { (*self.ring[h % RING].get()).take() };
        self.head.store(h + 1, Ordering::Release);
        let helped = if waiter {
            self.helped.load(Ordering::Relaxed).saturating_add(1)
        } else {
            0
        };
        self.helped.store(helped, Ordering::Relaxed);
        if let Some(job) = job {
            super::IN_JOB.with(|j| j.set(true));
            // SAFETY: the job stays valid until `finished` passes it (push's contract).
            if let Some(why) = unsafe { job.as_ref() }.run(self.comm) {
                self.failed(why);
            }
            super::IN_JOB.with(|j| j.set(false));
        }
        // From here the job may be freed by its handle.
        self.finished.store(h + 1, Ordering::Release);
        if !waiter {
            // Pairs with `wait_until`'s fence: it sees the count, or we see it sleeping.
            fence(Ordering::SeqCst);
            if self.sleeping.load(Ordering::Relaxed) {
                let _g = self.waiter.lock().unwrap_or_else(|e| e.into_inner());
                self.woken.notify_all();
            }
        }
        self.token.store(false, Ordering::Release);
        // Operations queued behind this one go to the progress thread now.
        if waiter
            && self.head.load(Ordering::Relaxed) != self.tail.load(Ordering::Relaxed)
            && self.napping.load(Ordering::Relaxed)
        {
            let _g = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            self.wake.notify_all();
        }
        true
    }

    /// The scope's thread waits until `done`: runs operations itself while nobody else does,
    /// else polls briefly, then sleeps until an operation finishes (each of the operations'
    /// waits is bounded by `RDMACOMM_TIMEOUT`).
    pub(super) fn wait_until(&self, done: impl Fn() -> bool) {
        if done() {
            return;
        }
        // Under caller progress, the operations move freely while their caller waits.
        let _free = self.comm.core.gate.waiting();
        while !done() {
            if self.run_next(true) {
                continue;
            }
            let t0 = Instant::now();
            while !done() && t0.elapsed() < SPIN {
                std::hint::spin_loop();
            }
            let g = self.waiter.lock().unwrap_or_else(|e| e.into_inner());
            self.sleeping.store(true, Ordering::Relaxed);
            fence(Ordering::SeqCst);
            if !done() {
                drop(self.woken.wait_timeout(g, NAP));
            }
            self.sleeping.store(false, Ordering::Relaxed);
        }
    }

    /// Until every operation started has finished (a blocking call on the scope's thread).
    pub(crate) fn drain(&self) {
        self.wait_until(|| self.drained());
    }

    /// The progress thread: runs operations as they come, until closed and every one finished.
    pub(super) fn serve(&self) {
        let mut last = Instant::now();
        let mut seen = 0;
        loop {
            if self.run_next(false) {
                last = Instant::now();
                continue;
            }
            if self.closed.load(Ordering::SeqCst) && self.drained() {
                return;
            }
            let t = self.tail.load(Ordering::Acquire);
            if t != seen {
                seen = t;
                last = Instant::now();
            }
            let dozing = last.elapsed() > DOZE_AFTER;
            let look = if dozing {
                DOZE_LOOK
            } else if self.helped.load(Ordering::Relaxed) >= HELPED_SELDOM {
                LOOK_SELDOM
            } else {
                LOOK_EVERY
            };
            let g = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            self.dozing.store(dozing, Ordering::Relaxed);
            self.napping.store(true, Ordering::Relaxed);
            fence(Ordering::SeqCst);
            if self.tail.load(Ordering::Acquire) == seen && !self.closed.load(Ordering::SeqCst) {
                let (g, _) = self
                    .wake
                    .wait_timeout(g, look)
                    .unwrap_or_else(|e| e.into_inner());
                drop(g);
            }
            self.napping.store(false, Ordering::Relaxed);
            // Awake: starts need not wake it (each would pay a system call).
            self.dozing.store(false, Ordering::Relaxed);
            if dozing {
                // Operations come again: look for them for a while instead of being woken by
                // each start.
                last = Instant::now();
            }
        }
    }

    /// The runner under `RDMACOMM_PROGRESS=caller`: runs operations only while the gate lets
    /// them move, until closed and every one finished.
    pub(super) fn serve_held(&self) {
        let gate = &self.comm.core.gate;
        loop {
            gate.enter();
            if self.run_next(false) {
                continue;
            }
            if self.closed.load(Ordering::SeqCst) && self.drained() {
                return;
            }
            gate.idle(LOOK_EVERY);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Positions wrap around the ring: more operations than it holds, each run once, in order.
    #[test]
    fn more_operations_than_the_ring_holds_run_once_in_order() {
        let comm = Comm::new(&crate::config::Config::defaults(0, 1, "127.0.0.1:9")).unwrap();
        let q = Queue::new(&comm);
        let order = Mutex::new(Vec::new());
        struct Push<'a>(&'a Mutex<Vec<usize>>, usize);
        impl<'env> Job<'env> for Push<'_> {
            fn run(&self, _: &Comm) -> Option<String> {
                self.0.lock().unwrap().push(self.1);
                None
            }
        }
        let n = 3 * RING + 7;
        let jobs: Vec<Push> = (0..n).map(|i| Push(&order, i)).collect();
        for (i, j) in jobs.iter().enumerate() {
            let p: &dyn Job = j;
            // SAFETY: `jobs` outlives the queue's use of them (drained below).
            assert_eq!(unsafe { q.push(NonNull::from(p)) }, i);
            if i % 5 == 0 {
                q.run_next(true);
            }
        }
        q.drain();
        assert!(q.is_finished(n - 1) && !q.is_finished(n));
        assert_eq!(*order.lock().unwrap(), (0..n).collect::<Vec<_>>());
    }
}
