//! What both transports do about failures: keep the first one, tell the group over the side
//! channel, learn of others' from it, and decide whom to blame.

use crate::error::{Error, Peer, Result};
use crate::transport::bootstrap::SideChannel;
use std::time::{Duration, Instant};

/// Progress calls between reads of the side channel while a transport spins or yields.
pub const SIDE_POLL_EVERY: u32 = 1024;

/// The side channel and the first failure of one rank's transport.
pub struct Watch {
    side: SideChannel,
    failed: Option<(usize, String)>,
    rank: usize,
    addrs: Vec<String>,
    calls: u32,
}

impl Watch {
    /// Watches through `side` for `rank`, whose group's host addresses are `addrs`.
    pub fn new(side: SideChannel, rank: usize, addrs: Vec<String>) -> Watch {
        Watch {
            side,
            failed: None,
            rank,
            addrs,
            calls: 0,
        }
    }

    /// A rank's identity, for errors.
    pub fn peer(&self, rank: usize) -> Peer {
        Peer {
            rank,
            addr: self.addrs.get(rank).cloned().unwrap_or_default(),
        }
    }

    /// This rank's index among the ranks that share its host address, and their number.
    pub fn local_rank(&self) -> (usize, usize) {
        let me = &self.addrs[self.rank];
        let before = self.addrs[..self.rank].iter().filter(|a| *a == me).count();
        (before, self.addrs.iter().filter(|a| *a == me).count())
    }

    /// The recorded failure as an error, if any.
    pub fn error(&self) -> Option<Error> {
        self.failed.as_ref().map(|(p, why)| Error::PeerFailed {
            peer: self.peer(*p),
            reason: why.clone(),
        })
    }

    /// Records the first failure (blaming `p`), tells the group, and returns the error. A broken
    /// link to p may be the echo of another rank's failure (p failed too and exited), so the side
    /// channel gets a moment (250 ms at most) to deliver the root cause first.
    pub fn fail(&mut self, p: usize, reason: String) -> Error {
        if self.failed.is_none() && p != self.rank {
            let until = Instant::now() + Duration::from_millis(250);
            while self.side.failure().is_none() && Instant::now() < until {
                self.side.poll();
                std::thread::sleep(Duration::from_millis(5));
            }
            self.failed = self.side.failure();
        }
        if self.failed.is_none() {
            let told = format!(
                "{reason} (reported by rank {} ({}))",
                self.rank, self.addrs[self.rank]
            );
            self.side.abort(p, &told);
            self.failed = Some((p, reason));
        }
        self.error().expect("just recorded")
    }

    /// Reads the side channel now: a peer's abort or a closed connection becomes our failure.
    pub fn poll(&mut self) -> Result<()> {
        self.side.poll();
        if self.failed.is_none() {
            self.failed = self.side.failure();
        }
        self.error().map_or(Ok(()), Err)
    }

    /// [`Watch::poll`] on every [`SIDE_POLL_EVERY`]th call (no clock read: where the clocksource
    /// traps, as under an emulated CPU, reading it every 16 polls took 7% of a small operation's
    /// time); a transport that backs off polls the side channel on every nap instead.
    pub fn poll_sometimes(&mut self) -> Result<()> {
        self.calls = self.calls.wrapping_add(1);
        if self.calls % SIDE_POLL_EVERY == 0 {
            self.poll()?;
        }
        self.error().map_or(Ok(()), Err)
    }

    /// Teardown, after the caller flushed its sends: while panicking, tell the group at once;
    /// if healthy, wait (bounded) at the close barrier so no rank tears down while a peer still
    /// writes to it, then say goodbye. Returns whether the caller may still flush first.
    pub fn close(&mut self, limit: Duration) {
        if self.failed.is_some() {
            return;
        }
        if std::thread::panicking() {
            let why = format!(
                "rank {} dropped its communicator while panicking",
                self.rank
            );
            self.side.abort(self.rank, &why);
            return;
        }
        let _ = self.side.close_barrier(limit);
        self.side.bye();
    }

    /// Whether nothing has failed and the thread is not unwinding (then sends are flushed).
    pub fn healthy(&self) -> bool {
        self.failed.is_none() && !std::thread::panicking()
    }
}
