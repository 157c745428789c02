//! The one numbering of operations between two ranks and the check of the descriptor a peer's
//! first chunk carries, shared by every transport (RDMA, TCP, shared memory): a transport says
//! when an operation starts, what it posted and took; this says what to send and whether what
//! came matches.

use crate::transport::op::{self, OpDesc, OpKind, Partners};

/// One peer's operation numbers in each direction (see [`OpDesc::seq`]) and whether the
/// current operation's first chunk each way is still to come, as of operation `seen` with
/// every peer.
#[derive(Debug, Clone, Copy)]
struct Counts {
    out: u64,
    inn: u64,
    first_out: bool,
    first_in: bool,
    seen: u64,
}

/// The operation under way and its numbers with every peer.
///
/// An operation with every peer ([`Partners::All`], every collective) moves every peer's
/// numbers; it is counted once and applied to a peer when that peer is next touched, so that
/// starting one costs the same at any world size.
#[derive(Debug)]
pub(crate) struct Numbering {
    me: usize,
    op: OpDesc,
    /// `op`'s wire bytes, encoded once per operation and numbered per peer.
    wire: [u8; op::WIRE],
    peers: Vec<Counts>,
    /// Operations with every peer started so far.
    all: u64,
}

impl Numbering {
    /// Numbers for rank `me` of `n`; the first operation with each peer is number 0.
    pub(crate) fn new(me: usize, n: usize) -> Numbering {
        let op = OpDesc::new(OpKind::Barrier, 0);
        let none = Counts {
            out: u64::MAX,
            inn: u64::MAX,
            first_out: false,
            first_in: false,
            seen: 0,
        };
        Numbering {
            me,
            op,
            wire: op.encode(),
            peers: vec![none; n],
            all: 0,
        }
    }

    /// Peer `p`'s counts with the operations with every peer it has not seen yet applied.
    fn view(&self, p: usize) -> Counts {
        let mut c = self.peers[p];
        let missed = self.all - c.seen;
        if missed > 0 {
            c.out = c.out.wrapping_add(missed);
            c.inn = c.inn.wrapping_add(missed);
            // Nothing went either way since the last of them started (a post or a take
            // would have applied them).
            c.first_out = true;
            c.first_in = true;
            c.seen = self.all;
        }
        c
    }

    /// Applies to `p` the operations with every peer it has not seen yet.
    fn sync(&mut self, p: usize) -> &mut Counts {
        self.peers[p] = self.view(p);
        &mut self.peers[p]
    }

    /// Starts `op` with the peers of `scope`: each direction it uses gets its next number.
    pub(crate) fn start(&mut self, op: &OpDesc, scope: Partners) {
        self.op = *op;
        self.wire = op.encode();
        if scope == Partners::All {
            self.all += 1;
            return;
        }
        let n = self.peers.len();
        scope.each(n, true, |p| {
            let c = self.sync(p);
            c.out = c.out.wrapping_add(1);
            c.first_out = true;
        });
        scope.each(n, false, |p| {
            let c = self.sync(p);
            c.inn = c.inn.wrapping_add(1);
            c.first_in = true;
        });
    }

    /// The descriptor of the operation under way, numbered for what this rank sends to `p`.
    pub(crate) fn desc_to(&self, p: usize) -> [u8; op::WIRE] {
        OpDesc::numbered(self.wire, self.view(p).out)
    }

    /// Whether the operation's first chunk to `p` is yet to be posted.
    pub(crate) fn first_to(&self, p: usize) -> bool {
        self.view(p).first_out
    }

    /// A chunk to `p` was posted.
    pub(crate) fn posted_to(&mut self, p: usize) {
        self.sync(p).first_out = false;
    }

    /// Whether the operation's first chunk from `p` is yet to be taken (and checked).
    pub(crate) fn first_from(&self, p: usize) -> bool {
        self.view(p).first_in
    }

    /// Checks the descriptor `got` that `p`'s chunk carries against this rank's operation:
    /// `Err` names both calls, in words.
    pub(crate) fn check_from(&self, p: usize, got: &[u8]) -> Result<(), String> {
        let seq = self.view(p).inn;
        if got == OpDesc::numbered(self.wire, seq) {
            return Ok(());
        }
        OpDesc { seq, ..self.op }.check(got, p, self.me)
    }

    /// A chunk from `p` was taken (its descriptor checked).
    pub(crate) fn took_from(&mut self, p: usize) {
        self.sync(p).first_in = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_count_each_direction_and_a_peer_out_of_step_is_named() {
        let (mut a, mut b) = (Numbering::new(0, 2), Numbering::new(1, 2));
        let sum = OpDesc::new(OpKind::AllReduce, 64);
        // Rank 0 sends twice to rank 1, then both run a collective.
        for _ in 0..2 {
            a.start(&OpDesc::new(OpKind::SendRecv, 8), Partners::To(1));
            b.start(&OpDesc::new(OpKind::SendRecv, 8), Partners::From(0));
            assert!(a.first_to(1) && b.first_from(0));
            assert_eq!(b.check_from(0, &a.desc_to(1)), Ok(()));
            a.posted_to(1);
            b.took_from(0);
            assert!(!a.first_to(1) && !b.first_from(0));
        }
        a.start(&sum, Partners::All);
        b.start(&sum, Partners::All);
        assert_eq!(b.check_from(0, &a.desc_to(1)), Ok(()));
        assert_eq!(a.check_from(1, &b.desc_to(0)), Ok(()));
        // Numbers differ per direction: rank 1 has sent once, rank 0 three times.
        assert_eq!(OpDesc::decode(&b.desc_to(0), 0).map(|d| d.seq), Some(0));
        assert_eq!(OpDesc::decode(&a.desc_to(1), 0).map(|d| d.seq), Some(2));
        // Rank 1 skips an operation: rank 0's check names what each called.
        b.start(&OpDesc::new(OpKind::Barrier, 0), Partners::All);
        b.start(&sum, Partners::All);
        a.start(&sum, Partners::All);
        let why = a.check_from(1, &b.desc_to(0)).unwrap_err();
        assert!(
            why.contains("rank 1") && why.contains("operation 2"),
            "{why}"
        );
    }

    #[test]
    fn a_batch_numbers_only_the_peers_it_uses() {
        let mut a = Numbering::new(0, 4);
        let send = OpDesc::new(OpKind::Batch, 0);
        a.start(
            &send,
            Partners::Peers {
                to: &[2, 3],
                from: &[1],
            },
        );
        assert!(a.first_to(2) && a.first_to(3) && !a.first_to(1));
        assert!(a.first_from(1) && !a.first_from(2) && !a.first_from(3));
        let seq = |w: [u8; op::WIRE]| OpDesc::decode(&w, 0).map(|d| d.seq);
        assert_eq!(seq(a.desc_to(2)), Some(0));
        assert_eq!(
            seq(a.desc_to(1)),
            Some(u64::MAX),
            "nothing sent to rank 1 yet"
        );
    }

    /// The numbering as it was before operations with every peer were counted once: every
    /// peer's numbers moved at each start (the reference the lazy numbering must equal).
    struct Eager {
        out: Vec<u64>,
        inn: Vec<u64>,
        first_out: Vec<bool>,
        first_in: Vec<bool>,
    }

    impl Eager {
        fn start(&mut self, scope: Partners) {
            let n = self.out.len();
            scope.each(n, true, |p| {
                self.out[p] = self.out[p].wrapping_add(1);
                self.first_out[p] = true;
            });
            scope.each(n, false, |p| {
                self.inn[p] = self.inn[p].wrapping_add(1);
                self.first_in[p] = true;
            });
        }
    }

    #[test]
    fn operations_with_every_peer_number_as_if_each_peer_were_walked() {
        let n = 9;
        let mut lazy = Numbering::new(0, n);
        let mut eager = Eager {
            out: vec![u64::MAX; n],
            inn: vec![u64::MAX; n],
            first_out: vec![false; n],
            first_in: vec![false; n],
        };
        let mut rng = crate::transport::test_rng::Rng::new(0x2545_f491_4f6c_dd1du64);
        let mut rnd = |m: u64| rng.below(m);
        let seq = |w: [u8; op::WIRE]| OpDesc::decode(&w, 0).map(|d| d.seq);
        for _ in 0..3000 {
            let (a, b) = (rnd(n as u64) as usize, rnd(n as u64) as usize);
            let (to, from) = ([a], [b]);
            let scope = match rnd(4) {
                0 | 1 => Partners::All,
                2 => Partners::To(a),
                _ => Partners::Peers {
                    to: &to,
                    from: &from,
                },
            };
            let op = OpDesc::new(OpKind::AllReduce, rnd(100) as usize);
            lazy.start(&op, scope);
            eager.start(scope);
            // Post to and take from a few peers, as an algorithm would.
            for _ in 0..rnd(3) {
                let p = rnd(n as u64) as usize;
                if rnd(2) == 0 {
                    lazy.posted_to(p);
                    eager.first_out[p] = false;
                } else {
                    lazy.took_from(p);
                    eager.first_in[p] = false;
                }
            }
            let p = rnd(n as u64) as usize;
            assert_eq!(seq(lazy.desc_to(p)), Some(eager.out[p]));
            assert_eq!(lazy.first_to(p), eager.first_out[p]);
            assert_eq!(lazy.first_from(p), eager.first_in[p]);
            let mut mine = op;
            mine.seq = eager.inn[p];
            assert_eq!(lazy.check_from(p, &mine.encode()), Ok(()));
        }
    }
}
