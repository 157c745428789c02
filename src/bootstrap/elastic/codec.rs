//! The agreement's messages on the wire: one sealed frame each (`control::seal`, under the
//! group's session key and the agreement's tag), the sender's rank first. A decision carries
//! where its group meets; a FOLLOW's deadline travels as the time left (the ranks' clocks
//! share no origin).

use super::agreement::{Decision, Msg, Time};
use crate::bootstrap::wire::auth::KEY;
use crate::bootstrap::wire::port::{get_ranks, open, put_ranks, seal};
use crate::bootstrap::wire::{put_bytes, Reader};

const JOIN: u8 = 50;
const INVITE: u8 = 51;
const FOLLOW: u8 = 52;
const DECIDE: u8 = 53;
const ACK: u8 = 54;
const GO: u8 = 55;
const OUT: u8 = 56;

/// Whether a frame of kind `kind` may be one of the agreement's (a stranger's is dropped at
/// its first bytes).
pub(crate) fn is_agreement_kind(kind: u8) -> bool {
    (JOIN..=OUT).contains(&kind)
}

/// A message as read: its sender, what it says, and where the group it decides meets.
pub(crate) struct Read {
    pub from: usize,
    pub msg: Msg,
    pub meet: Option<String>,
}

/// `msg` from rank `from` at `now`, sealed with `key` under `tag`: the frame's kind and body.
/// `meet` is where a decision's group meets (for DECIDE, GO and OUT).
pub(crate) fn encode(
    key: &[u8; KEY],
    tag: u32,
    from: usize,
    msg: &Msg,
    meet: &str,
    now: Time,
) -> (u8, Vec<u8>) {
    let mut v = (from as u32).to_le_bytes().to_vec();
    let kind = match msg {
        Msg::Join { value, named } => {
            v.extend_from_slice(&value.to_le_bytes());
            put_ranks(&mut v, named);
            JOIN
        }
        Msg::Invite => INVITE,
        Msg::Follow {
            coord,
            until,
            alive,
        } => {
            v.extend_from_slice(&(*coord as u32).to_le_bytes());
            v.extend_from_slice(&until.saturating_sub(now).to_le_bytes());
            v.push(u8::from(*alive));
            FOLLOW
        }
        Msg::Ack { round, joined } => {
            v.extend_from_slice(&round.to_le_bytes());
            v.extend_from_slice(&(joined.len() as u32).to_le_bytes());
            for &(q, value) in joined {
                v.extend_from_slice(&(q as u32).to_le_bytes());
                v.extend_from_slice(&value.to_le_bytes());
            }
            ACK
        }
        Msg::Decide(d) | Msg::Go(d) | Msg::Out(d) => {
            put_decision(&mut v, d);
            put_bytes(&mut v, meet.as_bytes());
            match msg {
                Msg::Decide(_) => DECIDE,
                Msg::Go(_) => GO,
                _ => OUT,
            }
        }
    };
    (kind, seal(key, kind, tag, &v))
}

fn put_decision(v: &mut Vec<u8>, d: &Decision) {
    v.extend_from_slice(&(d.coordinator as u32).to_le_bytes());
    v.extend_from_slice(&d.round.to_le_bytes());
    v.extend_from_slice(&d.least.to_le_bytes());
    v.extend_from_slice(&d.all.to_le_bytes());
    put_ranks(v, &d.members);
}

fn get_decision(r: &mut Reader, n: usize) -> Option<Decision> {
    let coordinator = r.u32().ok()? as usize;
    let round = r.u32().ok()?;
    let least = r.u64().ok()?;
    let all = r.u64().ok()?;
    let members = get_ranks(r, n)?;
    // Members in the old order, each once, the coordinator among them.
    let ordered = members.windows(2).all(|w| w[0] < w[1]);
    (ordered && members.contains(&coordinator)).then_some(Decision {
        members,
        least,
        all,
        coordinator,
        round,
    })
}

/// The message in a frame of kind `kind` read at `now` by a rank of a group of `n`: `None` for
/// a forged, malformed or other-tagged one (never fatal: it is ignored).
pub(crate) fn decode(
    key: &[u8; KEY],
    tag: u32,
    kind: u8,
    frame: &[u8],
    n: usize,
    now: Time,
) -> Option<Read> {
    let body = open(key, kind, tag, frame)?;
    let mut r = Reader(body);
    let from = r.u32().ok()? as usize;
    let mut meet = None;
    let msg = match kind {
        JOIN => Msg::Join {
            value: r.u64().ok()?,
            named: get_ranks(&mut r, n)?,
        },
        INVITE => Msg::Invite,
        FOLLOW => {
            let coord = r.u32().ok()? as usize;
            let left = r.u64().ok()?;
            let alive = match r.take(1).ok()?[0] {
                0 => false,
                1 => true,
                _ => return None,
            };
            if coord >= n {
                return None;
            }
            Msg::Follow {
                coord,
                until: now.saturating_add(left),
                alive,
            }
        }
        ACK => {
            let round = r.u32().ok()?;
            let k = r.u32().ok()? as usize;
            if k > n {
                return None;
            }
            let joined = (0..k)
                .map(|_| {
                    let q = r.u32().ok()? as usize;
                    let v = r.u64().ok()?;
                    (q < n).then_some((q, v))
                })
                .collect::<Option<Vec<_>>>()?;
            Msg::Ack { round, joined }
        }
        DECIDE | GO | OUT => {
            let d = get_decision(&mut r, n)?;
            meet = Some(String::from_utf8(r.bytes().ok()?.to_vec()).ok()?);
            match kind {
                DECIDE => Msg::Decide(d),
                GO => Msg::Go(d),
                _ => Msg::Out(d),
            }
        }
        _ => return None,
    };
    (from < n && r.0.is_empty()).then_some(Read { from, msg, meet })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d() -> Decision {
        Decision {
            members: vec![0, 2, 3],
            least: 4,
            all: 5,
            coordinator: 2,
            round: 1,
        }
    }

    #[test]
    fn every_message_reads_back_as_written() {
        let key = [3u8; KEY];
        let msgs = [
            Msg::Join {
                value: 9,
                named: vec![0, 2],
            },
            Msg::Invite,
            Msg::Follow {
                coord: 1,
                until: 1500,
                alive: true,
            },
            Msg::Ack {
                round: 2,
                joined: vec![(1, 7), (3, 8)],
            },
            Msg::Decide(d()),
            Msg::Go(d()),
            Msg::Out(d()),
        ];
        for m in msgs {
            let (kind, f) = encode(&key, 7, 3, &m, "10.0.0.1:5", 1000);
            // Read 200 ms later on another clock: a deadline keeps the time left.
            let r = decode(&key, 7, kind, &f, 4, 200).expect("reads back");
            let want = match m.clone() {
                Msg::Follow { coord, alive, .. } => Msg::Follow {
                    coord,
                    until: 700,
                    alive,
                },
                m => m,
            };
            assert_eq!((r.from, &r.msg), (3, &want));
            assert_eq!(
                r.meet.is_some(),
                matches!(m, Msg::Decide(_) | Msg::Go(_) | Msg::Out(_))
            );
            assert!(decode(&key, 8, kind, &f, 4, 0).is_none(), "another tag");
            assert!(
                decode(&[4; KEY], 7, kind, &f, 4, 0).is_none(),
                "another key"
            );
            assert!(decode(&key, 7, kind, &f, 3, 0).is_none(), "a rank past n");
            for cut in 0..f.len() {
                assert!(decode(&key, 7, kind, &f[..cut], 4, 0).is_none());
            }
        }
    }

    #[test]
    fn a_decision_naming_a_rank_twice_or_out_of_order_is_refused() {
        let key = [3u8; KEY];
        for members in [vec![0, 2, 2], vec![2, 0], vec![0, 3], vec![]] {
            let bad = Decision { members, ..d() };
            let (kind, f) = encode(&key, 1, 0, &Msg::Go(bad), "", 0);
            assert!(decode(&key, 1, kind, &f, 4, 0).is_none());
        }
    }
}
