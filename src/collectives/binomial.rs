//! Gather and scatter along a binomial tree (log2(n) steps, log2(n) + 1 peers a rank), for
//! worlds whose root would otherwise connect more peers than its memory bound holds
//! ([`crate::transport::Props::peers_max`]).
//!
//! Ranks are counted from the root (v = r - root). Rank v's subtree is v .. v + low(v), where
//! low(v) is v's lowest set bit (the root's: the world); its parent is v - low(v), its children
//! v + k for the powers of two k below low(v). A subtree's blocks are consecutive in v, so a
//! rank sends its parent one piece and each child one piece.

use crate::collectives::exchange::exchange_with;
use crate::error::Result;
use crate::transport::Link;

/// v's subtree size bound: its lowest set bit, or the next power of two from n for the root.
fn low(v: usize, n: usize) -> usize {
    if v == 0 {
        n.next_power_of_two()
    } else {
        v & v.wrapping_neg()
    }
}

/// Blocks in v's subtree (v .. v + low(v), clipped at n).
fn span(v: usize, n: usize) -> usize {
    low(v, n).min(n - v)
}

/// Every rank's `input` into block q of `output` on `root` (`output` is used on the root only);
/// `held` keeps a rank's subtree in between calls.
pub fn gather(
    link: &mut dyn Link,
    root: usize,
    input: &[u8],
    output: &mut [u8],
    held: &mut Vec<u8>,
    counters: &mut Vec<usize>,
) -> Result<()> {
    let (r, n, len) = (link.rank(), link.size(), input.len());
    let v = (r + n - root) % n;
    let real = |x: usize| (x + root) % n;
    // The subtree's blocks in v order: this rank's first, then each child's subtree.
    held.clear();
    held.resize(span(v, n) * len, 0);
    crate::copy::copy(&mut held[..len], input);
    {
        let mut recvs = Vec::new();
        let mut rest = &mut held[len..];
        let mut k = 1;
        while k < low(v, n) && v + k < n {
            let (part, tail) = std::mem::take(&mut rest).split_at_mut(span(v + k, n) * len);
            recvs.push((real(v + k), part));
            rest = tail;
            k <<= 1;
        }
        if !recvs.is_empty() {
            exchange_with(link, &[], &mut recvs, counters)?;
        }
    }
    if v != 0 {
        return exchange_with(link, &[(real(v - low(v, n)), held)], &mut [], counters);
    }
    for (x, block) in held.chunks_exact(len.max(1)).enumerate().take(n) {
        let q = real(x);
        crate::copy::copy(&mut output[q * len..(q + 1) * len], &block[..len]);
    }
    Ok(())
}

/// Block q of `input` on `root` (used there only) into rank q's `output`; `held` keeps a rank's
/// subtree in between calls.
pub fn scatter(
    link: &mut dyn Link,
    root: usize,
    input: &[u8],
    output: &mut [u8],
    held: &mut Vec<u8>,
    counters: &mut Vec<usize>,
) -> Result<()> {
    let (r, n, len) = (link.rank(), link.size(), output.len());
    let v = (r + n - root) % n;
    let real = |x: usize| (x + root) % n;
    held.clear();
    if v == 0 {
        for x in 0..n {
            let q = real(x);
            held.extend_from_slice(&input[q * len..(q + 1) * len]);
        }
    } else {
        held.resize(span(v, n) * len, 0);
        exchange_with(
            link,
            &[],
            &mut [(real(v - low(v, n)), held.as_mut_slice())],
            counters,
        )?;
    }
    let mut sends = Vec::new();
    let mut k = 1;
    while k < low(v, n) && v + k < n {
        let at = k * len;
        sends.push((real(v + k), &held[at..at + span(v + k, n) * len]));
        k <<= 1;
    }
    if !sends.is_empty() {
        exchange_with(link, &sends, &mut [], counters)?;
    }
    crate::copy::copy(output, &held[..len]);
    Ok(())
}

/// The peers rank `r` of `n` exchanges with in a tree rooted at `root`.
#[cfg(test)]
pub(crate) fn partners(r: usize, n: usize, root: usize) -> Vec<usize> {
    let v = (r + n - root) % n;
    let mut p: Vec<usize> = (0..usize::BITS)
        .map(|b| 1usize << b)
        .take_while(|&k| k < low(v, n) && v + k < n)
        .map(|k| (v + k + root) % n)
        .collect();
    if v != 0 {
        p.push((v - low(v, n) + root) % n);
    }
    p
}
