//! Non-blocking operations: [`Comm::overlap`] opens a scope in which operations start without
//! waiting and run, in call order, on a progress thread while the caller computes (PyTorch DDP
//! starts each gradient bucket's all_reduce as soon as backward has produced it).
//!
//! A started operation borrows its buffers for the whole scope and hands them back from
//! [`Pending::wait`]; the scope waits for every operation before it returns, so neither a
//! dropped nor a forgotten handle can leave the transport writing into freed memory (the
//! design of `std::thread::scope`).

pub(crate) mod gate;

use crate::api::{
    check_all_gather, check_all_reduce, check_all_to_all, check_peer, check_reduce_scatter_v,
    check_root, Communicator,
};
use crate::comm::{this_thread, Comm};
use crate::config::Progress;
use crate::dtype::{AllReduce, DType};
use crate::error::{Error, Result};
use crate::tensor::Element;
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long a waiter polls its operation's flag before it sleeps (a hand-over then costs
/// about a microsecond instead of a thread wake-up).
const SPIN: Duration = Duration::from_micros(20);

/// A started operation, as the queue runs it.
trait Job<'env>: Send + Sync {
    /// Runs the operation (once) and leaves its result in its slot.
    fn run(&self, queue: &Queue<'env>);
}

/// A started operation as its handle sees it: where its result comes.
trait Done<B>: Send + Sync {
    fn slot(&self) -> &Slot<B>;
}

/// One started operation in one allocation: its closure until it runs, then its result.
struct Cell<F, B> {
    op: Mutex<Option<F>>,
    slot: Slot<B>,
}

impl<B: Send, F: Send> Done<B> for Cell<F, B> {
    fn slot(&self) -> &Slot<B> {
        &self.slot
    }
}

impl<'env, B, F> Job<'env> for Cell<F, B>
where
    B: Send + 'env,
    F: FnOnce(&Comm) -> (Result<()>, B) + Send + 'env,
{
    fn run(&self, queue: &Queue<'env>) {
        let comm = queue.comm;
        let op = self.op.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(op) = op else { return };
        let r = match catch_unwind(AssertUnwindSafe(|| op(comm))) {
            Ok((r, b)) => r.map(|()| b),
            // The operation poisoned the communicator and told the peers.
            Err(_) => comm.check_usable().and(Err(Error::Poisoned(
                "a non-blocking operation panicked".into(),
            ))),
        };
        if let Err(e) = &r {
            queue.failed.store(true, Ordering::Release);
            queue
                .first_error
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert_with(|| e.to_string());
        }
        self.slot.put(r);
        comm.pending.done();
    }
}

thread_local! {
    /// Whether this thread is running an operation of a scope (then a blocking call inside it
    /// must not wait for the scope's operations: it is one of them).
    static IN_JOB: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the calling thread runs a scope's operation now.
pub(crate) fn in_job() -> bool {
    IN_JOB.with(|j| j.get())
}

/// The operations started and not yet run, and the token to run them: whoever holds it (the
/// progress thread, or a caller waiting on an operation that has not begun) runs the next one,
/// so operations run one at a time in call order.
struct Queue<'env> {
    comm: &'env Comm,
    state: Mutex<QueueState<'env>>,
    changed: Condvar,
    /// Whether an operation failed.
    failed: AtomicBool,
    /// The first failure, in words, for a scope whose communicator it did not poison.
    first_error: Mutex<Option<String>>,
}

struct QueueState<'env> {
    jobs: VecDeque<Arc<dyn Job<'env> + 'env>>,
    closed: bool,
    running: bool,
    /// The progress thread sleeps until woken (else it looks again every [`LOOK_EVERY`]).
    asleep: bool,
    /// Operations started so far (the progress thread tells activity by its change).
    started: u64,
    /// Operations in a row that their waiters ran themselves (the progress thread found none).
    helped: u32,
}

/// While operations come, the progress thread looks for one this often instead of being woken
/// by each start: a start then costs no wake-up, which a waiter that runs its operation itself
/// (started and waited at once) would pay for nothing.
const LOOK_EVERY: Duration = Duration::from_millis(1);
/// Without a start for this long, the progress thread sleeps until woken.
const DOZE_AFTER: Duration = Duration::from_millis(20);
/// While every operation is run by its own waiter (started and waited at once), the progress
/// thread looks this seldom: its wake-ups would be all it adds (on emulated CPUs, a visible
/// share of a small operation). An operation then left to it begins within this long, and
/// from the next one it looks every [`LOOK_EVERY`] again.
const LOOK_SELDOM: Duration = Duration::from_millis(20);
/// Operations in a row run by their waiters after which the progress thread looks seldom.
const HELPED_SELDOM: u32 = 16;

impl<'env> Queue<'env> {
    fn push(&self, job: Arc<dyn Job<'env> + 'env>) {
        let mut q = self.state.lock().unwrap_or_else(|e| e.into_inner());
        q.jobs.push_back(job);
        q.started += 1;
        if q.asleep {
            self.changed.notify_all();
        }
    }

    /// No more operations will come.
    fn close(&self) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
        self.changed.notify_all();
    }

    /// Runs `job` holding the token, then gives the token back.
    fn run(&self, job: Arc<dyn Job<'env> + 'env>) {
        IN_JOB.with(|j| j.set(true));
        job.run(self);
        drop(job);
        IN_JOB.with(|j| j.set(false));
        let mut q = self.state.lock().unwrap_or_else(|e| e.into_inner());
        q.running = false;
        // Only a queued operation waits for the token.
        if !q.jobs.is_empty() {
            self.changed.notify_all();
        }
    }

    /// The progress thread: runs operations as they come, until closed and empty.
    fn serve(&self) {
        let mut last = Instant::now();
        let mut seen = 0;
        loop {
            let mut q = self.state.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if !q.running {
                    if let Some(j) = q.jobs.pop_front() {
                        q.running = true;
                        q.helped = 0;
                        drop(q);
                        self.run(j);
                        last = Instant::now();
                        break;
                    }
                    if q.closed {
                        return;
                    }
                }
                if !q.jobs.is_empty() || q.started != seen {
                    seen = q.started;
                    last = Instant::now();
                }
                q.asleep = last.elapsed() > DOZE_AFTER;
                let look = if q.helped >= HELPED_SELDOM {
                    LOOK_SELDOM
                } else {
                    LOOK_EVERY
                };
                q = if q.asleep {
                    let q = self.changed.wait(q).unwrap_or_else(|e| e.into_inner());
                    // Operations come again: look for them for a while instead of being woken
                    // by each start (a waiter that runs its own would leave this thread dozing,
                    // and every start would then pay a wake-up).
                    last = Instant::now();
                    q
                } else {
                    let (q, _) = self
                        .changed
                        .wait_timeout(q, look)
                        .unwrap_or_else(|e| e.into_inner());
                    q
                };
            }
        }
    }

    /// The runner under `RDMACOMM_PROGRESS=caller`: runs operations only while the gate lets
    /// them move, until closed and empty.
    fn serve_held(&self) {
        let gate = &self.comm.gate;
        loop {
            gate.enter();
            {
                let mut q = self.state.lock().unwrap_or_else(|e| e.into_inner());
                if !q.running {
                    if let Some(j) = q.jobs.pop_front() {
                        q.running = true;
                        drop(q);
                        self.run(j);
                        continue;
                    }
                    if q.closed {
                        return;
                    }
                }
            }
            gate.idle(LOOK_EVERY);
        }
    }

    /// A waiting caller: runs the next operation itself if nobody runs one (operations started
    /// and waited at once then cost what a blocking call does). Whether it ran one.
    fn help(&self) -> bool {
        let mut q = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if q.running {
            return false;
        }
        let Some(j) = q.jobs.pop_front() else {
            return false;
        };
        q.running = true;
        q.helped = q.helped.saturating_add(1);
        drop(q);
        self.run(j);
        true
    }
}

/// Where an operation leaves its result and hands back its buffers.
struct Slot<B> {
    done: AtomicBool,
    out: Mutex<Handback<B>>,
    cv: Condvar,
}

/// A result to hand back, and whether its waiter sleeps (a wake-up is a system call: made only
/// for a sleeper).
struct Handback<B> {
    result: Option<Result<B>>,
    sleeping: bool,
}

impl<B> Slot<B> {
    fn put(&self, r: Result<B>) {
        let mut o = self.out.lock().unwrap_or_else(|e| e.into_inner());
        o.result = Some(r);
        self.done.store(true, Ordering::Release);
        if o.sleeping {
            self.cv.notify_all();
        }
    }
}

/// An operation started in an [`Overlap`] scope. [`Pending::wait`] returns its result and hands
/// back its output buffer; dropping it without waiting waits (the scope's end would anyway).
#[must_use = "an operation's error is seen by waiting on it (or at the end of its scope)"]
pub struct Pending<'env, B> {
    op: Arc<dyn Done<B> + 'env>,
    queue: Arc<Queue<'env>>,
    /// Waited on by the thread that started it (which may run it): not sent elsewhere.
    _here: PhantomData<*const ()>,
}

impl<B> Pending<'_, B> {
    /// Whether the operation has finished. Under a progress thread it only looks; under
    /// `RDMACOMM_PROGRESS=caller` it first lets the operations move until they would wait on a
    /// peer (what has arrived is taken and what can be sent is sent), then looks.
    pub fn test(&self) -> bool {
        if self.op.slot().done.load(Ordering::Acquire) {
            return true;
        }
        self.queue.comm.gate.test();
        self.op.slot().done.load(Ordering::Acquire)
    }

    /// Until the operation is done: runs it (and those before it) here where the progress
    /// thread has not begun them, else waits for it.
    fn finish(&self) {
        if self.op.slot().done.load(Ordering::Acquire) {
            return;
        }
        // Under caller progress, the operations move freely while their caller waits.
        let _free = self.queue.comm.gate.waiting();
        while !self.op.slot().done.load(Ordering::Acquire) {
            if self.queue.help() {
                continue;
            }
            let t0 = Instant::now();
            while !self.op.slot().done.load(Ordering::Acquire) && t0.elapsed() < SPIN {
                std::hint::spin_loop();
            }
            let mut g = self.op.slot().out.lock().unwrap_or_else(|e| e.into_inner());
            if !self.op.slot().done.load(Ordering::Acquire) {
                // Woken by the result; the timed wait re-checks whether the token came free.
                g.sleeping = true;
                let (mut g, _) = self
                    .op
                    .slot()
                    .cv
                    .wait_timeout(g, Duration::from_millis(1))
                    .unwrap_or_else(|e| e.into_inner());
                g.sleeping = false;
            }
        }
    }

    /// Waits for the operation (each of its waits is bounded by `RDMACOMM_TIMEOUT`) and hands
    /// back its output buffer.
    pub fn wait(self) -> Result<B> {
        self.finish();
        self.op
            .slot()
            .out
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .result
            .take()
            .expect("a finished operation's result, taken once")
    }
}

impl<B> Drop for Pending<'_, B> {
    fn drop(&mut self) {
        self.finish();
    }
}

/// A scope of non-blocking operations on one communicator ([`Comm::overlap`]). Operations
/// started here, and blocking ones called on the communicator meanwhile, run in call order,
/// the same on every rank.
pub struct Overlap<'env> {
    comm: &'env Comm,
    queue: Arc<Queue<'env>>,
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
        self.overlap_with(self.progress_mode(), f)
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
        self.check_thread(&"overlap")?;
        if self.executor.load(Ordering::Relaxed) != 0 {
            return Err(Error::InvalidArgument(
                "overlap: a scope is open on this communicator already (scopes do not nest)".into(),
            ));
        }
        self.check_usable()?;
        let scope = Overlap {
            comm: self,
            queue: Arc::new(Queue {
                comm: self,
                state: Mutex::new(QueueState {
                    jobs: VecDeque::new(),
                    closed: false,
                    running: false,
                    asleep: true,
                    started: 0,
                    helped: 0,
                }),
                changed: Condvar::new(),
                failed: AtomicBool::new(false),
                first_error: Mutex::new(None),
            }),
            _env: PhantomData,
        };
        let held = progress == Progress::Caller;
        self.gate.hold(held);
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let r = std::thread::scope(|ts| {
            let s = &scope;
            let cpu = self.progress_cpu();
            let progress = std::thread::Builder::new()
                .name("rdmacomm-progress".into())
                .spawn_scoped(ts, move || {
                    if let Some(id) = cpu {
                        core_affinity::set_for_current(core_affinity::CoreId { id });
                    }
                    s.comm.executor.store(this_thread(), Ordering::Relaxed);
                    let _ = started_tx.send(());
                    if held {
                        crate::collectives::pause::set(Some(s.comm.gate.clone()));
                        s.queue.serve_held();
                        crate::collectives::pause::set(None);
                    } else {
                        s.queue.serve();
                    }
                    s.comm.executor.store(0, Ordering::Relaxed);
                });
            let progress = match progress {
                Ok(p) => p,
                Err(e) => {
                    self.gate.hold(false);
                    return Err(Error::Io(e));
                }
            };
            // The executor is known before the first operation is checked against it.
            let _ = started_rx.recv();
            let r = catch_unwind(AssertUnwindSafe(|| f(s)));
            s.queue.close();
            // What is left runs to its end now.
            self.gate.hold(false);
            let _ = progress.join();
            Ok(r)
        })?;
        let r = match r {
            Ok(r) => r,
            Err(panic) => std::panic::resume_unwind(panic),
        };
        if scope.queue.failed.load(Ordering::Acquire) {
            self.check_usable()?;
            let first = scope
                .queue
                .first_error
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if let Some(why) = first.clone() {
                return Err(Error::InvalidArgument(format!(
                    "a non-blocking operation failed: {why}"
                )));
            }
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
    ) -> Result<Pending<'env, B>> {
        self.comm.check_thread(&"a non-blocking operation")?;
        self.comm.check_usable()?;
        let cell = Arc::new(Cell {
            op: Mutex::new(Some(op)),
            slot: Slot {
                done: AtomicBool::new(false),
                out: Mutex::new(Handback {
                    result: None,
                    sleeping: false,
                }),
                cv: Condvar::new(),
            },
        });
        self.comm.pending.add();
        self.queue.push(cell.clone());
        Ok(Pending {
            op: cell,
            queue: self.queue.clone(),
            _here: PhantomData,
        })
    }

    /// Starts [`Communicator::all_reduce`] of `data` (elements of `T`).
    pub fn all_reduce<T: Element + Send + Sync>(
        &self,
        data: &'env mut [T],
        op: AllReduce,
    ) -> Result<Pending<'env, &'env mut [T]>> {
        self.start(move |c| {
            let r = c.all_reduce(op, T::DTYPE, bytemuck::cast_slice_mut(data));
            (r, data)
        })
    }

    /// Starts [`Communicator::all_reduce`] of `data` as bytes of `dtype`.
    pub fn all_reduce_bytes(
        &self,
        op: AllReduce,
        dtype: DType,
        data: &'env mut [u8],
    ) -> Result<Pending<'env, &'env mut [u8]>> {
        check_all_reduce(dtype, data)?;
        self.start(move |c| (c.all_reduce(op, dtype, data), data))
    }

    /// Starts [`Communicator::all_gather`] of `input` into `output` (handed back).
    pub fn all_gather<T: Element + Send + Sync>(
        &self,
        input: &'env [T],
        output: &'env mut [T],
    ) -> Result<Pending<'env, &'env mut [T]>> {
        let (i, o) = (bytemuck::cast_slice(input), bytemuck::cast_slice(output));
        check_all_gather(self.comm.size(), i, o)?;
        self.start(move |c| {
            let r = c.all_gather(
                bytemuck::cast_slice(input),
                bytemuck::cast_slice_mut(output),
            );
            (r, output)
        })
    }

    /// Starts [`Communicator::reduce_scatter_v`] with equal parts: rank r's `output` is the
    /// reduction of every rank's part r of `input` (`size * output.len()` elements).
    pub fn reduce_scatter<T: Element + Send + Sync>(
        &self,
        input: &'env [T],
        output: &'env mut [T],
        op: AllReduce,
    ) -> Result<Pending<'env, &'env mut [T]>> {
        let lens = vec![std::mem::size_of_val(output); self.comm.size()];
        check_reduce_scatter_v(
            self.comm.rank(),
            self.comm.size(),
            T::DTYPE,
            bytemuck::cast_slice(input),
            bytemuck::cast_slice(output),
            &lens,
        )?;
        self.start(move |c| {
            let r = c.reduce_scatter_v(
                op,
                T::DTYPE,
                bytemuck::cast_slice(input),
                bytemuck::cast_slice_mut(output),
                &lens,
            );
            (r, output)
        })
    }

    /// Starts [`Communicator::broadcast`] of `data` from `root`.
    pub fn broadcast<T: Element + Send + Sync>(
        &self,
        data: &'env mut [T],
        root: usize,
    ) -> Result<Pending<'env, &'env mut [T]>> {
        check_root(root, self.comm.size())?;
        self.start(move |c| (c.broadcast(root, bytemuck::cast_slice_mut(data)), data))
    }

    /// Starts [`Communicator::reduce`] of `data` to `root`.
    pub fn reduce<T: Element + Send + Sync>(
        &self,
        data: &'env mut [T],
        op: AllReduce,
        root: usize,
    ) -> Result<Pending<'env, &'env mut [T]>> {
        check_root(root, self.comm.size())?;
        self.start(move |c| {
            let r = c.reduce(root, op, T::DTYPE, bytemuck::cast_slice_mut(data));
            (r, data)
        })
    }

    /// Starts [`Communicator::all_to_all`] of `input` into `output` (handed back).
    pub fn all_to_all<T: Element + Send + Sync>(
        &self,
        input: &'env [T],
        output: &'env mut [T],
    ) -> Result<Pending<'env, &'env mut [T]>> {
        let (i, o) = (bytemuck::cast_slice(input), bytemuck::cast_slice(output));
        check_all_to_all(self.comm.size(), i, o)?;
        self.start(move |c| {
            let r = c.all_to_all(
                bytemuck::cast_slice(input),
                bytemuck::cast_slice_mut(output),
            );
            (r, output)
        })
    }

    /// Starts [`Communicator::send`] of `data` to `dst`.
    pub fn send<T: Element + Send + Sync>(
        &self,
        dst: usize,
        data: &'env [T],
    ) -> Result<Pending<'env, ()>> {
        check_peer("send", self.comm.rank(), self.comm.size(), dst)?;
        self.start(move |c| (c.send(dst, bytemuck::cast_slice(data)), ()))
    }

    /// Starts [`Communicator::recv`] into `data` from `src`.
    pub fn recv<T: Element + Send + Sync>(
        &self,
        src: usize,
        data: &'env mut [T],
    ) -> Result<Pending<'env, &'env mut [T]>> {
        check_peer("recv", self.comm.rank(), self.comm.size(), src)?;
        self.start(move |c| (c.recv(src, bytemuck::cast_slice_mut(data)), data))
    }

    /// Starts [`Communicator::sendrecv`]: `send` to `dst` while `recv` comes from `src`.
    pub fn sendrecv<T: Element + Send + Sync>(
        &self,
        dst: usize,
        send: &'env [T],
        src: usize,
        recv: &'env mut [T],
    ) -> Result<Pending<'env, &'env mut [T]>> {
        let (me, n) = (self.comm.rank(), self.comm.size());
        check_peer("send", me, n, dst)?;
        check_peer("recv", me, n, src)?;
        self.start(move |c| {
            let r = c.sendrecv(
                dst,
                bytemuck::cast_slice(send),
                src,
                bytemuck::cast_slice_mut(recv),
            );
            (r, recv)
        })
    }

    /// Starts [`Communicator::barrier`].
    pub fn barrier(&self) -> Result<Pending<'env, ()>> {
        self.start(move |c| (c.barrier(), ()))
    }
}
