//! What both transports do about failures: keep the first one, tell the group over the side
//! channel, learn of others' from it, and decide whom to blame.

use crate::bootstrap::{Probe, SideChannel, MAX_PROBES, STALL_VERDICT, STALL_WINDOW};
use crate::error::{Error, Peer, Result};
use crate::transport::op::{OpDesc, OpKind, Partners};
use crate::transport::pacer::{Pacer, Wait};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How a failure record starts when the application aborted (`Comm::abort`): such a record
/// becomes [`Error::Aborted`] on every rank.
pub const ABORTED: &str = "aborted by the application";

/// An abort asked for from any thread ([`Watch::abort_request`]): the transport's next poll
/// turns it into this rank's failure and tells the group.
#[derive(Debug, Default)]
pub struct AbortRequest {
    set: AtomicBool,
    why: Mutex<String>,
}

impl AbortRequest {
    /// Asks for the abort (the first reason stays).
    pub fn request(&self, why: &str) {
        let mut w = self.why.lock().unwrap_or_else(|e| e.into_inner());
        if !self.set.load(Ordering::Acquire) {
            *w = why.to_string();
            self.set.store(true, Ordering::Release);
        }
    }

    /// The reason, if the abort was asked for.
    pub fn reason(&self) -> Option<String> {
        if !self.set.load(Ordering::Acquire) {
            return None;
        }
        Some(self.why.lock().unwrap_or_else(|e| e.into_inner()).clone())
    }
}

/// How long a rank may still wait on a peer that closed its communicator: what the peer sent
/// before closing arrives within it.
pub const LEAVE_GRACE: Duration = Duration::from_millis(200);

/// Progress calls between reads of the side channel while a transport spins or yields.
pub const SIDE_POLL_EVERY: u32 = 1024;

/// How long a wait on a peer goes without progress before this rank tells the peer what it
/// waits for ([`SideChannel::probe`]): a peer that called something else says so at once.
pub const PROBE_AFTER: Duration = Duration::from_millis(100);

/// Operations toward each peer remembered for comparing with its probes.
const HISTORY: usize = 4;

/// The side channel and the first failure of one rank's transport.
pub struct Watch {
    side: SideChannel,
    failed: Option<(usize, String)>,
    rank: usize,
    addrs: Vec<String>,
    calls: u32,
    request: Arc<AbortRequest>,
    /// The operation under way, numbered per peer as the transports number it.
    op: OpDesc,
    /// The operations started here, numbered per peer.
    ledger: Ledger,
    /// Probes for operations this rank has not reached yet, compared once it has.
    held: Vec<Probe>,
    /// Empty buffers for the next read of probes (see [`Watch::poll`]).
    spare: Vec<Probe>,
    fresh: Vec<Probe>,
    /// Whether this operation's wait was told to the peer waited on.
    probed: bool,
}

/// The operations a rank started, numbered per peer in each direction, with each peer's last
/// [`HISTORY`] each way: what a peer's probe is compared against.
struct Ledger {
    seq_out: Vec<u64>,
    seq_in: Vec<u64>,
    /// Per peer, the last [`HISTORY`] operations toward it: (number, descriptor).
    sent: Vec<[(u64, OpDesc); HISTORY]>,
    /// Per peer, the last [`HISTORY`] operations from it: (number, descriptor).
    recvd: Vec<[(u64, OpDesc); HISTORY]>,
    /// Operations started here, and per peer the last one that sent to it / received from it
    /// (so a wait knows which ways its operation goes with the peer waited on).
    ops: u64,
    out_at: Vec<u64>,
    in_at: Vec<u64>,
    /// Operations with every peer ([`Partners::All`]) started so far, the last [`HISTORY`] of
    /// them (`ops` at their start, descriptor) by that count, and per peer how many of them
    /// its numbers include: they are applied to a peer when it is next looked at, so that a
    /// collective's start does not walk the world.
    all: u64,
    all_log: [(u64, OpDesc); HISTORY],
    seen_all: Vec<u64>,
}

impl Ledger {
    fn new(n: usize) -> Ledger {
        let none = OpDesc::new(OpKind::Barrier, 0);
        Ledger {
            seq_out: vec![0; n],
            seq_in: vec![0; n],
            sent: vec![[(0, none); HISTORY]; n],
            recvd: vec![[(0, none); HISTORY]; n],
            ops: 0,
            out_at: vec![0; n],
            in_at: vec![0; n],
            all: 0,
            all_log: [(0, none); HISTORY],
            seen_all: vec![0; n],
        }
    }

    fn started(&mut self, op: &OpDesc, scope: Partners) {
        self.ops += 1;
        if scope == Partners::All {
            self.all += 1;
            self.all_log[self.all as usize % HISTORY] = (self.ops, *op);
            return;
        }
        let n = self.seq_out.len();
        scope.each(n, true, |p| self.sync(p));
        scope.each(n, false, |p| self.sync(p));
        let ops = self.ops;
        let (seq_out, sent, out_at) = (&mut self.seq_out, &mut self.sent, &mut self.out_at);
        scope.each(n, true, |p| {
            let k = seq_out[p].wrapping_add(1);
            seq_out[p] = k;
            sent[p][k as usize % HISTORY] = (k, *op);
            out_at[p] = ops;
        });
        let (seq_in, recvd, in_at) = (&mut self.seq_in, &mut self.recvd, &mut self.in_at);
        scope.each(n, false, |p| {
            let k = seq_in[p].wrapping_add(1);
            seq_in[p] = k;
            recvd[p][k as usize % HISTORY] = (k, *op);
            in_at[p] = ops;
        });
    }

    /// Applies to peer `p`'s numbers and history the operations with every peer started since
    /// it was last looked at, as if each had walked it.
    fn sync(&mut self, p: usize) {
        let missed = self.all - self.seen_all[p];
        if missed == 0 {
            return;
        }
        self.seen_all[p] = self.all;
        // Only the last HISTORY of them are remembered, here and in the peer's history alike.
        for j in self.all - missed.min(HISTORY as u64) + 1..=self.all {
            let op = self.all_log[j as usize % HISTORY].1;
            let t = missed - (self.all - j);
            let k = self.seq_out[p].wrapping_add(t);
            self.sent[p][k as usize % HISTORY] = (k, op);
            let k = self.seq_in[p].wrapping_add(t);
            self.recvd[p][k as usize % HISTORY] = (k, op);
        }
        self.seq_out[p] = self.seq_out[p].wrapping_add(missed);
        self.seq_in[p] = self.seq_in[p].wrapping_add(missed);
        let last = self.all_log[self.all as usize % HISTORY].0;
        self.out_at[p] = last;
        self.in_at[p] = last;
    }
}

/// What a peer's probe shows against this rank's calls.
enum Verdict {
    /// The calls differ: why, in words.
    Mismatch(String),
    /// The calls agree (or can no longer be compared).
    Fine,
    /// This rank has not reached the operation the probe is about.
    NotYet,
}

/// How long a wait goes without progress before it reads the side channel and probes at each
/// of the pacer's clock reads, whatever the polling mode.
pub const WATCH_AFTER: Duration = Duration::from_millis(1);

impl Watch {
    /// Watches through `side` for `rank`, whose group's host addresses are `addrs`.
    pub fn new(side: SideChannel, rank: usize, addrs: Vec<String>) -> Watch {
        let n = addrs.len();
        Watch {
            side,
            failed: None,
            rank,
            addrs,
            calls: 0,
            request: Arc::default(),
            op: OpDesc::new(OpKind::Barrier, 0),
            ledger: Ledger::new(n),
            held: Vec::with_capacity(MAX_PROBES),
            spare: Vec::with_capacity(MAX_PROBES),
            fresh: Vec::with_capacity(MAX_PROBES),
            probed: false,
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
        self.failed
            .as_ref()
            .map(|(p, why)| match why.strip_prefix(ABORTED) {
                Some(rest) => Error::Aborted {
                    by: self.peer(*p),
                    reason: rest.trim_start_matches(": ").to_string(),
                },
                None => Error::PeerFailed {
                    peer: self.peer(*p),
                    reason: why.clone(),
                },
            })
    }

    /// The handle through which any thread asks this transport to abort.
    pub fn abort_request(&self) -> Arc<AbortRequest> {
        self.request.clone()
    }

    /// Turns an abort asked for into this rank's failure, told to the group.
    fn take_request(&mut self) {
        if self.failed.is_none() {
            if let Some(why) = self.request.reason() {
                let told = format!("{ABORTED}: {why}");
                self.side.abort(self.rank, &told);
                self.failed = Some((self.rank, told));
            }
        }
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

    /// This rank is waiting on `p` now (rank 0 counts it when it judges a stall).
    #[inline]
    pub fn waiting_on(&mut self, p: Option<usize>) {
        self.side.set_waiting(p);
    }

    /// This rank's wait on `p` made no progress for `after`. A waiting neighbour is not to
    /// blame, so the rank is reported to rank 0, which follows every stalled rank's wait to the
    /// one that waits on nobody and tells everyone; that verdict is returned
    /// ([`Error::Timeout`] naming that rank). Without a verdict in time, rank 0 itself is not
    /// answering and is named.
    pub fn stalled(&mut self, p: usize, after: Duration) -> Error {
        if self.failed.is_none() {
            self.side.report_stall(p);
            let until = Instant::now() + STALL_WINDOW + Duration::from_millis(400);
            loop {
                self.side.poll();
                if let Some(f) = self.side.failure() {
                    self.failed = Some(f);
                    break;
                }
                if Instant::now() >= until {
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        if self.failed.is_none() {
            let why = format!(
                "{STALL_VERDICT}: rank {} waited {after:?} on rank {p}, and rank 0 did not answer \
                 its report within {:?} (its relay answers whatever rank 0 computes: the process \
                 is stopped or hung)",
                self.rank,
                STALL_WINDOW + Duration::from_millis(400)
            );
            let culprit = if self.rank == 0 { p } else { 0 };
            self.side.abort(culprit, &why);
            self.failed = Some((culprit, why));
        }
        match self.failed.clone() {
            Some((r, why)) if why.starts_with(STALL_VERDICT) => Error::Timeout {
                peer: self.peer(r),
                what: why,
                after,
            },
            _ => self.error().expect("recorded"),
        }
    }

    /// A mismatch of calls found here (its cause is known: no wait for another verdict):
    /// recorded, told to the group, and returned as [`Error::Mismatch`] naming `p`. A failure
    /// recorded before wins.
    pub fn mismatch(&mut self, p: usize, reason: String) -> Error {
        if self.failed.is_none() {
            self.failed = self.side.failure();
        }
        if self.failed.is_some() {
            return self.error().expect("recorded");
        }
        let told = format!(
            "{reason} (found by rank {} ({}))",
            self.rank, self.addrs[self.rank]
        );
        self.side.abort(p, &told);
        self.failed = Some((p, told));
        Error::Mismatch {
            peer: self.peer(p),
            reason,
        }
    }

    /// This rank failed (`reason`): recorded and told to the group at once.
    pub fn abort_self(&mut self, reason: String) {
        if self.failed.is_none() {
            let told = format!("{reason} (rank {} ({}))", self.rank, self.addrs[self.rank]);
            self.side.abort(self.rank, &told);
            self.failed = Some((self.rank, told));
        }
    }

    /// Operation `op` starts with the peers of `scope` (numbered as the transports number it).
    pub fn started(&mut self, op: &OpDesc, scope: Partners) {
        self.op = *op;
        self.probed = false;
        self.ledger.started(op, scope);
    }

    /// Reads the side channel now: a peer's abort or a closed connection becomes our failure,
    /// as does a peer's probe that shows it waits on this rank in another call.
    pub fn poll(&mut self) -> Result<()> {
        self.take_request();
        self.side.poll();
        if self.failed.is_none() {
            self.failed = self.side.failure();
        }
        if self.failed.is_none() {
            // Three buffers of MAX_PROBES swap round: a wait that probes allocates nothing.
            let held = std::mem::replace(&mut self.held, std::mem::take(&mut self.spare));
            let mut fresh = std::mem::take(&mut self.fresh);
            self.side.take_probes(&mut fresh);
            let all = held.iter().map(|p| (p, false));
            for (pr, new) in all.chain(fresh.iter().map(|p| (p, true))) {
                if pr.from < self.ledger.seq_out.len() {
                    self.ledger.sync(pr.from);
                }
                match self.deadlocked(pr, new) {
                    Verdict::Mismatch(why) => return Err(self.mismatch(pr.from, why)),
                    Verdict::NotYet if self.held.len() < MAX_PROBES => self.held.push(*pr),
                    _ => {}
                }
            }
            (self.spare, self.fresh) = (held, fresh);
            self.spare.clear();
        }
        self.error().map_or(Ok(()), Err)
    }

    /// What peer `q`'s wait on this rank (`pr`) shows against this rank's calls. Each way the
    /// peer's operation goes is compared with this rank's operation of the same number the other
    /// way (what q sends as its k-th is what this rank receives as its k-th), once this rank has
    /// reached it: numbers are absolute, so an old probe compares as truly as a new one. Then one
    /// more case: q waits to receive an operation this rank has not reached toward it while this
    /// rank waits on q for one q has not reached toward it (neither can move again), judged on a
    /// `fresh` probe only (a held one may be out of date).
    fn deadlocked(&self, pr: &Probe, fresh: bool) -> Verdict {
        let (q, me) = (pr.from, self.rank);
        if q >= self.ledger.seq_out.len() || q == me {
            return Verdict::Fine;
        }
        let mut not_yet = false;
        // (q's number, this rank's count that way, this rank's history that way)
        let ways = [
            (
                pr.recvs,
                pr.seq_in,
                self.ledger.seq_out[q],
                &self.ledger.sent[q],
            ),
            (
                pr.sends,
                pr.seq_out,
                self.ledger.seq_in[q],
                &self.ledger.recvd[q],
            ),
        ];
        for (goes, k, mine_so_far, history) in ways {
            if !goes || k == 0 {
                continue;
            }
            if k > mine_so_far {
                not_yet = true;
                continue;
            }
            let (at, op) = history[k as usize % HISTORY];
            if at != k {
                continue; // too old to compare
            }
            let mine = OpDesc { seq: k, ..op };
            if let Err(why) = mine.check(&OpDesc::numbered(pr.desc, k), q, me) {
                return Verdict::Mismatch(format!(
                    "{why} (rank {q} waited on rank {me} without either moving a byte)"
                ));
            }
        }
        let behind_me = pr.recvs && self.ledger.seq_out[q] < pr.seq_in;
        let behind_them = pr.seq_out < self.ledger.seq_in[q];
        if fresh && behind_me && behind_them && self.side.waiting() == Some(q) {
            let theirs = OpDesc::decode(&pr.desc, pr.seq_in)
                .map_or_else(|| "an operation".to_string(), |t| t.to_string());
            return Verdict::Mismatch(format!(
                "mismatched operations: rank {q} waits on rank {me} in {theirs} (its operation {} \
                 counting what rank {me} sent to it), while rank {me} waits on rank {q} in {} (its \
                 operation {} counting what rank {q} sent to it): neither can move; every rank \
                 must call the same operations, with the same arguments, in the same order",
                pr.seq_in, self.op, self.ledger.seq_in[q]
            ));
        }
        if not_yet {
            Verdict::NotYet
        } else {
            Verdict::Fine
        }
    }

    /// [`Watch::poll`] while waiting on `p`, after a nap, the wait having made no progress for
    /// `stalled`: also fails when `p` closed its communicator at least [`LEAVE_GRACE`] ago (time
    /// for what it sent before to arrive); past [`PROBE_AFTER`], tells `p` what it waits for.
    pub fn poll_waiting(&mut self, p: usize, stalled: Duration) -> Result<()> {
        if !self.probed && stalled >= PROBE_AFTER && p != self.rank && p < self.ledger.seq_in.len()
        {
            self.probed = true;
            self.ledger.sync(p);
            self.side.probe(&Probe {
                from: p,
                seq_in: self.ledger.seq_in[p],
                seq_out: self.ledger.seq_out[p],
                desc: self.op.encode(),
                sends: self.ledger.out_at[p] == self.ledger.ops,
                recvs: self.ledger.in_at[p] == self.ledger.ops,
            });
        }
        self.poll()?;
        match self.side.leaving_since(p) {
            Some(t) if t.elapsed() >= LEAVE_GRACE && p != self.rank => Err(self.left(p)),
            _ => Ok(()),
        }
    }

    /// One idle poll of a wait on `p`: what the pacer says to do next. Whenever the pacer read
    /// the clock on a wait stalled for [`WATCH_AFTER`] (in every polling mode, spinning too),
    /// the side channel is read and the wait told to `p` ([`Watch::poll_waiting`]); a wait that
    /// ran out becomes the stall verdict.
    pub fn idle(&mut self, pacer: &mut Pacer, p: usize, timeout: Duration) -> Result<Wait> {
        let w = pacer.idle();
        if w == Wait::Expired {
            return Err(self.stalled(p, timeout));
        }
        if w == Wait::BackOff || (pacer.just_read() && pacer.stalled_for() >= WATCH_AFTER) {
            self.poll_waiting(p, pacer.stalled_for())?;
        }
        Ok(w)
    }

    /// Records (and tells the group) that `p` left while this rank waited on it.
    fn left(&mut self, p: usize) -> Error {
        if self.failed.is_none() {
            let why = format!(
                "it closed its communicator (dropped it, or its process exited) while rank {} \
                 still waited on it",
                self.rank
            );
            self.side.abort(p, &why);
            self.failed = Some((p, why));
        }
        self.error().expect("recorded")
    }

    /// [`Watch::poll`] on every [`SIDE_POLL_EVERY`]th call (no clock read: where the clocksource
    /// traps, as under an emulated CPU, reading it every 16 polls took 7% of a small operation's
    /// time); a transport that backs off polls the side channel on every nap instead.
    pub fn poll_sometimes(&mut self) -> Result<()> {
        self.calls = self.calls.wrapping_add(1);
        if self.calls % SIDE_POLL_EVERY == 0 || self.request.set.load(Ordering::Relaxed) {
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
        self.side.leave();
        let _ = self.side.close_barrier(limit);
        self.side.bye();
    }

    /// What the rendezvous left to reach the group again without the data path, once.
    pub fn take_control(&mut self) -> Option<crate::bootstrap::Control> {
        self.side.take_control()
    }

    /// Ends this link here alone, telling nobody (its group moved on to a shrunk one): its
    /// teardown then waits at no barrier.
    pub fn retire(&mut self, why: String) {
        if self.failed.is_none() {
            self.failed = Some((self.rank, why));
        }
    }

    /// Whether nothing has failed and the thread is not unwinding (then sends are flushed).
    pub fn healthy(&self) -> bool {
        self.failed.is_none() && !std::thread::panicking()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ledger and the same operations walked peer by peer, as before operations with every
    /// peer were counted once, agree on every peer's numbers, history and last operations.
    #[test]
    fn a_ledger_applies_operations_with_every_peer_as_if_walked() {
        let n = 7;
        let mut lazy = Ledger::new(n);
        let mut eager = Ledger::new(n);
        let mut rng = crate::transport::test_rng::Rng::new(0x9e37_79b9_7f4a_7c15u64);
        let mut rnd = |m: u64| rng.below(m);
        for i in 0..2000 {
            let (a, b) = (rnd(n as u64) as usize, rnd(n as u64) as usize);
            let (to, from) = ([a], [b]);
            let scope = match rnd(5) {
                0..=2 => Partners::All,
                3 => Partners::From(b),
                _ => Partners::Peers {
                    to: &to,
                    from: &from,
                },
            };
            let op = OpDesc::new(OpKind::AllReduce, i);
            lazy.started(&op, scope);
            // The walk: every peer's numbers move, one by one.
            let all = Partners::Peers {
                to: &[0, 1, 2, 3, 4, 5, 6],
                from: &[0, 1, 2, 3, 4, 5, 6],
            };
            eager.started(&op, if scope == Partners::All { all } else { scope });
            let p = rnd(n as u64) as usize;
            lazy.sync(p);
            assert_eq!(lazy.seq_out[p], eager.seq_out[p], "operation {i}, peer {p}");
            assert_eq!(lazy.seq_in[p], eager.seq_in[p]);
            assert_eq!(lazy.sent[p], eager.sent[p]);
            assert_eq!(lazy.recvd[p], eager.recvd[p]);
            assert_eq!(
                (lazy.out_at[p], lazy.in_at[p]),
                (eager.out_at[p], eager.in_at[p])
            );
        }
    }
}
