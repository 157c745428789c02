//! One request per operation: what it is, its buffers, its checks, its descriptor and peers, its
//! result in a world of one, and how it runs over the link. Every list of operations here is an
//! exhaustive `match`, so an operation added to [`Request`] and not handled everywhere does not
//! compile. [`Comm::run`] takes every call down one path: blocking calls, `Overlap` and the
//! frameworks' transports alike.

use super::*;

/// Distinct ranks, on the stack up to [`PeerSet::ON_STACK`] (a batch's peers: no allocation for
/// the batches one meets).
#[derive(Default)]
struct PeerSet {
    stack: [usize; PeerSet::ON_STACK],
    len: usize,
    more: Vec<usize>,
}

impl PeerSet {
    const ON_STACK: usize = 32;

    fn insert(&mut self, p: usize) {
        if self.stack[..self.len].contains(&p) || self.more.contains(&p) {
            return;
        }
        if self.len < Self::ON_STACK {
            self.stack[self.len] = p;
            self.len += 1;
        } else {
            self.more.push(p);
        }
    }

    /// The ranks inserted, each once.
    fn ranks(&mut self) -> &[usize] {
        if self.more.is_empty() {
            return &self.stack[..self.len];
        }
        if self.len > 0 {
            // Past the stack: all of them in one list, once.
            self.more
                .splice(0..0, self.stack[..self.len].iter().copied());
            self.len = 0;
        }
        &self.more
    }
}

/// A batch's operations as an exchange plan: `index` holds the sends' positions in `ops`, then
/// the receives' (kept in the communicator's scratch, so a repeated batch allocates nothing).
struct Batch<'s, 'd> {
    ops: &'s mut [P2p<'d>],
    index: &'s [usize],
    sends: usize,
}

impl exchange::Plan for Batch<'_, '_> {
    fn sends(&self) -> usize {
        self.sends
    }
    fn send_peer(&self, i: usize) -> usize {
        self.ops[self.index[i]].peer()
    }
    fn send(&self, i: usize) -> &[u8] {
        match &self.ops[self.index[i]] {
            P2p::Send { data, .. } => data,
            P2p::Recv { .. } => unreachable!("indexed as a send"),
        }
    }
    fn recvs(&self) -> usize {
        self.index.len() - self.sends
    }
    fn recv_peer(&self, i: usize) -> usize {
        self.ops[self.index[self.sends + i]].peer()
    }
    fn recv(&mut self, i: usize) -> &mut [u8] {
        match &mut self.ops[self.index[self.sends + i]] {
            P2p::Recv { data, .. } => data,
            P2p::Send { .. } => unreachable!("indexed as a receive"),
        }
    }
}

/// One operation as a rank called it, with its buffers.
pub(crate) enum Request<'a, 'b> {
    /// [`Communicator::all_reduce`].
    AllReduce {
        op: AllReduce,
        dtype: DType,
        data: &'a mut [u8],
    },
    /// [`Communicator::all_gather`].
    AllGather {
        input: &'a [u8],
        output: &'a mut [u8],
    },
    /// [`Communicator::sum_scatter`].
    SumScatter {
        dtype: DType,
        input: &'a [u8],
        output: &'a mut [u8],
    },
    /// [`Communicator::broadcast`].
    Broadcast { root: usize, data: &'a mut [u8] },
    /// [`Communicator::barrier`].
    Barrier,
    /// [`Communicator::send`].
    Send { dst: usize, data: &'a [u8] },
    /// [`Communicator::recv`].
    Recv { src: usize, data: &'a mut [u8] },
    /// [`Communicator::sendrecv`].
    SendRecv {
        dst: usize,
        send: &'a [u8],
        src: usize,
        recv: &'a mut [u8],
    },
    /// [`Communicator::all_to_all`].
    AllToAll {
        input: &'a [u8],
        output: &'a mut [u8],
    },
    /// [`Communicator::all_to_allv`].
    AllToAllV {
        input: &'a [u8],
        send_lens: &'a [usize],
        output: &'a mut [u8],
        recv_lens: &'a [usize],
    },
    /// [`Communicator::reduce`].
    Reduce {
        root: usize,
        op: AllReduce,
        dtype: DType,
        data: &'a mut [u8],
    },
    /// [`Communicator::gather`].
    Gather {
        root: usize,
        input: &'a [u8],
        output: &'a mut [u8],
    },
    /// [`Communicator::scatter`].
    Scatter {
        root: usize,
        input: &'a [u8],
        output: &'a mut [u8],
    },
    /// [`Communicator::all_gather_v`].
    AllGatherV {
        input: &'a [u8],
        output: &'a mut [u8],
        lens: &'a [usize],
    },
    /// [`Communicator::reduce_scatter_v`].
    ReduceScatterV {
        op: AllReduce,
        dtype: DType,
        input: &'a [u8],
        output: &'a mut [u8],
        lens: &'a [usize],
    },
    /// [`Communicator::batch`].
    Batch { ops: &'a mut [P2p<'b>] },
}

impl Request<'_, '_> {
    /// The call's name, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Request::AllReduce { .. } => "all_reduce",
            Request::AllGather { .. } => "all_gather",
            Request::SumScatter { .. } => "sum_scatter",
            Request::Broadcast { .. } => "broadcast",
            Request::Barrier => "barrier",
            Request::Send { .. } => "send",
            Request::Recv { .. } => "recv",
            Request::SendRecv { .. } => "sendrecv",
            Request::AllToAll { .. } => "all_to_all",
            Request::AllToAllV { .. } => "all_to_allv",
            Request::Reduce { .. } => "reduce",
            Request::Gather { .. } => "gather",
            Request::Scatter { .. } => "scatter",
            Request::AllGatherV { .. } => "all_gather_v",
            Request::ReduceScatterV { .. } => "reduce_scatter_v",
            Request::Batch { .. } => "batch",
        }
    }

    /// The checks of its arguments on rank `me` of `n`, before any byte moves.
    pub fn check(&self, me: usize, n: usize) -> Result<()> {
        match self {
            Request::AllReduce { dtype, data, .. } => check_all_reduce(*dtype, data),
            Request::AllGather { input, output } => check_all_gather(n, input, output),
            Request::SumScatter {
                dtype,
                input,
                output,
            } => check_sum_scatter(n, *dtype, input, output),
            Request::Broadcast { root, .. } => check_root(*root, n),
            Request::Barrier => Ok(()),
            Request::Send { dst, .. } => check_peer("send", me, n, *dst),
            Request::Recv { src, .. } => check_peer("recv", me, n, *src),
            Request::SendRecv { dst, src, .. } => {
                check_peer("send", me, n, *dst)?;
                check_peer("recv", me, n, *src)
            }
            Request::AllToAll { input, output } => check_all_to_all(n, input, output),
            Request::AllToAllV {
                input,
                send_lens,
                output,
                recv_lens,
            } => check_all_to_allv(me, n, input, send_lens, output, recv_lens),
            Request::Reduce {
                root, dtype, data, ..
            } => {
                check_root(*root, n)?;
                check_all_reduce(*dtype, data)
            }
            Request::Gather {
                root,
                input,
                output,
            } => check_gather(me, n, *root, input, output),
            Request::Scatter {
                root,
                input,
                output,
            } => check_scatter(me, n, *root, input, output),
            Request::AllGatherV {
                input,
                output,
                lens,
            } => check_all_gather_v(me, n, input, output, lens),
            Request::ReduceScatterV {
                dtype,
                input,
                output,
                lens,
                ..
            } => check_reduce_scatter_v(me, n, *dtype, input, output, lens),
            Request::Batch { ops } => check_batch(me, n, ops),
        }
    }

    /// Whether the call moves nothing whatever the world (an empty batch).
    pub fn is_nothing(&self) -> bool {
        matches!(self, Request::Batch { ops } if ops.is_empty())
    }

    /// Its result where nothing moves (a world of one, or nothing to move): a rank's own part
    /// copied where the operation has one.
    pub fn alone(self) {
        match self {
            Request::AllGather { input, output }
            | Request::SumScatter { input, output, .. }
            | Request::AllToAll { input, output }
            | Request::AllToAllV { input, output, .. }
            | Request::Gather { input, output, .. }
            | Request::Scatter { input, output, .. }
            | Request::AllGatherV { input, output, .. }
            | Request::ReduceScatterV { input, output, .. } => crate::copy::copy(output, input),
            Request::AllReduce { .. }
            | Request::Broadcast { .. }
            | Request::Barrier
            | Request::Send { .. }
            | Request::Recv { .. }
            | Request::SendRecv { .. }
            | Request::Reduce { .. }
            | Request::Batch { .. } => {}
        }
    }

    /// Its descriptor on `c`, whose choices (an algorithm, a root) ride in it so that every rank
    /// checks them.
    pub fn desc(&self, c: &Comm) -> OpDesc {
        let n = c.size;
        let medium = || c.medium.expect("a link beyond a world of one");
        // Whether an operation with every peer stays within the peers a rank may hold.
        let fits = tuning::every_peer_fits(n, c.peers_max);
        match self {
            Request::AllReduce { op, dtype, data } => OpDesc {
                dtype: Some(*dtype),
                reduce: Some(*op),
                algo: c.algorithm().code(),
                ..OpDesc::new(OpKind::AllReduce, data.len())
            },
            Request::AllGather { input, .. } => OpDesc::new(OpKind::AllGather, input.len()),
            Request::SumScatter { dtype, input, .. } => OpDesc {
                dtype: Some(*dtype),
                reduce: Some(AllReduce::Sum),
                ..OpDesc::new(OpKind::SumScatter, input.len())
            },
            Request::Broadcast { root, data } => OpDesc {
                root: *root,
                algo: c.cfg.bcast.code(),
                ..OpDesc::new(OpKind::Broadcast, data.len())
            },
            Request::Barrier => OpDesc::new(OpKind::Barrier, 0),
            Request::Send { data, .. } => OpDesc::new(OpKind::SendRecv, data.len()),
            Request::Recv { data, .. } => OpDesc::new(OpKind::SendRecv, data.len()),
            // A batch of these two (what the other rank may call), without a batch's lists.
            Request::SendRecv { .. } | Request::Batch { .. } => OpDesc::new(OpKind::Batch, 0),
            Request::AllToAll { input, .. } => {
                let block = input.len() / n;
                let algo = if !fits {
                    op::TREE
                } else {
                    u8::from(block >= tuning::all_to_all_pairwise_min(medium(), n))
                };
                OpDesc {
                    algo,
                    ..OpDesc::new(OpKind::AllToAll, block)
                }
            }
            // Lengths differ by rank, so the choice is all at once (each rank knows only its own).
            Request::AllToAllV { .. } => OpDesc {
                algo: if fits { 0 } else { op::TREE },
                ..OpDesc::new(OpKind::AllToAllV, 0)
            },
            Request::Reduce {
                root,
                op,
                dtype,
                data,
            } => {
                let tree = n == 2 || !fits || data.len() <= tuning::reduce_tree_max(medium());
                OpDesc {
                    dtype: Some(*dtype),
                    reduce: Some(*op),
                    root: *root,
                    algo: u8::from(!tree),
                    ..OpDesc::new(OpKind::Reduce, data.len())
                }
            }
            Request::Gather { root, input, .. } => OpDesc {
                root: *root,
                algo: if fits { 0 } else { op::TREE },
                ..OpDesc::new(OpKind::Gather, input.len())
            },
            Request::Scatter { root, output, .. } => OpDesc {
                root: *root,
                algo: if fits { 0 } else { op::TREE },
                ..OpDesc::new(OpKind::Scatter, output.len())
            },
            Request::AllGatherV { output, .. } => OpDesc::new(OpKind::AllGatherV, output.len()),
            Request::ReduceScatterV {
                op, dtype, input, ..
            } => OpDesc {
                dtype: Some(*dtype),
                reduce: Some(*op),
                ..OpDesc::new(OpKind::ReduceScatterV, input.len())
            },
        }
    }

    /// Runs it over `l` as `desc` says (the choices made there), on `c`.
    pub fn run(
        self,
        c: &Comm,
        desc: &OpDesc,
        l: &mut dyn Link,
        scratch: &mut Scratch,
    ) -> Result<()> {
        match self {
            Request::AllReduce { op, dtype, data } => {
                all_reduce(c, Algo::from_code(desc.algo), op, dtype, data, l, scratch)
            }
            Request::AllGather { input, output } => {
                let n = input.len();
                crate::copy::copy(&mut output[l.rank() * n..(l.rank() + 1) * n], input);
                if let Some(z) = l.lending() {
                    z.lend(output);
                }
                ring::all_gather(l, output)
            }
            Request::SumScatter {
                dtype,
                input,
                output,
            } => {
                scratch.clear();
                scratch.extend_from_slice(input);
                if let Some(z) = l.lending() {
                    z.lend(scratch);
                }
                if tuning::sum_scatter_halving(l.size()) {
                    halving::reduce_scatter_halving(l, AllReduce::Sum, dtype, scratch)?;
                } else {
                    ring::reduce_scatter(l, AllReduce::Sum, dtype, scratch)?;
                }
                let (r, m) = (l.rank(), output.len());
                crate::copy::copy(output, &scratch[r * m..(r + 1) * m]);
                Ok(())
            }
            Request::Broadcast { root, data } => {
                let tree = match c.cfg.bcast {
                    Bcast::Tree => true,
                    Bcast::Chain => false,
                    Bcast::Auto => tuning::broadcast_tree(l.size(), data.len()),
                };
                if let Some(z) = l.lending() {
                    z.lend(data);
                }
                if tree {
                    bcast::broadcast_tree(l, root, data)
                } else {
                    bcast::broadcast(l, root, data)
                }
            }
            Request::Barrier => bcast::barrier(l),
            Request::Send { dst, data } => {
                if let Some(z) = l.lending() {
                    z.lend(data);
                }
                p2p::send(l, dst, data)
            }
            Request::Recv { src, data } => p2p::recv(l, src, data),
            Request::SendRecv {
                dst,
                send,
                src,
                recv,
            } => exchange::exchange_with(
                l,
                &[(dst, send)],
                &mut [(src, recv)],
                &mut scratch.counters,
            ),
            Request::AllToAll { input, output } => {
                let at = rooted::BlockAt::Equal(desc.bytes as usize);
                if desc.algo == op::TREE {
                    let Scratch {
                        bruck, counters, ..
                    } = scratch;
                    return bruck::all_to_all(l, input, at, output, at, bruck, counters);
                }
                rooted::all_to_all(
                    l,
                    input,
                    at,
                    output,
                    at,
                    desc.algo == 1,
                    &mut scratch.counters,
                )
            }
            Request::AllToAllV {
                input,
                send_lens,
                output,
                recv_lens,
            } => {
                let Scratch {
                    index,
                    counters,
                    bruck,
                    ..
                } = scratch;
                index.clear();
                offsets_onto(send_lens, index);
                offsets_onto(recv_lens, index);
                let (so, ro) = index.split_at(send_lens.len() + 1);
                let (send_at, recv_at) = (rooted::BlockAt::Listed(so), rooted::BlockAt::Listed(ro));
                if desc.algo == op::TREE {
                    return bruck::all_to_all(l, input, send_at, output, recv_at, bruck, counters);
                }
                rooted::all_to_all(l, input, send_at, output, recv_at, false, counters)
            }
            Request::Reduce {
                root,
                op,
                dtype,
                data,
            } => {
                if desc.algo == 0 {
                    rooted::reduce_tree(l, root, op, dtype, data, scratch)
                } else {
                    rooted::reduce_scatter_gather(l, root, op, dtype, data, scratch)
                }
            }
            Request::Gather {
                root,
                input,
                output,
            } => {
                if desc.algo == op::TREE {
                    let Scratch {
                        bytes, counters, ..
                    } = scratch;
                    return binomial::gather(l, root, input, output, bytes, counters);
                }
                rooted::gather(l, root, input, output, &mut scratch.counters)
            }
            Request::Scatter {
                root,
                input,
                output,
            } => {
                if desc.algo == op::TREE {
                    let Scratch {
                        bytes, counters, ..
                    } = scratch;
                    return binomial::scatter(l, root, input, output, bytes, counters);
                }
                rooted::scatter(l, root, input, output, &mut scratch.counters)
            }
            Request::AllGatherV {
                input,
                output,
                lens,
            } => {
                let offs = &mut scratch.index;
                offs.clear();
                offsets_onto(lens, offs);
                let r = l.rank();
                crate::copy::copy(&mut output[offs[r]..offs[r + 1]], input);
                ring::all_gather_in(l, output, ring::Chunks::listed(offs, 1))
            }
            Request::ReduceScatterV {
                op,
                dtype,
                input,
                output,
                lens,
            } => {
                let Scratch { bytes, index, .. } = scratch;
                index.clear();
                offsets_onto(lens, index);
                bytes.clear();
                bytes.extend_from_slice(input);
                let parts = ring::Chunks::listed(index, dtype.size());
                ring::reduce_scatter_in(l, op, dtype, bytes, parts)?;
                let r = l.rank();
                crate::copy::copy(output, &bytes[index[r]..index[r + 1]]);
                Ok(())
            }
            Request::Batch { ops } => {
                let Scratch {
                    index, counters, ..
                } = scratch;
                index.clear();
                index.extend((0..ops.len()).filter(|&i| matches!(ops[i], P2p::Send { .. })));
                let sends = index.len();
                index.extend((0..ops.len()).filter(|&i| matches!(ops[i], P2p::Recv { .. })));
                exchange::run(l, &mut Batch { ops, index, sends }, counters)
            }
        }
    }
}

/// An all_reduce of `data` over `l` with `algo` (as every rank set it).
fn all_reduce(
    c: &Comm,
    algo: Algo,
    op: AllReduce,
    dtype: DType,
    data: &mut [u8],
    l: &mut dyn Link,
    scratch: &mut Scratch,
) -> Result<()> {
    if let Some(z) = l.lending() {
        z.lend(data);
    }
    // Whole elements per slice; each slice is an all_reduce of its own, its algorithm chosen by
    // its size, so every rank still gets the same bits, run to run.
    let es = dtype.size();
    let slice = (tuning::slice_bytes(l.props().medium) / es).max(1) * es;
    let mut rest = data;
    loop {
        let (part, tail) = rest.split_at_mut(rest.len().min(slice));
        // Every rank has the same host map where it is regular (no rank is alone on its host
        // there), so every rank makes the same choice.
        let layout = c.layout.as_ref();
        let mut limits = tuning::limits(l.props().medium, l.size());
        if let Some(h) = layout {
            limits = limits.on_hosts_of(h.local.len());
        }
        // A link fact, alike on every rank (a registration is one rank's and must not steer).
        if l.props().relays {
            limits = limits.relaying(l.size());
        }
        let (n, len, shared) = (l.size(), part.len(), l.props().shares_memory);
        match algo.choose(n, len, limits, shared, layout.is_some()) {
            Algo::Hierarchical => hier::all_reduce(l, layout, op, dtype, part, scratch)?,
            Algo::Direct => direct::all_reduce_direct(l, op, dtype, part, scratch)?,
            Algo::Doubling => halving::all_reduce_doubling(l, op, dtype, part, scratch)?,
            Algo::Halving => halving::all_reduce_halving(l, op, dtype, part, scratch)?,
            _ => ring::all_reduce(l, op, dtype, part)?,
        }
        if tail.is_empty() {
            return Ok(());
        }
        rest = tail;
    }
}

impl Comm {
    /// Every call's one path: its checks (a refusal is told to the peers), its result where
    /// nothing moves, and its run over the link.
    pub(crate) fn run(&self, req: Request<'_, '_>) -> Result<()> {
        req.check(self.rank, self.size)
            .map_err(|e| self.refused(e))?;
        self.run_checked(req)
    }

    /// [`Comm::run`] for a request whose arguments passed its checks (a started one is checked
    /// when it starts).
    pub(crate) fn run_checked(&self, req: Request<'_, '_>) -> Result<()> {
        if self.size == 1 || req.is_nothing() {
            self.alone(req.name())?;
            req.alone();
            return Ok(());
        }
        let desc = req.desc(self);
        let (mut to, mut from) = (PeerSet::default(), PeerSet::default());
        let pair = |q: usize| [q];
        let (one_to, one_from);
        let scope = match &req {
            Request::Send { dst, .. } => Partners::To(*dst),
            Request::Recv { src, .. } => Partners::From(*src),
            Request::SendRecv { dst, src, .. } => {
                (one_to, one_from) = (pair(*dst), pair(*src));
                Partners::Peers {
                    to: &one_to,
                    from: &one_from,
                }
            }
            Request::Batch { ops } => {
                for op in ops.iter() {
                    match op {
                        P2p::Send { peer, .. } => to.insert(*peer),
                        P2p::Recv { peer, .. } => from.insert(*peer),
                    }
                }
                Partners::Peers {
                    to: to.ranks(),
                    from: from.ranks(),
                }
            }
            Request::AllReduce { .. }
            | Request::AllGather { .. }
            | Request::SumScatter { .. }
            | Request::Broadcast { .. }
            | Request::Barrier
            | Request::AllToAll { .. }
            | Request::AllToAllV { .. }
            | Request::Reduce { .. }
            | Request::Gather { .. }
            | Request::Scatter { .. }
            | Request::AllGatherV { .. }
            | Request::ReduceScatterV { .. } => Partners::All,
        };
        self.with_link(desc, scope, |l, scratch| req.run(self, &desc, l, scratch))
    }
}

#[cfg(test)]
mod tests {
    use super::PeerSet;

    #[test]
    fn peer_sets_keep_each_rank_once_past_the_stack() {
        for n in [0, 1, 5, PeerSet::ON_STACK, PeerSet::ON_STACK + 1, 100] {
            let mut set = PeerSet::default();
            for _ in 0..3 {
                for p in (0..n).rev() {
                    set.insert(p * 7);
                }
            }
            let mut got = set.ranks().to_vec();
            got.sort_unstable();
            let want: Vec<usize> = (0..n).map(|p| p * 7).collect();
            assert_eq!(got, want, "{n} ranks");
            assert_eq!(set.ranks().len(), n, "asked twice");
        }
    }
}
