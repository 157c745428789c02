//! The byte-level communicator API (the byte-level spec's `Communicator`).

use crate::dtype::{AllReduce, DType};
use crate::error::{Error, Result};
use std::sync::Arc;

/// The transport of a Group: every rank of the group calls the same operations in the same
/// order. Buffers are row-contiguous elements; a failure names the peer.
///
/// # Errors
/// Every operation returns, never hangs:
/// - [`Error::InvalidArgument`]: this rank's buffers do not fit the call (lengths, a rank out of
///   range: found before anything is sent, and the communicator stays usable), or a peer's
///   data has another length than this rank's buffer.
/// - [`Error::Mismatch`]: ranks called different operations, or the same one with different
///   arguments, at the same point; every rank involved names both calls.
/// - [`Error::PeerFailed`], [`Error::Timeout`]: a peer died, broke the protocol or made no
///   progress for `RDMACOMM_TIMEOUT`; the error names it on every rank.
/// - [`Error::WrongThread`]: called from a thread that does not own the communicator (`Comm`).
/// - [`Error::Poisoned`]: an earlier failure; a failed communicator refuses further work.
pub trait Communicator: Send + Sync {
    /// This process's rank, `0..size`.
    fn rank(&self) -> usize;

    /// The number of processes.
    fn size(&self) -> usize;

    /// Reduces `data` (elements of `dtype`) with every rank's data, in place; every rank gets
    /// the same bits.
    fn all_reduce(&self, op: AllReduce, dtype: DType, data: &mut [u8]) -> Result<()>;

    /// Every rank's `input` (equal lengths), concatenated in rank order into `output`.
    fn all_gather(&self, input: &[u8], output: &mut [u8]) -> Result<()>;

    /// Sends `data` to rank `dst`.
    fn send(&self, dst: usize, data: &[u8]) -> Result<()>;

    /// Receives exactly `data.len()` bytes from rank `src`.
    fn recv(&self, src: usize, data: &mut [u8]) -> Result<()>;

    /// Rank r's `output` is the element-wise sum (elements of `dtype`) of every rank's r-th chunk
    /// of `input` (`input.len() == size * output.len()`), as MLX's `sum_scatter`.
    ///
    /// The default all-reduces a copy of `input` and keeps this rank's chunk.
    fn sum_scatter(&self, dtype: DType, input: &[u8], output: &mut [u8]) -> Result<()> {
        check_sum_scatter(self.size(), dtype, input, output)?;
        let mut tmp = input.to_vec();
        self.all_reduce(AllReduce::Sum, dtype, &mut tmp)?;
        let r = self.rank();
        output.copy_from_slice(&tmp[r * output.len()..(r + 1) * output.len()]);
        Ok(())
    }

    /// Broadcasts `data` from rank `root` to every rank (equal lengths everywhere).
    ///
    /// Beyond the spec; the default has the root send to every rank in turn.
    fn broadcast(&self, root: usize, data: &mut [u8]) -> Result<()> {
        check_root(root, self.size())?;
        if self.rank() == root {
            for r in (0..self.size()).filter(|&r| r != root) {
                self.send(r, data)?;
            }
            Ok(())
        } else {
            self.recv(root, data)
        }
    }

    /// Waits until every rank has called it. Beyond the spec; the default all-reduces a byte.
    fn barrier(&self) -> Result<()> {
        let mut b = [0u8];
        self.all_reduce(AllReduce::Max, DType::u8, &mut b)
    }

    /// Whether every peer is still reachable, checked without a collective and without
    /// blocking; an error names a lost peer. Backends that cannot tell report `Ok`.
    fn health(&self) -> Result<()> {
        Ok(())
    }

    /// Registers `buf` once and runs `f` on it: operations `f` runs on parts of `buf` send
    /// straight from it, with no staging copy and no registration per call (NCCL's
    /// `ncclCommRegister`, UCX's `ucp_mem_map`), and the registration ends when `f` returns, so
    /// it cannot outlive the buffer. Beyond the spec; the default (and TCP) just runs `f`.
    fn with_registered(
        &self,
        buf: &mut [u8],
        f: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<()> {
        f(buf)
    }

    /// A subgroup of the ranks with the same `color`, ordered by `key` (MLX's split).
    ///
    /// The default supports only the trivial case of a world of one.
    fn split(&self, color: i32, key: i32) -> Result<Arc<dyn Communicator>> {
        let _ = (color, key);
        Err(Error::InvalidArgument(
            "split is not supported by this communicator".into(),
        ))
    }
}

/// Checks `all_reduce` arguments.
pub(crate) fn check_all_reduce(dtype: DType, data: &[u8]) -> Result<()> {
    dtype.check_len(data.len(), "all_reduce buffer").map(|_| ())
}

/// Checks `all_gather` arguments.
pub(crate) fn check_all_gather(size: usize, input: &[u8], output: &[u8]) -> Result<()> {
    if output.len() != size * input.len() {
        return Err(Error::InvalidArgument(format!(
            "all_gather: output has {} bytes but must be size ({size}) x input ({}) = {} bytes",
            output.len(),
            input.len(),
            size * input.len()
        )));
    }
    Ok(())
}

/// Checks `sum_scatter` arguments.
pub(crate) fn check_sum_scatter(
    size: usize,
    dtype: DType,
    input: &[u8],
    output: &[u8],
) -> Result<()> {
    dtype.check_len(output.len(), "sum_scatter output")?;
    if input.len() != size * output.len() {
        return Err(Error::InvalidArgument(format!(
            "sum_scatter: input has {} bytes but must be size ({size}) x output ({}) = {} bytes",
            input.len(),
            output.len(),
            size * output.len()
        )));
    }
    Ok(())
}

/// Checks a broadcast root.
pub(crate) fn check_root(root: usize, size: usize) -> Result<()> {
    if root >= size {
        return Err(Error::InvalidArgument(format!(
            "broadcast: root {root} is out of range (world size {size})"
        )));
    }
    Ok(())
}

/// Checks a peer rank for send/recv.
pub(crate) fn check_peer(what: &str, me: usize, size: usize, peer: usize) -> Result<()> {
    if peer >= size {
        return Err(Error::InvalidArgument(format!(
            "{what}: rank {peer} is out of range (world size {size}, ranks 0..{size})"
        )));
    }
    if peer == me {
        return Err(Error::InvalidArgument(format!(
            "{what}: rank {peer} is this rank; cannot {what} to itself"
        )));
    }
    Ok(())
}
