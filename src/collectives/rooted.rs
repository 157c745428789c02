//! Collectives with a root: reduce to it (a binomial tree for small vectors; a ring
//! reduce-scatter and a gather of the parts for large ones), gather to it, scatter from it.

use crate::collectives::exchange::exchange;
use crate::collectives::ring;
use crate::collectives::take;
use crate::dtype::{AllReduce, DType};
use crate::error::Result;
use crate::transport::Link;

/// Reduce of every rank's `data` into `data` on `root` by a binomial tree: a rank receives
/// from its children (relative ranks v + 1, v + 2, v + 4 ... below its own lowest set bit),
/// reducing each in, then sends the sum to its parent. Other ranks' `data` stays as it was
/// (`scratch` accumulates there).
pub fn reduce_tree(
    link: &mut dyn Link,
    root: usize,
    op: AllReduce,
    dtype: DType,
    data: &mut [u8],
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let (r, n) = (link.rank(), link.size());
    let v = (r + n - root) % n;
    let real = |x: usize| (x + root) % n;
    let has_children = v % 2 == 0 && v + 1 < n;
    let acc: &mut [u8] = if v == 0 || !has_children {
        data
    } else {
        scratch.clear();
        scratch.extend_from_slice(data);
        scratch
    };
    let max = link.max_chunk() / dtype.size() * dtype.size();
    let max = max.max(dtype.size());
    let mut k = 1;
    while k < n {
        if v & k != 0 {
            // A leaf sends its own `data`, untouched; an inner rank its sum.
            return crate::collectives::p2p::send(link, real(v - k), acc);
        }
        if v + k < n {
            let child = real(v + k);
            link.begin();
            let len = acc.len();
            for i in 0..crate::collectives::exchange::pieces(len, max) {
                let part = &mut acc[(i * max).min(len)..((i + 1) * max).min(len)];
                while !take(link, child, part, Some((op, dtype)))? {
                    link.progress(child)?;
                }
            }
        }
        k <<= 1;
    }
    Ok(())
}

/// Reduce of every rank's `data` into `data` on `root`: a ring reduce-scatter of a copy (rank
/// q ends with part q complete), then every rank sends its part to the root. Other ranks'
/// `data` stays as it was.
pub fn reduce_scatter_gather(
    link: &mut dyn Link,
    root: usize,
    op: AllReduce,
    dtype: DType,
    data: &mut [u8],
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let (r, n) = (link.rank(), link.size());
    let es = dtype.size();
    let parts = ring::chunks(data.len() / es, n, es);
    scratch.clear();
    scratch.extend_from_slice(data);
    ring::reduce_scatter_in(link, op, dtype, scratch, parts)?;
    let (off, len) = parts.get(r);
    if r != root {
        return exchange(link, &[(root, &scratch[off..off + len])], &mut []);
    }
    data[off..off + len].copy_from_slice(&scratch[off..off + len]);
    let mut rest: &mut [u8] = data;
    let mut recvs = Vec::with_capacity(n - 1);
    let mut at = 0;
    for q in 0..n {
        let (o, l) = parts.get(q);
        let (_, tail) = rest.split_at_mut(o - at);
        let (mine, tail) = tail.split_at_mut(l);
        if q != root {
            recvs.push((q, mine));
        }
        rest = tail;
        at = o + l;
    }
    exchange(link, &[], &mut recvs)
}

/// Blocks of a buffer paired with the rank each goes to or comes from.
pub(crate) type Blocks<'a> = Vec<(usize, &'a mut [u8])>;

/// Cuts `buf` into `n` consecutive blocks of `lens[q]` bytes, paired with their rank, but
/// `skip`'s (whose block goes to `own`, if asked for).
pub(crate) fn blocks(
    buf: &mut [u8],
    lens: impl Iterator<Item = usize>,
    skip: usize,
) -> (Blocks<'_>, Option<&mut [u8]>) {
    let mut out = Vec::new();
    let mut own = None;
    let mut rest = buf;
    for (q, l) in lens.enumerate() {
        let (b, tail) = std::mem::take(&mut rest).split_at_mut(l);
        if q == skip {
            own = Some(b);
        } else {
            out.push((q, b));
        }
        rest = tail;
    }
    (out, own)
}

/// Every rank's `input` into block q of `output` on `root` (`output` is used on the root only).
pub fn gather(link: &mut dyn Link, root: usize, input: &[u8], output: &mut [u8]) -> Result<()> {
    let (r, n) = (link.rank(), link.size());
    if r != root {
        return exchange(link, &[(root, input)], &mut []);
    }
    let (mut recvs, own) = blocks(output, (0..n).map(|_| input.len()), r);
    crate::copy::copy(own.expect("the root's block"), input);
    exchange(link, &[], &mut recvs)
}

/// Block q of `input` on `root` (used there only) into rank q's `output`.
pub fn scatter(link: &mut dyn Link, root: usize, input: &[u8], output: &mut [u8]) -> Result<()> {
    let (r, n) = (link.rank(), link.size());
    if r != root {
        return exchange(link, &[], &mut [(root, output)]);
    }
    let len = output.len();
    let sends: Vec<(usize, &[u8])> = (0..n)
        .filter(|&q| q != r)
        .map(|q| (q, &input[q * len..(q + 1) * len]))
        .collect();
    crate::copy::copy(output, &input[r * len..(r + 1) * len]);
    exchange(link, &sends, &mut [])
}

/// Rank p's block q of `input` (at `send_offs[q]`, `send_offs[q + 1]`) into rank q's block p of
/// `output` (at `recv_offs[p]`): with every peer at once, starting with the next rank, or
/// `pairwise`, one step per peer (the k-th next and the k-th previous rank in step k). This
/// rank's own block must be as long both ways.
pub fn all_to_all(
    link: &mut dyn Link,
    input: &[u8],
    send_offs: &[usize],
    output: &mut [u8],
    recv_offs: &[usize],
    pairwise: bool,
) -> Result<()> {
    let (r, n) = (link.rank(), link.size());
    let peers = (1..n).map(|k| (r + k) % n);
    let sends: Vec<(usize, &[u8])> = peers
        .clone()
        .map(|q| (q, &input[send_offs[q]..send_offs[q + 1]]))
        .collect();
    let (recvs, own) = blocks(output, recv_offs.windows(2).map(|w| w[1] - w[0]), r);
    let own = own.expect("this rank's block");
    crate::copy::copy(own, &input[send_offs[r]..send_offs[r + 1]]);
    // Receives in the order the peers send to this rank (from the previous rank first).
    let mut by_peer: Vec<Option<&mut [u8]>> = (0..n).map(|_| None).collect();
    for (q, b) in recvs {
        by_peer[q] = Some(b);
    }
    let mut recvs: Vec<(usize, &mut [u8])> = (1..n)
        .map(|k| (r + n - k) % n)
        .map(|q| (q, by_peer[q].take().expect("one block per peer")))
        .collect();
    if !pairwise {
        return exchange(link, &sends, &mut recvs);
    }
    // Step k: to the k-th next rank, from the k-th previous one (one peer each way at a time).
    for (send, recv) in sends.iter().zip(recvs.iter_mut()) {
        exchange(link, std::slice::from_ref(send), std::slice::from_mut(recv))?;
    }
    Ok(())
}
