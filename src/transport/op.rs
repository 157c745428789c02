//! What an operation is, as every rank's transport carries it: a sequence number and what the
//! caller asked (kind, dtype, reduction, algorithm, root, bytes) in a 16-byte header that rides
//! on the first chunk of an operation to each peer. The receiver compares it with its own
//! before it lands a byte, so calls that differ across ranks are an error that names both,
//! never a silent mix of two operations.

use crate::dtype::{AllReduce, DType};

/// Bytes of an encoded [`OpDesc`].
pub const WIRE: usize = 16;
const _: () = assert!(WIRE == crate::bootstrap::DESC_BYTES);

/// Declares [`OpKind`] from one list: each kind's wire code (explicit, never reused), its doc
/// and its name in messages; decoding and naming are generated from the same list, so a kind
/// cannot be added without both.
macro_rules! op_kinds {
    ($($(#[doc = $doc:literal])* $kind:ident = $code:literal, $name:literal;)*) => {
        /// The kind of a communicator operation.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        #[repr(u8)]
        pub enum OpKind {
            $($(#[doc = $doc])* $kind = $code,)*
        }

        impl OpKind {
            /// The kind whose wire code is `c`, if any.
            fn from_code(c: u8) -> Option<OpKind> {
                match c {
                    $($code => Some(OpKind::$kind),)*
                    _ => None,
                }
            }

            /// Its name in messages.
            pub fn name(self) -> &'static str {
                match self {
                    $(OpKind::$kind => $name,)*
                }
            }
        }
    };
}

op_kinds! {
    /// `all_reduce`.
    AllReduce = 1, "all_reduce";
    /// `all_gather` (bytes: each rank's input).
    AllGather = 2, "all_gather";
    /// `sum_scatter` (bytes: the input).
    SumScatter = 3, "sum_scatter";
    /// `broadcast`.
    Broadcast = 4, "broadcast";
    /// `barrier`.
    Barrier = 5, "barrier";
    /// A `send` matched by a `recv` (bytes: the message).
    SendRecv = 6, "send/recv";
    /// Step `algo` of `split` (an exchange of colors, keys or endpoints).
    Split = 7, "split";
    /// `all_to_all` (bytes: one block).
    AllToAll = 8, "all_to_all";
    /// `all_to_allv` (bytes: 0; the blocks' lengths are checked chunk by chunk).
    AllToAllV = 9, "all_to_allv";
    /// `reduce` to a root (bytes: the buffer).
    Reduce = 10, "reduce";
    /// `gather` to a root (bytes: each rank's input).
    Gather = 11, "gather";
    /// `scatter` from a root (bytes: each rank's output).
    Scatter = 12, "scatter";
    /// `all_gather_v` (bytes: the output).
    AllGatherV = 13, "all_gather_v";
    /// `reduce_scatter_v` (bytes: the input).
    ReduceScatterV = 14, "reduce_scatter_v";
    /// A batch of sends and receives posted together (`sendrecv`, `batch`; bytes: 0).
    Batch = 15, "batch";
}

impl OpKind {
    /// Whether the operation has a root (then part of its descriptor).
    pub fn rooted(self) -> bool {
        match self {
            OpKind::Broadcast | OpKind::Reduce | OpKind::Gather | OpKind::Scatter => true,
            OpKind::AllReduce
            | OpKind::AllGather
            | OpKind::SumScatter
            | OpKind::Barrier
            | OpKind::SendRecv
            | OpKind::Split
            | OpKind::AllToAll
            | OpKind::AllToAllV
            | OpKind::AllGatherV
            | OpKind::ReduceScatterV
            | OpKind::Batch => false,
        }
    }

    fn code(self) -> u8 {
        self as u8
    }
}

/// One operation as a rank called it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpDesc {
    /// The operation's number in its direction between two ranks: the operations before it
    /// that sent from the one to the other (every collective, and each send of the one matched
    /// by a receive of the other), counted alike on both sides.
    pub seq: u64,
    /// What was called.
    pub kind: OpKind,
    /// Element type, where the operation has one.
    pub dtype: Option<DType>,
    /// Reduction, where the operation has one.
    pub reduce: Option<AllReduce>,
    /// The algorithm setting the chunk pattern depends on (all_reduce's `Algo`, broadcast's
    /// chain or tree, split's step), as a small number named by [`OpDesc::algo_name`].
    pub algo: u8,
    /// The root of a rooted operation ([`OpKind::rooted`]; 0 otherwise).
    pub root: usize,
    /// The byte length that sets the transfer (see [`OpKind`]); 48 bits on the wire.
    pub bytes: u64,
    /// The communicator that called it, where several share one link (a shared view's number,
    /// see `Comm::split_shared`; 0: the link's own).
    pub comm: u16,
}

/// Which peers an operation exchanges with, for its numbering ([`OpDesc::seq`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Partners<'a> {
    /// Every peer, both ways: a collective.
    All,
    /// Sends to one peer only.
    To(usize),
    /// Receives from one peer only.
    From(usize),
    /// Sends to the ranks of `to` and receives from those of `from` (a batch).
    Peers {
        /// Ranks sent to.
        to: &'a [usize],
        /// Ranks received from.
        from: &'a [usize],
    },
}

impl Partners<'_> {
    /// Calls `f` with every rank below `n` the operation sends to (`out`) or receives from
    /// (`!out`), each once: the peers it uses, not the whole world (a batch's lists hold
    /// distinct ranks).
    pub fn each(self, n: usize, out: bool, mut f: impl FnMut(usize)) {
        let one = |q: usize, f: &mut dyn FnMut(usize)| {
            if q < n {
                f(q)
            }
        };
        match self {
            Partners::All => (0..n).for_each(f),
            Partners::To(q) if out => one(q, &mut f),
            Partners::From(q) if !out => one(q, &mut f),
            Partners::To(_) | Partners::From(_) => {}
            Partners::Peers { to, from } => {
                for &q in if out { to } else { from } {
                    one(q, &mut f);
                }
            }
        }
    }
}

pub use crate::config::{ALL_REDUCE_ALGOS, BROADCAST_ALGOS};

/// The `algo` of an all_to_all(v), gather or scatter run as a tree of log2(n) peers (Bruck's
/// all_to_all, a binomial gather or scatter): a world wider than the peers a rank may hold.
pub const TREE: u8 = 2;

impl OpDesc {
    /// A descriptor with no dtype, reduction, algorithm or root.
    pub fn new(kind: OpKind, bytes: usize) -> OpDesc {
        OpDesc {
            seq: 0,
            kind,
            dtype: None,
            reduce: None,
            algo: 0,
            root: 0,
            bytes: bytes as u64,
            comm: 0,
        }
    }

    /// The 16 bytes on the wire: bytes (48 bits), comm (u16), seq (low 16 bits), root (u16),
    /// kind, dtype, reduction, algorithm (little-endian; 0 = none for dtype and reduction).
    pub fn encode(&self) -> [u8; WIRE] {
        let mut w = [0u8; WIRE];
        w[..6].copy_from_slice(&self.bytes.to_le_bytes()[..6]);
        w[6..8].copy_from_slice(&self.comm.to_le_bytes());
        w[8..10].copy_from_slice(&(self.seq as u16).to_le_bytes());
        w[10..12].copy_from_slice(&(self.root as u16).to_le_bytes());
        w[12] = self.kind.code();
        w[13] = self.dtype.map_or(0, |d| {
            DType::ALL.iter().position(|&x| x == d).unwrap() as u8 + 1
        });
        w[14] = self.reduce.map_or(0, |r| {
            AllReduce::ALL.iter().position(|&x| x == r).unwrap() as u8 + 1
        });
        w[15] = self.algo;
        w
    }

    /// The wire bytes of this descriptor (from [`OpDesc::encode`]) with its number set to `seq`:
    /// a transport encodes once per operation and numbers per peer.
    pub fn numbered(mut wire: [u8; WIRE], seq: u64) -> [u8; WIRE] {
        wire[8..10].copy_from_slice(&(seq as u16).to_le_bytes());
        wire
    }

    /// Reads what [`OpDesc::encode`] wrote; the sequence number is completed from `near`
    /// (the receiver's own), to which it is closest. `None` for bytes that are no descriptor.
    pub fn decode(w: &[u8], near: u64) -> Option<OpDesc> {
        let w: &[u8; WIRE] = w.get(..WIRE)?.try_into().ok()?;
        let low = u16::from_le_bytes([w[8], w[9]]);
        let diff = low.wrapping_sub(near as u16) as i16;
        let pick = |c: u8, n: usize| (c as usize).checked_sub(1).filter(|&i| i < n);
        Some(OpDesc {
            seq: near.wrapping_add(diff as i64 as u64),
            kind: OpKind::from_code(w[12])?,
            dtype: match w[13] {
                0 => None,
                c => Some(DType::ALL[pick(c, DType::ALL.len())?]),
            },
            reduce: match w[14] {
                0 => None,
                c => Some(AllReduce::ALL[pick(c, AllReduce::ALL.len())?]),
            },
            algo: w[15],
            root: u16::from_le_bytes([w[10], w[11]]) as usize,
            bytes: u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], 0, 0]),
            comm: u16::from_le_bytes([w[6], w[7]]),
        })
    }

    /// The name of the algorithm setting, for messages.
    pub fn algo_name(&self) -> String {
        let names: &[&str] = match self.kind {
            OpKind::AllReduce => &ALL_REDUCE_ALGOS,
            OpKind::Broadcast => &BROADCAST_ALGOS,
            OpKind::AllToAll => &["every peer at once", "pairwise", "bruck"],
            OpKind::AllToAllV => &["every peer at once", "pairwise", "bruck"],
            OpKind::Gather | OpKind::Scatter => &["every peer at once", "(none)", "tree"],
            OpKind::Reduce => &["tree", "ring and gather"],
            OpKind::Split => return format!("step {}", self.algo),
            _ => &[],
        };
        names
            .get(self.algo as usize)
            .map_or_else(|| format!("algorithm {}", self.algo), |s| s.to_string())
    }

    /// Checks the descriptor a peer sent (`wire`) against this rank's: `Err` says, in words,
    /// what `peer` called where this rank (`me`) called something else.
    pub fn check(&self, wire: &[u8], peer: usize, me: usize) -> Result<(), String> {
        if wire == self.encode() {
            return Ok(());
        }
        let theirs = OpDesc::decode(wire, self.seq);
        if theirs.as_ref() == Some(self) {
            return Ok(());
        }
        let what = match theirs {
            Some(t) => format!("called {t} as operation {}", t.seq),
            None => "sent bytes that describe no operation (a corrupt or misaligned stream)".into(),
        };
        Err(format!(
            "mismatched operations: rank {peer} {what} where rank {me} called {self} as \
             operation {} (counting what rank {peer} sent to rank {me}): every rank must call \
             the same operations, with the same arguments, in the same order",
            self.seq
        ))
    }
}

impl std::fmt::Display for OpDesc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = self.kind.name();
        let mut args: Vec<String> = Vec::new();
        if let Some(d) = self.dtype {
            args.push(d.name().into());
        }
        if let Some(r) = self.reduce {
            args.push(r.name().into());
        }
        if self.kind.rooted() {
            args.push(format!("root {}", self.root));
        }
        if !matches!(
            self.kind,
            OpKind::Barrier | OpKind::Batch | OpKind::AllToAllV
        ) {
            args.push(format!("{} B", self.bytes));
        }
        if matches!(
            self.kind,
            OpKind::AllReduce | OpKind::Broadcast | OpKind::Split
        ) {
            args.push(self.algo_name());
        }
        if self.comm != 0 {
            args.push(format!("on shared view {}", self.comm));
        }
        write!(f, "{name}({})", args.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> OpDesc {
        OpDesc {
            seq: 70_000,
            kind: OpKind::AllReduce,
            dtype: Some(DType::f32),
            reduce: Some(AllReduce::Sum),
            algo: 3,
            root: 0,
            bytes: 4 << 20,
            comm: 0,
        }
    }

    #[test]
    fn round_trips_and_completes_the_sequence_number() {
        let d = sample();
        assert_eq!(OpDesc::decode(&d.encode(), d.seq), Some(d));
        // A peer a few operations ahead or behind (across the 16-bit wrap) decodes exactly.
        for delta in [-3i64, -1, 1, 2, 700] {
            let mut t = d;
            t.seq = (d.seq as i64 + delta) as u64;
            assert_eq!(OpDesc::decode(&t.encode(), d.seq), Some(t), "{delta}");
        }
        let mut b = sample();
        b.kind = OpKind::Broadcast;
        b.dtype = None;
        b.reduce = None;
        b.root = 5;
        b.algo = 1;
        assert_eq!(OpDesc::decode(&b.encode(), b.seq), Some(b));
        b.comm = 513;
        b.bytes = (1 << 48) - 1;
        assert_eq!(OpDesc::decode(&b.encode(), b.seq), Some(b), "a view's call");
        let parent = OpDesc { comm: 0, ..b };
        let e = parent.check(&b.encode(), 1, 0).unwrap_err();
        assert!(e.contains("on shared view 513"), "{e}");
    }

    #[test]
    fn every_code_decodes_to_its_kind() {
        let mut kinds = 0;
        for c in 0..=u8::MAX {
            if let Some(k) = OpKind::from_code(c) {
                assert_eq!(k.code(), c, "{k:?}");
                assert!(!k.name().is_empty());
                kinds += 1;
            }
        }
        assert!(kinds >= 15, "{kinds}");
        assert_eq!(OpKind::from_code(0), None, "0 is no kind");
    }

    #[test]
    fn every_difference_is_named_in_words() {
        let me = sample();
        assert_eq!(me.check(&me.encode(), 1, 0), Ok(()));
        let mut half = me;
        half.bytes = 2 << 20;
        let e = me.check(&half.encode(), 1, 0).unwrap_err();
        assert!(
            e.contains("rank 1 called all_reduce(f32, sum, 2097152 B, auto) as operation 70000")
                && e.contains("rank 0 called all_reduce(f32, sum, 4194304 B, auto)"),
            "{e}"
        );
        let mut i = me;
        i.dtype = Some(DType::i32);
        assert!(me
            .check(&i.encode(), 1, 0)
            .unwrap_err()
            .contains("all_reduce(i32"));
        let mut next = me;
        next.seq += 1;
        assert!(me
            .check(&next.encode(), 2, 0)
            .unwrap_err()
            .contains("as operation 70001"));
        let mut b = me;
        b.kind = OpKind::Broadcast;
        assert!(me
            .check(&b.encode(), 1, 0)
            .unwrap_err()
            .contains("broadcast("));
        assert!(me
            .check(&[0xEE; WIRE], 1, 0)
            .unwrap_err()
            .contains("describe no operation"));
        assert!(me.check(&[0; 3], 1, 0).is_err(), "short");
    }
}
