//! Broadcast (a pipelined chain from the root, or a binomial tree) and barrier (dissemination).

use crate::collectives::pause::wait_on;
use crate::error::Result;
use crate::transport::Link;

/// Broadcast of `data` from `root`: ranks form a chain in rank order starting at the root; each
/// forwards every segment as soon as it has it, so all links carry data at once (bandwidth of
/// one link for large messages; n-1 hops of latency for small ones).
pub fn broadcast(link: &mut dyn Link, root: usize, data: &mut [u8]) -> Result<()> {
    let (r, n) = (link.rank(), link.size());
    if n == 1 {
        return Ok(());
    }
    let v = (r + n - root) % n;
    let prev = (r + n - 1) % n;
    let next = (r + 1) % n;
    let seg = link.props().max_chunk;
    let len = data.len();
    let pieces = len.div_ceil(seg).max(1);
    let piece = |i: usize| (i * seg).min(len)..((i + 1) * seg).min(len);
    let (mut got, mut sent) = (if v == 0 { pieces } else { 0 }, 0);
    let forwards = v + 1 < n;
    link.begin();
    while got < pieces || (forwards && sent < pieces) {
        let mut did = false;
        if got < pieces {
            let dst = &mut data[piece(got)];
            let ok = link.try_take_into(prev, dst)?;
            if ok {
                got += 1;
                did = true;
            }
        }
        while forwards && sent < got {
            if !link.try_post(next, &data[piece(sent)])? {
                break;
            }
            sent += 1;
            did = true;
        }
        if !did {
            wait_on(link, if got < pieces { prev } else { next })?;
        }
    }
    Ok(())
}

/// Broadcast of `data` from `root` down a binomial tree: ceil(log2 n) rounds; in round k the
/// ranks that have the data (relative ranks below 2^k) send it whole to relative rank + 2^k.
/// Fewer hops than the chain for small messages; each message crosses one link per round.
pub fn broadcast_tree(link: &mut dyn Link, root: usize, data: &mut [u8]) -> Result<()> {
    let (r, n) = (link.rank(), link.size());
    let v = (r + n - root) % n;
    let real = |x: usize| (x + root) % n;
    // The round in which this rank receives: the highest set bit of v.
    let mut k = 1;
    if v > 0 {
        let parent = v & !(1 << (usize::BITS - 1 - v.leading_zeros()));
        crate::collectives::p2p::recv(link, real(parent), data)?;
        k = 1 << (usize::BITS - v.leading_zeros());
    }
    while k < n {
        if v + k < n {
            crate::collectives::p2p::send(link, real(v + k), data)?;
        }
        k <<= 1;
    }
    Ok(())
}

/// Dissemination barrier: in round k every rank signals rank + 2^k and waits for rank - 2^k;
/// after ceil(log2 n) rounds every rank has (transitively) heard from every other.
pub fn barrier(link: &mut dyn Link) -> Result<()> {
    let (r, n) = (link.rank(), link.size());
    let mut k = 1;
    while k < n {
        let to = (r + k) % n;
        let from = (r + n - k) % n;
        let (mut posted, mut heard) = (false, false);
        link.begin();
        while !(posted && heard) {
            let mut did = false;
            if !posted && link.try_post(to, &[])? {
                posted = true;
                did = true;
            }
            if !heard && link.try_take(from, &mut |_| Ok(()))? {
                heard = true;
                did = true;
            }
            if !did {
                wait_on(link, if heard { to } else { from })?;
            }
        }
        k *= 2;
    }
    Ok(())
}
