//! all_to_all(v) in log2(n) steps over log2(n) peers each way (Bruck's index algorithm), for
//! worlds whose every-peer exchange would connect more peers than a rank's memory bound holds
//! ([`crate::transport::Props::peers_max`]).
//!
//! Position j of a rank's working set holds a block headed j ranks on; in the step of bit k,
//! every rank sends the blocks whose position has bit k set to rank r + k and takes the same
//! positions from rank r - k. After the last step position j holds rank r - j's block for r.
//! Each step moves about half the blocks, so it sends log2(n) / 2 times the bytes of a
//! pairwise exchange: the price of holding log2(n) connections instead of n - 1.

use crate::collectives::exchange::{exchange_with, run, Plan};
use crate::collectives::rooted::BlockAt;
use crate::error::{Error, Result};
use crate::transport::Link;

/// What Bruck's exchange keeps from call to call (so that a repeated call allocates, and
/// faults in, nothing): two staging buffers for blocks on their way, and the packed path's
/// working sets, offsets and lengths.
#[derive(Debug, Default)]
pub struct Buffers {
    stage: [Vec<u8>; 2],
    packed: [Vec<u8>; 2],
    at: [Vec<usize>; 2],
    lens: Vec<usize>,
    /// Uneven blocks' lengths as sent and as received.
    wire_lens: [Vec<u8>; 2],
}

/// Rank p's block q of `input` (at `send_at`) into rank q's block p of `output` (at
/// `recv_at`). Equal blocks of at least half a chunk go as messages of their own, from `input`
/// or a staging buffer into a staging buffer or, on a block's last move, `output`; smaller or
/// uneven blocks are packed into one message a step (uneven ones after their lengths). A block
/// whose length differs from the receiver's is an error naming its sender.
pub fn all_to_all(
    link: &mut dyn Link,
    input: &[u8],
    send_at: BlockAt<'_>,
    output: &mut [u8],
    recv_at: BlockAt<'_>,
    bufs: &mut Buffers,
    counters: &mut Vec<usize>,
) -> Result<()> {
    let r = link.rank();
    let (mine, own) = (send_at.range(r), recv_at.range(r));
    if mine.len() != own.len() {
        return Err(Error::length_mismatch(mine.len(), own.len(), r));
    }
    crate::copy::copy(&mut output[own], &input[mine]);
    match send_at {
        // Every rank has the same block and chunk, so every rank takes the same path.
        BlockAt::Equal(b) if b >= link.props().max_chunk / 2 => {
            direct(link, input, b, output, bufs, counters)
        }
        _ => packed(link, input, send_at, output, recv_at, bufs, counters),
    }
}

/// Position j's highest set bit: the step of its last move.
fn last_move(j: usize) -> usize {
    1 << (usize::BITS - 1 - j.leading_zeros())
}

/// One step of the direct path: position j (of `moving`) goes to rank r + k, from `input` on
/// its first move, else from the staging buffer of its previous move; it comes from rank r - k
/// into `output` on its last move, else into the other staging buffer.
struct Step<'s> {
    input: &'s [u8],
    output: &'s mut [u8],
    stage: &'s mut [Vec<u8>; 2],
    b: usize,
    r: usize,
    n: usize,
    k: usize,
    moving: &'s [usize],
}

impl Step<'_> {
    /// Which move of position j this step makes (from 1).
    fn nth(&self, j: usize) -> usize {
        (j & (self.k - 1)).count_ones() as usize + 1
    }
}

impl Plan for Step<'_> {
    fn sends(&self) -> usize {
        self.moving.len()
    }
    fn send_peer(&self, _: usize) -> usize {
        (self.r + self.k) % self.n
    }
    fn send(&self, i: usize) -> &[u8] {
        let (j, b) = (self.moving[i], self.b);
        match self.nth(j) {
            1 => {
                let q = (self.r + j) % self.n;
                &self.input[q * b..(q + 1) * b]
            }
            m => &self.stage[(m - 1) % 2][j * b..(j + 1) * b],
        }
    }
    fn recvs(&self) -> usize {
        self.moving.len()
    }
    fn recv_peer(&self, _: usize) -> usize {
        (self.r + self.n - self.k) % self.n
    }
    fn recv(&mut self, i: usize) -> &mut [u8] {
        let (j, b) = (self.moving[i], self.b);
        if last_move(j) == self.k {
            let q = (self.r + self.n - j) % self.n;
            &mut self.output[q * b..(q + 1) * b]
        } else {
            let m = self.nth(j);
            &mut self.stage[m % 2][j * b..(j + 1) * b]
        }
    }
}

/// Equal blocks of `b` bytes, each its own message: no copy but a block's stops on the way.
fn direct(
    link: &mut dyn Link,
    input: &[u8],
    b: usize,
    output: &mut [u8],
    bufs: &mut Buffers,
    counters: &mut Vec<usize>,
) -> Result<()> {
    let (r, n) = (link.rank(), link.size());
    for s in bufs.stage.iter_mut() {
        s.resize(n * b, 0);
    }
    let mut moving = std::mem::take(&mut bufs.lens);
    let mut k = 1;
    while k < n {
        moving.clear();
        moving.extend((1..n).filter(|j| j & k != 0));
        let mut step = Step {
            input,
            output: &mut *output,
            stage: &mut bufs.stage,
            b,
            r,
            n,
            k,
            moving: &moving,
        };
        run(link, &mut step, counters)?;
        k <<= 1;
    }
    bufs.lens = moving;
    Ok(())
}

/// Small or uneven blocks: each step packs its moving blocks into one message (after their
/// lengths, where uneven) and unpacks what comes into the next working set.
fn packed(
    link: &mut dyn Link,
    input: &[u8],
    send_at: BlockAt<'_>,
    output: &mut [u8],
    recv_at: BlockAt<'_>,
    bufs: &mut Buffers,
    counters: &mut Vec<usize>,
) -> Result<()> {
    let (r, n) = (link.rank(), link.size());
    let equal = matches!(send_at, BlockAt::Equal(_));
    let Buffers {
        stage: [out, got],
        packed: [cur, next],
        at: [at, next_at],
        lens: lens_in,
        wire_lens: [lens_out, raw],
    } = bufs;
    // Position j (1..n) of the working set: `at[j]..at[j + 1]` of `cur`.
    cur.clear();
    at.clear();
    at.resize(n + 1, 0);
    next_at.clear();
    next_at.resize(n + 1, 0);
    for j in 1..n {
        at[j] = cur.len();
        cur.extend_from_slice(&input[send_at.range((r + j) % n)]);
    }
    at[n] = cur.len();
    let mut k = 1;
    while k < n {
        let (to, from) = ((r + k) % n, (r + n - k) % n);
        let moving = || (1..n).filter(move |j| j & k != 0);
        out.clear();
        for j in moving() {
            out.extend_from_slice(&cur[at[j]..at[j + 1]]);
        }
        // What arrives: each moving position's length, known where blocks are equal.
        lens_in.clear();
        if equal {
            lens_in.extend(moving().map(|j| at[j + 1] - at[j]));
        } else {
            lens_out.clear();
            for j in moving() {
                lens_out.extend_from_slice(&((at[j + 1] - at[j]) as u64).to_le_bytes());
            }
            raw.clear();
            raw.resize(lens_out.len(), 0);
            exchange_with(link, &[(to, lens_out)], &mut [(from, raw)], counters)?;
            lens_in.extend(
                raw.chunks_exact(8)
                    .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize),
            );
        }
        // A length no memory holds is a misbehaving peer's, never a panic or an abort.
        let total = lens_in.iter().try_fold(0usize, |a, &l| a.checked_add(l));
        got.clear();
        let total = match total.filter(|&t| t <= isize::MAX as usize) {
            Some(t) if got.try_reserve(t).is_ok() => t,
            _ => {
                return Err(Error::PeerFailed {
                    peer: link.peer(from),
                    reason: "sent all_to_allv block lengths that no buffer holds".into(),
                })
            }
        };
        got.resize(total, 0);
        exchange_with(link, &[(to, out)], &mut [(from, got)], counters)?;
        // The next working set: moved positions from `got`, the others as they were.
        next.clear();
        let mut taken = 0;
        let mut lens = lens_in.iter();
        for j in 1..n {
            next_at[j] = next.len();
            if j & k != 0 {
                let l = *lens.next().expect("one length a moving position");
                next.extend_from_slice(&got[taken..taken + l]);
                taken += l;
            } else {
                next.extend_from_slice(&cur[at[j]..at[j + 1]]);
            }
        }
        next_at[n] = next.len();
        std::mem::swap(cur, next);
        std::mem::swap(at, next_at);
        k <<= 1;
    }
    for j in 1..n {
        let src = (r + n - j) % n;
        let (block, dst) = (&cur[at[j]..at[j + 1]], recv_at.range(src));
        if block.len() != dst.len() {
            return Err(Error::length_mismatch(block.len(), dst.len(), src));
        }
        crate::copy::copy(&mut output[dst], block);
    }
    Ok(())
}

/// The peers rank `r` of `n` exchanges with: r + k and r - k for every power of two k below n.
#[cfg(test)]
pub(crate) fn partners(r: usize, n: usize) -> Vec<usize> {
    let mut p: Vec<usize> = std::iter::successors(Some(1usize), |k| Some(k << 1))
        .take_while(|&k| k < n)
        .flat_map(|k| [(r + k) % n, (r + n - k) % n])
        .collect();
    p.sort_unstable();
    p.dedup();
    p
}
