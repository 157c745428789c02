//! The operations: [`Communicator`] for [`Comm`], each one checked, then run over the link by the
//! algorithm its size and medium call for.

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

impl Comm {
    /// [`Communicator::all_reduce`] once its arguments have passed `check_all_reduce` (a
    /// started one is checked when it starts).
    pub(crate) fn all_reduce_checked(
        &self,
        op: AllReduce,
        dtype: DType,
        data: &mut [u8],
    ) -> Result<()> {
        if self.size == 1 {
            return self.alone("all_reduce");
        }
        let algo = self.algorithm();
        let desc = OpDesc {
            dtype: Some(dtype),
            reduce: Some(op),
            algo: algo.code(),
            ..OpDesc::new(OpKind::AllReduce, data.len())
        };
        self.with_link(desc, Scope::All, |l, scratch| {
            l.lend(data);
            // Whole elements per slice; each slice is an all_reduce of its own, its algorithm
            // chosen by its size, so every rank still gets the same bits, run to run.
            let es = dtype.size();
            let slice = (tuning::slice_bytes(l.medium()) / es).max(1) * es;
            let mut rest = data;
            loop {
                let (part, tail) = rest.split_at_mut(rest.len().min(slice));
                // Every rank has the same host map where it is regular (no rank is alone on
                // its host there), so every rank makes the same choice.
                let layout = self.layout.as_ref();
                let (n, len, dmax, shared) = (
                    l.size(),
                    part.len(),
                    tuning::doubling_max(l.medium(), l.size()),
                    l.shares_memory(),
                );
                match algo.choose(n, len, dmax, shared, layout.is_some()) {
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
        })
    }
}

impl Communicator for Comm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce(&self, op: AllReduce, dtype: DType, data: &mut [u8]) -> Result<()> {
        check_all_reduce(dtype, data).map_err(|e| self.refused(e))?;
        self.all_reduce_checked(op, dtype, data)
    }

    fn all_gather(&self, input: &[u8], output: &mut [u8]) -> Result<()> {
        check_all_gather(self.size, input, output).map_err(|e| self.refused(e))?;
        let n = input.len();
        if self.size == 1 {
            self.alone("all_gather")?;
            crate::copy::copy(output, input);
            return Ok(());
        }
        self.with_link(OpDesc::new(OpKind::AllGather, n), Scope::All, |l, _| {
            crate::copy::copy(&mut output[l.rank() * n..(l.rank() + 1) * n], input);
            l.lend(output);
            ring::all_gather(l, output)
        })
    }

    fn send(&self, dst: usize, data: &[u8]) -> Result<()> {
        check_peer("send", self.rank, self.size, dst).map_err(|e| self.refused(e))?;
        self.with_link(
            OpDesc::new(OpKind::SendRecv, data.len()),
            Scope::To(dst),
            |l, _| {
                l.lend(data);
                p2p::send(l, dst, data)
            },
        )
    }

    fn recv(&self, src: usize, data: &mut [u8]) -> Result<()> {
        check_peer("recv", self.rank, self.size, src).map_err(|e| self.refused(e))?;
        self.with_link(
            OpDesc::new(OpKind::SendRecv, data.len()),
            Scope::From(src),
            |l, _| p2p::recv(l, src, data),
        )
    }

    fn sum_scatter(&self, dtype: DType, input: &[u8], output: &mut [u8]) -> Result<()> {
        check_sum_scatter(self.size, dtype, input, output).map_err(|e| self.refused(e))?;
        if self.size == 1 {
            self.alone("sum_scatter")?;
            crate::copy::copy(output, input);
            return Ok(());
        }
        let desc = OpDesc {
            dtype: Some(dtype),
            reduce: Some(AllReduce::Sum),
            ..OpDesc::new(OpKind::SumScatter, input.len())
        };
        self.with_link(desc, Scope::All, |l, scratch| {
            scratch.clear();
            scratch.extend_from_slice(input);
            l.lend(scratch);
            if tuning::sum_scatter_halving(l.size()) {
                halving::reduce_scatter_halving(l, AllReduce::Sum, dtype, scratch)?;
            } else {
                ring::reduce_scatter(l, AllReduce::Sum, dtype, scratch)?;
            }
            let (r, m) = (l.rank(), output.len());
            crate::copy::copy(output, &scratch[r * m..(r + 1) * m]);
            Ok(())
        })
    }

    /// Registers `buf` with the transport (fails, without running `f`, when registering fails,
    /// e.g. at the locked-memory limit, whose error says how to raise it, or when
    /// [`crate::transport::rdma::MAX_REGISTERED`] buffers are registered already); the
    /// registration ends however `f` exits. A panic in `f` poisons the communicator and tells
    /// the peers before it goes on unwinding.
    fn with_registered(
        &self,
        buf: &mut [u8],
        f: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<()> {
        self.alone("with_registered")?;
        let id = match self.lock().link.as_deref_mut() {
            // SAFETY: `buf` is borrowed mutably for this whole call, and `_end` below ends the
            // registration before the call returns or unwinds: it stays allocated and in place
            // while registered.
            Some(l) => unsafe { l.register(buf)? },
            None => None,
        };
        /// Ends the registration however `f` exits.
        struct Unregister<'a>(&'a Comm, Option<u64>);
        impl Drop for Unregister<'_> {
            fn drop(&mut self) {
                // Operations `f` left started run first (under caller progress they hold the
                // link until a call moves them).
                self.0.wait_started_ones();
                if let (Some(id), Some(l)) = (self.1, self.0.lock().link.as_deref_mut()) {
                    l.unregister(id);
                }
            }
        }
        let _end = Unregister(self, id);
        match catch_unwind(AssertUnwindSafe(|| f(buf))) {
            Ok(r) => r,
            Err(panic) => {
                let why = format!(
                    "rank {} panicked inside with_registered: {}",
                    self.rank,
                    panic_text(&*panic)
                );
                if let Some(l) = self.lock().link.as_deref_mut() {
                    l.abort(why.clone());
                }
                self.poison_with(why);
                resume_unwind(panic)
            }
        }
    }

    fn split(&self, color: i32, key: i32) -> Result<std::sync::Arc<dyn Communicator>> {
        Ok(std::sync::Arc::new(self.split_comm(color, key)?))
    }

    fn broadcast(&self, root: usize, data: &mut [u8]) -> Result<()> {
        check_root(root, self.size).map_err(|e| self.refused(e))?;
        if self.size == 1 {
            return self.alone("broadcast");
        }
        let tree = match self.cfg.bcast {
            Bcast::Tree => true,
            Bcast::Chain => false,
            Bcast::Auto => tuning::broadcast_tree(self.size, data.len()),
        };
        let desc = OpDesc {
            root,
            algo: self.cfg.bcast.code(),
            ..OpDesc::new(OpKind::Broadcast, data.len())
        };
        self.with_link(desc, Scope::All, |l, _| {
            l.lend(data);
            if tree {
                bcast::broadcast_tree(l, root, data)
            } else {
                bcast::broadcast(l, root, data)
            }
        })
    }

    fn barrier(&self) -> Result<()> {
        if self.size == 1 {
            return self.alone("barrier");
        }
        self.with_link(OpDesc::new(OpKind::Barrier, 0), Scope::All, |l, _| {
            bcast::barrier(l)
        })
    }

    fn all_to_all(&self, input: &[u8], output: &mut [u8]) -> Result<()> {
        check_all_to_all(self.size, input, output).map_err(|e| self.refused(e))?;
        if self.size == 1 {
            self.alone("all_to_all")?;
            crate::copy::copy(output, input);
            return Ok(());
        }
        let block = input.len() / self.size;
        let medium = self.medium.expect("a link beyond a world of one");
        let pairwise = block >= tuning::all_to_all_pairwise_min(medium, self.size);
        let desc = OpDesc {
            algo: u8::from(pairwise),
            ..OpDesc::new(OpKind::AllToAll, block)
        };
        self.with_link(desc, Scope::All, |l, scratch| {
            let at = rooted::BlockAt::Equal(block);
            rooted::all_to_all(l, input, at, output, at, pairwise, &mut scratch.counters)
        })
    }

    fn all_to_allv(
        &self,
        input: &[u8],
        send_lens: &[usize],
        output: &mut [u8],
        recv_lens: &[usize],
    ) -> Result<()> {
        check_all_to_allv(self.rank, self.size, input, send_lens, output, recv_lens)
            .map_err(|e| self.refused(e))?;
        if self.size == 1 {
            self.alone("all_to_allv")?;
            crate::copy::copy(output, input);
            return Ok(());
        }
        // Lengths differ by rank, so the choice is all at once (each rank knows only its own).
        self.with_link(
            OpDesc::new(OpKind::AllToAllV, 0),
            Scope::All,
            |l, scratch| {
                let Scratch {
                    index, counters, ..
                } = scratch;
                index.clear();
                offsets_onto(send_lens, index);
                offsets_onto(recv_lens, index);
                let (so, ro) = index.split_at(send_lens.len() + 1);
                let (send_at, recv_at) = (rooted::BlockAt::Listed(so), rooted::BlockAt::Listed(ro));
                rooted::all_to_all(l, input, send_at, output, recv_at, false, counters)
            },
        )
    }

    fn reduce(&self, root: usize, op: AllReduce, dtype: DType, data: &mut [u8]) -> Result<()> {
        check_root(root, self.size).map_err(|e| self.refused(e))?;
        check_all_reduce(dtype, data).map_err(|e| self.refused(e))?;
        if self.size == 1 {
            return self.alone("reduce");
        }
        let medium = self.medium.expect("a link beyond a world of one");
        let tree = self.size == 2 || data.len() <= tuning::reduce_tree_max(medium);
        let desc = OpDesc {
            dtype: Some(dtype),
            reduce: Some(op),
            root,
            algo: u8::from(!tree),
            ..OpDesc::new(OpKind::Reduce, data.len())
        };
        self.with_link(desc, Scope::All, |l, scratch| {
            if tree {
                rooted::reduce_tree(l, root, op, dtype, data, scratch)
            } else {
                rooted::reduce_scatter_gather(l, root, op, dtype, data, scratch)
            }
        })
    }

    fn gather(&self, root: usize, input: &[u8], output: &mut [u8]) -> Result<()> {
        check_gather(self.rank, self.size, root, input, output).map_err(|e| self.refused(e))?;
        if self.size == 1 {
            self.alone("gather")?;
            crate::copy::copy(output, input);
            return Ok(());
        }
        let desc = OpDesc {
            root,
            ..OpDesc::new(OpKind::Gather, input.len())
        };
        self.with_link(desc, Scope::All, |l, scratch| {
            rooted::gather(l, root, input, output, &mut scratch.counters)
        })
    }

    fn scatter(&self, root: usize, input: &[u8], output: &mut [u8]) -> Result<()> {
        check_scatter(self.rank, self.size, root, input, output).map_err(|e| self.refused(e))?;
        if self.size == 1 {
            self.alone("scatter")?;
            crate::copy::copy(output, input);
            return Ok(());
        }
        let desc = OpDesc {
            root,
            ..OpDesc::new(OpKind::Scatter, output.len())
        };
        self.with_link(desc, Scope::All, |l, scratch| {
            rooted::scatter(l, root, input, output, &mut scratch.counters)
        })
    }

    fn all_gather_v(&self, input: &[u8], output: &mut [u8], lens: &[usize]) -> Result<()> {
        check_all_gather_v(self.rank, self.size, input, output, lens)
            .map_err(|e| self.refused(e))?;
        if self.size == 1 {
            self.alone("all_gather_v")?;
            crate::copy::copy(output, input);
            return Ok(());
        }
        let desc = OpDesc::new(OpKind::AllGatherV, output.len());
        self.with_link(desc, Scope::All, |l, scratch| {
            let offs = &mut scratch.index;
            offs.clear();
            offsets_onto(lens, offs);
            let r = l.rank();
            crate::copy::copy(&mut output[offs[r]..offs[r + 1]], input);
            ring::all_gather_in(l, output, ring::Chunks::listed(offs, 1))
        })
    }

    fn reduce_scatter_v(
        &self,
        op: AllReduce,
        dtype: DType,
        input: &[u8],
        output: &mut [u8],
        lens: &[usize],
    ) -> Result<()> {
        check_reduce_scatter_v(self.rank, self.size, dtype, input, output, lens)
            .map_err(|e| self.refused(e))?;
        if self.size == 1 {
            self.alone("reduce_scatter_v")?;
            crate::copy::copy(output, input);
            return Ok(());
        }
        let desc = OpDesc {
            dtype: Some(dtype),
            reduce: Some(op),
            ..OpDesc::new(OpKind::ReduceScatterV, input.len())
        };
        self.with_link(desc, Scope::All, |l, scratch| {
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
        })
    }

    fn sendrecv(&self, dst: usize, send: &[u8], src: usize, recv: &mut [u8]) -> Result<()> {
        check_peer("send", self.rank, self.size, dst).map_err(|e| self.refused(e))?;
        check_peer("recv", self.rank, self.size, src).map_err(|e| self.refused(e))?;
        // A batch of these two (what the other rank may call), without a batch's lists.
        let (to, from) = ([dst], [src]);
        let scope = Scope::Peers {
            to: &to,
            from: &from,
        };
        self.with_link(OpDesc::new(OpKind::Batch, 0), scope, |l, scratch| {
            exchange::exchange_with(l, &[(dst, send)], &mut [(src, recv)], &mut scratch.counters)
        })
    }

    fn batch(&self, ops: &mut [P2p<'_>]) -> Result<()> {
        check_batch(self.rank, self.size, ops).map_err(|e| self.refused(e))?;
        if ops.is_empty() {
            return self.alone("batch");
        }
        let (mut to, mut from) = (PeerSet::default(), PeerSet::default());
        for op in ops.iter() {
            match op {
                P2p::Send { peer, .. } => to.insert(*peer),
                P2p::Recv { peer, .. } => from.insert(*peer),
            }
        }
        let scope = Scope::Peers {
            to: to.ranks(),
            from: from.ranks(),
        };
        self.with_link(OpDesc::new(OpKind::Batch, 0), scope, |l, scratch| {
            let Scratch {
                index, counters, ..
            } = scratch;
            index.clear();
            index.extend((0..ops.len()).filter(|&i| matches!(ops[i], P2p::Send { .. })));
            let sends = index.len();
            index.extend((0..ops.len()).filter(|&i| matches!(ops[i], P2p::Recv { .. })));
            exchange::run(l, &mut Batch { ops, index, sends }, counters)
        })
    }

    /// Never blocks, from any thread: while another thread runs an operation, reports what is
    /// known (that operation itself fails within the timeout if a peer is lost).
    fn health(&self) -> Result<()> {
        self.check_usable()?;
        let mut g = match self.inner.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return Ok(()),
        };
        let Some(link) = g.link.as_mut() else {
            return Ok(());
        };
        let r = link.health();
        if let Err(e) = &r {
            self.poison(e);
        }
        r
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
