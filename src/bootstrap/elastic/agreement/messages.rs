//! The agreement's answers to messages, by phase: what a rank seeking a coordinator, one
//! collecting, one deciding and one pledged to a decision do with each message.

use super::{Agreement, Decision, Msg, Outcome, Phase, Send, Time};
use std::collections::BTreeSet;

impl Agreement {
    pub(super) fn recv(&mut self, now: Time, from: usize, msg: Msg, out: &mut Vec<Send>) {
        if msg == Msg::Invite {
            self.inviters.insert(from);
        }
        if let Msg::Join { value, named } = &msg {
            self.heard.insert(from, *value);
            self.views.insert(from, named.iter().copied().collect());
            self.dropped.remove(&from);
        }
        // A rank that has returned answers: members GO, the others OUT (a coordinator woken
        // past its window that decides again learns where its members went).
        if let Phase::Ended(o) = &self.phase {
            let asks = matches!(
                msg,
                Msg::Join { .. } | Msg::Invite | Msg::Follow { .. } | Msg::Decide(_)
            );
            if let (Outcome::Decided(d), true) = (o, asks) {
                let reply = if d.members.contains(&from) {
                    Msg::Go(d.clone())
                } else {
                    Msg::Out(d.clone())
                };
                Self::send(out, from, reply);
            }
            return;
        }
        // From any phase: a decision that holds with this rank, or without it.
        match &msg {
            // GO is sent only for a decision that holds: it wins over any pledge.
            Msg::Go(d) if d.members.contains(&self.me) => {
                self.adopt(d.clone(), out);
                return;
            }
            Msg::Out(d) if !d.members.contains(&self.me) => {
                self.left_out(from, &d.clone(), out);
                return;
            }
            _ => {}
        }
        match self.phase.clone() {
            Phase::Collecting { .. } | Phase::Deciding { .. } if matches!(&msg, Msg::Decide(d) if from < self.me && d.members.contains(&self.me)) =>
            {
                // A lower coordinator decided with this rank: it follows (so do its joiners).
                let Msg::Decide(d) = msg else { return };
                self.suspects.remove(&from);
                self.pledge(now, from, d, out);
            }
            Phase::Seeking { c, until } => self.when_seeking(now, from, msg, c, until, out),
            Phase::Collecting { until } => self.when_collecting(now, from, msg, until, out),
            Phase::Deciding { d, acks, until } => {
                self.when_deciding(now, from, msg, (d, acks, until), out)
            }
            Phase::Pledged { c, until, .. } => self.when_pledged(now, from, msg, (c, until), out),
            Phase::Ended(_) => {}
        }
    }

    fn when_seeking(
        &mut self,
        now: Time,
        from: usize,
        msg: Msg,
        c: usize,
        until: Time,
        out: &mut Vec<Send>,
    ) {
        let g = self.grace;
        match msg {
            // A decision from the rank sought, or from a lower one (alive after all).
            Msg::Decide(d) if from <= c => {
                self.suspects.remove(&from);
                self.pledge(now, from, d, out)
            }
            Msg::Follow { coord, .. } if from == c && coord == self.me => self.collect(now, out),
            Msg::Follow {
                coord,
                until: u,
                alive,
            } if from == c => {
                // A rank heard from is sought even if suspected; one only chosen is not.
                if coord != c && (alive || !self.suspects.contains(&coord)) {
                    self.suspects.remove(&coord);
                    self.seek(coord, alive, now, out);
                } else {
                    self.extend(u + self.timeout + 2 * g);
                }
            }
            Msg::Invite => {
                self.suspects.remove(&from);
                if from < c {
                    self.seek(from, true, now, out);
                } else {
                    Self::follow(out, from, c, until, false);
                }
            }
            Msg::Join { .. } => Self::follow(out, from, c, until, false),
            _ => {}
        }
    }

    fn when_collecting(
        &mut self,
        now: Time,
        from: usize,
        msg: Msg,
        until: Time,
        out: &mut Vec<Send>,
    ) {
        let g = self.grace;
        if self.meets_collector(now, from, &msg, until, out) {
            return;
        }
        match msg {
            Msg::Join { .. } => {
                Self::follow(out, from, self.me, until, true);
                self.check_collected(now, out);
            }
            Msg::Follow {
                coord, until: u, ..
            } if coord != self.me => {
                // It waits on someone else until `u`, then may come here.
                self.extend(u + g);
                if coord == from {
                    // A higher collector: it defers to this one on the INVITE.
                    self.extend(now + 2 * g);
                }
            }
            _ => {}
        }
    }

    fn when_deciding(
        &mut self,
        now: Time,
        from: usize,
        msg: Msg,
        (d, mut acks, until): (Decision, BTreeSet<usize>, Time),
        out: &mut Vec<Send>,
    ) {
        let g = self.grace;
        if self.meets_collector(now, from, &msg, until, out) {
            return;
        }
        match msg {
            Msg::Ack { round, joined } if round == d.round && d.members.contains(&from) => {
                acks.insert(from);
                for (q, v) in joined {
                    let gone = self.lost.contains(&q) || self.dropped.contains(&q);
                    if q < self.n && !gone && q != self.me {
                        self.heard.insert(q, v);
                    }
                }
                if acks.len() + 1 < d.members.len() {
                    self.phase = Phase::Deciding { d, acks, until };
                } else if now > until {
                    // Acknowledgements read after the window (this rank was stopped):
                    // their senders may have given up on it, so ask them again.
                    self.decide(now, out);
                } else if self.heard.keys().any(|q| !d.members.contains(q)) {
                    // Latecomers gathered meanwhile: one more round with them all.
                    self.decide(now, out);
                } else {
                    for &q in &d.members {
                        if q != self.me {
                            Self::send(out, q, Msg::Go(d.clone()));
                        }
                    }
                    self.phase = Phase::Ended(Outcome::Decided(d));
                }
            }
            // A late joiner waits for the next round (it is heard); a member that asks
            // again is answered.
            Msg::Join { .. } if !d.members.contains(&from) => {
                Self::follow(out, from, self.me, until, true)
            }
            Msg::Join { .. } => {
                // It missed the decision: again, with time for its answer (a window that
                // closed stays closed: acknowledgements before it may be stale).
                Self::send(out, from, Msg::Decide(d.clone()));
                let until = if now <= until {
                    until.max(now + 2 * g)
                } else {
                    until
                };
                self.phase = Phase::Deciding { d, acks, until };
            }
            _ => {}
        }
    }

    fn when_pledged(
        &mut self,
        now: Time,
        from: usize,
        msg: Msg,
        (c, until): (usize, Time),
        out: &mut Vec<Send>,
    ) {
        match msg {
            Msg::Decide(d2) if from <= c => self.pledge(now, from, d2, out),
            Msg::Follow { coord, alive, .. } if from == c && coord != c => {
                self.suspects.remove(&coord);
                self.seek(coord, alive, now, out);
            }
            Msg::Join { .. } | Msg::Invite => Self::follow(out, from, c, until, true),
            _ => {}
        }
    }

    /// A collecting or deciding rank's answer to another that collects: it defers to a lower
    /// one, and tells a higher one's INVITE that it collects itself. Whether `msg` was such.
    fn meets_collector(
        &mut self,
        now: Time,
        from: usize,
        msg: &Msg,
        until: Time,
        out: &mut Vec<Send>,
    ) -> bool {
        if from < self.me && self.is_collector(msg, from) {
            self.defer(from, now, out);
        } else if *msg == Msg::Invite {
            Self::follow(out, from, self.me, until, true);
        } else {
            return false;
        }
        true
    }

    /// Whether `msg` from `from` says that `from` collects.
    fn is_collector(&self, msg: &Msg, from: usize) -> bool {
        match msg {
            Msg::Invite => true,
            Msg::Follow { coord, .. } => *coord == from,
            _ => false,
        }
    }

    fn pledge(&mut self, now: Time, c: usize, d: Decision, out: &mut Vec<Send>) {
        if !d.members.contains(&self.me) {
            self.left_out(c, &d, out);
            return;
        }
        let joined = self
            .heard
            .iter()
            .filter(|(q, _)| !d.members.contains(q))
            .map(|(&q, &v)| (q, v))
            .collect();
        Self::send(
            out,
            c,
            Msg::Ack {
                round: d.round,
                joined,
            },
        );
        // Past the coordinator's wait for acknowledgements and its next decision.
        let until = now + self.timeout + 2 * self.grace;
        self.redirect(c, true, until, out);
        self.phase = Phase::Pledged { c, d, until };
    }
}
