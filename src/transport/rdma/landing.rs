//! Landing an operation's chunks straight in the receiver's memory: a rank offers a peer a
//! window onto its buffer for one operation (address, length and the remote key of the
//! registration it lies in, sent over the pair's own queue pair, so to this communicator's
//! peer alone), and the peer RDMA-writes those chunks there with the immediate that announces
//! them, instead of into a receive slot: no copy out of a slot. Only a buffer inside a
//! registration (`Communicator::with_registered`) or lent for this operation
//! (`RDMACOMM_ZERO_COPY_MIN`) is offered; its key dies with the registration (the scope, or the
//! operation), so a write after that fails with a remote access error, as does one outside the
//! registered memory. An operation that fails with a window out revokes every
//! writable registration before it returns: no peer writes the caller's memory after that.

use super::link::{Source, Target};
use super::*;

/// Bytes of an offer: the window's address, its length, its remote key, and 1 if it gives one.
const OFFER: usize = 24;

/// A window a peer offered: where its buffer starts, how long it is, its remote key.
#[derive(Clone, Copy, Debug)]
pub(super) struct Window {
    at: Remote,
    len: u64,
}

/// One operation's windows: the peers this rank offered one to, and those offered to it.
#[derive(Default)]
pub(super) struct Landing {
    /// Peers this rank offered a window (true) or word that there is none (false).
    offered: Vec<(usize, bool)>,
    /// Peers whose offer was taken, and their window where they gave one.
    accepted: Vec<(usize, Option<Window>)>,
    /// The last window each peer gave (for the test hook that writes with a stale key).
    last: Vec<(usize, Window)>,
    /// The operation finished (every landed chunk taken, every write complete).
    pub(super) finished: bool,
}

impl Landing {
    /// A new operation: no window yet.
    pub(super) fn start(&mut self) {
        self.offered.clear();
        self.accepted.clear();
        self.finished = false;
    }

    /// Whether this rank offered `p` a window in this operation.
    fn offered_window(&self, p: usize) -> bool {
        self.offered.iter().any(|&(q, w)| q == p && w)
    }

    /// Whether this rank offered any window in this operation.
    pub(super) fn out(&self) -> bool {
        self.offered.iter().any(|&(_, w)| w)
    }

    /// `p`'s window in this operation, where it offered one.
    fn window(&self, p: usize) -> Option<Window> {
        let w = self
            .accepted
            .iter()
            .find(|(q, _)| *q == p)
            .and_then(|(_, w)| *w);
        if w.is_none() && crate::diag::test_fault("land-stale-window") {
            // A peer that kept a window past its operation: its key must be refused.
            return self.last.iter().find(|(q, _)| *q == p).map(|(_, w)| *w);
        }
        w
    }
}

/// An offer's bytes: `w` (address, length, key) or none.
fn encode(w: Option<(u64, u64, u32)>) -> [u8; OFFER] {
    let mut b = [0u8; OFFER];
    if let Some((addr, len, rkey)) = w {
        b[..8].copy_from_slice(&addr.to_le_bytes());
        b[8..16].copy_from_slice(&len.to_le_bytes());
        b[16..20].copy_from_slice(&rkey.to_le_bytes());
        b[20] = 1;
    }
    b
}

/// An offer from its bytes: `Ok(None)` for none, `Err` for bytes no offer has.
fn decode(b: &[u8]) -> std::result::Result<Option<(u64, u64, u32)>, String> {
    if b.len() != OFFER || b[20] > 1 || b[21..].iter().any(|&x| x != 0) {
        return Err(format!(
            "protocol error: a window offer of {} bytes that is none ({OFFER} expected)",
            b.len()
        ));
    }
    let u = |r: std::ops::Range<usize>| u64::from_le_bytes(b[r].try_into().expect("8 bytes"));
    let rkey = u32::from_le_bytes(b[16..20].try_into().expect("4 bytes"));
    Ok((b[20] == 1).then(|| (u(0..8), u(8..16), rkey)))
}

impl RdmaTransport {
    /// Posts `p` this rank's window onto `dst`: where `dst` lies in a writable registration,
    /// its address, length and key; else word that there is none.
    pub(super) fn offer(&mut self, p: usize, dst: &[u8]) -> Result<bool> {
        if !self.post_room(p, OFFER)? {
            return Ok(false);
        }
        let w = self
            .lent
            .iter()
            .chain(self.registered.iter().map(|(_, r)| r))
            .filter(|r| !dst.is_empty() && r.contains(dst))
            .find_map(|r| r.rkey())
            .map(|rkey| (dst.as_ptr() as u64, dst.len() as u64, rkey));
        self.post_chunk(p, Source::Data(&encode(w)), Target::Control)?;
        // A later ring of the same operation (its next slice) offers anew.
        self.landing.offered.retain(|(q, _)| *q != p);
        self.landing.offered.push((p, w.is_some()));
        self.poll()?;
        Ok(true)
    }

    /// Takes `p`'s offer (its first chunk of the operation).
    pub(super) fn accept(&mut self, p: usize) -> Result<bool> {
        let Some(a) = self.arrival(p)? else {
            return Ok(false);
        };
        // SAFETY: `a` is `p`'s next chunk, given back by `took` below, after its last use.
        let got = decode(unsafe { &*self.arrived_bytes(p, &a) });
        let w = match got {
            Ok(w) => w.map(|(addr, len, rkey)| Window {
                at: Remote { addr, rkey },
                len,
            }),
            Err(why) => return Err(self.fail(p, why)),
        };
        self.took(p, a)?;
        if let Some(w) = w {
            self.landing.last.retain(|(q, _)| *q != p);
            self.landing.last.push((p, w));
        }
        self.landing.accepted.retain(|(q, _)| *q != p);
        self.landing.accepted.push((p, w));
        Ok(true)
    }

    /// Where a chunk of `len` bytes for byte `at` of `p`'s window goes, if `p` offered one.
    pub(super) fn target(&mut self, p: usize, at: usize, len: usize) -> Result<Option<Target>> {
        let Some(w) = self.landing.window(p) else {
            return Ok(None);
        };
        // The test hook: a peer that writes just past the window it was given.
        let at = if crate::diag::test_fault("land-past-window") {
            w.len as usize
        } else {
            at
        };
        if (at as u64).saturating_add(len as u64) > w.len
            && !crate::diag::test_fault("land-past-window")
        {
            return Err(Error::InvalidArgument(format!(
                "a landing post of {len} bytes at {at} past rank {p}'s window of {} bytes",
                w.len
            )));
        }
        // A window at an address no memory has is the peer's word, never a panic here.
        let Some(addr) = w.at.addr.checked_add(at as u64) else {
            let why = format!(
                "protocol error: a window at {:#x} runs past memory",
                w.at.addr
            );
            return Err(self.fail(p, why));
        };
        Ok(Some(Target::Window(Remote {
            addr,
            rkey: w.at.rkey,
        })))
    }

    /// Posts `data` to `p`, into its window at `at` where it offered one.
    pub(super) fn post_at(&mut self, p: usize, data: &[u8], at: usize) -> Result<bool> {
        let target = self.target(p, at, data.len())?.unwrap_or(Target::Slot);
        self.post_to(p, Source::Data(data), target)
    }

    /// Takes `p`'s next chunk, landed in `dst` already where this rank offered `p` a window.
    pub(super) fn take_landed(&mut self, p: usize, dst: &mut [u8]) -> Result<bool> {
        if !self.landing.offered_window(p) {
            return Link::try_take_into(self, p, dst);
        }
        if self.numbering.first_from(p) {
            return Err(Error::InvalidArgument(format!(
                "a landed chunk from rank {p} before any other chunk of the operation"
            )));
        }
        let Some(a) = self.arrival(p)? else {
            return Ok(false);
        };
        if a.mailbox_consumed.is_some() {
            let e = "protocol error: a chunk for its window came to a mailbox".to_string();
            return Err(self.fail(p, e));
        }
        if a.len != dst.len() {
            return Err(Error::length_mismatch(a.len, dst.len(), p));
        }
        // The write's receive completion was polled: its bytes are in `dst`.
        self.took(p, a)?;
        Ok(true)
    }

    /// An operation ends: where it failed with a window out, every writable registration is
    /// revoked (deregistered), so that no peer's write lands in the caller's memory after.
    pub(super) fn close_windows(&mut self) {
        if self.landing.out() && !self.landing.finished {
            self.registered.retain(|(_, r)| r.rkey().is_none());
        }
        self.landing.start();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offers_read_back_and_malformed_ones_are_refused() {
        let w = (0x7f00_1234_5678u64, 16u64 << 20, 0xdead_beefu32);
        assert_eq!(decode(&encode(Some(w))), Ok(Some(w)));
        assert_eq!(decode(&encode(None)), Ok(None));
        // Short, long, a flag that is neither, bytes past the flag: refused, never a panic.
        for bad in [vec![], vec![1u8; 3], vec![0u8; OFFER + 1]] {
            assert!(decode(&bad).is_err(), "{bad:?}");
        }
        let mut b = encode(Some(w));
        b[20] = 2;
        assert!(decode(&b).is_err());
        let mut b = encode(None);
        b[23] = 1;
        assert!(decode(&b).is_err());
    }
}
