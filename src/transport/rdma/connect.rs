//! Queue pairs made when first needed: the two ranks' proven TCP connection (the dialer's)
//! carries each side's endpoint and block, then a READY once its queue pair is connected; a
//! rank writes to a peer only after that peer's READY, so nothing lands on a queue pair that
//! cannot take it yet.
//!
//! Order on each side: register the peer's block, create the queue pair and post its receives,
//! send INFO; on the peer's INFO connect the queue pair (from then its chunks may arrive) and
//! send READY; on the peer's READY, post.

use super::*;
use crate::transport::dial::Event;
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;

/// Bytes of INFO: the endpoint of the sender's queue pair for the receiver, then the address
/// and key of its block for the receiver.
pub const INFO: usize = Endpoint::BYTES + 8 + 4;
/// The byte a rank sends once its queue pair is connected.
pub const READY: u8 = 1;

/// The INFO of a queue pair and block.
pub fn info(e: &Endpoint, addr: u64, rkey: u32) -> [u8; INFO] {
    let mut b = [0u8; INFO];
    b[..Endpoint::BYTES].copy_from_slice(&e.to_bytes());
    b[Endpoint::BYTES..Endpoint::BYTES + 8].copy_from_slice(&addr.to_le_bytes());
    b[Endpoint::BYTES + 8..].copy_from_slice(&rkey.to_le_bytes());
    b
}

/// An INFO's endpoint and block (None if malformed).
pub fn parse_info(b: &[u8]) -> Option<(Endpoint, Remote)> {
    let e = Endpoint::from_bytes(b.get(..Endpoint::BYTES)?)?;
    let addr = u64::from_le_bytes(
        b.get(Endpoint::BYTES..Endpoint::BYTES + 8)?
            .try_into()
            .ok()?,
    );
    let rkey = u32::from_le_bytes(b.get(Endpoint::BYTES + 8..INFO)?.try_into().ok()?);
    Some((e, Remote { addr, rkey }))
}

/// A peer whose queue pair is being connected over its proven TCP connection.
pub(super) struct Coming {
    /// Our side, until the queue pair is connected (then it moves to `peers`).
    pub(super) st: Option<PeerState>,
    sock: TcpStream,
    /// What we send (INFO, then READY), and how much of it went.
    out: Vec<u8>,
    sent: usize,
    /// What the peer sent (INFO, then READY).
    got: Vec<u8>,
}

impl PeerState {
    /// Our side of a link to a peer: its registered buffer, a queue pair on `cq` in INIT with
    /// every receive posted (a peer's chunk can never find none).
    fn new(
        p: usize,
        pd: &Arc<ProtectionDomain>,
        cq: &CompletionQueue,
        sel: &verbs::Selected,
        layout: Layout,
        spare: Option<RegisteredBuffer>,
    ) -> Result<PeerState> {
        let buf = match spare {
            Some(b) => b,
            None => register(pd, layout)?,
        };
        let s = layout.slots as u32;
        let mut qp = RcQueuePair::new(pd, cq, sel, send_depth(layout.slots), s)?;
        for k in 0..layout.slots as u64 {
            qp.post_recv(wr_id(KIND_RECV, p, k))?;
        }
        Ok(PeerState {
            qpn: qp.endpoint().qpn,
            qp,
            remote: Remote::default(),
            ready: false,
            sent: 0,
            send_done: 0,
            wr_posted: 0,
            wr_done: 0,
            unsignaled: 0,
            chunk_wr: vec![0; layout.slots],
            cq_next: 0,
            consumed: 0,
            returned: 0,
            peer_consumed: 0,
            lens: vec![EMPTY; layout.slots],
            probe: None,
            buf,
        })
    }
}

/// A peer's buffer, zeroed (its mailboxes rely on it), its block the peer's to write.
pub(super) fn register(pd: &Arc<ProtectionDomain>, layout: Layout) -> Result<RegisteredBuffer> {
    RegisteredBuffer::with_windows(pd, layout.total(), &[layout.window()])
}

/// Work requests a peer's send queue holds: every slot's data and as many unsignaled writes.
pub(super) fn send_depth(slots: usize) -> u32 {
    2 * slots as u32 + 16
}

impl RdmaTransport {
    /// Whether we may post to `p` (its READY came); if not, dials it (unless under way) and
    /// moves every connection under way.
    pub(super) fn reach(&mut self, p: usize) -> Result<bool> {
        if self.peers[p].as_ref().is_some_and(|s| s.ready) {
            return Ok(true);
        }
        if self.peers[p].is_none() && self.coming[p].is_none() {
            self.dialer
                .dial(p)
                .map_err(|(q, why)| self.watch.fail(q, why))?;
        }
        self.connect_step()?;
        Ok(self.peers[p].as_ref().is_some_and(|s| s.ready))
    }

    /// Whether a connection is under way (then waits watch its sockets).
    pub(super) fn connecting(&self) -> bool {
        self.dialer.busy() || !self.pending.is_empty()
    }

    /// Moves the dials and the queue pairs being connected; whether a peer came up (or failed).
    pub(super) fn connect_step(&mut self) -> Result<bool> {
        let mut moved = self.dialer.step(&mut self.dial_events)?;
        while let Some(e) = self.dial_events.pop() {
            match e {
                Event::Up(p, sock) => self.begin_pair(p, sock)?,
                Event::Failed(p, why) => return Err(self.fail(p, why)),
            }
        }
        let mut i = 0;
        while i < self.pending.len() {
            let p = self.pending[i];
            if self.pair_step(p)? {
                moved = true;
                self.pending.swap_remove(i);
            } else {
                i += 1;
            }
        }
        if moved {
            self.made_progress();
        }
        Ok(moved)
    }

    /// `p`'s proven connection is up: our side of the pair, and our INFO on its way.
    fn begin_pair(&mut self, p: usize, sock: TcpStream) -> Result<()> {
        let made = (|| -> Result<PeerState> {
            sock.set_nonblocking(true)?;
            let _ = sock.set_nodelay(true);
            // Room in the completion queue for this pair's completions too.
            let each = send_depth(self.layout.slots) + self.layout.slots as u32;
            let need = each * (self.up.len() + self.pending.len() + 1) as u32;
            if need > self.cq.depth() {
                if need > self.max_cqe {
                    return Err(Error::Verbs {
                        op: "resize completion queue",
                        detail: format!(
                            "{} peers connected need {need} entries, past the device's {}: \
                             fewer slots (RDMACOMM_SLOTS) or peers",
                            self.up.len() + self.pending.len() + 1,
                            self.max_cqe
                        ),
                        source: None,
                    });
                }
                self.cq
                    .reserve((2 * self.cq.depth()).clamp(need, self.max_cqe))?;
            }
            let spare = self.spare.take();
            PeerState::new(p, &self._pd, &self.cq, &self.sel, self.layout, spare)
        })();
        let st = match made {
            Ok(st) => st,
            Err(e) => return Err(self.fail(self.rank, format!("connecting rank {p}: {e}"))),
        };
        let window = self.layout.window();
        let out = info(
            &st.qp.endpoint(),
            st.buf.addr(),
            st.buf.rkey_at(window.start),
        )
        .to_vec();
        self.coming[p] = Some(Box::new(Coming {
            st: Some(st),
            sock,
            out,
            sent: 0,
            got: Vec::with_capacity(INFO + 1),
        }));
        self.pending.push(p);
        Ok(())
    }

    /// Moves `p`'s pair as far as it goes now: whether it is done (READY both ways).
    pub(super) fn pair_step(&mut self, p: usize) -> Result<bool> {
        let c = self.coming[p].as_mut().expect("pending");
        while c.sent < c.out.len() {
            match c.sock.write(&c.out[c.sent..]) {
                Ok(k) => c.sent += k,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    let why = format!("its connection closed while connecting queue pairs: {e}");
                    return Err(self.fail(p, why));
                }
            }
        }
        let mut buf = [0u8; INFO + 1];
        while c.got.len() < INFO + 1 {
            let want = INFO + 1 - c.got.len();
            match c.sock.read(&mut buf[..want]) {
                Ok(0) => {
                    let why = "its connection closed while connecting queue pairs (it exited?)";
                    return Err(self.fail(p, why.into()));
                }
                Ok(k) => c.got.extend_from_slice(&buf[..k]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    let why = format!("its connection failed while connecting queue pairs: {e}");
                    return Err(self.fail(p, why));
                }
            }
        }
        if c.got.len() >= INFO && c.st.is_some() {
            let mut st = c.st.take().expect("checked");
            let Some((theirs, remote)) = parse_info(&c.got[..INFO]) else {
                return Err(self.fail(p, "sent a malformed queue pair endpoint".into()));
            };
            st.remote = remote;
            if let Err(e) = st.qp.connect(&theirs, self.policy) {
                return Err(self.fail(p, format!("connecting the queue pair: {e}")));
            }
            c.out.push(READY);
            // From here its chunks may land: completions find it among the peers.
            self.peers[p] = Some(st);
            return self.pair_step(p);
        }
        let c = self.coming[p].as_ref().expect("pending");
        if c.got.len() == INFO + 1 && c.sent == c.out.len() && c.st.is_none() {
            if c.got[INFO] != READY {
                return Err(self.fail(p, "sent a malformed READY".into()));
            }
            self.coming[p] = None;
            self.state(p).ready = true;
            self.up.push(p);
            return Ok(true);
        }
        Ok(false)
    }

    /// The sockets a wait should wake on while connecting: the dialer's and the pairs'.
    pub(super) fn connect_waits(&self) -> impl Iterator<Item = crate::sys::Wait> + '_ {
        let pairs = self.pending.iter().map(|&p| {
            let c = self.coming[p].as_ref().expect("pending");
            crate::sys::Wait {
                fd: c.sock.as_raw_fd(),
                read: true,
                write: c.sent < c.out.len(),
            }
        });
        self.dialer.waits().chain(pairs)
    }

    /// Connects every peer now (`RDMACOMM_CONNECT=eager`): a rank dials the ranks below it.
    pub(super) fn connect_all(&mut self) -> Result<()> {
        let n = self.peers.len();
        let deadline = Instant::now() + self.timeout;
        while self.up.len() + 1 < n {
            for p in 0..self.rank {
                if self.peers[p].is_none() && self.coming[p].is_none() {
                    self.dialer
                        .dial(p)
                        .map_err(|(q, why)| self.watch.fail(q, why))?;
                }
            }
            self.check_side()?;
            if self.connect_step()? {
                continue;
            }
            if Instant::now() >= deadline {
                let missing = (0..n)
                    .find(|&p| p != self.rank && !self.peers[p].as_ref().is_some_and(|s| s.ready))
                    .unwrap_or(0);
                let why = format!(
                    "its queue pair did not connect within {:?} (RDMACOMM_CONNECT=eager)",
                    self.timeout
                );
                return Err(self.fail(missing, why));
            }
            let waits: Vec<_> = self.connect_waits().collect();
            crate::sys::wait_for(waits, Duration::from_millis(2), &mut self.fds);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_info_reads_back_and_a_short_one_is_refused() {
        let e = Endpoint {
            qpn: 0x11_2233,
            psn: 0x44,
            lid: 5,
            gid: [9; 16],
            mtu: 5,
        };
        let b = info(&e, 0x1234_5678_9abc, 0xfeed);
        let (back, remote) = parse_info(&b).expect("well formed");
        assert_eq!(back, e);
        assert_eq!((remote.addr, remote.rkey), (0x1234_5678_9abc, 0xfeed));
        assert!(parse_info(&b[..INFO - 1]).is_none());
    }
}
