//! The starters of [`Overlap`]: one per operation, each the blocking call's [`Request`] queued
//! (checked now, on the caller's thread, where the blocking call checks it).

use super::{Overlap, Pending};
use crate::api::{check_all_reduce, check_peer, check_root, Communicator, P2p};
use crate::comm::request::Request;
use crate::dtype::Element;
use crate::dtype::{AllReduce, DType};
use crate::error::Result;

impl<'env> Overlap<'env> {
    /// Starts [`Communicator::all_reduce`] of `data` (elements of `T`).
    pub fn all_reduce<T: Element + Send + Sync>(
        &self,
        data: &'env mut [T],
        op: AllReduce,
    ) -> Result<Pending<'_, &'env mut [T]>> {
        // Whole elements of `T::DTYPE` by their type: nothing to check.
        self.start(move |c| {
            let bytes = bytemuck::cast_slice_mut(data);
            let r = c.run_checked(Request::AllReduce {
                op,
                dtype: T::DTYPE,
                data: bytes,
            });
            (r, data)
        })
    }

    /// Starts [`Communicator::all_reduce`] of `data` as bytes of `dtype`.
    #[inline]
    pub fn all_reduce_bytes(
        &self,
        op: AllReduce,
        dtype: DType,
        data: &'env mut [u8],
    ) -> Result<Pending<'_, &'env mut [u8]>> {
        check_all_reduce(dtype, data).map_err(|e| self.comm.refused(e))?;
        self.start(move |c| {
            let r = c.run_checked(Request::AllReduce {
                op,
                dtype,
                data: &mut *data,
            });
            (r, data)
        })
    }

    /// Starts [`Communicator::all_gather`] of `input` into `output` (handed back).
    pub fn all_gather<T: Element + Send + Sync>(
        &self,
        input: &'env [T],
        output: &'env mut [T],
    ) -> Result<Pending<'_, &'env mut [T]>> {
        let input = bytemuck::cast_slice(input);
        self.check(Request::AllGather {
            input,
            output: bytemuck::cast_slice_mut(output),
        })?;
        self.start(move |c| {
            let r = c.run_checked(Request::AllGather {
                input,
                output: bytemuck::cast_slice_mut(output),
            });
            (r, output)
        })
    }

    /// Starts [`Communicator::sum_scatter`]: rank r's `output` is the sum of every rank's
    /// chunk r of `input` (`size * output.len()` elements).
    pub fn sum_scatter<T: Element + Send + Sync>(
        &self,
        input: &'env [T],
        output: &'env mut [T],
    ) -> Result<Pending<'_, &'env mut [T]>> {
        let input = bytemuck::cast_slice(input);
        self.check(Request::SumScatter {
            dtype: T::DTYPE,
            input,
            output: bytemuck::cast_slice_mut(output),
        })?;
        self.start(move |c| {
            let r = c.run_checked(Request::SumScatter {
                dtype: T::DTYPE,
                input,
                output: bytemuck::cast_slice_mut(output),
            });
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
    ) -> Result<Pending<'_, &'env mut [T]>> {
        let lens = vec![std::mem::size_of_val(output); self.comm.size()];
        let input = bytemuck::cast_slice(input);
        self.check(Request::ReduceScatterV {
            op,
            dtype: T::DTYPE,
            input,
            output: bytemuck::cast_slice_mut(output),
            lens: &lens,
        })?;
        self.start(move |c| {
            let r = c.run_checked(Request::ReduceScatterV {
                op,
                dtype: T::DTYPE,
                input,
                output: bytemuck::cast_slice_mut(output),
                lens: &lens,
            });
            (r, output)
        })
    }

    /// Starts [`Communicator::reduce_scatter_v`] of bytes of `dtype` (`lens` in bytes).
    pub fn reduce_scatter_v(
        &self,
        op: AllReduce,
        dtype: DType,
        input: &'env [u8],
        output: &'env mut [u8],
        lens: &'env [usize],
    ) -> Result<Pending<'_, &'env mut [u8]>> {
        self.check(Request::ReduceScatterV {
            op,
            dtype,
            input,
            output: &mut *output,
            lens,
        })?;
        self.start(move |c| {
            let r = c.run_checked(Request::ReduceScatterV {
                op,
                dtype,
                input,
                output: &mut *output,
                lens,
            });
            (r, output)
        })
    }

    /// Starts [`Communicator::broadcast`] of `data` from `root`.
    pub fn broadcast<T: Element + Send + Sync>(
        &self,
        data: &'env mut [T],
        root: usize,
    ) -> Result<Pending<'_, &'env mut [T]>> {
        check_root(root, self.comm.size()).map_err(|e| self.comm.refused(e))?;
        self.start(move |c| {
            let r = c.run_checked(Request::Broadcast {
                root,
                data: bytemuck::cast_slice_mut(data),
            });
            (r, data)
        })
    }

    /// Starts [`Communicator::reduce`] of `data` to `root`.
    pub fn reduce<T: Element + Send + Sync>(
        &self,
        data: &'env mut [T],
        op: AllReduce,
        root: usize,
    ) -> Result<Pending<'_, &'env mut [T]>> {
        check_root(root, self.comm.size()).map_err(|e| self.comm.refused(e))?;
        self.start(move |c| {
            let r = c.run_checked(Request::Reduce {
                root,
                op,
                dtype: T::DTYPE,
                data: bytemuck::cast_slice_mut(data),
            });
            (r, data)
        })
    }

    /// Starts [`Communicator::gather`] of every rank's `input` into `output` on `root`.
    pub fn gather<T: Element + Send + Sync>(
        &self,
        root: usize,
        input: &'env [T],
        output: &'env mut [T],
    ) -> Result<Pending<'_, &'env mut [T]>> {
        let input = bytemuck::cast_slice(input);
        self.check(Request::Gather {
            root,
            input,
            output: bytemuck::cast_slice_mut(output),
        })?;
        self.start(move |c| {
            let r = c.run_checked(Request::Gather {
                root,
                input,
                output: bytemuck::cast_slice_mut(output),
            });
            (r, output)
        })
    }

    /// Starts [`Communicator::scatter`] of `root`'s `input` into every rank's `output`.
    pub fn scatter<T: Element + Send + Sync>(
        &self,
        root: usize,
        input: &'env [T],
        output: &'env mut [T],
    ) -> Result<Pending<'_, &'env mut [T]>> {
        let input = bytemuck::cast_slice(input);
        self.check(Request::Scatter {
            root,
            input,
            output: bytemuck::cast_slice_mut(output),
        })?;
        self.start(move |c| {
            let r = c.run_checked(Request::Scatter {
                root,
                input,
                output: bytemuck::cast_slice_mut(output),
            });
            (r, output)
        })
    }

    /// Starts [`Communicator::all_gather_v`] (bytes; rank q's `input` is `lens[q]` bytes).
    pub fn all_gather_v(
        &self,
        input: &'env [u8],
        output: &'env mut [u8],
        lens: &'env [usize],
    ) -> Result<Pending<'_, &'env mut [u8]>> {
        self.check(Request::AllGatherV {
            input,
            output: &mut *output,
            lens,
        })?;
        self.start(move |c| {
            let r = c.run_checked(Request::AllGatherV {
                input,
                output: &mut *output,
                lens,
            });
            (r, output)
        })
    }

    /// Starts [`Communicator::all_to_all`] of `input` into `output` (handed back).
    pub fn all_to_all<T: Element + Send + Sync>(
        &self,
        input: &'env [T],
        output: &'env mut [T],
    ) -> Result<Pending<'_, &'env mut [T]>> {
        let input = bytemuck::cast_slice(input);
        self.check(Request::AllToAll {
            input,
            output: bytemuck::cast_slice_mut(output),
        })?;
        self.start(move |c| {
            let r = c.run_checked(Request::AllToAll {
                input,
                output: bytemuck::cast_slice_mut(output),
            });
            (r, output)
        })
    }

    /// Starts [`Communicator::all_to_allv`] (bytes; block lengths in bytes).
    pub fn all_to_allv(
        &self,
        input: &'env [u8],
        send_lens: &'env [usize],
        output: &'env mut [u8],
        recv_lens: &'env [usize],
    ) -> Result<Pending<'_, &'env mut [u8]>> {
        self.check(Request::AllToAllV {
            input,
            send_lens,
            output: &mut *output,
            recv_lens,
        })?;
        self.start(move |c| {
            let r = c.run_checked(Request::AllToAllV {
                input,
                send_lens,
                output: &mut *output,
                recv_lens,
            });
            (r, output)
        })
    }

    /// Starts [`Communicator::send`] of `data` to `dst`.
    pub fn send<T: Element + Send + Sync>(
        &self,
        dst: usize,
        data: &'env [T],
    ) -> Result<Pending<'_, ()>> {
        let data = bytemuck::cast_slice(data);
        self.check(Request::Send { dst, data })?;
        self.start(move |c| (c.run_checked(Request::Send { dst, data }), ()))
    }

    /// Starts [`Communicator::recv`] into `data` from `src`.
    pub fn recv<T: Element + Send + Sync>(
        &self,
        src: usize,
        data: &'env mut [T],
    ) -> Result<Pending<'_, &'env mut [T]>> {
        check_peer("recv", self.comm.rank(), self.comm.size(), src)
            .map_err(|e| self.comm.refused(e))?;
        self.start(move |c| {
            let r = c.run_checked(Request::Recv {
                src,
                data: bytemuck::cast_slice_mut(data),
            });
            (r, data)
        })
    }

    /// Starts [`Communicator::sendrecv`]: `send` to `dst` while `recv` comes from `src`.
    pub fn sendrecv<T: Element + Send + Sync>(
        &self,
        dst: usize,
        send: &'env [T],
        src: usize,
        recv: &'env mut [T],
    ) -> Result<Pending<'_, &'env mut [T]>> {
        let send = bytemuck::cast_slice(send);
        self.check(Request::SendRecv {
            dst,
            send,
            src,
            recv: bytemuck::cast_slice_mut(recv),
        })?;
        self.start(move |c| {
            let r = c.run_checked(Request::SendRecv {
                dst,
                send,
                src,
                recv: bytemuck::cast_slice_mut(recv),
            });
            (r, recv)
        })
    }

    /// Starts [`Communicator::batch`] of `ops` (handed back).
    pub fn batch<'o: 'env>(
        &self,
        ops: &'env mut [P2p<'o>],
    ) -> Result<Pending<'_, &'env mut [P2p<'o>]>> {
        self.check(Request::Batch { ops: &mut *ops })?;
        self.start(move |c| {
            let r = c.run_checked(Request::Batch { ops: &mut *ops });
            (r, ops)
        })
    }

    /// Starts [`Communicator::barrier`].
    #[inline]
    pub fn barrier(&self) -> Result<Pending<'_, ()>> {
        self.start(move |c| (c.run_checked(Request::Barrier), ()))
    }
}
