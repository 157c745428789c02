//! Non-blocking operations: [`Comm::overlap`] opens a scope in which operations start without
//! waiting and run, in call order, on a progress thread while the caller computes (PyTorch DDP
//! starts each gradient bucket's all_reduce as soon as backward has produced it).
//!
//! A started operation borrows its buffers for the whole scope and hands them back from
//! [`Pending::wait`]; the scope waits for every operation before it returns, so neither a
//! dropped nor a forgotten handle can leave the transport writing into freed memory (the
//! design of `std::thread::scope`).

mod job;
pub(crate) mod queue;
mod start;

use crate::api::Communicator;
use crate::comm::request::Request;
use crate::comm::{this_thread, Comm, ScopeHook};
use crate::config::Progress;
use crate::error::{Error, Result};
use job::{Cell, Done};
use queue::Queue;
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::atomic::Ordering;

thread_local! {
    /// Whether this thread is running an operation of a scope (then a blocking call inside it
    /// must not wait for the scope's operations: it is one of them).
    static IN_JOB: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the calling thread runs a scope's operation now.
pub(crate) fn in_job() -> bool {
    IN_JOB.with(|j| j.get())
}

/// [`ScopeHook::drain`] for a scope's queue: a blocking call from the owning thread first runs
/// the non-blocking operations started before it (operations run in call order), here where
/// nobody runs them; not from inside one of them.
///
/// # Safety
/// `data` points at the open scope's `Queue`, which outlives the call.
unsafe fn drain_queue(data: *const ()) {
    if in_job() {
        return;
    }
    // SAFETY: by the contract above; the lifetime is erased for this call only.
    unsafe { &*data.cast::<Queue<'static>>() }.drain();
}

/// What a handle asks of its scope's queue (without naming the scope's buffers' lifetime).
trait Track {
    fn is_finished(&self, pos: usize) -> bool;
    fn wait_for(&self, pos: usize);
    fn test(&self);
}

impl Track for Queue<'_> {
    #[inline]
    fn is_finished(&self, pos: usize) -> bool {
        Queue::is_finished(self, pos)
    }

    fn wait_for(&self, pos: usize) {
        self.wait_until(|| Queue::is_finished(self, pos));
    }

    fn test(&self) {
        self.comm.core.gate.test();
    }
}

/// An operation started in an [`Overlap`] scope. [`Pending::wait`] returns its result and hands
/// back its output buffer; dropping it without waiting waits. It cannot outlive the scope's
/// closure, and a forgotten one is waited for by the scope's end (its allocation, tens of
/// bytes, is leaked, as `mem::forget` leaks).
#[must_use = "an operation's error is seen by waiting on it (or at the end of its scope)"]
pub struct Pending<'s, B> {
    /// The operation's allocation, freed here once the queue has finished it.
    cell: NonNull<dyn Done<B> + 's>,
    /// Its position in the queue.
    pos: usize,
    queue: &'s (dyn Track + 's),
    /// Waited on by the thread that started it (which may run it): not sent elsewhere.
    _here: PhantomData<*const ()>,
}

impl<B> Pending<'_, B> {
    /// Whether the operation has finished. Under a progress thread it only looks; under
    /// `RDMACOMM_PROGRESS=caller` it first lets the operations move until they would wait on a
    /// peer (what has arrived is taken and what can be sent is sent), then looks.
    pub fn test(&self) -> bool {
        if self.queue.is_finished(self.pos) {
            return true;
        }
        self.queue.test();
        self.queue.is_finished(self.pos)
    }

    /// Waits for the operation (each of its waits is bounded by `RDMACOMM_TIMEOUT`), running it
    /// and those before it here where the progress thread has not begun them, and hands back
    /// its output buffer.
    pub fn wait(self) -> Result<B> {
        self.queue.wait_for(self.pos);
        // SAFETY: the queue has finished the operation, and this handle is its only reader.
        unsafe { self.cell.as_ref().take() }.expect("a finished operation's result, taken once")
    }
}

impl<B> Drop for Pending<'_, B> {
    fn drop(&mut self) {
        self.queue.wait_for(self.pos);
        // SAFETY: the allocation came from `Box::leak` in `Overlap::start`, and the queue, which
        // held the only other pointer to it, has finished the operation and touches it no more.
        drop(unsafe { Box::from_raw(self.cell.as_ptr()) });
    }
}

/// A scope of non-blocking operations on one communicator ([`Comm::overlap`]). Operations
/// started here, and blocking ones called on the communicator meanwhile, run in call order,
/// the same on every rank. It stays on the thread that opened it.
pub struct Overlap<'env> {
    comm: &'env Comm,
    queue: Queue<'env>,
    /// Only the scope's thread starts operations (the queue has one appender): not shared.
    _here: PhantomData<*const ()>,
    /// Invariant: buffers are borrowed for exactly the scope's environment.
    _env: PhantomData<&'env mut &'env ()>,
}

impl Comm {
    /// Runs `f` with a scope in which operations start without waiting ([`Overlap`]); they run,
    /// in call order, on a progress thread (pinned to `RDMACOMM_PROGRESS_CPU` if set) while `f`
    /// computes, or, with `RDMACOMM_PROGRESS=caller`, only inside `f`'s calls on them (see
    /// [`Comm::overlap_with`]). Returns when every started operation has finished: `f`'s value,
    /// or the first failure of an operation (the communicator then refuses further work, as
    /// after any failure). Scopes do not nest.
    ///
    /// ```no_run
    /// # let comm = rdmacomm::Comm::from_env()?;
    /// use rdmacomm::AllReduce;
    /// let mut grads = vec![1.0f32; 1 << 22];
    /// comm.overlap(|s| -> rdmacomm::Result<()> {
    ///     let mut pending = Vec::new();
    ///     for bucket in grads.chunks_mut(1 << 20) {
    ///         // ... backward produces `bucket` ...
    ///         pending.push(s.all_reduce(bucket, AllReduce::Sum)?);
    ///     }
    ///     for p in pending {
    ///         p.wait()?;
    ///     }
    ///     Ok(())
    /// })??;
    /// # Ok::<(), rdmacomm::Error>(())
    /// ```
    pub fn overlap<'env, F, R>(&'env self, f: F) -> Result<R>
    where
        F: FnOnce(&Overlap<'env>) -> R,
    {
        self.overlap_with(self.progress(), f)
    }

    /// [`Comm::overlap`] with its operations moved as `progress` says. With
    /// [`Progress::Caller`] they move only inside the caller's calls, as in MPI without
    /// asynchronous progress: [`Pending::test`] runs them until they would wait on a peer,
    /// [`Pending::wait`], a blocking call and the scope's end run them to their end; between
    /// those calls no thread works for them (their stack sleeps on a helper thread). A peer
    /// waiting on this rank meanwhile still fails after `RDMACOMM_TIMEOUT`, as it would for a
    /// rank that is late to call.
    pub fn overlap_with<'env, F, R>(&'env self, progress: Progress, f: F) -> Result<R>
    where
        F: FnOnce(&Overlap<'env>) -> R,
    {
        if self.is_shared_view() {
            return Err(Error::InvalidArgument(
                "overlap: a shared view (Comm::split_shared) runs in one order with the \
                 communicator it shares: open the scope there"
                    .into(),
            ));
        }
        // Held for the scope's life, and taken before the owner check: an adapter's claim
        // from another thread cannot slip in between, nor during the scope.
        let mut tries = 0;
        let _held = loop {
            match self.core.scope_held.try_lock() {
                Ok(g) => break g,
                Err(std::sync::TryLockError::Poisoned(e)) => break e.into_inner(),
                // An adapter's claim holds it for an instant; a scope, for its life.
                Err(std::sync::TryLockError::WouldBlock) if tries < 1000 => {
                    tries += 1;
                    std::thread::yield_now();
                }
                Err(std::sync::TryLockError::WouldBlock) => {
                    return Err(Error::InvalidArgument(
                        "overlap: a scope is open on this communicator already (scopes do not \
                         nest)"
                            .into(),
                    ))
                }
            }
        };
        self.check_thread(&"overlap")?;
        if self.core.executor.load(Ordering::Relaxed) != 0 {
            return Err(Error::InvalidArgument(
                "overlap: a scope is open on this communicator already (scopes do not nest)".into(),
            ));
        }
        self.check_usable()?;
        let scope = Overlap {
            comm: self,
            queue: Queue::new(self),
            _here: PhantomData,
            _env: PhantomData,
        };
        let q = &scope.queue;
        /// Blocking calls find the scope's queue while it is open.
        struct Open<'a>(&'a Comm);
        impl Drop for Open<'_> {
            fn drop(&mut self) {
                self.0
                    .core
                    .scope
                    .store(std::ptr::null_mut(), Ordering::Release);
            }
        }
        let hook = ScopeHook {
            data: std::ptr::from_ref(q).cast(),
            drain: drain_queue,
        };
        // Registered after the hook is made and cleared (by `Open`) before it drops.
        self.core
            .scope
            .store(std::ptr::from_ref(&hook).cast_mut(), Ordering::Release);
        let open = Open(self);
        let held = progress == Progress::Caller;
        self.core.gate.hold(held);
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let r = std::thread::scope(|ts| {
            let cpu = self.progress_cpu();
            let progress = std::thread::Builder::new()
                .name("rdmacomm-progress".into())
                .spawn_scoped(ts, move || {
                    if let Some(id) = cpu {
                        core_affinity::set_for_current(core_affinity::CoreId { id });
                    }
                    q.comm.core.executor.store(this_thread(), Ordering::Relaxed);
                    let _ = started_tx.send(());
                    if held {
                        crate::collectives::pause::set(Some(q.comm.core.gate.clone()));
                        q.serve_held();
                        crate::collectives::pause::set(None);
                    } else {
                        q.serve();
                    }
                    q.comm.core.executor.store(0, Ordering::Relaxed);
                });
            let progress = match progress {
                Ok(p) => p,
                Err(e) => {
                    self.core.gate.hold(false);
                    return Err(Error::Io(e));
                }
            };
            // The executor is known before the first operation is checked against it.
            let _ = started_rx.recv();
            let r = catch_unwind(AssertUnwindSafe(|| f(&scope)));
            q.close();
            // What is left runs to its end now.
            self.core.gate.hold(false);
            let _ = progress.join();
            Ok(r)
        })?;
        drop(open);
        let r = match r {
            Ok(r) => r,
            Err(panic) => std::panic::resume_unwind(panic),
        };
        if let Some(why) = q.failure() {
            self.check_usable()?;
            return Err(Error::InvalidArgument(format!(
                "a non-blocking operation failed: {why}"
            )));
        }
        Ok(r)
    }
}

impl<'env> Overlap<'env> {
    /// The communicator this scope runs on.
    pub fn comm(&self) -> &'env Comm {
        self.comm
    }

    /// Queues `op` (which hands back its buffers) after the operations started before.
    fn start<B: Send + 'env>(
        &self,
        op: impl FnOnce(&Comm) -> (Result<()>, B) + Send + 'env,
    ) -> Result<Pending<'_, B>> {
        // No thread check: an `Overlap` cannot leave the thread that opened the scope.
        self.comm.check_usable()?;
        let cell = NonNull::from(Box::leak(Box::new(Cell::new(op))));
        // SAFETY: the allocation is freed only by the handle's drop, after the queue has
        // finished it (or never, if the handle is forgotten).
        let pos = unsafe { self.queue.push(cell) };
        Ok(Pending {
            cell,
            pos,
            queue: &self.queue,
            _here: PhantomData,
        })
    }

    /// The starter of each operation, by name: every [`Request`] has one above, and a new
    /// operation does not compile until it is listed here (and its starter written).
    #[allow(dead_code)] // read by the compiler, for its exhaustiveness
    fn starter(req: &Request<'_, '_>) -> &'static str {
        match req {
            Request::AllReduce { .. } => "all_reduce, all_reduce_bytes",
            Request::AllGather { .. } => "all_gather",
            Request::SumScatter { .. } => "sum_scatter, reduce_scatter",
            Request::Broadcast { .. } => "broadcast",
            Request::Barrier => "barrier",
            Request::Send { .. } => "send",
            Request::Recv { .. } => "recv",
            Request::SendRecv { .. } => "sendrecv",
            Request::AllToAll { .. } => "all_to_all",
            Request::AllToAllV { .. } => "all_to_allv",
            Request::Reduce { .. } => "reduce",
            Request::Gather { .. } => "gather",
            Request::Scatter { .. } => "scatter",
            Request::AllGatherV { .. } => "all_gather_v",
            Request::ReduceScatterV { .. } => "reduce_scatter_v",
            Request::Batch { .. } => "batch",
        }
    }

    /// Checks `req` now, on the calling thread: a refusal is told to the peers, as a blocking
    /// call's is.
    fn check(&self, req: Request<'_, '_>) -> Result<()> {
        req.check(self.comm.rank(), self.comm.size())
            .map_err(|e| self.comm.refused(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::dtype::{AllReduce, DType};

    /// The queue's hand-overs between the scope's thread and the progress thread (also run
    /// under Miri, which checks them for data races and use after free): operations waited in
    /// and out of order, dropped unwaited, forgotten, and blocking calls between them, under
    /// both kinds of progress. A world of one: an all_reduce hands its data back unchanged,
    /// and a `Max` of a buffer with itself keeps it.
    #[test]
    fn hand_overs_keep_every_buffer_and_result() {
        let c = Comm::new(&Config::defaults(0, 1, "127.0.0.1:9")).unwrap();
        for progress in [Progress::Thread, Progress::Caller] {
            let mut bufs: Vec<Vec<f32>> = (0..12)
                .map(|k| (0..5).map(|i| (k * 5 + i) as f32).collect())
                .collect();
            let mut extra = vec![7.0f32; 3];
            c.overlap_with(progress, |s| -> Result<()> {
                let mut pending = Vec::new();
                for (k, b) in bufs.iter_mut().enumerate() {
                    let p = s.all_reduce(&mut b[..], AllReduce::Max)?;
                    match k % 4 {
                        0 => assert_eq!(p.wait()?[0], (k * 5) as f32),
                        1 => drop(p),
                        2 => std::mem::forget(p),
                        _ => pending.push((k, p)),
                    }
                    if k % 3 == 0 {
                        c.all_reduce(
                            AllReduce::Sum,
                            DType::f32,
                            bytemuck::cast_slice_mut(&mut extra),
                        )?;
                    }
                }
                // Out of order.
                while let Some((k, p)) = pending.pop() {
                    let _ = p.test();
                    assert_eq!(p.wait()?[4], (k * 5 + 4) as f32);
                }
                Ok(())
            })
            .unwrap()
            .unwrap();
            for (k, b) in bufs.iter().enumerate() {
                assert_eq!(*b, (0..5).map(|i| (k * 5 + i) as f32).collect::<Vec<_>>());
            }
            assert_eq!(extra, vec![7.0; 3]);
        }
    }
}
