//! One started operation in one allocation: its closure until it runs, then its result until
//! its handle takes it.

use crate::comm::Comm;
use crate::error::{Error, Result};
use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// A started operation as the queue runs it (`'env`: what it borrows lives that long).
pub(super) trait Job<'env>: Send + Sync {
    /// Runs the operation on `comm` (once) and leaves its result for the handle; its failure
    /// in words, for the queue to record.
    fn run(&self, comm: &Comm) -> Option<String>;
}

/// A started operation as its handle sees it.
pub(super) trait Done<B>: Send + Sync {
    /// The result, taken once the queue says the operation finished.
    ///
    /// # Safety
    /// Only the operation's one handle calls this, after it saw the operation finished.
    unsafe fn take(&self) -> Option<Result<B>>;
}

/// The closure, then the result. Both are touched by one thread at a time, handed over by the
/// queue: the token's holder takes the closure and writes the result, then publishes the
/// operation as finished; the handle reads the result only after it has seen that.
pub(super) struct Cell<F, B> {
    op: UnsafeCell<Option<F>>,
    result: UnsafeCell<Option<Result<B>>>,
}

// SAFETY: the fields are accessed only as described above (the queue's token and its finished
// count order the accesses), and `F` and `B` may move between threads.
unsafe impl<F: Send, B: Send> Sync for Cell<F, B> {}

impl<F, B> Cell<F, B> {
    pub(super) fn new(op: F) -> Self {
        Cell {
            op: UnsafeCell::new(Some(op)),
            result: UnsafeCell::new(None),
        }
    }
}

impl<F: Send, B: Send> Done<B> for Cell<F, B> {
    unsafe fn take(&self) -> Option<Result<B>> {
        // SAFETY: per this function's contract the runner has written the result and writes no
        // more, and nobody else reads it.
        unsafe { (*self.result.get()).take() }
    }
}

impl<'env, B, F> Job<'env> for Cell<F, B>
where
    B: Send + 'env,
    F: FnOnce(&Comm) -> (Result<()>, B) + Send + 'env,
{
    fn run(&self, comm: &Comm) -> Option<String> {
        // SAFETY: the caller holds the queue's token and has taken this operation off it, so no
        // other thread touches the closure, and the handle does not read the result yet.
        let op = (unsafe { &mut *self.op.get() }).take()?;
        let result = self.result.get();
        // The result goes straight into the cell (no copies of it on the way out).
        let ran = catch_unwind(AssertUnwindSafe(|| {
            let (r, b) = op(comm);
            let failed = r.as_ref().err().map(Error::to_string);
            // SAFETY: as above; the queue publishes the operation as finished after `run`.
            unsafe { *result = Some(r.map(|()| b)) };
            failed
        }));
        match ran {
            Ok(failed) => failed,
            Err(_) => {
                // The operation poisoned the communicator and told the peers.
                let e = comm
                    .check_usable()
                    .err()
                    .unwrap_or_else(|| Error::Poisoned("a non-blocking operation panicked".into()));
                let failed = e.to_string();
                // SAFETY: as above.
                unsafe { *result = Some(Err(e)) };
                Some(failed)
            }
        }
    }
}
