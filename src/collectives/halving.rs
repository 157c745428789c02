//! Recursive halving-doubling (Rabenseifner) and recursive doubling, for any world size.
//!
//! With p the largest power of two <= n and rem = n - p, the first 2*rem ranks fold first: each
//! even one sends its whole vector to the odd one above it and sits out; the p remaining ranks
//! (new rank = r/2 below 2*rem, r - rem above) run the power-of-two algorithm; at the end each
//! odd folding rank sends the result back to its even partner (Open MPI's scheme).
//!
//! - `all_reduce_halving`: reduce-scatter by recursive halving (each step exchanges half of the
//!   current range with partner newrank ^ mask and reduces the kept half), then all-gather by
//!   recursive doubling. Each final element is computed on exactly one rank and then copied, so
//!   every rank gets the same bits. Where the link lands ([`Link::lands`]) the doubling's
//!   chunks are written straight into the partners' buffers (offered as windows first).
//! - `all_reduce_doubling`: the latency path: log2(p) exchanges of the whole vector; partners
//!   combine as op(lower group, higher group), so both compute the same bits.

use crate::collectives::pause::wait_on;
use crate::collectives::ring::{chunks, equal_chunks, Chunks};
use crate::collectives::{land, take};
use crate::dtype::{AllReduce, DType};
use crate::error::Result;
use crate::reduce::reduce_unchecked;
use crate::transport::{Link, Pass};

/// Sends `send` to `peer` while receiving `recv.len()` bytes from it into `recv`, pipelined over
/// the link's slots. `None` skips a direction; an empty slice still sends/takes one empty chunk.
fn exchange(
    link: &mut dyn Link,
    peer: usize,
    send: Option<&[u8]>,
    recv: Option<&mut [u8]>,
    reduce: Option<(AllReduce, DType)>,
    esize: usize,
) -> Result<()> {
    exchange_at(link, peer, send, recv, reduce, esize, None)
}

/// [`exchange`]; with `at` = (offset of `send`, of `recv`) in the buffer both ranks offered
/// each other as windows, the sends land in the peer's buffer and the receives are landed.
fn exchange_at(
    link: &mut dyn Link,
    peer: usize,
    send: Option<&[u8]>,
    mut recv: Option<&mut [u8]>,
    reduce: Option<(AllReduce, DType)>,
    esize: usize,
    at: Option<(usize, usize)>,
) -> Result<()> {
    let seg = (link.props().max_chunk / esize * esize).max(esize);
    let pieces = |len: usize| len.div_ceil(seg).max(1);
    let piece = |i: usize, len: usize| (i * seg).min(len)..((i + 1) * seg).min(len);
    let ns = send.map_or(0, |s| pieces(s.len()));
    let nr = recv.as_ref().map_or(0, |r| pieces(r.len()));
    let (mut si, mut ri) = (0, 0);
    let one_post = link.props().takes_return_credits;
    link.begin();
    while si < ns || ri < nr {
        let mut did = false;
        while let Some(out) = send.filter(|_| si < ns) {
            let range = piece(si, out.len());
            let posted = match at {
                Some((o, _)) => link.try_post_at(peer, &out[range.clone()], o + range.start)?,
                None => link.try_post(peer, &out[range])?,
            };
            if !posted {
                break;
            }
            si += 1;
            did = true;
            if one_post {
                break;
            }
        }
        if let Some(inp) = recv.as_deref_mut().filter(|_| ri < nr) {
            let len = inp.len();
            let dst = &mut inp[piece(ri, len)];
            let got = match at {
                Some(_) => link.try_take_landed(peer, dst)?,
                None => take(link, peer, dst, reduce)?,
            };
            if got {
                ri += 1;
                did = true;
            }
        }
        if !did {
            wait_on(link, peer)?;
        }
    }
    Ok(())
}

/// Calls `f` until it moves, waiting on `peer` meanwhile.
fn until(
    link: &mut dyn Link,
    peer: usize,
    mut f: impl FnMut(&mut dyn Link) -> Result<bool>,
) -> Result<()> {
    link.begin();
    while !f(link)? {
        wait_on(link, peer)?;
    }
    Ok(())
}

/// Two disjoint ranges of `buf`: the first to read, the second to write.
fn split(buf: &mut [u8], read: (usize, usize), write: (usize, usize)) -> (&[u8], &mut [u8]) {
    if read.0 < write.0 {
        let (a, b) = buf.split_at_mut(write.0);
        (&a[read.0..read.0 + read.1], &mut b[..write.1])
    } else {
        let (a, b) = buf.split_at_mut(read.0);
        (&b[..read.1], &mut a[write.0..write.0 + write.1])
    }
}

/// The fold of a non-power-of-two world: `Some(new rank)` for ranks that take part in the
/// power-of-two algorithm, `None` for the even ranks below 2*rem that sit out.
struct Fold {
    p: usize,
    rem: usize,
    me: Option<usize>,
}

impl Fold {
    fn new(rank: usize, n: usize) -> Fold {
        let p = 1 << (usize::BITS - 1 - n.leading_zeros());
        let rem = n - p;
        let me = if rank < 2 * rem {
            (rank % 2 == 1).then_some(rank / 2)
        } else {
            Some(rank - rem)
        };
        Fold { p, rem, me }
    }
    /// The real rank of new rank `nr`.
    fn real(&self, nr: usize) -> usize {
        if nr < self.rem {
            2 * nr + 1
        } else {
            nr + self.rem
        }
    }
}

/// Fold in: even ranks below 2*rem send everything to rank+1, which reduces it in.
fn fold_in(
    link: &mut dyn Link,
    f: &Fold,
    data: &mut [u8],
    op: AllReduce,
    dtype: DType,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let r = link.rank();
    if r >= 2 * f.rem {
        return Ok(());
    }
    if r % 2 == 0 {
        exchange(link, r + 1, Some(data), None, None, dtype.size())
    } else {
        // op(lower rank's data, ours) in rank order: receive into scratch, then combine.
        scratch.clear();
        scratch.resize(data.len(), 0);
        exchange(link, r - 1, None, Some(scratch), None, dtype.size())?;
        reduce_unchecked(op, dtype, scratch, data);
        crate::copy::copy(data, scratch);
        link.count(Pass::Reduce, data.len());
        link.count(Pass::CopyOut, data.len());
        Ok(())
    }
}

/// Fold out: odd ranks below 2*rem send the result back to rank-1.
fn fold_out(link: &mut dyn Link, f: &Fold, data: &mut [u8], esize: usize) -> Result<()> {
    let r = link.rank();
    if r >= 2 * f.rem {
        return Ok(());
    }
    if r % 2 == 1 {
        exchange(link, r - 1, Some(data), None, None, esize)
    } else {
        exchange(link, r + 1, None, Some(data), None, esize)
    }
}

/// Byte range covering blocks `lo..hi` of `blocks`.
fn span(blocks: &Chunks, lo: usize, hi: usize) -> (usize, usize) {
    let start = blocks.get(lo).0;
    let last = blocks.get(hi - 1);
    let end = last.0 + last.1;
    (start, end - start)
}

/// Recursive halving: afterwards this rank (new rank `me`) holds block `me` fully reduced.
/// Returns the owned block range. `offered`: every partner offered a window first (an
/// all_reduce's doubling lands), whose offer is taken before its data.
#[allow(clippy::too_many_arguments)]
fn halve(
    link: &mut dyn Link,
    f: &Fold,
    me: usize,
    data: &mut [u8],
    blocks: &Chunks,
    op: AllReduce,
    dtype: DType,
    offered: bool,
) -> Result<(usize, usize)> {
    let (mut lo, mut hi) = (0, f.p);
    let mut mask = f.p / 2;
    while mask > 0 {
        let partner = f.real(me ^ mask);
        let mid = lo + (hi - lo) / 2;
        let (keep, give) = if me & mask == 0 {
            ((lo, mid), (mid, hi))
        } else {
            ((mid, hi), (lo, mid))
        };
        // The partner's offer came first that way, before its data.
        if offered && link.lands(partner) {
            until(link, partner, |l| l.try_accept(partner))?;
        }
        let (out, inp) = split(
            data,
            span(blocks, give.0, give.1),
            span(blocks, keep.0, keep.1),
        );
        exchange(
            link,
            partner,
            Some(out),
            Some(inp),
            Some((op, dtype)),
            dtype.size(),
        )?;
        (lo, hi) = keep;
        mask /= 2;
    }
    Ok((lo, hi))
}

/// Recursive doubling all-gather: grows the owned block range back to all blocks.
fn double(
    link: &mut dyn Link,
    f: &Fold,
    me: usize,
    data: &mut [u8],
    blocks: &Chunks,
    owned: (usize, usize),
    esize: usize,
) -> Result<()> {
    let (mut lo, mut hi) = owned;
    let mut mask = 1;
    while mask < f.p {
        let partner = f.real(me ^ mask);
        let width = hi - lo;
        let (plo, phi) = if me & mask == 0 {
            (hi, hi + width)
        } else {
            (lo - width, lo)
        };
        let (send, recv) = (span(blocks, lo, hi), span(blocks, plo, phi));
        let at = link.lands(partner).then_some((send.0, recv.0));
        let (out, inp) = split(data, send, recv);
        exchange_at(link, partner, Some(out), Some(inp), None, esize, at)?;
        (lo, hi) = (lo.min(plo), hi.max(phi));
        mask *= 2;
    }
    Ok(())
}

/// Reduce-scatter by recursive halving, for a power-of-two world: afterwards chunk `rank` of
/// `data` (`size` equal chunks) holds the reduction of every rank's chunk `rank`.
pub fn reduce_scatter_halving(
    link: &mut dyn Link,
    op: AllReduce,
    dtype: DType,
    data: &mut [u8],
) -> Result<()> {
    let n = link.size();
    debug_assert!(n.is_power_of_two());
    let f = Fold::new(link.rank(), n);
    let blocks = equal_chunks(data.len(), n);
    let me = link.rank();
    halve(link, &f, me, data, &blocks, op, dtype, false).map(|_| ())
}

/// Recursive halving reduce-scatter over `p` blocks, then recursive doubling all-gather.
pub fn all_reduce_halving(
    link: &mut dyn Link,
    op: AllReduce,
    dtype: DType,
    data: &mut [u8],
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let n = link.size();
    let f = Fold::new(link.rank(), n);
    fold_in(link, &f, data, op, dtype, scratch)?;
    if let Some(me) = f.me {
        let blocks = chunks(data.len() / dtype.size(), f.p, dtype.size());
        // The doubling's chunks land in the partners' buffers where the link can: each
        // partner is offered a window first (it takes the offer before its halving step).
        let mut mask = 1;
        while mask < f.p {
            let partner = f.real(me ^ mask);
            if link.lands(partner) {
                until(link, partner, |l| l.try_offer(partner, data))?;
            }
            mask *= 2;
        }
        let owned = halve(link, &f, me, data, &blocks, op, dtype, true)?;
        double(link, &f, me, data, &blocks, owned, dtype.size())?;
    }
    fold_out(link, &f, data, dtype.size())
}

/// Recursive doubling of the whole vector: log2(p) exchanges (the latency path).
pub fn all_reduce_doubling(
    link: &mut dyn Link,
    op: AllReduce,
    dtype: DType,
    data: &mut [u8],
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let n = link.size();
    let f = Fold::new(link.rank(), n);
    fold_in(link, &f, data, op, dtype, scratch)?;
    if let Some(me) = f.me {
        let mut mask = 1;
        while mask < f.p {
            let partner = f.real(me ^ mask);
            exchange_reduce(link, partner, data, op, dtype, me & mask != 0, scratch)?;
            mask *= 2;
        }
    }
    fold_out(link, &f, data, dtype.size())
}

/// Sends `data` to `peer` while reducing what `peer` sends into it, segment by segment as it
/// arrives (no staging of the whole vector). Both partners compute op(lower, upper): the lower
/// one reduces in place, the upper one (`upper`) swaps operands through `tmp` (one segment).
/// A segment is overwritten only after it was posted.
fn exchange_reduce(
    link: &mut dyn Link,
    peer: usize,
    data: &mut [u8],
    op: AllReduce,
    dtype: DType,
    upper: bool,
    tmp: &mut Vec<u8>,
) -> Result<()> {
    let esize = dtype.size();
    let seg = (link.props().max_chunk / esize * esize).max(esize);
    let len = data.len();
    let pieces = len.div_ceil(seg).max(1);
    let piece = |i: usize| (i * seg).min(len)..((i + 1) * seg).min(len);
    if upper && tmp.len() < seg.min(len) {
        tmp.resize(seg.min(len), 0);
    }
    let (mut si, mut ri) = (0, 0);
    let one_post = link.props().takes_return_credits;
    link.begin();
    while si < pieces || ri < pieces {
        let mut did = false;
        while si < pieces && link.try_post(peer, &data[piece(si)])? {
            si += 1;
            did = true;
            if one_post {
                break;
            }
        }
        if ri < si {
            let dst = &mut data[piece(ri)];
            crate::transport::settle(link, dst)?;
            let got = link.try_take(peer, &mut |src: &[u8]| {
                if !upper {
                    return land(dst, src, Some((op, dtype)), peer);
                }
                land(&mut tmp[..dst.len()], dst, None, peer)?;
                land(dst, src, None, peer)?;
                reduce_unchecked(op, dtype, dst, &tmp[..dst.len()]);
                Ok(())
            })?;
            if got {
                // The upper partner also copies the arrival into place before reducing.
                link.count(Pass::Reduce, piece(ri).len());
                if upper {
                    link.count(Pass::CopyOut, piece(ri).len());
                }
                ri += 1;
                did = true;
            }
        }
        if !did {
            wait_on(link, peer)?;
        }
    }
    Ok(())
}
