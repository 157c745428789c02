//! The one numbering of operations between two ranks and the check of the descriptor a peer's
//! first chunk carries, shared by every transport (RDMA, TCP, shared memory): a transport says
//! when an operation starts, what it posted and took; this says what to send and whether what
//! came matches.

use crate::transport::op::{self, OpDesc, OpKind, Partners};

/// One peer's operation numbers in each direction (see [`OpDesc::seq`]) and whether the
/// current operation's first chunk each way is still to come.
#[derive(Debug, Clone, Copy)]
struct Counts {
    out: u64,
    inn: u64,
    first_out: bool,
    first_in: bool,
}

/// The operation under way and its numbers with every peer.
#[derive(Debug)]
pub(crate) struct Numbering {
    me: usize,
    op: OpDesc,
    /// `op`'s wire bytes, encoded once per operation and numbered per peer.
    wire: [u8; op::WIRE],
    peers: Vec<Counts>,
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
        };
        Numbering {
            me,
            op,
            wire: op.encode(),
            peers: vec![none; n],
        }
    }

    /// Starts `op` with the peers of `scope`: each direction it uses gets its next number.
    pub(crate) fn start(&mut self, op: &OpDesc, scope: Partners) {
        self.op = *op;
        self.wire = op.encode();
        let n = self.peers.len();
        let peers = &mut self.peers;
        scope.each(n, true, |p| {
            peers[p].out = peers[p].out.wrapping_add(1);
            peers[p].first_out = true;
        });
        scope.each(n, false, |p| {
            peers[p].inn = peers[p].inn.wrapping_add(1);
            peers[p].first_in = true;
        });
    }

    /// The descriptor of the operation under way, numbered for what this rank sends to `p`.
    pub(crate) fn desc_to(&self, p: usize) -> [u8; op::WIRE] {
        OpDesc::numbered(self.wire, self.peers[p].out)
    }

    /// Whether the operation's first chunk to `p` is yet to be posted.
    pub(crate) fn first_to(&self, p: usize) -> bool {
        self.peers[p].first_out
    }

    /// A chunk to `p` was posted.
    pub(crate) fn posted_to(&mut self, p: usize) {
        self.peers[p].first_out = false;
    }

    /// Whether the operation's first chunk from `p` is yet to be taken (and checked).
    pub(crate) fn first_from(&self, p: usize) -> bool {
        self.peers[p].first_in
    }

    /// Checks the descriptor `got` that `p`'s chunk carries against this rank's operation:
    /// `Err` names both calls, in words.
    pub(crate) fn check_from(&self, p: usize, got: &[u8]) -> Result<(), String> {
        let seq = self.peers[p].inn;
        if got == OpDesc::numbered(self.wire, seq) {
            return Ok(());
        }
        OpDesc { seq, ..self.op }.check(got, p, self.me)
    }

    /// A chunk from `p` was taken (its descriptor checked).
    pub(crate) fn took_from(&mut self, p: usize) {
        self.peers[p].first_in = false;
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
}
