//! The pass ledger: what the CPU did to the bytes a communicator's operations moved, counted per
//! chunk (never per byte), so that a saved pass shows as a count where the wire hides it in time.
//!
//! A pass is one sweep of the CPU over a chunk: a copy into a transport's own send memory
//! (copy-in), a reduction of a received chunk with the caller's (reduce), or a copy of a received
//! chunk into the caller's memory (copy-out). A fused pass that writes its result to two places
//! (the caller's buffer and the next send slot) is one pass whose second write is counted apart.

/// Bytes by what the CPU (or the kernel) did to them, and what went on the wire; a snapshot
/// ([`crate::Comm::ledger`]) or the difference of two.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ledger {
    /// Bytes copied from the caller's memory into a transport's own (a staging slot, a peer's
    /// shared-memory slot, a send queue) before they went out.
    pub copied_in: u64,
    /// Bytes of received chunks reduced with the caller's (each read two operands and wrote
    /// one result).
    pub reduced: u64,
    /// Bytes of received chunks copied into the caller's memory.
    pub copied_out: u64,
    /// Of the reduced and copied-out bytes, those a fused pass also wrote to a second place
    /// (a reduction or copy straight into the next send slot that the caller's buffer needs too).
    pub second_writes: u64,
    /// Bytes the kernel copied through sockets (TCP: sent and received payload), on system time.
    pub kernel: u64,
    /// Payload bytes posted to peers (no headers, descriptors or credits).
    pub wire: u64,
    /// Memory registrations made for the caller's buffers (per operation or across calls).
    pub registrations: u64,
    /// Nanoseconds those registrations took.
    pub registration_ns: u64,
}

impl Ledger {
    /// Bytes a pass of the CPU touched: copied in, reduced and copied out.
    pub fn pass_bytes(&self) -> u64 {
        self.copied_in + self.reduced + self.copied_out
    }

    /// CPU passes per wire byte: (copy-in, reduce, copy-out), each its bytes over [`Ledger::wire`]
    /// (zeros where nothing went on the wire).
    pub fn passes_per_wire_byte(&self) -> (f64, f64, f64) {
        if self.wire == 0 {
            return (0.0, 0.0, 0.0);
        }
        let w = self.wire as f64;
        (
            self.copied_in as f64 / w,
            self.reduced as f64 / w,
            self.copied_out as f64 / w,
        )
    }

    /// All CPU passes per wire byte (the three of [`Ledger::passes_per_wire_byte`] together).
    pub fn passes(&self) -> f64 {
        let (a, b, c) = self.passes_per_wire_byte();
        a + b + c
    }
}

/// `Add` and `Sub`, field by field (a difference of snapshots, a sum over transports).
macro_rules! fieldwise {
    ($trait:ident, $method:ident, $op:tt) => {
        impl std::ops::$trait for Ledger {
            type Output = Ledger;
            fn $method(self, o: Ledger) -> Ledger {
                Ledger {
                    copied_in: self.copied_in $op o.copied_in,
                    reduced: self.reduced $op o.reduced,
                    copied_out: self.copied_out $op o.copied_out,
                    second_writes: self.second_writes $op o.second_writes,
                    kernel: self.kernel $op o.kernel,
                    wire: self.wire $op o.wire,
                    registrations: self.registrations $op o.registrations,
                    registration_ns: self.registration_ns $op o.registration_ns,
                }
            }
        }
    };
}
fieldwise!(Add, add, +);
fieldwise!(Sub, sub, -);

/// What a pass did, for [`Ledger::count`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pass {
    /// A copy into a transport's own send memory.
    CopyIn,
    /// A reduction of a received chunk.
    Reduce,
    /// A copy of a received chunk into the caller's memory.
    CopyOut,
    /// A fused pass's write to a second place.
    SecondWrite,
    /// A kernel copy through a socket.
    Kernel,
    /// Payload posted to a peer.
    Wire,
}

impl Ledger {
    /// Counts `bytes` of `pass`.
    #[inline]
    pub(crate) fn count(&mut self, pass: Pass, bytes: usize) {
        let b = bytes as u64;
        match pass {
            Pass::CopyIn => self.copied_in += b,
            Pass::Reduce => self.reduced += b,
            Pass::CopyOut => self.copied_out += b,
            Pass::SecondWrite => self.second_writes += b,
            Pass::Kernel => self.kernel += b,
            Pass::Wire => self.wire += b,
        }
    }
}
