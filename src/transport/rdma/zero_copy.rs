//! Sends straight from the caller's memory: a buffer lent for one operation, or registered
//! across calls; no range is landed into before the writes reading it completed.

use super::*;

impl RdmaTransport {
    /// Forgets the zero-copy writes that completed.
    pub(super) fn retire_zero_copy(&mut self) {
        let peers = &self.peers;
        self.zc
            .retain(|&(p, k, ..)| peers[p].as_ref().is_some_and(|s| s.send_done <= k));
    }

    /// Registers `buf` as a source of zero-copy sends (a lending or a registration), and where
    /// `writable` as a window the operations inside a registration may offer peers.
    pub(super) fn register_source(&mut self, buf: &[u8], writable: bool) -> Result<LentRegion> {
        let t0 = Instant::now();
        // SAFETY: the device reads this memory (sends from it), and peers write it only where
        // `writable`, with a key that goes out only in an operation's offer for the operation's
        // own buffer (landing.rs), which the caller lent mutably for the operation or keeps
        // allocated and in place until unregister() (`Lending::register`); the registration pins its pages
        // while it lives, so a lent buffer freed too early gets stale bytes sent, never freed
        // memory touched. Its keys are used only while it lives: a lending ends in release(),
        // a registration in unregister(), both between operations, after finish() completed
        // their writes (after a failure, a WR still using it fails).
        let r = unsafe { LentRegion::new(&self._pd, buf.as_ptr() as usize, buf.len(), writable) };
        self.ledger.registrations += 1;
        self.ledger.registration_ns += t0.elapsed().as_nanos() as u64;
        r
    }

    pub(super) fn lend_source(&mut self, buf: &[u8]) {
        // One lending at a time: a second one (or one while zero-copy sends are unsettled)
        // only means copying.
        if self.lent.is_some()
            || !self.zc.is_empty()
            || self.zc_min == 0
            || buf.len() < self.zc_min
            || self.registered.iter().any(|(_, r)| r.contains(buf))
        {
            return;
        }
        // A failed registration (e.g. the locked-memory limit) only means copying. Writable:
        // an all_reduce offers it as a window for this operation alone (landing.rs).
        self.lent = self.register_source(buf, true).ok();
    }

    pub(super) unsafe fn register_source_for_calls(&mut self, buf: &[u8]) -> Result<Option<u64>> {
        if buf.is_empty() {
            return Ok(None); // nothing to send from (and verbs refuse an empty region)
        }
        if self.registered.len() >= MAX_REGISTERED {
            return Err(Error::InvalidArgument(format!(
                "{MAX_REGISTERED} buffers are registered with this communicator already: \
                 register fewer at once (one large buffer can hold several tensors)"
            )));
        }
        let region = self.register_source(buf, true)?;
        let id = self.next_registration;
        self.next_registration += 1;
        self.registered.push((id, region));
        Ok(Some(id))
    }

    pub(super) fn unregister_source(&mut self, id: u64) {
        self.registered.retain(|(i, _)| *i != id);
    }

    pub(super) fn settle_range(&mut self, range: &[u8]) -> Result<()> {
        let (a, b) = (
            range.as_ptr() as usize,
            range.as_ptr() as usize + range.len(),
        );
        while !self.zc.is_empty() {
            self.retire_zero_copy();
            match self.zc.iter().find(|e| e.2 < b && a < e.3) {
                Some(&(p, ..)) => self.progress(p)?,
                None => break,
            }
        }
        Ok(())
    }

    pub(super) fn release_sources(&mut self) {
        self.zc.clear();
        self.lent = None;
    }

    pub(super) fn finish_sends(&mut self) -> Result<()> {
        // Every zero-copy write completes before the caller gets its buffer back.
        while let Some(&(p, k, ..)) = self.zc.front() {
            if self.state(p).send_done > k {
                self.zc.pop_front();
            } else {
                self.progress(p)?;
            }
        }
        Ok(())
    }
}
