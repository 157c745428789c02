//! The data path: posting chunks into a peer's slots or mailboxes within its credits, taking
//! arrived chunks and returning credits, and waiting.

use super::*;

impl RdmaTransport {
    /// Posts a WR on `p`'s QP, signaling when needed so the send queue never fills.
    pub(super) fn post(
        &mut self,
        p: usize,
        kind: u64,
        off: usize,
        len: usize,
        remote_off: usize,
        imm: Option<u32>,
    ) -> Result<()> {
        let buf = &self.state(p).buf;
        let sge = Sge {
            lkey: buf.lkey_at(off, len),
            addr: buf.addr() + off as u64,
            len: len as u32,
        };
        self.post_from(p, kind, &[sge], remote_off, None, imm, false)
    }

    /// [`RdmaTransport::post`] from the ranges `local`: our buffer, then possibly the lent one;
    /// to `remote_off` in `p`'s block, or to `window` (a range of `p`'s memory it offered).
    /// A `quiet` data write (inline from the staging slot) may go unsignaled.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn post_from(
        &mut self,
        p: usize,
        kind: u64,
        local: &[Sge],
        remote_off: usize,
        window: Option<Remote>,
        imm: Option<u32>,
        quiet: bool,
    ) -> Result<()> {
        let st = self.peers[p].as_mut().expect("no link to self");
        // What an HCA counts (entries free only as completions are polled) must fit the queue.
        debug_assert!(
            st.wr_posted - st.wr_done < u64::from(connect::send_depth(st.lens.len())),
            "rank {p}'s send queue overfilled"
        );
        // A WR that needs nothing after posting may go unsignaled (see the module notes).
        let fire_and_forget = kind == KIND_CREDIT || (kind == KIND_DATA && quiet);
        let signaled = !fire_and_forget || st.unsignaled >= QUIET_MAX;
        let id = wr_id(kind, p, st.wr_posted);
        let to = window.unwrap_or(Remote {
            addr: st.remote.addr + remote_off as u64,
            rkey: st.remote.rkey,
        });
        // SAFETY: the local range lies in our registered buffer for `p` (off/len from the
        // layout), which outlives its QP (field order), or in the lent buffer, which stays
        // registered and unwritten until the write completes (settle, finish) or the operation failed and
        // release() deregistered it (the WR then fails; the memory is never touched after); the
        // data slot is not reused before this write completes (send_done); credit words are sent
        // inline (copied at post time).
        let r = unsafe { st.qp.post_write(id, local, to.rkey, to.addr, imm, signaled) };
        if let Err(e) = r {
            return Err(self.fail(p, e.to_string()));
        }
        let st = self.state(p);
        st.wr_posted += 1;
        st.unsignaled = if signaled { 0 } else { st.unsignaled + 1 };
        Ok(())
    }

    /// Chunk `k` from `p`, if it has landed in its mailbox: (length, offset of the entry, the low
    /// 16 bits of `p`'s consumed count of our chunks).
    pub(super) fn landed(&self, p: usize, k: u64) -> Option<(usize, usize, u16)> {
        let entry = self.layout.mailbox_off(k);
        let buf = &self.peers[p].as_ref().expect("connected").buf;
        let ptr = buf.ptr_at(entry + ENTRY - 8) as *const u64;
        // SAFETY: an aligned u64 inside our buffer (entries are 64-byte aligned), written only
        // by the peer's RDMA writes; read volatile since the device changes it behind the
        // compiler's back.
        let tag = u64::from_le(unsafe { std::ptr::read_volatile(ptr) });
        let len = mailbox::tag_len(tag, k)?;
        // The tag is read before the bytes written ahead of it.
        fence(Ordering::Acquire);
        Some((len, entry, mailbox::tag_consumed(tag)))
    }

    /// The highest consumed count of our chunks that `p` reported in a mailbox chunk that
    /// arrived and is not taken yet (0 if none).
    pub(super) fn mailbox_credits(&self, p: usize) -> u64 {
        let st = self.peers[p].as_ref().expect("no link to self");
        (st.consumed..st.consumed + self.layout.slots as u64)
            .filter_map(|k| self.landed(p, k))
            .map(|(.., low)| protocol::below(st.sent, low))
            .max()
            .unwrap_or(0)
    }

    pub(super) fn credits_from(&self, p: usize) -> u64 {
        let buf = &self.peers[p].as_ref().expect("connected").buf;
        let ptr = buf.ptr_at(self.layout.credit_off()) as *const u64;
        // SAFETY: an aligned u64 inside our buffer, written only by the peer's RDMA writes;
        // read volatile since the HCA changes it behind the compiler's back.
        let v = unsafe { std::ptr::read_volatile(ptr) };
        fence(Ordering::Acquire);
        v
    }

    /// Sleeps on the completion channel and the data listener (a peer may dial), and the
    /// connections under way, until one wakes or the nap's end (see [`MIN_NAP`]).
    pub(super) fn nap(&mut self) -> Result<()> {
        // A completion that came before the request raised no event: look once more first.
        if self.cq.arm()? && self.poll()? {
            self.made_progress();
            return Ok(());
        }
        match self.cq.event_fd() {
            Some(fd) => {
                let mut fds = std::mem::take(&mut self.fds);
                let cq = crate::sys::Wait {
                    fd,
                    read: true,
                    write: false,
                };
                crate::sys::wait_for(
                    std::iter::once(cq).chain(self.connect_waits()),
                    self.nap,
                    &mut fds,
                );
                // Takes (acknowledges) the CQ's event if that is what woke us.
                if fds[0].revents & libc::POLLIN != 0 {
                    self.cq.block(Duration::ZERO)?;
                }
                self.fds = fds;
            }
            None => {
                self.cq.block(self.nap)?;
            }
        }
        self.nap = (self.nap * 2).min(MAX_NAP);
        Ok(())
    }
}

/// What a post sends: the caller's bytes, or bytes a relay writes straight into the slot.
pub(super) enum Source<'a> {
    /// The caller's bytes (copied into the staging slot, or sent from a lent or registered
    /// buffer).
    Data(&'a [u8]),
    /// `len` bytes written into the staging slot by the closure.
    Fill(usize, &'a mut dyn FnMut(&mut [u8]) -> Result<()>),
}

/// Where a post's bytes go on the peer.
#[derive(Clone, Copy)]
pub(super) enum Target {
    /// Its receive slot (or mailbox, if small): payload, counted in the ledger.
    Slot,
    /// As [`Target::Slot`], but no payload of the caller's (an offer): not counted.
    Control,
    /// Straight into the peer's memory, in the window it offered, announced by the immediate.
    Window(Remote),
}

/// A chunk that has landed and is not taken yet: where its bytes lie in the peer's buffer.
pub(super) struct Arrival {
    /// Offset of its bytes after the descriptor, and their length.
    off: usize,
    pub(super) len: usize,
    /// The credits a mailbox trailer carried.
    pub(super) mailbox_consumed: Option<u64>,
}

impl RdmaTransport {
    /// Whether a chunk of `len` bytes may be posted to `p` now: connected, within its credits
    /// and with room in the send queue.
    pub(super) fn post_room(&mut self, p: usize, len: usize) -> Result<bool> {
        if len > self.layout.slot {
            return Err(Error::InvalidArgument(format!(
                "a chunk of {len} bytes posted to rank {p}, past the {}-byte slot (max_chunk)",
                self.layout.slot
            )));
        }
        if !self.reach(p)? {
            return Ok(false);
        }
        let slots = self.layout.slots as u64;
        let word = self.credits_from(p);
        let st = self.state(p);
        if word > st.sent {
            // A peer cannot have consumed what was never sent: it is misbehaving.
            let e = format!(
                "protocol error: its credit word says {word} chunks consumed of {} sent",
                st.sent
            );
            return Err(self.fail(p, e));
        }
        let mut credits = word.max(st.peer_consumed);
        let k = st.sent;
        if !protocol::has_credit(k, credits, slots) {
            // Credits ride on chunks that arrived but are not taken yet: on receive
            // completions (seen when polled) and in mailbox trailers (seen only here).
            credits = credits.max(self.mailbox_credits(p));
            self.state(p).peer_consumed = credits;
        }
        let st = self.state(p);
        let sq_room = st.wr_posted - st.wr_done + 2 < connect::send_depth(slots as usize) as u64;
        Ok(protocol::may_post(k, credits, st.send_done, slots) && sq_room)
    }

    /// The buffer region (lent or registered) a post of `data` may send straight from.
    fn region_of(&self, data: &[u8]) -> Option<&LentRegion> {
        if data.len() <= MAX_INLINE as usize {
            // Small enough to go inline: copied at post time, no settling needed.
            return None;
        }
        self.lent
            .iter()
            .chain(self.registered.iter().map(|(_, r)| r))
            .find(|r| r.contains(data))
    }

    /// Posts `src` to `p` at `target`, whose room [`RdmaTransport::post_room`] found.
    pub(super) fn post_chunk(&mut self, p: usize, src: Source<'_>, target: Target) -> Result<()> {
        let slots = self.layout.slots as u64;
        let st = self.state(p);
        let (k, consumed) = (st.sent, st.consumed);
        // The operation's first chunk to p carries its descriptor just ahead of the data.
        let head = if self.numbering.first_to(p) {
            op::WIRE
        } else {
            0
        };
        let window = match target {
            Target::Window(w) => Some(w),
            _ => None,
        };
        if window.is_some() && head > 0 {
            // The descriptor rides in the offer that came first the other way.
            return Err(Error::InvalidArgument(format!(
                "a landing post to rank {p} before any other chunk of the operation"
            )));
        }
        let desc = self.numbering.desc_to(p);
        let data_len = match &src {
            Source::Data(d) => d.len(),
            Source::Fill(len, _) => *len,
        };
        let region = match &src {
            Source::Data(d) => self.region_of(d).map(|r| r.lkey()),
            Source::Fill(..) => None,
        };
        let to_mailbox =
            window.is_none() && region.is_none() && head + data_len <= mailbox::MAX_PAYLOAD;
        let off = self.layout.send_off(k);
        let buf = &mut self.peers[p].as_mut().expect("connected").buf;
        let staging_key = buf.lkey_at(off, 0);
        let staged_head = Sge {
            lkey: staging_key,
            addr: buf.addr() + (off - head) as u64,
            len: head as u32,
        };
        if head > 0 {
            // SAFETY: send slots are registered for local access only (no peer writes them),
            // and may_post found this slot's previous write completed (the device is done
            // reading it).
            unsafe { buf.slice_mut(off - head, head) }.copy_from_slice(&desc);
        }
        let mut len = head + data_len;
        let mut copied = 0;
        let none = Sge {
            len: 0,
            ..staged_head
        };
        let (sges, zero_copy) = match (region, src) {
            // The descriptor from the staging slot, then the data from the caller's memory.
            (Some(lkey), Source::Data(data)) => {
                let from = Sge {
                    lkey,
                    addr: data.as_ptr() as u64,
                    len: data.len() as u32,
                };
                ([staged_head, from], Some(data))
            }
            (_, src) if to_mailbox => {
                let mut payload = [0u8; mailbox::MAX_PAYLOAD];
                payload[..head].copy_from_slice(&desc[..head]);
                match src {
                    Source::Data(data) => {
                        payload[head..len].copy_from_slice(data);
                        copied = data_len;
                    }
                    Source::Fill(_, f) => f(&mut payload[head..len])?,
                }
                // SAFETY: this rank's send slot, free (as for the descriptor above).
                let out = unsafe { buf.slice_mut(off, ENTRY) };
                len = mailbox::encode(k, consumed, &payload[..len], out);
                let at = Sge {
                    lkey: staging_key,
                    addr: buf.addr() + off as u64,
                    len: len as u32,
                };
                ([at, none], None)
            }
            (_, src) => {
                // SAFETY: this rank's send slot, free (as for the descriptor above).
                let slot = unsafe { buf.slice_mut(off, data_len) };
                match src {
                    Source::Data(data) => {
                        crate::copy::copy(slot, data);
                        copied = data_len;
                    }
                    Source::Fill(_, f) => f(slot)?,
                }
                let whole = Sge {
                    len: len as u32,
                    ..staged_head
                };
                ([whole, none], None)
            }
        };
        let (remote_off, imm) = if to_mailbox {
            let entry = self.layout.mailbox_off(k);
            (entry + mailbox::write_offset(len), None)
        } else {
            let imm = protocol::immediate(k, consumed);
            (self.layout.recv_off(k) - head, Some(imm))
        };
        let quiet = zero_copy.is_none() && len <= MAX_INLINE as usize;
        let wr = self.state(p).wr_posted;
        self.state(p).chunk_wr[(k % slots) as usize] = if quiet { FREE_AT_POST } else { wr };
        self.post_from(p, KIND_DATA, &sges, remote_off, window, imm, quiet)?;
        if let Some(data) = zero_copy {
            if self.zc.len() == self.zc.capacity() {
                self.retire_zero_copy(); // often room enough again: no reallocation
            }
            let a = data.as_ptr() as usize;
            self.zc.push_back((p, k, a, a + data.len()));
        }
        if !matches!(target, Target::Control) {
            self.ledger.count(Pass::CopyIn, copied);
            self.ledger.count(Pass::Wire, data_len);
        }
        self.numbering.posted_to(p);
        let st = self.state(p);
        st.returned = consumed;
        st.sent += 1;
        st.retire_sends();
        self.made_progress();
        Ok(())
    }

    /// The next chunk from `p`, if it has landed (its descriptor checked, its length within
    /// what `p` may write).
    pub(super) fn arrival(&mut self, p: usize) -> Result<Option<Arrival>> {
        if self.peers[p].is_none() {
            self.reach(p)?;
            if self.peers[p].is_none() {
                return Ok(None);
            }
        }
        let slots = self.layout.slots as u64;
        let st = self.state(p);
        let k = st.consumed;
        let slot = (k % slots) as usize;
        let (by_imm, sent) = (st.lens[slot], st.sent);
        let head = if self.numbering.first_from(p) {
            op::WIRE
        } else {
            0
        };
        // The chunk's bytes as written (the descriptor first, if any): where, how many, and
        // the credits a mailbox trailer carries.
        let (off, len, mailbox_consumed) = if by_imm != EMPTY {
            (self.layout.recv_off(k) - head, by_imm as usize, None)
        } else {
            let Some((len, entry, low)) = self.landed(p, k) else {
                return Ok(None);
            };
            let consumed = Some(protocol::below(sent, low));
            (
                entry + mailbox::payload(len.min(mailbox::MAX_PAYLOAD)).start,
                len,
                consumed,
            )
        };
        let limit = if by_imm != EMPTY {
            self.layout.slot + head
        } else {
            mailbox::MAX_PAYLOAD
        };
        // Nothing a peer writes is trusted: a length past what it may write, or short of the
        // descriptor it owes, fails that peer.
        if len > limit || len < head {
            let e = format!(
                "protocol error: chunk {k} has {len} bytes (at least {head}, at most {limit} allowed)"
            );
            return Err(self.fail(p, e));
        }
        if head > 0 {
            // SAFETY: a receive slot whose chunk arrived (its completion was seen) and whose
            // credit has not been returned: the writer may not write it again until we do.
            let got = unsafe {
                self.peers[p]
                    .as_ref()
                    .expect("connected")
                    .buf
                    .slice(off, head)
            };
            if let Err(why) = self.numbering.check_from(p, got) {
                return Err(self.watch.mismatch(p, why));
            }
        }
        Ok(Some(Arrival {
            off: off + head,
            len: len - head,
            mailbox_consumed,
        }))
    }

    /// The bytes of an arrived chunk from `p`.
    ///
    /// # Safety
    /// `a` must be `p`'s next chunk, found by [`RdmaTransport::arrival`] and not yet given back
    /// by [`RdmaTransport::took`], and the slice must not outlive that.
    pub(super) unsafe fn arrived_bytes(&self, p: usize, a: &Arrival) -> *const [u8] {
        // SAFETY: an arrived chunk, its slot not yet given back (the caller's contract): the
        // writer may not write it again until we return its credit.
        let s = unsafe {
            self.peers[p]
                .as_ref()
                .expect("connected")
                .buf
                .slice(a.off, a.len)
        };
        s as *const [u8]
    }

    /// Frees the slot of `p`'s chunk `a`, returning credits when due.
    pub(super) fn took(&mut self, p: usize, a: Arrival) -> Result<()> {
        let slots = self.layout.slots as u64;
        self.numbering.took_from(p);
        let st = self.state(p);
        let slot = (st.consumed % slots) as usize;
        st.lens[slot] = EMPTY;
        if let Some(c) = a.mailbox_consumed {
            st.peer_consumed = st.peer_consumed.max(c);
        }
        let st = self.state(p);
        st.consumed += 1;
        let consumed = st.consumed;
        // Return credits in batches of half the slots: the writer then always has half its
        // slots free or unconsumed data waiting here, so batching cannot deadlock, and most
        // small operations finish without a credit write on their critical path.
        if !protocol::return_due(consumed, st.returned, slots) {
            self.made_progress();
            return Ok(());
        }
        // An HCA frees send-queue entries only as their completions are polled, and a rank
        // that takes chunks from mailboxes without ever waiting never polls: make room first.
        let depth = u64::from(connect::send_depth(slots as usize));
        while {
            let st = self.state(p);
            st.wr_posted - st.wr_done + 1 >= depth
        } {
            self.progress(p)?;
        }
        self.state(p).returned = consumed;
        // Our consumed count into the writer's credit word for us (inline).
        let credit_remote = self.layout.credit_off();
        // A scratch word past the send slots, which no peer has a key for.
        let tmp_off = self.layout.scratch_off();
        // SAFETY: the scratch line is registered for local access only, and every credit write
        // from it went inline (the device copied the word when it was posted).
        unsafe { self.state(p).buf.slice_mut(tmp_off, 8) }.copy_from_slice(&consumed.to_le_bytes());
        self.post(p, KIND_CREDIT, tmp_off, 8, credit_remote, None)?;
        self.made_progress();
        Ok(())
    }

    /// Posts `src` to `p` at `target` if there is room: whether it went.
    pub(super) fn post_to(&mut self, p: usize, src: Source<'_>, target: Target) -> Result<bool> {
        let len = match &src {
            Source::Data(d) => d.len(),
            Source::Fill(len, _) => *len,
        };
        if !self.post_room(p, len)? {
            return Ok(false);
        }
        self.post_chunk(p, src, target)?;
        // Look at the completion queue (a user-space read) after every post, so a caller that
        // keeps posting still sees, and takes, what arrived meanwhile (on rxe a post takes long
        // enough for the peer's chunks to land); idle turns poll in `progress`.
        self.poll()?;
        Ok(true)
    }

    /// Takes `from`'s next chunk and posts to `to`, at `target`, the `len` bytes `f` writes
    /// from it: whether both happened (neither did otherwise).
    pub(super) fn relay_to(
        &mut self,
        from: usize,
        to: usize,
        len: usize,
        target: Target,
        f: &mut crate::transport::Relay<'_>,
    ) -> Result<bool> {
        if !self.post_room(to, len)? {
            return Ok(false);
        }
        let Some(a) = self.arrival(from)? else {
            return Ok(false);
        };
        // SAFETY: `a` is `from`'s next chunk, given back only by `took` below, after the last
        // use of `src` (the fill runs inside post_chunk, which frees no receive slot).
        let src = unsafe { &*self.arrived_bytes(from, &a) };
        self.post_chunk(to, Source::Fill(len, &mut |out| f(src, out)), target)?;
        self.took(from, a)?;
        self.poll()?;
        Ok(true)
    }
}
