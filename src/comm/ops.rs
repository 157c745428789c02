//! [`Communicator`] for [`Comm`]: every operation is a [`Request`] down [`Comm::run`].

use super::request::Request;
use super::*;

impl Communicator for Comm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce(&self, op: AllReduce, dtype: DType, data: &mut [u8]) -> Result<()> {
        self.run(Request::AllReduce { op, dtype, data })
    }

    fn all_gather(&self, input: &[u8], output: &mut [u8]) -> Result<()> {
        self.run(Request::AllGather { input, output })
    }

    fn send(&self, dst: usize, data: &[u8]) -> Result<()> {
        self.run(Request::Send { dst, data })
    }

    fn recv(&self, src: usize, data: &mut [u8]) -> Result<()> {
        self.run(Request::Recv { src, data })
    }

    fn sum_scatter(&self, dtype: DType, input: &[u8], output: &mut [u8]) -> Result<()> {
        self.run(Request::SumScatter {
            dtype,
            input,
            output,
        })
    }

    /// Registers `buf` with the transport (fails, without running `f`, when registering fails,
    /// e.g. at the locked-memory limit, whose error says how to raise it, or when
    /// 64 buffers (`MAX_REGISTERED` of the RDMA transport) are registered already); the
    /// registration ends however `f` exits. A panic in `f` poisons the communicator and tells
    /// the peers before it goes on unwinding.
    fn with_registered(
        &self,
        buf: &mut [u8],
        f: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<()> {
        self.alone("with_registered")?;
        let id = match self.lock().link.as_deref_mut().and_then(|l| l.lending()) {
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
                    if let Some(l) = l.lending() {
                        l.unregister(id);
                    }
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
        self.run(Request::Broadcast { root, data })
    }

    fn barrier(&self) -> Result<()> {
        self.run(Request::Barrier)
    }

    fn all_to_all(&self, input: &[u8], output: &mut [u8]) -> Result<()> {
        self.run(Request::AllToAll { input, output })
    }

    fn all_to_allv(
        &self,
        input: &[u8],
        send_lens: &[usize],
        output: &mut [u8],
        recv_lens: &[usize],
    ) -> Result<()> {
        self.run(Request::AllToAllV {
            input,
            send_lens,
            output,
            recv_lens,
        })
    }

    fn reduce(&self, root: usize, op: AllReduce, dtype: DType, data: &mut [u8]) -> Result<()> {
        self.run(Request::Reduce {
            root,
            op,
            dtype,
            data,
        })
    }

    fn gather(&self, root: usize, input: &[u8], output: &mut [u8]) -> Result<()> {
        self.run(Request::Gather {
            root,
            input,
            output,
        })
    }

    fn scatter(&self, root: usize, input: &[u8], output: &mut [u8]) -> Result<()> {
        self.run(Request::Scatter {
            root,
            input,
            output,
        })
    }

    fn all_gather_v(&self, input: &[u8], output: &mut [u8], lens: &[usize]) -> Result<()> {
        self.run(Request::AllGatherV {
            input,
            output,
            lens,
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
        self.run(Request::ReduceScatterV {
            op,
            dtype,
            input,
            output,
            lens,
        })
    }

    fn sendrecv(&self, dst: usize, send: &[u8], src: usize, recv: &mut [u8]) -> Result<()> {
        self.run(Request::SendRecv {
            dst,
            send,
            src,
            recv,
        })
    }

    fn batch(&self, ops: &mut [P2p<'_>]) -> Result<()> {
        self.run(Request::Batch { ops })
    }

    /// Never blocks, from any thread: while another thread runs an operation, reports what is
    /// known (that operation itself fails within the timeout if a peer is lost).
    fn health(&self) -> Result<()> {
        self.check_usable()?;
        let mut g = match self.core.inner.try_lock() {
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
