//! Where everything lives in the registered buffer a rank keeps for one peer.

use crate::transport::mailbox::ENTRY;

/// Bytes before each slot's data, where the operation header of an operation's first chunk
/// lands (just ahead of the data, which stays 64-byte aligned).
pub(super) const PRE: usize = 64;

/// The layout of a rank's buffer for one peer: the block that only the peer may write, under a
/// key of its own (receive slots, a credit line, mailboxes); then the send slots to it and a
/// scratch line, which no peer may write. A slot is [`PRE`] bytes, then `slot` bytes of data.
#[derive(Debug, Clone, Copy)]
pub(super) struct Layout {
    pub(super) slots: usize,
    pub(super) slot: usize,
}

impl Layout {
    pub(super) fn region(&self) -> usize {
        self.slots * (PRE + self.slot)
    }
    /// Bytes of the block the peer writes.
    pub(super) fn block(&self) -> usize {
        self.region() + 64 + self.slots * ENTRY
    }
    /// The block the peer writes.
    pub(super) fn window(&self) -> std::ops::Range<usize> {
        0..self.block()
    }
    /// Where chunk `k` from the peer lands: the data's offset.
    pub(super) fn recv_off(&self, k: u64) -> usize {
        (k as usize % self.slots) * (PRE + self.slot) + PRE
    }
    /// Where chunk `k` to the peer is staged: the data's offset.
    pub(super) fn send_off(&self, k: u64) -> usize {
        self.block() + (k as usize % self.slots) * (PRE + self.slot) + PRE
    }
    /// The word where the peer writes its consumed count of our chunks.
    pub(super) fn credit_off(&self) -> usize {
        self.region()
    }
    pub(super) fn mailbox_off(&self, k: u64) -> usize {
        self.region() + 64 + (k as usize % self.slots) * ENTRY
    }
    /// A word of our own that credit writes are sent from (inline).
    pub(super) fn scratch_off(&self) -> usize {
        self.block() + self.region()
    }
    pub(super) fn total(&self) -> usize {
        self.block() + self.region() + 64
    }
}
