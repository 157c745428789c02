//! Collectives with a root: reduce to it (a binomial tree for small vectors; a ring
//! reduce-scatter and a gather of the parts for large ones), gather to it, scatter from it.

use crate::collectives::exchange::{exchange_with, run, Plan};
use crate::collectives::pause::wait_on;
use crate::collectives::ring;
use crate::collectives::{take, Scratch};
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
    let max = link.props().max_chunk / dtype.size() * dtype.size();
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
                    wait_on(link, child)?;
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
    scratch: &mut Scratch,
) -> Result<()> {
    let (r, n) = (link.rank(), link.size());
    let es = dtype.size();
    let parts = ring::chunks(data.len() / es, n, es);
    let Scratch {
        bytes, counters, ..
    } = scratch;
    bytes.clear();
    bytes.extend_from_slice(data);
    ring::reduce_scatter_in(link, op, dtype, bytes, parts)?;
    let (off, len) = parts.get(r);
    if r != root {
        return exchange_with(link, &[(root, &bytes[off..off + len])], &mut [], counters);
    }
    data[off..off + len].copy_from_slice(&bytes[off..off + len]);
    let mut plan = Blocks {
        sent: &[],
        got: data,
        at: BlockAt::Parts(parts),
        root,
        n,
        sending: false,
    };
    run(link, &mut plan, counters)
}

/// Blocks of a buffer paired with the rank each goes to or comes from.
pub(crate) type BlockList<'a> = Vec<(usize, &'a mut [u8])>;

/// Cuts `buf` into `n` consecutive blocks of `lens[q]` bytes, paired with their rank, but
/// `skip`'s (whose block goes to `own`, if asked for).
pub(crate) fn blocks(
    buf: &mut [u8],
    lens: impl Iterator<Item = usize>,
    skip: usize,
) -> (BlockList<'_>, Option<&mut [u8]>) {
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

/// Where block q of a buffer lies.
#[derive(Clone, Copy)]
pub enum BlockAt<'a> {
    /// Blocks of this many bytes each.
    Equal(usize),
    /// Block q from `o[q]` to `o[q + 1]`.
    Listed(&'a [usize]),
    /// The parts of a ring.
    Parts(ring::Chunks<'a>),
}

impl BlockAt<'_> {
    pub(crate) fn range(&self, q: usize) -> std::ops::Range<usize> {
        match *self {
            BlockAt::Equal(b) => q * b..(q + 1) * b,
            BlockAt::Listed(o) => o[q]..o[q + 1],
            BlockAt::Parts(p) => {
                let (o, l) = p.get(q);
                o..o + l
            }
        }
    }
}

/// A root's side of a gather (block q from every other rank q into `got`) or of a scatter
/// (block q of `sent` to every other rank q), in rank order.
struct Blocks<'s, 'g, 'a> {
    sent: &'s [u8],
    got: &'g mut [u8],
    at: BlockAt<'a>,
    root: usize,
    n: usize,
    sending: bool,
}

impl Blocks<'_, '_, '_> {
    /// The i-th rank but the root.
    fn rank(&self, i: usize) -> usize {
        if i < self.root {
            i
        } else {
            i + 1
        }
    }
}

impl Plan for Blocks<'_, '_, '_> {
    fn sends(&self) -> usize {
        if self.sending {
            self.n - 1
        } else {
            0
        }
    }
    fn send_peer(&self, i: usize) -> usize {
        self.rank(i)
    }
    fn send(&self, i: usize) -> &[u8] {
        &self.sent[self.at.range(self.rank(i))]
    }
    fn recvs(&self) -> usize {
        if self.sending {
            0
        } else {
            self.n - 1
        }
    }
    fn recv_peer(&self, i: usize) -> usize {
        self.rank(i)
    }
    fn recv(&mut self, i: usize) -> &mut [u8] {
        let range = self.at.range(self.rank(i));
        &mut self.got[range]
    }
}

/// Every rank's `input` into block q of `output` on `root` (`output` is used on the root only).
pub fn gather(
    link: &mut dyn Link,
    root: usize,
    input: &[u8],
    output: &mut [u8],
    counters: &mut Vec<usize>,
) -> Result<()> {
    let (r, n) = (link.rank(), link.size());
    if r != root {
        return exchange_with(link, &[(root, input)], &mut [], counters);
    }
    let len = input.len();
    crate::copy::copy(&mut output[r * len..(r + 1) * len], input);
    let mut plan = Blocks {
        sent: &[],
        got: output,
        at: BlockAt::Equal(len),
        root,
        n,
        sending: false,
    };
    run(link, &mut plan, counters)
}

/// Block q of `input` on `root` (used there only) into rank q's `output`.
pub fn scatter(
    link: &mut dyn Link,
    root: usize,
    input: &[u8],
    output: &mut [u8],
    counters: &mut Vec<usize>,
) -> Result<()> {
    let (r, n) = (link.rank(), link.size());
    if r != root {
        return exchange_with(link, &[], &mut [(root, output)], counters);
    }
    let len = output.len();
    crate::copy::copy(output, &input[r * len..(r + 1) * len]);
    let mut plan = Blocks {
        sent: input,
        got: &mut [],
        at: BlockAt::Equal(len),
        root,
        n,
        sending: true,
    };
    run(link, &mut plan, counters)
}

/// An all_to_all's messages: in step k (or, at once, message k - 1), block (r + k) % n of
/// `input` to rank r + k, and from rank r - k into its block of `output`.
struct AllToAll<'i, 'o, 'a> {
    input: &'i [u8],
    output: &'o mut [u8],
    send_at: BlockAt<'a>,
    recv_at: BlockAt<'a>,
    r: usize,
    n: usize,
    /// One step of a pairwise exchange, or every peer at once.
    step: Option<usize>,
}

impl AllToAll<'_, '_, '_> {
    fn k(&self, i: usize) -> usize {
        self.step.unwrap_or(i + 1)
    }
    fn count(&self) -> usize {
        if self.step.is_some() {
            1
        } else {
            self.n - 1
        }
    }
}

impl Plan for AllToAll<'_, '_, '_> {
    fn sends(&self) -> usize {
        self.count()
    }
    fn send_peer(&self, i: usize) -> usize {
        (self.r + self.k(i)) % self.n
    }
    fn send(&self, i: usize) -> &[u8] {
        &self.input[self.send_at.range(self.send_peer(i))]
    }
    fn recvs(&self) -> usize {
        self.count()
    }
    fn recv_peer(&self, i: usize) -> usize {
        (self.r + self.n - self.k(i)) % self.n
    }
    fn recv(&mut self, i: usize) -> &mut [u8] {
        let range = self.recv_at.range(self.recv_peer(i));
        &mut self.output[range]
    }
}

/// Rank p's block q of `input` into rank q's block p of `output`: with every peer at once,
/// starting with the next rank (receiving from the previous one first), or `pairwise`, one step
/// per peer (the k-th next and the k-th previous rank in step k). This rank's own block must be
/// as long both ways. Repeated calls allocate nothing (`counters` is reused).
pub fn all_to_all(
    link: &mut dyn Link,
    input: &[u8],
    send_at: BlockAt<'_>,
    output: &mut [u8],
    recv_at: BlockAt<'_>,
    pairwise: bool,
    counters: &mut Vec<usize>,
) -> Result<()> {
    let (r, n) = (link.rank(), link.size());
    crate::copy::copy(&mut output[recv_at.range(r)], &input[send_at.range(r)]);
    let mut plan = AllToAll {
        input,
        output,
        send_at,
        recv_at,
        r,
        n,
        step: None,
    };
    if !pairwise {
        return run(link, &mut plan, counters);
    }
    for k in 1..n {
        plan.step = Some(k);
        run(link, &mut plan, counters)?;
    }
    Ok(())
}

/// Byte offsets of consecutive blocks of `lens` (n + 1 entries).
pub(crate) fn offsets(lens: &[usize]) -> Vec<usize> {
    let mut o = Vec::with_capacity(lens.len() + 1);
    offsets_onto(lens, &mut o);
    o
}

/// [`offsets`], appended to `o` (a buffer reused from call to call allocates nothing).
pub(crate) fn offsets_onto(lens: &[usize], o: &mut Vec<usize>) {
    let mut at = 0;
    o.push(at);
    for l in lens {
        at += l;
        o.push(at);
    }
}
