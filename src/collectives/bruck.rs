//! all_to_all(v) in log2(n) steps over log2(n) peers each way (Bruck's index algorithm), for
//! worlds whose every-peer exchange would connect more peers than a rank's memory bound holds
//! ([`crate::transport::Props::peers_max`]).
//!
//! Position j of a rank's working set holds a block headed j ranks on; in the step of bit k,
//! every rank sends the blocks whose position has bit k set to rank r + k and takes the same
//! positions from rank r - k. After the last step position j holds rank r - j's block for r.
//! Each step moves about half the blocks, so it sends log2(n) / 2 times the bytes of a
//! pairwise exchange: the price of holding log2(n) connections instead of n - 1.

use crate::collectives::exchange::exchange_with;
use crate::collectives::rooted::BlockAt;
use crate::error::{Error, Result};
use crate::transport::Link;

/// Rank p's block q of `input` (at `send_at`) into rank q's block p of `output` (at
/// `recv_at`). Where blocks are `Listed`, each step first sends the lengths of the blocks it
/// carries; a block whose length differs from the receiver's is an error naming its sender.
pub fn all_to_all(
    link: &mut dyn Link,
    input: &[u8],
    send_at: BlockAt<'_>,
    output: &mut [u8],
    recv_at: BlockAt<'_>,
    counters: &mut Vec<usize>,
) -> Result<()> {
    let (r, n) = (link.rank(), link.size());
    let own = recv_at.range(r);
    if own.len() != send_at.range(r).len() {
        return Err(Error::length_mismatch(send_at.range(r).len(), own.len(), r));
    }
    crate::copy::copy(&mut output[own], &input[send_at.range(r)]);
    let equal = matches!(send_at, BlockAt::Equal(_));
    // Position j (1..n) of the working set: `at[j]..at[j + 1]` of `cur`.
    let mut cur = Vec::with_capacity(input.len());
    let mut at = vec![0usize; n + 1];
    for j in 1..n {
        at[j] = cur.len();
        cur.extend_from_slice(&input[send_at.range((r + j) % n)]);
    }
    at[n] = cur.len();
    let (mut next, mut next_at) = (Vec::new(), vec![0usize; n + 1]);
    let (mut out, mut got) = (Vec::new(), Vec::new());
    let (mut lens_out, mut lens_in) = (Vec::new(), Vec::new());
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
            let mut raw = vec![0u8; lens_out.len()];
            exchange_with(link, &[(to, &lens_out)], &mut [(from, &mut raw)], counters)?;
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
        exchange_with(link, &[(to, &out)], &mut [(from, &mut got)], counters)?;
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
        std::mem::swap(&mut cur, &mut next);
        std::mem::swap(&mut at, &mut next_at);
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
