//! A communicator for a framework that calls its transport from any thread, one call at a time
//! (nuvec evaluates collectives on whichever thread runs the graph; fuel's transport is `Send`
//! and moves with its model): [`Serial`] takes each call under a lock of its own and makes the
//! calling thread the communicator's owner for it. Two calls at once are refused, never
//! crossed. Frameworks that keep their transport for the life of the process never drop it,
//! so every one is closed at process exit.

use crate::comm::Comm;
use crate::error::{Error, Result};
use std::sync::{Arc, Mutex, Once, TryLockError, Weak};

/// A [`Comm`] and the state `S` a call needs, for callers on any thread.
pub(crate) struct Serial<S> {
    comm: Arc<Comm>,
    state: Mutex<S>,
}

impl<S> Serial<S> {
    /// Wraps `comm` (closed at process exit if still alive then).
    pub(crate) fn new(comm: Comm, state: S) -> Serial<S> {
        let comm = Arc::new(comm);
        close_at_exit(&comm);
        Serial {
            comm,
            state: Mutex::new(state),
        }
    }

    /// The communicator, for calls that need no turn (rank, size, health).
    pub(crate) fn comm(&self) -> &Comm {
        &self.comm
    }

    /// Runs `f` as the one call in progress, from the calling thread; `what` names it if
    /// another thread's call is still running.
    pub(crate) fn run<T>(
        &self,
        what: &str,
        f: impl FnOnce(&Comm, &mut S) -> Result<T>,
    ) -> Result<T> {
        let mut state = match self.state.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => {
                // The adapters say which rank (the message is theirs to prefix).
                return Err(Error::InvalidArgument(format!(
                    "{what} was called while another thread's call runs on this communicator; \
                     their order could differ between ranks: give each thread its own (split or \
                     dup)"
                )));
            }
        };
        self.comm.claim(what)?;
        f(&self.comm, &mut state)
    }
}

static LIVE: Mutex<Vec<Weak<Comm>>> = Mutex::new(Vec::new());

/// Closes `comm` at process exit if it is still alive then: without it, a rank that finishes
/// first would vanish from under a peer still completing the last collective.
fn close_at_exit(comm: &Arc<Comm>) {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        // close_all catches its panics.
        crate::sys::at_exit(close_all);
    });
    let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
    live.retain(|w| w.strong_count() > 0);
    live.push(Arc::downgrade(comm));
}

extern "C" fn close_all() {
    let _ = std::panic::catch_unwind(|| {
        let live = std::mem::take(&mut *LIVE.lock().unwrap_or_else(|e| e.into_inner()));
        for comm in live.iter().filter_map(Weak::upgrade) {
            comm.close("closed its communicator at process exit");
        }
    });
}
