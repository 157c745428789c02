//! What the completion queue and the device say: completed writes and arrived chunks, failed
//! work requests named by peer, and the health checks (async events, QP states, probes).

use super::*;

impl RdmaTransport {
    /// Whether every peer is still reachable, without blocking: the side channel, the device's
    /// async events, each QP's state, and a zero-byte RDMA write probe per peer whose
    /// completion is checked on the next call.
    pub fn health(&mut self) -> Result<()> {
        self.check_side()?;
        self.poll()?;
        for ev in self.opened.events() {
            if ev.is_fatal() {
                // The device may be shared: another communicator's QP or CQ is not ours to
                // fail on; a port's or the device's event is every communicator's.
                let who = match ev {
                    AsyncEvent::QpFatal(qpn) => {
                        let ours = |s: &PeerState| s.qp.endpoint().qpn == qpn;
                        let coming = |p: usize| {
                            self.coming[p]
                                .as_ref()
                                .is_some_and(|c| c.st.as_ref().is_some_and(ours))
                        };
                        match (0..self.peers.len())
                            .find(|&p| self.peers[p].as_ref().is_some_and(ours) || coming(p))
                        {
                            Some(p) => Some(p),
                            None => continue,
                        }
                    }
                    AsyncEvent::CqError(cq) if cq != self.cq.id() => continue,
                    // Another port of the device (a dual-port HCA): not the one we use.
                    AsyncEvent::PortError(port) if port != self.port => continue,
                    _ => None,
                };
                // A QP's event blames its peer; port, CQ and device events are this rank's own.
                let p = who.unwrap_or(self.rank);
                return Err(self.fail(p, format!("device event on {}: {ev:?}", self.device)));
            }
        }
        let sq_limit = connect::send_depth(self.layout.slots) as u64;
        for i in 0..self.up.len() {
            let p = self.up[i];
            let Some(st) = self.peers[p].as_ref() else {
                continue;
            };
            if st.qp.query_state()? == QueuePairState::Error {
                return Err(self.fail(p, "its queue pair is in the error state".into()));
            }
            match st.probe {
                Some(t) if t.elapsed() > self.timeout => {
                    let why = format!("a probe write went unanswered for {:?}", self.timeout);
                    return Err(self.fail(p, why));
                }
                Some(_) => {}
                None if st.wr_posted - st.wr_done + 2 < sq_limit => {
                    self.post(p, KIND_PROBE, 0, 0, self.layout.credit_off(), None)?;
                    self.state(p).probe = Some(Instant::now());
                }
                None => {}
            }
        }
        Ok(())
    }

    /// Polls the CQ once; returns whether anything completed.
    pub(super) fn poll(&mut self) -> Result<bool> {
        let mut first = None;
        let moved = self.reap(&mut |blamed, _, why| {
            first.get_or_insert((blamed, why));
        })?;
        match first {
            Some((p, why)) => Err(self.fail(p, why)),
            None => Ok(moved),
        }
    }

    /// The peer whose queue pair `qpn` is, for a completion whose work request named `p`: a
    /// queue pair carried over from a generation before still holds receives naming the peer's
    /// old rank. None for a queue pair that is no longer ours.
    fn route(&self, p: usize, qpn: u32) -> Option<usize> {
        let ours = |q: usize| {
            self.peers
                .get(q)
                .and_then(Option::as_ref)
                .is_some_and(|s| s.qpn == qpn)
        };
        if ours(p) {
            return Some(p);
        }
        self.up.iter().copied().find(|&q| ours(q))
    }

    /// Polls the CQ once and applies what completed; a failed work request or a chunk that
    /// breaks the protocol goes to `fault` with the rank to blame (the peer, or this rank for a
    /// local error), the peer whose queue pair it came from, and why. Whether anything
    /// completed.
    pub(super) fn reap(&mut self, fault: &mut dyn FnMut(usize, usize, String)) -> Result<bool> {
        let mut events: [(u64, u32, u32, u32, u32); 64] = [(0, 0, 0, 0, 0); 64];
        let mut m = 0;
        self.cq.poll(|c| {
            if m < events.len() {
                events[m] = (c.wr_id, c.status, c.byte_len, c.imm, c.qp_num);
                m += 1;
            }
        })?;
        for &(id, status, len, imm, qpn) in &events[..m] {
            let kind = id >> 62;
            // A queue pair not among the peers ended (with a generation before, or being
            // connected: a failed connection is told by its TCP connection instead).
            let Some(p) = self.route(((id >> 48) & 0x3fff) as usize, qpn) else {
                continue;
            };
            let index = id & 0xffff_ffff_ffff;
            if status != 0 {
                let what = match kind {
                    KIND_DATA => "an RDMA write of data",
                    KIND_CREDIT => "an RDMA write of credits",
                    KIND_PROBE => "a probe write",
                    _ => "a receive",
                };
                // A local error, or our own port down, is this rank's failure (its link or
                // device), not the peer's: blame ourselves so every rank names the right one.
                let local = matches!(status, 1 | 2 | 4 | 8 | 19 | 21);
                let port_down = !self.port_active();
                let why = format!("{what} to rank {p} failed: {}", verbs::status_str(status));
                if local || port_down {
                    let why = format!(
                        "{why}; {} is {}",
                        self.device,
                        if port_down { "DOWN" } else { "in error" }
                    );
                    fault(self.rank, p, why);
                } else {
                    fault(p, p, why);
                }
                continue;
            }
            let slots = self.layout.slots as u64;
            let st = self.state(p);
            match kind {
                KIND_RECV => {
                    // The chunk's number from its low 16 bits: at or above the next expected,
                    // within `slots` of the consumed count (credits), into an empty slot.
                    let k = protocol::chunk_number(st.consumed, (imm & 0xffff) as u16);
                    if !protocol::arrival_ok(k, st.cq_next, st.consumed, slots)
                        || st.lens[(k % slots) as usize] != EMPTY
                    {
                        let e = format!(
                            "protocol error: chunk {} arrived where {} (at most {}) was expected",
                            imm & 0xffff,
                            st.cq_next,
                            st.consumed + slots - 1
                        );
                        fault(p, p, e);
                        continue;
                    }
                    // The peer's consumed count of our chunks, from its low 16 bits: it lies
                    // within `slots` below what we sent.
                    st.peer_consumed = st
                        .peer_consumed
                        .max(protocol::below(st.sent, (imm >> 16) as u16));
                    st.lens[(k % slots) as usize] = len;
                    st.cq_next = k + 1;
                    if let Err(e) = st.qp.post_recv(wr_id(KIND_RECV, p, k + slots)) {
                        // Our queue pair refused a receive: this rank's failure, told to all.
                        fault(
                            self.rank,
                            p,
                            format!("reposting a receive for rank {p}: {e}"),
                        );
                    }
                }
                _ => {
                    // Every WR up to this one is done (in order), signaled or not.
                    st.wr_done = st.wr_done.max(index + 1);
                    st.retire_sends();
                    if kind == KIND_PROBE {
                        st.probe = None;
                    }
                }
            }
        }
        Ok(m > 0)
    }
}
