//! When the operations of an [`crate::Overlap`] scope may move. Under a progress thread:
//! always. Under `RDMACOMM_PROGRESS=caller`: only while the caller is inside a call on them, as
//! in MPI without asynchronous progress. A `test()` lets them run until they would wait on a
//! peer; a `wait()`, a blocking call, the scope's end and `abort()` let them run freely.

use crate::collectives::pause::Pause;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// How many waits on a peer a `test()` lets the operations pass (each one a poll of the
/// transport) before they stop: what arrived meanwhile is taken, then the test returns.
const WAITS_PER_TEST: u32 = 2;

/// When a scope's operations may move (one per communicator).
#[derive(Debug, Default)]
pub(crate) struct Gate {
    /// Whether they move only inside the caller's calls (read without the lock).
    held: AtomicBool,
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct State {
    held: bool,
    /// Callers waiting on an operation (the operations run freely meanwhile).
    waiting: usize,
    /// Tests that asked the runner to go on, and how many it has answered.
    asked: u64,
    answered: u64,
    /// Waits the runner may still pass for the tests under way (None: no test under way).
    budget: Option<u32>,
}

impl State {
    fn free(&self) -> bool {
        !self.held || self.waiting > 0
    }
}

/// A caller waiting on the operations ([`Gate::waiting`]): they run freely until it drops.
pub(crate) struct Waiting<'g>(&'g Gate);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.lock().waiting -= 1;
    }
}

impl Gate {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// From now on the operations move only inside the caller's calls (`held`), or always.
    pub(crate) fn hold(&self, held: bool) {
        let mut s = self.lock();
        s.held = held;
        self.held.store(held, Ordering::Release);
        self.changed.notify_all();
    }

    /// A caller waits on the operations: they run freely until the guard drops (None, at the
    /// cost of one load, where they always do).
    #[inline]
    pub(crate) fn waiting(&self) -> Option<Waiting<'_>> {
        if !self.held.load(Ordering::Acquire) {
            return None;
        }
        let mut s = self.lock();
        s.waiting += 1;
        self.changed.notify_all();
        Some(Waiting(self))
    }

    /// A test: lets the runner go on until its operations would wait on a peer or it has none
    /// left to run, then returns (at once where the operations always move).
    #[inline]
    pub(crate) fn test(&self) {
        if !self.held.load(Ordering::Acquire) {
            return;
        }
        let mut s = self.lock();
        s.asked += 1;
        let mine = s.asked;
        self.changed.notify_all();
        while s.answered < mine && s.held {
            s = self.changed.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// The runner, before it takes an operation: returns once it may run one.
    #[inline]
    pub(crate) fn enter(&self) {
        if !self.held.load(Ordering::Acquire) {
            return;
        }
        let s = self.lock();
        drop(self.until_allowed(s));
    }

    /// The runner has no operation to run: answers the tests under way, then, where the
    /// operations run freely, naps briefly before it looks again.
    pub(crate) fn idle(&self, nap: Duration) {
        let mut s = self.lock();
        s.budget = None;
        s.answered = s.asked;
        self.changed.notify_all();
        if s.free() {
            drop(self.changed.wait_timeout(s, nap));
        }
    }

    /// Blocks while the operations may not move; starts the next test's allowance if one asked.
    fn until_allowed<'a>(&'a self, mut s: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        loop {
            if s.free() || s.budget.is_some() {
                return s;
            }
            if s.asked > s.answered {
                s.budget = Some(WAITS_PER_TEST);
                return s;
            }
            s = self.changed.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl Pause for Gate {
    fn at_wait(&self) -> bool {
        if !self.held.load(Ordering::Acquire) {
            return false;
        }
        let mut s = self.lock();
        if s.free() {
            return false;
        }
        if let Some(b) = s.budget.as_mut() {
            if *b > 0 {
                *b -= 1;
                return false;
            }
        }
        // The tests under way have had their allowance: answer them, and stop here.
        s.budget = None;
        s.answered = s.asked;
        self.changed.notify_all();
        drop(self.until_allowed(s));
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    /// A runner thread whose "operation" passes `waits` waits, counting how many it passed.
    fn runner(gate: Arc<Gate>, waits: u32, passed: Arc<Mutex<u32>>) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            gate.enter();
            for _ in 0..waits {
                gate.at_wait();
                *passed.lock().unwrap() += 1;
            }
            gate.idle(Duration::from_millis(1));
        })
    }

    #[test]
    fn a_held_operation_moves_only_inside_tests_and_waits() {
        let gate = Arc::new(Gate::default());
        gate.hold(true);
        let passed = Arc::new(Mutex::new(0));
        let t = runner(gate.clone(), 10, passed.clone());
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(*passed.lock().unwrap(), 0, "moved with nobody testing");
        for round in 1..=3 {
            gate.test();
            // Each test lets it pass its allowance of waits, then the next one stops it.
            std::thread::sleep(Duration::from_millis(20));
            assert_eq!(*passed.lock().unwrap(), round * (WAITS_PER_TEST + 1) - 1);
        }
        let w = gate.waiting();
        let t0 = Instant::now();
        while *passed.lock().unwrap() < 10 {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "a waiter did not free it"
            );
            std::thread::yield_now();
        }
        drop(w);
        t.join().unwrap();
    }

    #[test]
    fn a_free_gate_never_stops_and_releasing_frees_a_stopped_runner() {
        let gate = Arc::new(Gate::default());
        assert!(!gate.at_wait());
        assert!(gate.waiting().is_none());
        gate.test();
        gate.hold(true);
        let passed = Arc::new(Mutex::new(0));
        let t = runner(gate.clone(), 3, passed.clone());
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(*passed.lock().unwrap(), 0);
        // The scope's end, or an abort.
        gate.hold(false);
        t.join().unwrap();
        assert_eq!(*passed.lock().unwrap(), 3);
    }
}
