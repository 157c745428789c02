//! The TCP data path: pumping sockets, framing chunks out and in, waiting in poll(2), health.

use super::*;
use crate::transport::Pass;

impl TcpTransport {
    /// Moves bytes: writes what is queued, reads what has arrived. Returns whether any moved.
    pub(super) fn pump(&mut self) -> Result<bool> {
        let mut moved = false;
        for i in 0..self.up.len() {
            moved |= self.pump_one(self.up[i])?;
        }
        Ok(moved)
    }

    /// [`Self::pump`] for one peer's connection: writes what is queued, then reads straight
    /// into the receive buffer while the socket has bytes and the buffer has room.
    pub(super) fn pump_one(&mut self, p: usize) -> Result<bool> {
        let want = HDR + self.max_chunk;
        let Some(c) = self.conns[p].as_mut() else {
            return Ok(false);
        };
        let mut err = None;
        let mut moved = match c.write_queued() {
            Ok(m) => m,
            Err(e) => {
                err = Some(format!("TCP send failed: {e}"));
                false
            }
        };
        if err.is_none() && c.direct == Direct::Off {
            match c.read_some(want) {
                Ok(m) => moved |= m,
                Err(e) => err = Some(format!("TCP receive failed: {e}")),
            }
        }
        match err {
            Some(why) => Err(self.fail(p, why)),
            None => Ok(moved),
        }
    }

    /// Waits up to `d` for any socket to become readable (or writable when output is queued),
    /// the listener (a peer may dial) and the connections under way.
    pub(super) fn wait(&mut self, d: Duration) {
        let conns = &self.conns;
        let up = self.up.iter().filter_map(|&p| conns[p].as_ref());
        let socks = up.map(|c| crate::sys::Wait {
            fd: c.sock.as_raw_fd(),
            read: true,
            write: !c.out.is_empty(),
        });
        let dials = self.dialer.waits();
        crate::sys::wait(socks.chain(dials), d.as_millis() as u64, &mut self.fds);
    }

    /// A peer to which posted data still waits in its queue.
    pub(super) fn queued(&self) -> Option<usize> {
        let conns = &self.conns;
        let queued = |p: &usize| conns[*p].as_ref().is_some_and(|c| !c.out.is_empty());
        self.up.iter().copied().find(queued)
    }

    /// Whether every peer is still reachable, without blocking.
    pub fn health(&mut self) -> Result<()> {
        self.check_side()?;
        self.pump()?;
        for i in 0..self.up.len() {
            let p = self.up[i];
            if self.conns[p].as_ref().is_some_and(|c| c.closed) {
                return Err(self.fail(p, "its data connection closed".into()));
            }
        }
        Ok(())
    }
}

impl Link for TcpTransport {
    fn props(&self) -> &crate::transport::Props {
        &self.props
    }

    fn peer(&self, rank: usize) -> Peer {
        self.watch.peer(rank)
    }

    fn try_post(&mut self, p: usize, data: &[u8]) -> Result<bool> {
        if !self.reach(p)? {
            return Ok(false);
        }
        if !self.conns[p]
            .as_ref()
            .expect("no link to self")
            .out
            .is_empty()
        {
            self.pump_one(p)?;
        }
        let c = self.conns[p].as_mut().expect("no link to self");
        if !c.out.is_empty() {
            return Ok(false);
        }
        self.pacer.progress();
        let mut header = [0u8; HDR];
        header[..4].copy_from_slice(&(data.len() as u32).to_le_bytes());
        header[OP_AT..OP_AT + op::WIRE].copy_from_slice(&self.numbering.desc_to(p));
        let parts = [&header[..], data, &PAD[..pad(data.len())]];
        let mut done = 0;
        // Write straight from the caller's buffer; only what the socket does not take now is
        // copied.
        let iov = parts.map(IoSlice::new);
        match c.sock.write_vectored(&iov) {
            Ok(k) => done = k,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
            Err(e) => return Err(self.fail(p, format!("TCP send failed: {e}"))),
        }
        if done < parts.iter().map(|x| x.len()).sum() {
            c.out.keep_rest(&parts, done);
        }
        // The payload the socket did not take at once was copied into the send queue.
        let queued = data.len() - done.saturating_sub(HDR).min(data.len());
        self.ledger.count(Pass::CopyIn, queued);
        self.ledger.count(Pass::Kernel, data.len());
        self.ledger.count(Pass::Wire, data.len());
        Ok(true)
    }

    fn try_take(&mut self, p: usize, f: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<bool> {
        if !self.reach(p)? {
            return Ok(false);
        }
        let max = self.max_chunk;
        let c = self.conns[p].as_mut().expect("no link to self");
        match c.direct {
            Direct::Off => {}
            Direct::Armed => c.direct = Direct::Off,
            Direct::Placing { .. } => {
                return Err(Error::InvalidArgument(format!(
                    "a chunk from rank {p} is half placed by try_take_into: finish it first"
                )))
            }
        }
        let len = match c.inp.next_len(max) {
            Ok(Some(len)) => len,
            Ok(None) => return Ok(false),
            Err(why) => return Err(self.fail(p, why)),
        };
        self.check_op(p)?;
        let c = self.conns[p].as_mut().expect("present");
        let avail = c.inp.pending();
        let frame = HDR + len + pad(len);
        if avail.len() < frame {
            return Ok(false);
        }
        f(&avail[HDR..HDR + len])?;
        c.inp.consume(frame);
        self.ledger.count(Pass::Kernel, len);
        self.pacer.progress();
        Ok(true)
    }

    fn try_take_into(&mut self, p: usize, dst: &mut [u8]) -> Result<bool> {
        if !self.reach(p)? {
            return Ok(false);
        }
        let max = self.max_chunk;
        let verified = !self.numbering.first_from(p);
        let c = self.conns[p].as_mut().expect("no link to self");
        let mut err = None;
        // The frame's zero padding after the payload, read and dropped.
        let mut sink = [0u8; 64];
        let tail = pad(dst.len());
        // Payload and padding bytes read into place together with the header.
        let mut early = 0;
        if let Direct::Off | Direct::Armed = c.direct {
            // The header: from the receive buffer; or, when nothing is buffered and the chunk
            // is large, read in one readv with as much payload (and padding) as has arrived,
            // straight into place (a header that then disagrees with `dst` is an error either
            // way); or read with at most 4 KiB of payload (all of a small chunk in one read).
            let have = c.inp.pending().len();
            if have < HDR && !c.closed {
                let room = c.inp.room(HDR + max);
                // Only once this operation's descriptor from p was checked: no byte of a
                // mismatched operation may land in the caller's buffer.
                let vectored =
                    have == 0 && verified && dst.len() > DIRECT_PEEK && room.len() >= HDR;
                let got = if vectored {
                    let (head, _) = room.split_at_mut(HDR);
                    let mut iov = [
                        IoSliceMut::new(head),
                        IoSliceMut::new(dst),
                        IoSliceMut::new(&mut sink[..tail]),
                    ];
                    c.sock.read_vectored(&mut iov)
                } else {
                    let n = (HDR + DIRECT_PEEK - have).min(room.len());
                    c.sock.read(&mut room[..n])
                };
                match got {
                    Ok(0) => c.closed = true,
                    Ok(k) if vectored => {
                        c.inp.end += k.min(HDR);
                        early = k.saturating_sub(HDR);
                    }
                    Ok(k) => c.inp.end += k,
                    Err(e)
                        if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
                    Err(e) => err = Some(format!("TCP receive failed: {e}")),
                }
            }
            if let Some(why) = err {
                return Err(self.fail(p, why));
            }
            let c = self.conns[p].as_mut().expect("present");
            let len = match c.inp.next_len(max) {
                Ok(Some(len)) => len,
                Ok(None) => {
                    c.direct = Direct::Armed;
                    return Ok(false);
                }
                Err(why) => return Err(self.fail(p, why)),
            };
            let checked = self.check_op(p);
            let c = self.conns[p].as_mut().expect("present");
            if checked.is_err() || len != dst.len() {
                // Payload read with the header has left the socket: the stream's position says
                // so (a shrink's drain then skips the frame's true rest).
                c.direct = Direct::Off;
                if early > 0 {
                    c.inp.consume(HDR);
                    c.direct = Direct::Placing { placed: early, len };
                }
                checked?;
                return Err(Error::length_mismatch(len, dst.len(), p));
            }
            let avail = c.inp.pending();
            // What already sits in the receive buffer is copied (its padding dropped); the
            // rest is read in place.
            let k = (avail.len() - HDR).min(len + tail);
            let copied = k.min(len);
            crate::copy::copy(&mut dst[..copied], &avail[HDR..HDR + copied]);
            self.ledger.count(Pass::CopyOut, copied);
            c.inp.consume(HDR + k);
            c.direct = Direct::Placing {
                placed: k + early,
                len,
            };
        }
        let c = self.conns[p].as_mut().expect("present");
        let Direct::Placing { mut placed, len } = c.direct else {
            unreachable!("placing");
        };
        if len != dst.len() {
            return Err(Error::length_mismatch(len, dst.len(), p));
        }
        let was = placed;
        let frame = len + tail;
        while placed < frame && !c.closed {
            let got = if placed < len {
                let mut iov = [
                    IoSliceMut::new(&mut dst[placed..]),
                    IoSliceMut::new(&mut sink[..tail]),
                ];
                c.sock.read_vectored(&mut iov)
            } else {
                c.sock.read(&mut sink[placed - len..tail])
            };
            match got {
                Ok(0) => c.closed = true,
                Ok(k) => placed += k,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    err = Some(format!("TCP receive failed: {e}"));
                    break;
                }
            }
        }
        if let Some(why) = err {
            return Err(self.fail(p, why));
        }
        if placed > was {
            self.pacer.progress();
        }
        let c = self.conns[p].as_mut().expect("present");
        if placed < frame {
            c.direct = Direct::Placing { placed, len };
            return Ok(false);
        }
        c.direct = Direct::Off;
        self.ledger.count(Pass::Kernel, len);
        self.pacer.progress();
        Ok(true)
    }

    fn sends_in_place(&self, _data: &[u8]) -> bool {
        true
    }

    fn ledger_mut(&mut self) -> Option<&mut crate::transport::Ledger> {
        Some(&mut self.ledger)
    }

    fn progress(&mut self, waiting_on: usize) -> Result<()> {
        self.watch.waiting_on(Some(waiting_on));
        self.watch.poll_sometimes()?;
        let mut moved = self.pump()?;
        if self.conns[waiting_on].is_none() {
            self.dial(waiting_on)?;
        }
        // Connections under way move on every turn; otherwise the listener is looked at now
        // and then, so that a peer dialing this rank while it waits on another is answered.
        if self.conns[waiting_on].is_none() || self.dialer.busy() || self.lookout.due() {
            moved |= self.connect_step()?;
        }
        if moved {
            self.pacer.progress();
            return Ok(());
        }
        if self.conns[waiting_on]
            .as_ref()
            .is_some_and(|c| c.closed && c.inp.pending().len() < HDR)
        {
            return Err(self.fail(waiting_on, "its data connection closed".into()));
        }
        // Spin briefly (not at all when more local ranks than cores share the CPU), then yield
        // the core to whichever local rank has work, and only after 200 us of idleness block in
        // poll(2), which wakes as soon as data arrives: no core burnt on a long wait.
        match self.watch.idle(&mut self.pacer, waiting_on, self.timeout)? {
            Wait::Spin => std::hint::spin_loop(),
            Wait::Yield => std::thread::yield_now(),
            Wait::BackOff => {
                self.wait(Duration::from_millis(1));
                self.connect_step()?;
            }
            Wait::Expired => {}
        }
        Ok(())
    }

    fn start(&mut self, op: &OpDesc, scope: Partners) {
        self.numbering.start(op, scope);
        self.watch.waiting_on(None);
    }

    fn resume(&mut self) {
        self.pacer.begin();
    }

    fn begin(&mut self) {
        self.pacer.begin();
        for &p in &self.up {
            let Some(c) = self.conns[p].as_mut() else {
                continue;
            };
            if c.direct == Direct::Armed {
                c.direct = Direct::Off;
            }
        }
    }

    fn unsent(&mut self) -> Result<Option<usize>> {
        // What is queued goes out in `progress`, the caller's wait.
        Ok(self.queued())
    }

    fn finish(&mut self) -> Result<()> {
        self.flush()
    }
}

impl crate::transport::Transport for TcpTransport {
    fn health(&mut self) -> Result<()> {
        TcpTransport::health(self)
    }
    fn describe(&self) -> String {
        self.device()
    }
    fn local_rank(&self) -> (usize, usize) {
        self.watch().local_rank()
    }
    fn abort(&mut self, reason: String) {
        TcpTransport::abort(self, reason)
    }
    fn watch_mut(&mut self) -> &mut crate::transport::watch::Watch {
        TcpTransport::watch_mut(self)
    }
    fn poll_now(&mut self) -> Result<bool> {
        TcpTransport::poll_now(self)
    }
    fn note_progress(&mut self) {
        TcpTransport::note_progress(self)
    }
    fn keep(&mut self, members: &[usize], epoch: u32, until: Instant) -> crate::transport::Kept {
        crate::transport::Kept {
            tcp: TcpTransport::keep(self, members, epoch, until),
            rdma: None,
        }
    }
    fn ledger(&self) -> crate::transport::Ledger {
        self.ledger
    }
    fn holds(&self) -> crate::transport::Holdings {
        crate::transport::Holdings {
            connections: self.up.len(),
            buffered: (self.up.iter())
                .filter_map(|&p| self.conns[p].as_ref())
                .map(|c| c.inp.capacity() + c.out.buf.capacity())
                .sum(),
            ..Default::default()
        }
    }
}
