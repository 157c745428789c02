//! `shrink`: after a failure (or to drop ranks that do not answer), the ranks still alive agree
//! over their control ports on who goes on and on a value (`bootstrap/elastic/`), and meet
//! again as a new communicator at their coordinator; the old one ends here alone, with no
//! collective teardown.

use super::*;
use crate::bootstrap::elastic::driver::{agree, bound, Attempt, Decision, Step};
use crate::bootstrap::elastic::retired::Answerer;
use crate::transport::Kept;

/// What the ranks that go on after a [`Comm::shrink`] agreed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Agreed {
    /// The old rank of each rank of the new communicator, by new rank.
    pub members: Vec<usize>,
    /// The least of the values the members brought (say, the last step each completed).
    pub least: u64,
    /// The bitwise AND of the values the members brought (MPI ULFM's agree).
    pub all: u64,
}

/// How many times the survivors meet again after their new group failed to form (a member
/// lost between the agreement and its rendezvous).
const MEETINGS: usize = 3;

/// The tag of a generation's agreement: shrink's attempts `0..MEETINGS`, then grow's commit.
pub(super) fn agreement_tag(epoch: u32, attempt: usize) -> u32 {
    epoch
        .wrapping_mul(MEETINGS as u32 + 1)
        .wrapping_add(attempt as u32)
}

/// The attempt number of a grow's commit ([`agreement_tag`]).
pub(super) const GROW_COMMIT: usize = MEETINGS;

/// How long the members drain the connections they keep at most: past it a connection whose
/// peer's fence has not come is closed, and dialed again when first needed.
const DRAIN_FOR: Duration = Duration::from_secs(2);

impl Comm {
    /// Ends this communicator and gives the ranks still alive a new one over themselves
    /// (renumbered: the coordinator first, then the others in their old order), with every one
    /// agreeing on its members, and on the least and the AND of the `value`s they bring. Called
    /// by every surviving rank, after an operation failed because ranks were lost, or at any
    /// time to drop ranks that do not answer. No rank needs to know who was lost: a rank that
    /// does not call it within the timeout (`RDMACOMM_TIMEOUT`), or that every caller names, is
    /// left out (and told so if it calls later), as is one lost during the call; the lowest
    /// rank alive coordinates. Bounded (`docs/GUIDE.md`): an error names whom it waited on.
    /// Afterwards this communicator refuses every operation; drop it (its teardown waits on
    /// nobody).
    pub fn shrink(&self, value: u64) -> Result<(Comm, Agreed)> {
        if self.view.is_some() {
            return Err(Error::InvalidArgument(
                "shrink: a shared view shrinks with the communicator it was split from: shrink \
                 that one, then split_shared again"
                    .into(),
            ));
        }
        self.check_thread(&"shrink")?;
        self.wait_started_ones();
        if self.size == 1 {
            let alone = self.successor(self.cfg.clone(), None, self.core.epoch + 1);
            self.retire_for("its shrunk successor of 1 rank");
            return Ok((
                alone,
                Agreed {
                    members: vec![0],
                    least: value,
                    all: value,
                },
            ));
        }
        let mut control = self.core.control.lock().unwrap_or_else(|e| e.into_inner());
        let ctl = control.as_ref().ok_or_else(|| {
            Error::Bootstrap(format!(
                "rank {}: this communicator has no control port to shrink through (it was \
                 shrunk already, or its rendezvous gave it none)",
                self.rank
            ))
        })?;
        let suspects = self.suspects();
        let t = self.cfg.timeout;
        log::info!(
            "rank {}: shrinks, suspecting {suspects:?}, within {:?} at most",
            self.rank,
            bound(self.size, t)
        );
        let mut meetings = 0;
        let mut carried = Vec::new();
        let (comm, agreed) = loop {
            // Each attempt agrees under its own tag: an ended attempt's answers are not the
            // next one's. A frame of the next one means the others are there already.
            let tag = agreement_tag(self.core.epoch, meetings);
            let attempt = Attempt {
                tag,
                next: (meetings + 1 < MEETINGS)
                    .then(|| agreement_tag(self.core.epoch, meetings + 1)),
                carried: std::mem::take(&mut carried),
            };
            let (d, ended) = match agree(ctl, attempt, &suspects, value, t, "a shrink")? {
                Step::Decided(d, ended) => (d, ended),
                Step::Moved(frames) => {
                    carried = frames;
                    meetings += 1;
                    continue;
                }
            };
            self.retire_for(&format!(
                "its shrunk successor of {} rank(s)",
                d.members.len()
            ));
            // From now on the ended machine answers at this rank's old port: a member that
            // missed the GO learns it, a rank left out learns it was, while the group meets
            // and after.
            let went_on = ctl
                .try_clone()
                .ok()
                .map(|port| Answerer::start(port, tag, *ended));
            meetings += 1;
            match self.meet_again(d) {
                Ok((comm, agreed)) => {
                    comm.keep_answerer(went_on);
                    break (comm, agreed);
                }
                Err(e) if meetings < MEETINGS => {
                    log::warn!(
                        "rank {}: the shrunk group did not form ({e}); agreeing again",
                        self.rank
                    );
                }
                Err(e) => return Err(e),
            }
        };
        // The port is the answerer's now (its own descriptor): this one is closed.
        drop(control.take());
        Ok((comm, agreed))
    }

    /// Which generation of its group this communicator is: 0 for one made by
    /// [`Comm::new`] (and its splits), one more for each [`Comm::shrink`].
    pub fn epoch(&self) -> u32 {
        self.core.epoch
    }

    /// The ranks this one's first failure names as lost.
    fn suspects(&self) -> Vec<usize> {
        match &*self.core.poisoned.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(Poison(Error::PeerFailed { peer, .. } | Error::Timeout { peer, .. }))
                if peer.rank != self.rank =>
            {
                vec![peer.rank]
            }
            _ => Vec::new(),
        }
    }

    /// Ends this communicator on this rank alone, for `successor` (in words): later calls are
    /// refused, and its link is failed so that its teardown waits at no barrier.
    pub(super) fn retire_for(&self, successor: &str) {
        let why = format!(
            "rank {} left this communicator (epoch {}) for {successor}",
            self.rank, self.core.epoch
        );
        self.poison_with(why.clone());
        if let Some(l) = self.lock().link.as_mut() {
            l.watch_mut().retire(why);
        }
    }

    /// Keeps `a` (the ended agreement answering at an old port) for this communicator's life.
    pub(super) fn keep_answerer(&self, a: Option<Answerer>) {
        if let Some(a) = a {
            let mut all = self
                .core
                .answerers
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            all.push(a);
        }
    }

    /// The communicator that follows this one, over `link`, as generation `epoch`: it keeps the
    /// world's coordinator address (where newcomers look) and the answerers of the generations
    /// before.
    pub(super) fn successor(
        &self,
        mut cfg: Config,
        link: Option<Box<dyn Transport>>,
        epoch: u32,
    ) -> Comm {
        cfg.coordinator = self.cfg.coordinator.clone();
        let mut c = Comm::with_link_of(cfg, link, self.algorithm());
        let core = Arc::get_mut(&mut c.core).expect("a new communicator's core is its own");
        core.epoch = epoch;
        *core.answerers.get_mut().unwrap_or_else(|e| e.into_inner()) = std::mem::take(
            &mut *self
                .core
                .answerers
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        );
        c
    }

    /// The new group the survivors agreed on, met at its coordinator.
    fn meet_again(&self, d: Decision) -> Result<(Comm, Agreed)> {
        let Decision {
            members,
            meet,
            least,
            all,
            mut listener,
            identity,
        } = d;
        let rank = members
            .iter()
            .position(|&q| q == self.rank)
            .expect("a decision names its members");
        let cfg = self
            .cfg
            .for_group(rank, members.len(), meet, self.members_here(&members));
        let epoch = self.core.epoch + 1;
        // The connections between members carry over, drained, where both ends can keep them.
        let kept = match self.lock().link.as_mut() {
            Some(l) if members.len() > 1 => l.keep(
                &members,
                epoch,
                Instant::now() + self.cfg.timeout.min(DRAIN_FOR),
            ),
            _ => Kept::default(),
        };
        let carried = kept.len();
        let link = if members.len() > 1 {
            // Only the old group's members can present the new group's identity.
            let mut meet_cfg = cfg.clone();
            meet_cfg.job_id = identity;
            Some(transport::connect_keeping(
                &cfg,
                cfg.transport,
                kept,
                &mut |card| {
                    crate::bootstrap::rendezvous::rendezvous_on(&meet_cfg, card, listener.take())
                },
            )?)
        } else {
            None
        };
        let comm = self.successor(cfg, link, epoch);
        log::info!(
            "rank {} goes on as rank {rank} of {} (epoch {}), with ranks {members:?}, {carried} \
             connection(s) carried over",
            self.rank,
            members.len(),
            comm.core.epoch
        );
        Ok((
            comm,
            Agreed {
                members,
                least,
                all,
            },
        ))
    }
}
