//! The shrink's agreement as a state machine without I/O: events in (the call, a message, a
//! refused connection, the clock), messages out, and at the end a decision, a refusal or a
//! timeout. The driver (sockets, the control port) and the model checker (every interleaving)
//! run this same code.
//!
//! The protocol. A survivor asks the lowest rank it does not suspect to coordinate (JOIN); a
//! rank that finds none below it collects: it INVITEs every rank not known dead, takes JOINs
//! until each is heard or known dead, or for the timeout (longer while a rank says it waits on
//! someone else and when), then DECIDEs, takes ACKs and sends GO. Whoever is asked and is not
//! the coordinator answers FOLLOW (whom it waits on, until when), so that nobody times out on
//! a rank that is alive and waiting. Two collectors that meet settle on the lower one. A rank
//! that has returned answers GO to members of its group and OUT to the others, so a member is
//! never told it was left out and a rank left out never forms a group of its own.

use std::collections::{BTreeMap, BTreeSet};

mod messages;

/// Milliseconds on the driver's clock (ticks in the model).
pub type Time = u64;

/// Ranks that may die or stop during one call before it gives up ([`Agreement::bound`]).
pub const MAX_FAULTS: usize = 4;

/// What the survivors agreed.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Decision {
    /// The ranks that go on, in their old order.
    pub members: Vec<usize>,
    /// The least and the bitwise AND of the members' values.
    pub least: u64,
    /// The bitwise AND of the members' values.
    pub all: u64,
    /// Who decided (where the group meets).
    pub coordinator: usize,
    /// The coordinator's round (a member dropped or a latecomer starts another).
    pub round: u32,
}

/// A message between two ranks' state machines.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Msg {
    /// The sender takes part, with its value; the receiver is asked to coordinate.
    Join {
        /// The value the sender brings.
        value: u64,
        /// The ranks its failure named (it waited on them for the timeout, or lost them).
        named: Vec<usize>,
    },
    /// The sender collects: the receiver is asked to join it.
    Invite,
    /// The sender waits on `coord` until `until` (`coord` is the sender itself while it
    /// collects).
    Follow {
        /// Whom the sender waits on.
        coord: usize,
        /// Until when.
        until: Time,
        /// Whether the sender has heard from `coord` in this agreement (it is alive), or only
        /// chose it.
        alive: bool,
    },
    /// The coordinator's decision, to be acknowledged.
    Decide(Decision),
    /// A member acknowledges round `round`.
    Ack {
        /// The round acknowledged.
        round: u32,
        /// Ranks that joined the sender and are not in the decision, with their values: the
        /// coordinator decides again with them.
        joined: Vec<(usize, u64)>,
    },
    /// The decision holds.
    Go(Decision),
    /// The group went on as `Decision` without the receiver.
    Out(Decision),
}

/// What happens to a rank's state machine.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Event {
    /// A message from rank `from`.
    Recv {
        /// The sender.
        from: usize,
        /// What it sent.
        msg: Msg,
    },
    /// Rank `q`'s port refused a connection: it is dead.
    Lost(usize),
    /// The clock passed [`Agreement::deadline`].
    Timer,
}

/// What a state machine asks of its driver.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Send {
    /// The rank to send to.
    pub to: usize,
    /// What to send.
    pub msg: Msg,
}

/// How the agreement ended for this rank.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// This rank goes on in the decided group.
    Decided(Decision),
    /// The group went on without this rank; `by` told it.
    LeftOut {
        /// Who told it.
        by: usize,
        /// The group that went on.
        members: Vec<usize>,
    },
    /// The bound passed; the rank waited on `waited_on` last.
    TimedOut {
        /// The rank it waited on last.
        waited_on: usize,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Phase {
    /// Waiting on coordinator `c` until `until`.
    Seeking { c: usize, until: Time },
    /// Collecting JOINs until `until`.
    Collecting { until: Time },
    /// Decision `d` sent; ACKs so far.
    Deciding {
        d: Decision,
        acks: BTreeSet<usize>,
        until: Time,
    },
    /// Acknowledged `d` of coordinator `c`.
    Pledged { c: usize, d: Decision, until: Time },
    /// Returned: answers latecomers.
    Ended(Outcome),
}

/// One rank's side of a shrink's agreement.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Agreement {
    me: usize,
    n: usize,
    value: u64,
    timeout: Time,
    /// Added to a wait for a message to cross and be answered.
    grace: Time,
    /// The whole call ends by then.
    bound: Time,
    suspects: BTreeSet<usize>,
    /// The ranks this rank's failure named (its first suspects, kept).
    named: BTreeSet<usize>,
    /// The ranks each rank heard from named, as its JOIN said.
    views: BTreeMap<usize, BTreeSet<usize>>,
    lost: BTreeSet<usize>,
    /// Collectors that invited this rank (alive when they did).
    inviters: BTreeSet<usize>,
    /// Members this rank dropped for not acknowledging: back only by a JOIN of their own.
    dropped: BTreeSet<usize>,
    /// JOINs taken (at any phase), with their values.
    heard: BTreeMap<usize, u64>,
    round: u32,
    phase: Phase,
}

impl Agreement {
    /// How long a call takes at most when `faults` ranks die or stop while it runs (the
    /// model checker proves it; `docs/DESIGN.md`): a round of a timeout and two crossings per
    /// fault, two more, and a timeout.
    pub fn bound_with(faults: usize, timeout: Time, grace: Time) -> Time {
        (faults as Time + 2) * (timeout + 2 * grace) + timeout
    }

    /// Where a call gives up: the bound with up to `MAX_FAULTS` faults (fewer ranks, fewer).
    pub fn bound(n: usize, timeout: Time, grace: Time) -> Time {
        Self::bound_with(n.min(MAX_FAULTS), timeout, grace)
    }

    /// Rank `me` of `n` calls shrink at `now`, suspecting `suspects` and bringing `value`;
    /// each wait `timeout`, each answer `grace`. The messages to send first come back too.
    pub fn start(
        me: usize,
        n: usize,
        suspects: &[usize],
        value: u64,
        now: Time,
        timeout: Time,
        grace: Time,
    ) -> (Agreement, Vec<Send>) {
        let named: BTreeSet<usize> = suspects
            .iter()
            .copied()
            .filter(|&q| q != me && q < n)
            .collect();
        let mut a = Agreement {
            me,
            n,
            value,
            timeout,
            grace,
            bound: now + Self::bound(n, timeout, grace),
            suspects: named.clone(),
            named,
            views: BTreeMap::new(),
            lost: BTreeSet::new(),
            inviters: BTreeSet::new(),
            dropped: BTreeSet::new(),
            heard: BTreeMap::new(),
            round: 0,
            phase: Phase::Collecting { until: now },
        };
        let mut out = Vec::new();
        a.next_target(now, &mut out);
        (a, out)
    }

    /// When [`Event::Timer`] is due, if it is.
    pub fn deadline(&self) -> Option<Time> {
        let t = match &self.phase {
            Phase::Seeking { until, .. }
            | Phase::Collecting { until }
            | Phase::Deciding { until, .. }
            | Phase::Pledged { until, .. } => *until,
            Phase::Ended(_) => return None,
        };
        Some(t.min(self.bound))
    }

    /// How it ended, once it has.
    pub fn outcome(&self) -> Option<&Outcome> {
        match &self.phase {
            Phase::Ended(o) => Some(o),
            _ => None,
        }
    }

    /// Whether this rank has decided and awaits its members' acknowledgements.
    pub fn is_deciding(&self) -> bool {
        matches!(self.phase, Phase::Deciding { .. })
    }

    /// Whom the rank waits on now (for errors and stall reports).
    pub fn waiting_on(&self) -> Option<usize> {
        match &self.phase {
            Phase::Seeking { c, .. } | Phase::Pledged { c, .. } => Some(*c),
            _ => None,
        }
    }

    /// Where the rank is, in a few words (for logs and the checker's traces).
    pub fn describe(&self) -> String {
        match &self.phase {
            Phase::Seeking { c, until } => format!("seeks {c} until {until}"),
            Phase::Collecting { until } => format!("collects until {until}"),
            Phase::Deciding { d, acks, until } => {
                format!(
                    "decided {:?} r{}, acks {acks:?} until {until}",
                    d.members, d.round
                )
            }
            Phase::Pledged { c, d, until } => {
                format!("pledged to {c} {:?} r{} until {until}", d.members, d.round)
            }
            Phase::Ended(o) => format!("{o:?}"),
        }
    }

    /// Takes `event` at `now`; the messages to send.
    pub fn handle(&mut self, now: Time, event: Event) -> Vec<Send> {
        let mut out = Vec::new();
        if let Event::Lost(q) = event {
            self.lost.insert(q);
            self.suspects.insert(q);
            self.heard.remove(&q);
            self.views.remove(&q);
        }
        // The bound ends the call on the clock alone: a message that settles it is taken.
        if event == Event::Timer && self.outcome().is_none() && now >= self.bound {
            let waited_on = self.waiting_on().unwrap_or(self.me);
            self.phase = Phase::Ended(Outcome::TimedOut { waited_on });
            return out;
        }
        match event {
            Event::Recv { from, msg } if from != self.me && from < self.n => {
                self.recv(now, from, msg, &mut out)
            }
            Event::Recv { .. } => {}
            Event::Lost(q) => self.lost_rank(now, q, &mut out),
            Event::Timer => self.timer(now, &mut out),
        }
        out
    }

    fn send(out: &mut Vec<Send>, to: usize, msg: Msg) {
        out.push(Send { to, msg });
    }

    /// Tells `to` that this rank waits on `coord` until `until` (`alive`: heard from it).
    fn follow(out: &mut Vec<Send>, to: usize, coord: usize, until: Time, alive: bool) {
        Self::send(
            out,
            to,
            Msg::Follow {
                coord,
                until,
                alive,
            },
        );
    }

    /// Seeks the lowest rank not suspected, or collects if that is this one.
    fn next_target(&mut self, now: Time, out: &mut Vec<Send>) {
        let c = (0..self.n)
            .find(|q| !self.suspects.contains(q))
            .unwrap_or(self.me);
        // A collector that invited this rank is alive: after a silence it is joined rather
        // than a lower rank never heard from (one alive and collecting invites everyone).
        let invited = (self.inviters.iter())
            .copied()
            .find(|q| !self.suspects.contains(q) && !self.lost.contains(q));
        match invited {
            Some(i) if c != self.me || i < self.me => self.seek(i, true, now, out),
            _ if c == self.me => self.collect(now, out),
            _ => self.seek(c, false, now, out),
        }
    }

    /// Asks `c` to coordinate (`alive`: it was heard from, not only chosen).
    fn seek(&mut self, c: usize, alive: bool, now: Time, out: &mut Vec<Send>) {
        let until = now + self.timeout;
        self.phase = Phase::Seeking { c, until };
        let named = self.named.iter().copied().collect();
        Self::send(
            out,
            c,
            Msg::Join {
                value: self.value,
                named,
            },
        );
        self.redirect(c, alive, until, out);
    }

    /// Those that joined this rank are told whom it follows now, to join that one.
    fn redirect(&self, c: usize, alive: bool, until: Time, out: &mut Vec<Send>) {
        for &q in self.heard.keys() {
            if q != c {
                Self::follow(out, q, c, until, alive);
            }
        }
    }

    fn collect(&mut self, now: Time, out: &mut Vec<Send>) {
        // A rank that calls a timeout after this one is still heard.
        let until = now + self.timeout + self.grace;
        self.phase = Phase::Collecting { until };
        for q in 0..self.n {
            if q != self.me && !self.lost.contains(&q) {
                // The heard are told to wait; the rest are asked to join.
                let msg = if self.heard.contains_key(&q) {
                    Msg::Follow {
                        coord: self.me,
                        until,
                        alive: true,
                    }
                } else {
                    Msg::Invite
                };
                Self::send(out, q, msg);
            }
        }
        self.check_collected(now, out);
    }

    /// Decides once every other rank is heard, lost, or named by this rank and by every rank
    /// heard (all waited on it for a timeout: it is not waited on again).
    fn check_collected(&mut self, now: Time, out: &mut Vec<Send>) {
        let doubted = |q: usize| {
            !self.heard.is_empty()
                && self.named.contains(&q)
                && self
                    .heard
                    .keys()
                    .all(|h| self.views.get(h).is_some_and(|v| v.contains(&q)))
        };
        let all_in = (0..self.n).all(|q| {
            q == self.me || self.heard.contains_key(&q) || self.lost.contains(&q) || doubted(q)
        });
        if all_in {
            self.decide(now, out);
        }
    }

    fn decide(&mut self, now: Time, out: &mut Vec<Send>) {
        self.round += 1;
        let mut members: Vec<usize> = self.heard.keys().copied().collect();
        members.push(self.me);
        members.sort_unstable();
        let values = members
            .iter()
            .map(|q| self.heard.get(q).copied().unwrap_or(self.value));
        let d = Decision {
            least: values.clone().min().unwrap_or(self.value),
            all: values.fold(u64::MAX, |a, v| a & v),
            members,
            coordinator: self.me,
            round: self.round,
        };
        if d.members.len() == 1 {
            self.phase = Phase::Ended(Outcome::Decided(d));
            return;
        }
        for &q in &d.members {
            if q != self.me {
                Self::send(out, q, Msg::Decide(d.clone()));
            }
        }
        self.phase = Phase::Deciding {
            d,
            acks: BTreeSet::new(),
            until: now + self.timeout,
        };
    }

    /// Stops collecting or deciding and joins lower rank `c` (those heard follow).
    fn defer(&mut self, c: usize, now: Time, out: &mut Vec<Send>) {
        self.suspects.remove(&c);
        self.seek(c, true, now, out);
    }

    /// Tells those that joined this rank what became of them under `d`.
    fn pass_on(&self, d: &Decision, out: &mut Vec<Send>) {
        for &q in self.heard.keys() {
            let msg = if d.members.contains(&q) {
                Msg::Go(d.clone())
            } else {
                Msg::Out(d.clone())
            };
            Self::send(out, q, msg);
        }
    }

    /// A decision that holds with this rank, learnt from another member.
    fn adopt(&mut self, d: Decision, out: &mut Vec<Send>) {
        self.pass_on(&d, out);
        self.phase = Phase::Ended(Outcome::Decided(d));
    }

    fn left_out(&mut self, by: usize, d: &Decision, out: &mut Vec<Send>) {
        self.pass_on(d, out);
        self.phase = Phase::Ended(Outcome::LeftOut {
            by,
            members: d.members.clone(),
        });
    }

    fn extend(&mut self, to: Time) {
        match &mut self.phase {
            Phase::Seeking { until, .. }
            | Phase::Collecting { until }
            | Phase::Pledged { until, .. } => *until = (*until).max(to),
            _ => {}
        }
    }

    fn lost_rank(&mut self, now: Time, q: usize, out: &mut Vec<Send>) {
        match self.phase.clone() {
            Phase::Seeking { c, .. } | Phase::Pledged { c, .. } if c == q => {
                self.next_target(now, out)
            }
            Phase::Collecting { .. } => self.check_collected(now, out),
            Phase::Deciding { d, .. } if d.members.contains(&q) => self.decide(now, out),
            _ => {}
        }
    }

    fn timer(&mut self, now: Time, out: &mut Vec<Send>) {
        match self.phase.clone() {
            Phase::Seeking { c, until } | Phase::Pledged { c, until, .. } if now >= until => {
                self.suspects.insert(c);
                self.next_target(now, out);
            }
            Phase::Collecting { until } if now >= until => self.decide(now, out),
            Phase::Deciding { d, acks, until } if now >= until => {
                // Members that did not acknowledge are dropped; the rest decide again.
                for q in d.members {
                    if q != self.me && !acks.contains(&q) {
                        self.heard.remove(&q);
                        self.dropped.insert(q);
                    }
                }
                self.decide(now, out);
            }
            _ => {}
        }
    }
}
