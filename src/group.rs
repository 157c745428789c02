//! [`Group`]: the typed, ergonomic front over a byte-level [`Communicator`].

use crate::api::Communicator;
use crate::comm::Comm;
use crate::dtype::AllReduce;
use crate::dtype::Element;
use crate::error::Result;
use std::sync::Arc;

/// A group of ranks with typed collectives over any element type with a dtype:
/// `group.all_reduce(&mut grads, AllReduce::Sum)`.
#[derive(Clone)]
pub struct Group {
    comm: Arc<dyn Communicator>,
}

impl Group {
    /// A group over any byte-level communicator.
    pub fn new(comm: Arc<dyn Communicator>) -> Group {
        Group { comm }
    }

    /// Joins the group described by the environment (see [`crate::Config::from_env`]): RDMA
    /// where a device is usable, TCP otherwise.
    pub fn from_env() -> Result<Group> {
        Ok(Group::new(Arc::new(Comm::from_env()?)))
    }

    /// The underlying byte-level communicator.
    pub fn communicator(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.comm.size()
    }

    /// In-place reduction across ranks; every rank gets the same bits.
    pub fn all_reduce<T: Element>(&self, data: &mut [T], op: AllReduce) -> Result<()> {
        self.comm
            .all_reduce(op, T::DTYPE, bytemuck::cast_slice_mut(data))
    }

    /// Every rank's `input`, concatenated in rank order into `output` (`size * input.len()`).
    pub fn all_gather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        self.comm.all_gather(
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(output),
        )
    }

    /// Rank r's `output` is the sum of every rank's r-th chunk of `input` (`size * output.len()`).
    pub fn sum_scatter<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        self.comm.sum_scatter(
            T::DTYPE,
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(output),
        )
    }

    /// Rank `root`'s `data` on every rank.
    pub fn broadcast<T: Element>(&self, data: &mut [T], root: usize) -> Result<()> {
        self.comm.broadcast(root, bytemuck::cast_slice_mut(data))
    }

    /// Blocks until every rank has reached it.
    pub fn barrier(&self) -> Result<()> {
        self.comm.barrier()
    }

    /// Sends `data` to rank `dst`.
    pub fn send<T: Element>(&self, dst: usize, data: &[T]) -> Result<()> {
        self.comm.send(dst, bytemuck::cast_slice(data))
    }

    /// Receives exactly `data.len()` elements from rank `src`.
    pub fn recv<T: Element>(&self, src: usize, data: &mut [T]) -> Result<()> {
        self.comm.recv(src, bytemuck::cast_slice_mut(data))
    }

    /// Rank p's block q of `input` into rank q's block p of `output` (`size` equal blocks).
    pub fn all_to_all<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        self.comm.all_to_all(
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(output),
        )
    }

    /// Rank p's block q of `input` (`send_counts[q]` elements) into rank q's block p of
    /// `output` (`recv_counts[p]` elements), blocks consecutive in rank order.
    pub fn all_to_allv<T: Element>(
        &self,
        input: &[T],
        send_counts: &[usize],
        output: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        self.comm.all_to_allv(
            bytemuck::cast_slice(input),
            &bytes_of::<T>(send_counts),
            bytemuck::cast_slice_mut(output),
            &bytes_of::<T>(recv_counts),
        )
    }

    /// The reduction of every rank's `data` into `data` on `root` (others' stays as it was).
    pub fn reduce<T: Element>(&self, data: &mut [T], op: AllReduce, root: usize) -> Result<()> {
        self.comm
            .reduce(root, op, T::DTYPE, bytemuck::cast_slice_mut(data))
    }

    /// Every rank's `input` into `output` on `root` (`size * input.len()` there).
    pub fn gather<T: Element>(&self, input: &[T], output: &mut [T], root: usize) -> Result<()> {
        self.comm.gather(
            root,
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(output),
        )
    }

    /// Block q of `input` on `root` (`size * output.len()` there) into rank q's `output`.
    pub fn scatter<T: Element>(&self, input: &[T], output: &mut [T], root: usize) -> Result<()> {
        self.comm.scatter(
            root,
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(output),
        )
    }

    /// Every rank's `input` (rank q's has `counts[q]` elements) concatenated into `output`.
    pub fn all_gather_v<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        counts: &[usize],
    ) -> Result<()> {
        self.comm.all_gather_v(
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(output),
            &bytes_of::<T>(counts),
        )
    }

    /// Rank r's `output` (`counts[r]` elements) is the reduction of every rank's block r of
    /// `input` (blocks of `counts[q]` elements in rank order).
    pub fn reduce_scatter_v<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        counts: &[usize],
        op: AllReduce,
    ) -> Result<()> {
        self.comm.reduce_scatter_v(
            op,
            T::DTYPE,
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(output),
            &bytes_of::<T>(counts),
        )
    }

    /// Sends `send` to `dst` while receiving `recv` from `src` (neither waits for the other).
    pub fn sendrecv<T: Element>(
        &self,
        dst: usize,
        send: &[T],
        src: usize,
        recv: &mut [T],
    ) -> Result<()> {
        self.comm.sendrecv(
            dst,
            bytemuck::cast_slice(send),
            src,
            bytemuck::cast_slice_mut(recv),
        )
    }

    /// Runs a batch of sends and receives at once (see [`Communicator::batch`]).
    pub fn batch(&self, ops: &mut [crate::api::P2p<'_>]) -> Result<()> {
        self.comm.batch(ops)
    }

    /// Registers `data` once for the duration of `f`, so the collectives `f` runs on it send
    /// straight from it (see [`Communicator::with_registered`]); returns what `f` returns.
    pub fn with_registered<T: Element, R>(
        &self,
        data: &mut [T],
        f: impl FnOnce(&mut [T]) -> Result<R>,
    ) -> Result<R> {
        let (mut f, mut out) = (Some(f), None);
        self.comm
            .with_registered(bytemuck::cast_slice_mut(data), &mut |bytes| {
                let f = f.take().expect("called once");
                out = Some(f(bytemuck::cast_slice_mut(bytes))?);
                Ok(())
            })?;
        Ok(out.expect("ran"))
    }

    /// A subgroup of the ranks with the same `color`, ordered by `key`.
    pub fn split(&self, color: i32, key: i32) -> Result<Group> {
        Ok(Group::new(self.comm.split(color, key)?))
    }

    /// Whether every peer is still reachable (never blocks).
    pub fn health(&self) -> Result<()> {
        self.comm.health()
    }
}

/// Element counts as byte lengths (saturating: a count too large for memory then fails the
/// length checks by name, never wraps into a plausible length).
fn bytes_of<T: Element>(counts: &[usize]) -> Vec<usize> {
    counts
        .iter()
        .map(|c| c.saturating_mul(std::mem::size_of::<T>()))
        .collect()
}
