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
///   range: found before anything is sent), or a peer's data has another length than this
///   rank's buffer. As its peers may be in the call already, they are told the cause and the
///   communicator fails on every rank (a world of one stays usable).
/// - [`Error::Mismatch`]: ranks called different operations, or the same one with different
///   arguments, at the same point; every rank involved names both calls.
/// - [`Error::PeerFailed`], [`Error::Timeout`]: a peer died, broke the protocol or made no
///   progress for `RDMACOMM_TIMEOUT`; the error names it on every rank.
/// - [`Error::WrongThread`]: called from a thread that does not own the communicator (`Comm`).
/// - A failed communicator refuses further work: every later call returns its first error's
///   kind and peer (saying it is an earlier failure), or [`Error::Poisoned`] where that error
///   named no peer (a panic, a refused call, a closed communicator).
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

    /// Rank p's block q of `input` into rank q's block p of `output` (`size` equal blocks each;
    /// MPI_Alltoall). Beyond the spec, as every method below; the default runs
    /// [`Communicator::all_to_allv`].
    fn all_to_all(&self, input: &[u8], output: &mut [u8]) -> Result<()> {
        let n = self.size();
        check_all_to_all(n, input, output)?;
        let lens = vec![input.len() / n; n];
        self.all_to_allv(input, &lens, output, &lens)
    }

    /// Rank p's block q of `input` (`send_lens[q]` bytes, blocks consecutive in rank order)
    /// into rank q's block p of `output` (`recv_lens[p]` bytes); a peer's `send_lens[q]` must be
    /// rank q's `recv_lens[p]`. The default runs one [`Communicator::batch`].
    fn all_to_allv(
        &self,
        input: &[u8],
        send_lens: &[usize],
        output: &mut [u8],
        recv_lens: &[usize],
    ) -> Result<()> {
        let (me, n) = (self.rank(), self.size());
        check_all_to_allv(me, n, input, send_lens, output, recv_lens)?;
        let (so, ro) = (offsets(send_lens), offsets(recv_lens));
        let (mut recvs, own) = split_blocks(output, &ro, me);
        own.copy_from_slice(&input[so[me]..so[me + 1]]);
        let mut ops: Vec<P2p<'_>> = (0..n)
            .filter(|&q| q != me)
            .map(|q| P2p::Send {
                peer: q,
                data: &input[so[q]..so[q + 1]],
            })
            .collect();
        ops.extend(recvs.drain(..).map(|(peer, data)| P2p::Recv { peer, data }));
        self.batch(&mut ops)
    }

    /// Reduces every rank's `data` into `data` on `root`; other ranks' `data` is left as it
    /// was (MPI_Reduce, in place). The default all-reduces a copy.
    fn reduce(&self, root: usize, op: AllReduce, dtype: DType, data: &mut [u8]) -> Result<()> {
        check_root(root, self.size())?;
        let mut tmp = data.to_vec();
        self.all_reduce(op, dtype, &mut tmp)?;
        if self.rank() == root {
            data.copy_from_slice(&tmp);
        }
        Ok(())
    }

    /// Every rank's `input` (equal lengths) into `output` on `root`, in rank order
    /// (`size * input.len()` bytes there; other ranks may pass an empty `output`).
    fn gather(&self, root: usize, input: &[u8], output: &mut [u8]) -> Result<()> {
        check_gather(self.rank(), self.size(), root, input, output)?;
        let n = self.size();
        if self.rank() != root {
            return self.batch(&mut [P2p::Send {
                peer: root,
                data: input,
            }]);
        }
        let offs: Vec<usize> = (0..=n).map(|q| q * input.len()).collect();
        let (recvs, own) = split_blocks(output, &offs, root);
        own.copy_from_slice(input);
        let mut ops: Vec<P2p<'_>> = recvs
            .into_iter()
            .map(|(peer, data)| P2p::Recv { peer, data })
            .collect();
        self.batch(&mut ops)
    }

    /// Block q of `input` on `root` (`size * output.len()` bytes there; other ranks may pass
    /// an empty `input`) into rank q's `output`.
    fn scatter(&self, root: usize, input: &[u8], output: &mut [u8]) -> Result<()> {
        check_scatter(self.rank(), self.size(), root, input, output)?;
        let (me, n, m) = (self.rank(), self.size(), output.len());
        if me != root {
            return self.batch(&mut [P2p::Recv {
                peer: root,
                data: output,
            }]);
        }
        output.copy_from_slice(&input[me * m..(me + 1) * m]);
        let mut ops: Vec<P2p<'_>> = (0..n)
            .filter(|&q| q != me)
            .map(|q| P2p::Send {
                peer: q,
                data: &input[q * m..(q + 1) * m],
            })
            .collect();
        self.batch(&mut ops)
    }

    /// Every rank's `input` (rank q's is `lens[q]` bytes) concatenated in rank order into
    /// `output` (their sum); every rank passes the same `lens` (MPI_Allgatherv).
    fn all_gather_v(&self, input: &[u8], output: &mut [u8], lens: &[usize]) -> Result<()> {
        let (me, n) = (self.rank(), self.size());
        check_all_gather_v(me, n, input, output, lens)?;
        let offs = offsets(lens);
        let (recvs, own) = split_blocks(output, &offs, me);
        own.copy_from_slice(input);
        let mut ops: Vec<P2p<'_>> = (0..n)
            .filter(|&q| q != me)
            .map(|q| P2p::Send {
                peer: q,
                data: input,
            })
            .collect();
        ops.extend(
            recvs
                .into_iter()
                .map(|(peer, data)| P2p::Recv { peer, data }),
        );
        self.batch(&mut ops)
    }

    /// Rank r's `output` (`lens[r]` bytes) is the reduction of every rank's block r of `input`
    /// (blocks of `lens[q]` bytes in rank order, `input.len()` their sum); every rank passes the
    /// same `lens` (MPI_Reduce_scatter). The default all-reduces a copy.
    fn reduce_scatter_v(
        &self,
        op: AllReduce,
        dtype: DType,
        input: &[u8],
        output: &mut [u8],
        lens: &[usize],
    ) -> Result<()> {
        check_reduce_scatter_v(self.rank(), self.size(), dtype, input, output, lens)?;
        let offs = offsets(lens);
        let mut tmp = input.to_vec();
        self.all_reduce(op, dtype, &mut tmp)?;
        let r = self.rank();
        output.copy_from_slice(&tmp[offs[r]..offs[r + 1]]);
        Ok(())
    }

    /// Sends `send` to `dst` while receiving `recv` from `src`, neither waiting for the other
    /// (MPI_Sendrecv): a ring shift cannot deadlock. It matches a `sendrecv` or
    /// [`Communicator::batch`] on each peer.
    fn sendrecv(&self, dst: usize, send: &[u8], src: usize, recv: &mut [u8]) -> Result<()> {
        self.batch(&mut [
            P2p::Send {
                peer: dst,
                data: send,
            },
            P2p::Recv {
                peer: src,
                data: recv,
            },
        ])
    }

    /// Runs every send and receive of `ops` at once (ncclGroupStart/End, torch's
    /// `batch_isend_irecv`); messages to one peer go in the order listed, as do those from one.
    /// A batch's messages to a peer are received by one batch (or `sendrecv`) there.
    /// The default supports only an empty batch.
    fn batch(&self, ops: &mut [P2p<'_>]) -> Result<()> {
        check_batch(self.rank(), self.size(), ops)?;
        if ops.is_empty() {
            return Ok(());
        }
        Err(Error::InvalidArgument(
            "batch is not supported by this communicator".into(),
        ))
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

/// One send or receive of a [`Communicator::batch`].
#[derive(Debug)]
pub enum P2p<'a> {
    /// Sends `data` to rank `peer`.
    Send {
        /// The receiving rank.
        peer: usize,
        /// What is sent.
        data: &'a [u8],
    },
    /// Receives exactly `data.len()` bytes from rank `peer`.
    Recv {
        /// The sending rank.
        peer: usize,
        /// Where it lands.
        data: &'a mut [u8],
    },
}

impl P2p<'_> {
    /// The peer.
    pub fn peer(&self) -> usize {
        match self {
            P2p::Send { peer, .. } | P2p::Recv { peer, .. } => *peer,
        }
    }
}

pub(crate) use crate::collectives::rooted::{offsets, offsets_onto};

/// Cuts `buf` at `offs` into (rank, block) pairs but `skip`'s block, returned apart.
pub(crate) fn split_blocks<'a>(
    buf: &'a mut [u8],
    offs: &[usize],
    skip: usize,
) -> (crate::collectives::rooted::BlockList<'a>, &'a mut [u8]) {
    let (v, own) =
        crate::collectives::rooted::blocks(buf, offs.windows(2).map(|w| w[1] - w[0]), skip);
    (v, own.unwrap_or_default())
}

/// Checks that `lens` has an entry per rank; their sum.
fn lens_check(what: &str, n: usize, lens: &[usize], name: &str) -> Result<usize> {
    if lens.len() != n {
        return Err(Error::InvalidArgument(format!(
            "{what}: {name} has {} entries but the world has {n} ranks",
            lens.len()
        )));
    }
    lens.iter()
        .try_fold(0usize, |a, &l| a.checked_add(l))
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{what}: {name} {lens:?} sum to more bytes than memory has"
            ))
        })
}

/// Checks `all_to_all` arguments.
pub(crate) fn check_all_to_all(n: usize, input: &[u8], output: &[u8]) -> Result<()> {
    if input.len() % n != 0 || output.len() != input.len() {
        return Err(Error::InvalidArgument(format!(
            "all_to_all: input ({} B) and output ({} B) must be equal and hold size ({n}) \
             equal blocks",
            input.len(),
            output.len()
        )));
    }
    Ok(())
}

/// Checks `all_to_allv` arguments.
pub(crate) fn check_all_to_allv(
    me: usize,
    n: usize,
    input: &[u8],
    send_lens: &[usize],
    output: &[u8],
    recv_lens: &[usize],
) -> Result<()> {
    let sent = lens_check("all_to_allv", n, send_lens, "send_lens")?;
    let got = lens_check("all_to_allv", n, recv_lens, "recv_lens")?;
    if sent != input.len() || got != output.len() {
        return Err(Error::InvalidArgument(format!(
            "all_to_allv: send_lens sum to {} B for an input of {} B, recv_lens to {} B for an \
             output of {} B",
            sent,
            input.len(),
            got,
            output.len()
        )));
    }
    if send_lens[me] != recv_lens[me] {
        return Err(Error::InvalidArgument(format!(
            "all_to_allv: rank {me} sends itself {} B but receives {} B from itself",
            send_lens[me], recv_lens[me]
        )));
    }
    Ok(())
}

/// Checks `gather` arguments.
pub(crate) fn check_gather(
    me: usize,
    n: usize,
    root: usize,
    input: &[u8],
    output: &[u8],
) -> Result<()> {
    check_rooted("gather", me, n, root, ("output", output), ("input", input))
}

/// Checks `scatter` arguments.
pub(crate) fn check_scatter(
    me: usize,
    n: usize,
    root: usize,
    input: &[u8],
    output: &[u8],
) -> Result<()> {
    check_rooted("scatter", me, n, root, ("input", input), ("output", output))
}

/// A rooted operation's root and, on the root, its `whole` buffer of `n` times each rank's
/// `part` (named for the message).
fn check_rooted(
    what: &str,
    me: usize,
    n: usize,
    root: usize,
    whole: (&str, &[u8]),
    part: (&str, &[u8]),
) -> Result<()> {
    check_root(root, n)?;
    if me == root && Some(whole.1.len()) != n.checked_mul(part.1.len()) {
        return Err(Error::InvalidArgument(format!(
            "{what}: the root's {} has {} bytes but must be size ({n}) x {} ({}) = {}",
            whole.0,
            whole.1.len(),
            part.0,
            part.1.len(),
            n.saturating_mul(part.1.len())
        )));
    }
    Ok(())
}

/// Checks `all_gather_v` arguments.
pub(crate) fn check_all_gather_v(
    me: usize,
    n: usize,
    input: &[u8],
    output: &[u8],
    lens: &[usize],
) -> Result<()> {
    let total = lens_check("all_gather_v", n, lens, "lens")?;
    if lens[me] != input.len() || total != output.len() {
        return Err(Error::InvalidArgument(format!(
            "all_gather_v: rank {me}'s input has {} B where lens says {} B, and the output {} B \
             where lens sums to {} B",
            input.len(),
            lens[me],
            output.len(),
            total
        )));
    }
    Ok(())
}

/// Checks `reduce_scatter_v` arguments.
pub(crate) fn check_reduce_scatter_v(
    me: usize,
    n: usize,
    dtype: DType,
    input: &[u8],
    output: &[u8],
    lens: &[usize],
) -> Result<()> {
    let total = lens_check("reduce_scatter_v", n, lens, "lens")?;
    for &l in lens {
        dtype.check_len(l, "reduce_scatter_v block")?;
    }
    if lens[me] != output.len() || total != input.len() {
        return Err(Error::InvalidArgument(format!(
            "reduce_scatter_v: rank {me}'s output has {} B where lens says {} B, and the input \
             {} B where lens sums to {} B",
            output.len(),
            lens[me],
            input.len(),
            total
        )));
    }
    Ok(())
}

/// Checks a batch's peers.
pub(crate) fn check_batch(me: usize, n: usize, ops: &[P2p<'_>]) -> Result<()> {
    for op in ops {
        let what = if matches!(op, P2p::Send { .. }) {
            "send"
        } else {
            "recv"
        };
        check_peer(what, me, n, op.peer())?;
    }
    Ok(())
}

/// Checks `all_reduce` arguments.
pub(crate) fn check_all_reduce(dtype: DType, data: &[u8]) -> Result<()> {
    dtype.check_len(data.len(), "all_reduce buffer").map(|_| ())
}

/// Checks `all_gather` arguments.
pub(crate) fn check_all_gather(size: usize, input: &[u8], output: &[u8]) -> Result<()> {
    if Some(output.len()) != size.checked_mul(input.len()) {
        return Err(Error::InvalidArgument(format!(
            "all_gather: output has {} bytes but must be size ({size}) x input ({}) = {} bytes",
            output.len(),
            input.len(),
            size.saturating_mul(input.len())
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
    if Some(input.len()) != size.checked_mul(output.len()) {
        return Err(Error::InvalidArgument(format!(
            "sum_scatter: input has {} bytes but must be size ({size}) x output ({}) = {} bytes",
            input.len(),
            output.len(),
            size.saturating_mul(output.len())
        )));
    }
    Ok(())
}

/// Checks a broadcast root.
pub(crate) fn check_root(root: usize, size: usize) -> Result<()> {
    if root >= size {
        return Err(Error::InvalidArgument(format!(
            "root {root} is out of range (world size {size})"
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Lengths whose sum or product overflows are argument errors, never a panic or a wrapped
    /// length that happens to fit.
    #[test]
    fn lengths_that_overflow_are_named() {
        let (input, output) = ([0u8; 8], [0u8; 8]);
        for (send, recv) in [
            (vec![usize::MAX, 9], vec![4, 4]),
            (vec![4, 4], vec![usize::MAX, 9]),
        ] {
            let e = check_all_to_allv(0, 2, &input, &send, &output, &recv)
                .unwrap_err()
                .to_string();
            assert!(e.contains("more bytes than memory"), "{e}");
        }
        let e = check_all_gather_v(0, 2, &input, &output, &[8, usize::MAX])
            .unwrap_err()
            .to_string();
        assert!(e.contains("more bytes than memory"), "{e}");
        let e = check_reduce_scatter_v(0, 2, DType::u8, &input, &output, &[usize::MAX, 2])
            .unwrap_err()
            .to_string();
        assert!(e.contains("more bytes than memory"), "{e}");
        // A product of the world size and a length past memory is no match for any buffer.
        assert!(check_rooted(
            "gather",
            0,
            3,
            0,
            ("output", &[0u8; 6]),
            ("input", &[0u8; 2])
        )
        .is_ok());
    }
}
