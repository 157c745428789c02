//! Pipelined ring algorithms: reduce-scatter, all-gather, and all-reduce as the two in sequence.
//!
//! The buffer is cut into one chunk per rank, each chunk into segments of at most one slot. The
//! ring is run as a stream of (step, segment) units: the send of unit (s, j) needs the receive of
//! unit (s-1, j), so the reduction of one segment overlaps the transfer of the next, with as many
//! segments in flight as the link has slots. Each element's final value is computed on exactly
//! one rank and copied to the others, so every rank ends with the same bits.

use crate::collectives::pause::wait_on;
use crate::collectives::take;
use crate::dtype::{AllReduce, DType};
use crate::error::Result;
use crate::transport::{Link, Pass};

/// How a buffer is cut into `n` chunks, computed per chunk (no allocation on the hot path): the
/// first `extra` chunks get one element more; or, for the uneven collectives, at listed offsets.
#[derive(Clone, Copy, Debug)]
pub struct Chunks<'a> {
    base: usize,
    extra: usize,
    esize: usize,
    /// Byte offsets of the chunks and the end (n + 1 entries), where they are listed.
    listed: Option<&'a [usize]>,
}

impl<'a> Chunks<'a> {
    /// Byte range (offset, length) of chunk `c`.
    pub fn get(&self, c: usize) -> (usize, usize) {
        if let Some(o) = self.listed {
            return (o[c], o[c + 1] - o[c]);
        }
        let off = (c * self.base + c.min(self.extra)) * self.esize;
        (off, (self.base + usize::from(c < self.extra)) * self.esize)
    }

    /// Length of the longest chunk.
    fn max_len(&self) -> usize {
        if let Some(o) = self.listed {
            return o.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
        }
        (self.base + usize::from(self.extra > 0)) * self.esize
    }

    /// Chunks at `offsets` (ascending byte offsets of each chunk and of the end, every length a
    /// multiple of `esize`).
    pub fn listed(offsets: &'a [usize], esize: usize) -> Chunks<'a> {
        debug_assert!(offsets.windows(2).all(|w| w[0] <= w[1]));
        Chunks {
            base: 0,
            extra: 0,
            esize,
            listed: Some(offsets),
        }
    }
}

/// `n` chunks of a buffer of `elems` elements of `esize` bytes: the first `elems % n` chunks get
/// one element more.
pub fn chunks(elems: usize, n: usize, esize: usize) -> Chunks<'static> {
    Chunks {
        base: elems / n,
        extra: elems % n,
        esize,
        listed: None,
    }
}

/// `n` equal chunks of a buffer of `len` bytes.
pub fn equal_chunks(len: usize, n: usize) -> Chunks<'static> {
    Chunks {
        base: len / n,
        extra: 0,
        esize: 1,
        listed: None,
    }
}

/// What a ring run does with received segments.
struct Plan<'a> {
    /// Chunk ranges of the buffer.
    chunks: Chunks<'a>,
    /// Steps that reduce (the first ones), then steps that copy.
    reduce_steps: usize,
    steps: usize,
    /// Chunk sent at step 0 is `(rank + shift) mod n`; step s sends `(rank + shift - s) mod n`
    /// and receives the chunk that step s+1 sends.
    shift: usize,
    op: Option<(AllReduce, DType)>,
    esize: usize,
}

/// The order units go in: groups of `width` segments, each group through every step before
/// the next. With `width` = all segments there is one group (the ring as a plain stream).
#[derive(Clone, Copy)]
struct Units {
    nseg: usize,
    width: usize,
    steps: usize,
}

impl Units {
    /// The segments of unit `u`'s group.
    fn width_of(&self, u: usize) -> usize {
        let g = u / (self.width * self.steps);
        self.width.min(self.nseg - g * self.width)
    }

    /// Unit `u`'s (step, segment).
    fn at(&self, u: usize) -> (usize, usize) {
        let per_group = self.width * self.steps;
        let g = u / per_group;
        let w = self.width_of(u);
        let t = u - g * per_group;
        (t / w, g * self.width + t % w)
    }
}

fn run(link: &mut dyn Link, buf: &mut [u8], plan: &Plan<'_>) -> Result<()> {
    let n = link.size();
    let rank = link.rank();
    if n == 1 || plan.steps == 0 {
        return Ok(());
    }
    let right = (rank + 1) % n;
    let left = (rank + n - 1) % n;
    let max_chunk_len = plan.chunks.max_len();
    let seg = (link.props().max_chunk / plan.esize * plan.esize).max(plan.esize);
    let nseg = max_chunk_len.div_ceil(seg).max(1);
    // Where posts are staged, a received segment is reduced (or copied) straight into the
    // next send's slot: one pass where a take and a post would make two. Sends stay at most
    // the link's window ahead of receives, so that no rank waits in a circle for room.
    // The order of segments is the link's, alike on every rank; whether this rank relays is
    // its own (a buffer it registered sends in place).
    let props = link.props();
    let grouped = props.relays && props.window > 0;
    // Groups of half the window: the next group's first sends go while this one's last
    // arrive, so the pipeline never drains at a group's end.
    let width = if grouped {
        props.window.div_ceil(2).clamp(1, nseg)
    } else {
        nseg
    };
    let ahead = if grouped { props.window } else { nseg };
    let relay =
        grouped && plan.steps > 1 && !link.sends_in_place(buf) && link.relays_between(left, right);
    let units = Units {
        nseg,
        width,
        steps: plan.steps,
    };
    let chunk_at = |s: usize| (rank + plan.shift + n * plan.steps - s) % n;
    let seg_range = |c: usize, j: usize| {
        let (off, len) = plan.chunks.get(c);
        let a = (j * seg).min(len);
        let b = ((j + 1) * seg).min(len);
        (off + a, b - a)
    };
    let total = plan.steps * nseg;
    // An all_reduce's all-gather half lands straight in the receiver's buffer where the link
    // can: each rank offers its left a window onto its buffer (first, before any other chunk
    // that way) and takes its right's offer before its first all-gather send. Units of the
    // steps from `reduce_steps` on are the all-gather's.
    let lands = plan.reduce_steps > 0 && plan.steps > plan.reduce_steps;
    let offer = lands && link.lands(left);
    let accept = lands && link.lands(right);
    let (mut offered, mut accepted) = (!offer, !accept);
    let gathers = |s: usize| s >= plan.reduce_steps;
    let (mut sent, mut recvd) = (0usize, 0usize);
    let one_post = link.props().takes_return_credits;
    link.begin();
    while recvd < total || sent < total || !offered {
        let mut did = false;
        if !offered && link.try_offer(left, buf)? {
            offered = true;
            did = true;
        }
        // (With two ranks the right is the left: its offer comes first that way too.)
        if !accepted && link.try_accept(right)? {
            accepted = true;
            did = true;
        }
        // Posts from the buffer: a relay's dependent sends go with their receive instead.
        while offered && sent < total && sent < recvd + ahead {
            let (s, j) = units.at(sent);
            // A later step's send waits for its segment's arrival, one group width back.
            if s > 0 && (relay || sent >= recvd + units.width_of(sent)) {
                break;
            }
            let (off, len) = seg_range(chunk_at(s), j);
            let posted = if accept && gathers(s) {
                accepted && link.try_post_at(right, &buf[off..off + len], off)?
            } else {
                link.try_post(right, &buf[off..off + len])?
            };
            if !posted {
                break;
            }
            sent += 1;
            did = true;
            if one_post {
                break;
            }
        }
        if recvd < total && (accepted || left != right) {
            let (s, j) = units.at(recvd);
            let (off, len) = seg_range(chunk_at(s + 1), j);
            let dst = &mut buf[off..off + len];
            let reduce = if s < plan.reduce_steps { plan.op } else { None };
            if relay && s + 1 < plan.steps {
                // Its send is the next one once the posts before it went; an all-gather send
                // lands in the right's window.
                let at = (accept && gathers(s + 1)).then_some(off);
                if sent == recvd + units.width_of(recvd)
                    && (at.is_none() || accepted)
                    && relay_one(link, plan, dst, s, reduce, at)?
                {
                    sent += 1;
                    recvd += 1;
                    did = true;
                }
            } else if offer && gathers(s) {
                if link.try_take_landed(left, dst)? {
                    recvd += 1;
                    did = true;
                }
            } else if take(link, left, dst, reduce)? {
                recvd += 1;
                did = true;
            }
        }
        if !did {
            let waiting = if recvd < total || !offered {
                left
            } else {
                right
            };
            wait_on(link, waiting)?;
        }
    }
    Ok(())
}

/// Takes the segment of step `s` from the left and posts its next step to the right in one
/// pass: reduced with `dst` (kept in `dst` too where the result is final), or copied (into
/// `dst` too). Whether it moved.
fn relay_one(
    link: &mut dyn Link,
    plan: &Plan<'_>,
    dst: &mut [u8],
    s: usize,
    reduce: Option<(AllReduce, DType)>,
    at: Option<usize>,
) -> Result<bool> {
    let n = link.size();
    let (left, right) = ((link.rank() + n - 1) % n, (link.rank() + 1) % n);
    // Partial sums of an all_reduce are not needed again; the last one is this rank's result.
    let keep = reduce.is_none() || s + 1 == plan.reduce_steps;
    if keep {
        crate::transport::settle(link, dst)?;
    }
    let len = dst.len();
    let f = &mut |src: &[u8], out: &mut [u8]| {
        if src.len() != len {
            return Err(crate::Error::length_mismatch(src.len(), len, left));
        }
        match reduce {
            Some((op, dtype)) => crate::reduce::reduce_to(op, dtype, out, dst, src, keep),
            None => crate::reduce::copy_twice(out, dst, src),
        }
        Ok(())
    };
    let moved = link.try_relay(left, right, len, at, f)?;
    if moved {
        link.count(
            if reduce.is_some() {
                Pass::Reduce
            } else {
                Pass::CopyOut
            },
            len,
        );
        if keep {
            link.count(Pass::SecondWrite, len);
        }
    }
    Ok(moved)
}

/// In-place all-reduce: ring reduce-scatter, then ring all-gather.
pub fn all_reduce(link: &mut dyn Link, op: AllReduce, dtype: DType, data: &mut [u8]) -> Result<()> {
    let n = link.size();
    let chunks = chunks(data.len() / dtype.size(), n, dtype.size());
    let plan = Plan {
        chunks,
        reduce_steps: n - 1,
        steps: 2 * (n - 1),
        shift: 0,
        op: Some((op, dtype)),
        esize: dtype.size(),
    };
    run(link, data, &plan)
}

/// Reduce-scatter in place over `data` (`size` equal chunks): afterwards chunk `rank` of `data`
/// holds the reduction of every rank's chunk `rank`; other chunks hold partial results.
pub fn reduce_scatter(
    link: &mut dyn Link,
    op: AllReduce,
    dtype: DType,
    data: &mut [u8],
) -> Result<()> {
    let parts = equal_chunks(data.len(), link.size());
    reduce_scatter_in(link, op, dtype, data, parts)
}

/// Reduce-scatter in place over `data` cut as `parts` (one part per rank): afterwards part
/// `rank` holds the reduction of every rank's part `rank`.
pub fn reduce_scatter_in(
    link: &mut dyn Link,
    op: AllReduce,
    dtype: DType,
    data: &mut [u8],
    parts: Chunks<'_>,
) -> Result<()> {
    let n = link.size();
    // Step s sends part rank-1-s; after n-1 steps this rank holds its own part, complete.
    let plan = Plan {
        chunks: parts,
        reduce_steps: n - 1,
        steps: n - 1,
        shift: n - 1,
        op: Some((op, dtype)),
        esize: dtype.size(),
    };
    run(link, data, &plan)
}

/// All-gather in place over `data` cut as `parts`, part `rank` filled by the caller.
pub fn all_gather_in(link: &mut dyn Link, data: &mut [u8], parts: Chunks<'_>) -> Result<()> {
    let plan = Plan {
        chunks: parts,
        reduce_steps: 0,
        steps: link.size() - 1,
        shift: 0,
        op: None,
        esize: parts.esize,
    };
    run(link, data, &plan)
}

/// All-gather in place: `data` has `size` equal chunks, chunk `rank` filled by the caller.
pub fn all_gather(link: &mut dyn Link, data: &mut [u8]) -> Result<()> {
    let parts = equal_chunks(data.len(), link.size());
    all_gather_in(link, data, parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_tile_the_buffer_in_order() {
        for (elems, n, esize) in [
            (0, 3, 4),
            (2, 4, 4),
            (7, 3, 2),
            (1 << 18, 4, 4),
            (1001, 8, 8),
        ] {
            let c = chunks(elems, n, esize);
            let mut off = 0;
            let mut longest = 0;
            for i in 0..n {
                let (o, len) = c.get(i);
                assert_eq!(o, off, "chunk {i} of {elems} elements in {n}");
                let want = elems / n + usize::from(i < elems % n);
                assert_eq!(len, want * esize, "chunk {i} of {elems} elements in {n}");
                off += len;
                longest = longest.max(len);
            }
            assert_eq!(off, elems * esize);
            assert_eq!(c.max_len(), longest);
        }
        let e = equal_chunks(4096, 4);
        assert_eq!(
            (e.get(0), e.get(3), e.max_len()),
            ((0, 1024), (3072, 1024), 1024)
        );
    }
}
