//! What the core sees of the RDMA transport: its [`Link`], [`Lending`] and
//! [`crate::transport::Transport`] faces over the data path (`link.rs`), the windows
//! (`landing.rs`) and the registrations (`zero_copy.rs`).

use super::link::{Source, Target};
use super::*;

impl Link for RdmaTransport {
    fn props(&self) -> &crate::transport::Props {
        &self.props
    }

    fn peer(&self, rank: usize) -> Peer {
        self.watch.peer(rank)
    }

    fn try_post(&mut self, p: usize, data: &[u8]) -> Result<bool> {
        self.post_to(p, Source::Data(data), Target::Slot)
    }

    fn try_relay(
        &mut self,
        from: usize,
        to: usize,
        len: usize,
        at: Option<usize>,
        f: &mut crate::transport::Relay<'_>,
    ) -> Result<bool> {
        let target = match at {
            Some(at) => self.target(to, at, len)?,
            None => None,
        };
        self.relay_to(from, to, len, target.unwrap_or(Target::Slot), f)
    }

    fn sends_in_place(&self, data: &[u8]) -> bool {
        // Whatever its size (a small post still goes inline): a buffer this rank may offer as
        // a window must not be relayed into, or a landed chunk would be read from a slot.
        self.lent
            .iter()
            .chain(self.registered.iter().map(|(_, r)| r))
            .any(|r| r.contains(data))
    }

    fn lands(&self, _peer: usize) -> bool {
        true
    }

    fn try_offer(&mut self, p: usize, dst: &[u8]) -> Result<bool> {
        self.offer(p, dst)
    }

    fn try_accept(&mut self, p: usize) -> Result<bool> {
        self.accept(p)
    }

    fn try_post_at(&mut self, p: usize, data: &[u8], at: usize) -> Result<bool> {
        self.post_at(p, data, at)
    }

    fn try_take_landed(&mut self, p: usize, dst: &mut [u8]) -> Result<bool> {
        self.take_landed(p, dst)
    }

    fn ledger_mut(&mut self) -> Option<&mut crate::transport::Ledger> {
        Some(&mut self.ledger)
    }

    fn try_take(&mut self, p: usize, f: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<bool> {
        let Some(a) = self.arrival(p)? else {
            return Ok(false);
        };
        // SAFETY: `a` is `p`'s next chunk, given back only by `took`, after `f` returned.
        f(unsafe { &*self.arrived_bytes(p, &a) })?;
        self.took(p, a)?;
        Ok(true)
    }

    fn try_take_into(&mut self, p: usize, dst: &mut [u8]) -> Result<bool> {
        self.settle_range(dst)?;
        let took = self.try_take(p, &mut |src: &[u8]| copy_chunk(src, dst, p))?;
        if took {
            self.ledger.count(Pass::CopyOut, dst.len());
        }
        Ok(took)
    }

    fn lending(&mut self) -> Option<&mut dyn Lending> {
        Some(self)
    }

    fn finish(&mut self) -> Result<()> {
        self.finish_sends()?;
        self.landing.finished = true;
        Ok(())
    }

    fn progress(&mut self, waiting_on: usize) -> Result<()> {
        self.watch.waiting_on(Some(waiting_on));
        self.watch.poll_sometimes()?;
        if self.poll()? {
            self.made_progress();
            return Ok(());
        }
        // Connections under way move on every turn; otherwise the listener is looked at now
        // and then (`Lookout`), so that a peer dialing this rank while it waits on another is
        // answered.
        if (self.connecting() || self.lookout.due()) && self.connect_step()? {
            return Ok(());
        }
        match self.watch.idle(&mut self.pacer, waiting_on, self.timeout)? {
            Wait::Spin => std::hint::spin_loop(),
            Wait::Yield => std::thread::yield_now(),
            Wait::BackOff => {
                self.nap()?;
                self.connect_step()?;
            }
            Wait::Expired => {}
        }
        Ok(())
    }

    fn begin(&mut self) {
        self.pacer.begin();
    }

    fn start(&mut self, op: &OpDesc, scope: Partners) {
        self.numbering.start(op, scope);
        self.landing.start();
        self.watch.waiting_on(None);
    }
}

impl Lending for RdmaTransport {
    fn lend(&mut self, buf: &[u8]) {
        self.lend_source(buf)
    }

    unsafe fn register(&mut self, buf: &[u8]) -> Result<Option<u64>> {
        // SAFETY: the caller keeps `buf` alive and unmoved while registered (Lending::register).
        unsafe { self.register_source_for_calls(buf) }
    }

    fn unregister(&mut self, id: u64) {
        self.unregister_source(id)
    }

    fn settle(&mut self, range: &[u8]) -> Result<()> {
        self.settle_range(range)
    }

    fn release(&mut self) {
        self.close_windows();
        self.release_sources()
    }
}

impl crate::transport::Transport for RdmaTransport {
    fn health(&mut self) -> Result<()> {
        RdmaTransport::health(self)
    }
    fn describe(&self) -> String {
        format!("RDMA {}", self.device())
    }
    fn local_rank(&self) -> (usize, usize) {
        self.watch().local_rank()
    }
    fn abort(&mut self, reason: String) {
        RdmaTransport::abort(self, reason)
    }
    fn watch_mut(&mut self) -> &mut crate::transport::watch::Watch {
        RdmaTransport::watch_mut(self)
    }
    fn poll_now(&mut self) -> Result<bool> {
        RdmaTransport::poll_now(self)
    }
    fn note_progress(&mut self) {
        RdmaTransport::note_progress(self)
    }
    fn keep(&mut self, members: &[usize], epoch: u32, until: Instant) -> crate::transport::Kept {
        crate::transport::Kept {
            tcp: Vec::new(),
            rdma: RdmaTransport::keep(self, members, epoch, until),
        }
    }
    fn ledger(&self) -> Ledger {
        self.ledger
    }
    fn holds(&self) -> crate::transport::Holdings {
        crate::transport::Holdings {
            pinned: self
                .up
                .iter()
                .chain(&self.pending)
                .map(|&p| {
                    let st = self.peers[p].as_ref();
                    let c = self.coming[p].as_ref().and_then(|c| c.st.as_ref());
                    st.or(c).map_or(0, |s| s.buf.len())
                })
                .sum::<usize>()
                + self.spare.as_ref().map_or(0, |b| b.len()),
            connections: self.up.len(),
            ..Default::default()
        }
    }
}
