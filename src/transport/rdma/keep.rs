//! Queue pairs carried into a communicator's next generation (`Comm::shrink`): both ends of a
//! queue pair between survivors write a fence (their count of chunks sent, then the new
//! generation) behind everything the failed generation posted. Once our fence is acknowledged,
//! and the peer's fence and every chunk it counts have landed, each end drops the chunks not
//! taken and counts them taken, as the peer counts its own: the pair goes on, in RTS, with its
//! registered block, receives and chunk numbers, and no exchange of its own.

use super::*;

/// Where a fence lands in the peer's credit line: the writer's count of chunks sent, then the
/// generation it opens (last, so that seeing it means the count landed too).
const FENCE_SENT: usize = 8;
const FENCE_EPOCH: usize = 16;

/// Queue pairs to survivors, drained, with the completion queue they are bound to (a queue
/// pair's completion queue is fixed), for the next generation's transport.
pub(crate) struct KeptQps {
    /// By rank of the next generation. Dropped first: queue pairs before what they use.
    pub(super) peers: Vec<(usize, PeerState)>,
    pub(super) spare: Option<RegisteredBuffer>,
    pub(super) cq: CompletionQueue,
    pub(super) pd: Arc<ProtectionDomain>,
    pub(super) ctx: Arc<DeviceContext>,
    pub(super) layout: Layout,
}

impl KeptQps {
    /// How many queue pairs it holds.
    pub(crate) fn len(&self) -> usize {
        self.peers.len()
    }
}

/// One queue pair's drain.
#[derive(Clone, Copy, PartialEq)]
enum Drain {
    /// The fence is not posted yet (the send queue is full).
    Fencing,
    /// Our fence is posted; waiting for it to complete and for the peer's fence and chunks.
    Waiting,
    /// Drained: the peer sent this many chunks, all landed.
    Done(u64),
    /// Failed (an error completion, a protocol fault): not kept.
    Broken,
}

impl RdmaTransport {
    /// Hands over the queue pairs to the ranks of `members` (old ranks, in their new order) that
    /// are up, each drained by a fence exchange for generation `epoch` within `until`, with the
    /// completion queue; every other queue pair ends here. Every member calls it with the same
    /// arguments, at once; after it this transport holds no queue pair and does no work. None
    /// if nothing could be kept.
    pub(crate) fn keep(
        &mut self,
        members: &[usize],
        epoch: u32,
        until: Instant,
    ) -> Option<KeptQps> {
        let new_rank = |p: usize| members.iter().position(|&q| q == p);
        // Queue pairs to ranks not in the next generation end now (their completions are then
        // no longer routed, so a dead peer's failed writes cannot end the drain), as do
        // connections still dialing or exchanging endpoints. A pair whose queue pair is
        // connected and whose READY alone is missing is finished first: the peer may count it
        // up already and fence on it.
        self.dialer.abandon();
        let mut finishing = Vec::new();
        for p in std::mem::take(&mut self.pending) {
            if new_rank(p).is_some() && self.peers[p].is_some() {
                finishing.push(p);
            } else {
                self.coming[p] = None;
                self.peers[p] = None;
            }
        }
        for p in 0..self.peers.len() {
            if new_rank(p).is_none() {
                self.peers[p] = None;
            }
        }
        self.up.retain(|&p| new_rank(p).is_some());
        let mut drains: Vec<(usize, usize, Drain)> = members
            .iter()
            .enumerate()
            .filter(|&(_, &old)| self.up.contains(&old))
            .map(|(new, &old)| (new, old, Drain::Fencing))
            .collect();
        // The completion queue goes with the kept pairs; this transport keeps an empty one.
        let spare_cq = CompletionQueue::new(&self._ctx, 64).ok();
        if spare_cq.is_none() || epoch == 0 {
            drains.clear();
            finishing.clear();
        }
        let slots = self.layout.slots as u64;
        let depth = u64::from(connect::send_depth(self.layout.slots));
        let mut nap = Duration::from_micros(20);
        while !(drains.is_empty() && finishing.is_empty()) && Instant::now() < until {
            let mut moved = false;
            let mut i = 0;
            while i < finishing.len() {
                let p = finishing[i];
                match self.pair_step(p) {
                    Ok(false) => i += 1,
                    done => {
                        finishing.swap_remove(i);
                        moved = true;
                        match (done, new_rank(p)) {
                            (Ok(true), Some(new)) => drains.push((new, p, Drain::Fencing)),
                            _ => {
                                self.coming[p] = None;
                                self.peers[p] = None;
                            }
                        }
                    }
                }
            }
            let mut broken = Vec::new();
            match self.reap(&mut |_, pair, _| broken.push(pair)) {
                Ok(m) => moved |= m,
                Err(_) => break,
            }
            if !broken.is_empty() && !self.port_active() {
                drains.clear(); // this rank's port is down: nothing is kept
                break;
            }
            for (_, old, d) in drains.iter_mut() {
                if broken.contains(old) {
                    *d = Drain::Broken;
                }
                let p = *old;
                match *d {
                    Drain::Fencing => {
                        *d = match self.peers[p].as_mut() {
                            None => Drain::Broken,
                            Some(st) if st.wr_posted - st.wr_done + 2 >= depth => Drain::Fencing,
                            Some(st) => match post_fence(p, st, self.layout, epoch) {
                                Ok(()) => Drain::Waiting,
                                Err(_) => Drain::Broken,
                            },
                        };
                    }
                    Drain::Waiting => {
                        if let Some(sent) = self.fenced(p, epoch) {
                            *d = sent;
                        }
                    }
                    Drain::Done(_) | Drain::Broken => {}
                }
            }
            if finishing.is_empty()
                && drains
                    .iter()
                    .all(|(.., d)| matches!(d, Drain::Done(_) | Drain::Broken))
            {
                break;
            }
            if moved {
                nap = Duration::from_micros(20);
            } else {
                std::thread::sleep(nap);
                nap = (nap * 2).min(MAX_NAP);
            }
        }
        let mut kept = Vec::new();
        for (new, old, d) in drains {
            let (Drain::Done(theirs), Some(mut st)) = (d, self.peers[old].take()) else {
                continue;
            };
            // What the failed generation left untaken is dropped here, and the peer drops
            // all we sent it: both ends count every chunk of it taken.
            for k in st.consumed..theirs {
                st.lens[(k % slots) as usize] = EMPTY;
            }
            st.consumed = theirs;
            st.returned = theirs;
            st.cq_next = theirs;
            st.retire_sends();
            st.peer_consumed = st.sent;
            st.probe = None;
            kept.push((new, st));
        }
        // Every other queue pair ends now, before the completion queue is handed over: what
        // it held for them is dropped (a queue pair's completions name it, and its number
        // may be given again).
        self.release_sources();
        self.up.clear();
        self.coming.iter_mut().for_each(|c| *c = None);
        self.peers.iter_mut().for_each(|s| *s = None);
        while self.cq.poll(|_| {}).is_ok_and(|n| n > 0) {}
        let spare_cq = spare_cq?;
        if kept.is_empty() {
            return None;
        }
        Some(KeptQps {
            peers: kept,
            spare: self.spare.take(),
            cq: std::mem::replace(&mut self.cq, spare_cq),
            pd: Arc::clone(&self._pd),
            ctx: Arc::clone(&self._ctx),
            layout: self.layout,
        })
    }

    /// Whether `p`'s queue pair is drained for generation `epoch`: our writes completed, and
    /// the peer's fence and every chunk it counts landed. `Done` with the peer's count,
    /// `Broken` for a count no peer could send, else None.
    fn fenced(&self, p: usize, epoch: u32) -> Option<Drain> {
        let st = self.peers[p].as_ref()?;
        if st.wr_done < st.wr_posted {
            return None;
        }
        let at = |off: usize| {
            let ptr = st.buf.ptr_at(self.layout.credit_off() + off) as *const u64;
            // SAFETY: an aligned u64 inside our buffer's credit line, written only by the
            // peer's RDMA writes; read volatile since the device changes it.
            let v = u64::from_le(unsafe { std::ptr::read_volatile(ptr) });
            fence(Ordering::Acquire);
            v
        };
        if at(FENCE_EPOCH) != u64::from(epoch) {
            return None;
        }
        let theirs = at(FENCE_SENT);
        let slots = self.layout.slots as u64;
        if theirs < st.consumed || theirs > st.consumed + slots {
            return Some(Drain::Broken);
        }
        // A chunk sent with an immediate shows in its slot once its completion was polled; a
        // mailbox chunk by its tag.
        let landed = |k: u64| st.lens[(k % slots) as usize] != EMPTY || self.landed(p, k).is_some();
        (st.consumed..theirs)
            .all(landed)
            .then_some(Drain::Done(theirs))
    }
}

/// Posts our fence to the peer of `st`: our count of chunks sent, then `epoch`, into its credit
/// line, signaled (its completion retires every write before it).
fn post_fence(p: usize, st: &mut PeerState, layout: Layout, epoch: u32) -> Result<()> {
    let from = layout.scratch_off() + FENCE_SENT;
    // SAFETY: the scratch line is registered for local access only; this write goes inline
    // (16 bytes), so the device copies it when posted.
    let b = unsafe { st.buf.slice_mut(from, 16) };
    b[..8].copy_from_slice(&st.sent.to_le_bytes());
    b[8..].copy_from_slice(&u64::from(epoch).to_le_bytes());
    let sge = Sge {
        lkey: st.buf.lkey_at(from, 16),
        addr: st.buf.addr() + from as u64,
        len: 16,
    };
    let id = wr_id(KIND_PROBE, p, st.wr_posted);
    let remote = st.remote.addr + (layout.credit_off() + FENCE_SENT) as u64;
    // SAFETY: the local range lies in our registered buffer for this peer (its scratch line),
    // which outlives the queue pair (field order), and is not written again before the write
    // completes (the drain waits for it).
    unsafe {
        st.qp
            .post_write(id, &[sge], st.remote.rkey, remote, None, true)
    }?;
    st.wr_posted += 1;
    st.unsignaled = 0;
    Ok(())
}
