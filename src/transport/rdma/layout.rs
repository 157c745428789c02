//! Where everything lives in the one registered buffer of a rank.

use crate::transport::mailbox::ENTRY;

/// Bytes before each slot's data, where the operation header of an operation's first chunk
/// lands (just ahead of the data, which stays 64-byte aligned).
pub(super) const PRE: usize = 64;

/// Buffer layout: for each rank p (own index unused) a block that only p may write, under a key
/// of its own: recv slots, a credit line, mailboxes; then the send slots for every rank, which
/// no peer may write. A slot is [`PRE`] bytes, then `slot` bytes of data.
#[derive(Debug, Clone, Copy)]
pub(super) struct Layout {
    pub(super) n: usize,
    pub(super) slots: usize,
    pub(super) slot: usize,
}

impl Layout {
    pub(super) fn region(&self) -> usize {
        self.slots * (PRE + self.slot)
    }
    /// Bytes of the block each peer writes.
    pub(super) fn block(&self) -> usize {
        self.region() + 64 + self.slots * ENTRY
    }
    /// The block `p` writes.
    pub(super) fn window(&self, p: usize) -> std::ops::Range<usize> {
        p * self.block()..(p + 1) * self.block()
    }
    /// Where chunk `k` from `p` lands: the data's offset.
    pub(super) fn recv_off(&self, p: usize, k: u64) -> usize {
        p * self.block() + (k as usize % self.slots) * (PRE + self.slot) + PRE
    }
    /// Where chunk `k` to `p` is staged: the data's offset.
    pub(super) fn send_off(&self, p: usize, k: u64) -> usize {
        self.n * self.block()
            + p * self.region()
            + (k as usize % self.slots) * (PRE + self.slot)
            + PRE
    }
    pub(super) fn credit_off(&self, p: usize) -> usize {
        p * self.block() + self.region()
    }
    pub(super) fn mailbox_off(&self, p: usize, k: u64) -> usize {
        p * self.block() + self.region() + 64 + (k as usize % self.slots) * ENTRY
    }
    pub(super) fn total(&self) -> usize {
        self.n * (self.block() + self.region())
    }
}
