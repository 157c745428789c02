//! What each rank passed to a collective (operation, dtype, shape, dim or root, and whether it
//! could read its tensor), gathered from every rank before any data moves: a mismatch, or one
//! rank's local failure, is the same named error on every rank, never wrong data or a hang.

use crate::api::Communicator;
use crate::comm::Comm;
use crate::error::{Error, Result};

/// Dims kept whole; beyond them the header keeps a digest of the rest.
const DIMS: usize = 8;
/// A header's size on the wire.
pub(crate) const LEN: usize = 8 + 8 * (DIMS + 1);

/// One rank's call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    /// Which collective (and reduction), as the caller names it.
    pub op: u8,
    pub reduce: u8,
    /// fuel's dtype, as its discriminant.
    pub dtype: u8,
    /// 0: it read its tensor; 1: it could not.
    pub failed: bool,
    /// The dim or root argument.
    pub arg: u32,
    pub dims: Vec<usize>,
}

impl Header {
    fn encode(&self) -> [u8; LEN] {
        let mut b = [0u8; LEN];
        b[0] = self.op;
        b[1] = self.reduce;
        b[2] = self.dtype;
        b[3] = self.failed as u8;
        b[4..8].copy_from_slice(&self.arg.to_le_bytes());
        let n = self.dims.len();
        b[8..16].copy_from_slice(&(n as u64).to_le_bytes());
        for (i, &d) in self.dims.iter().take(DIMS).enumerate() {
            b[16 + 8 * i..24 + 8 * i].copy_from_slice(&(d as u64).to_le_bytes());
        }
        if n > DIMS {
            // The dims past the eighth, folded into the last slot.
            let digest = self.dims[DIMS..]
                .iter()
                .fold(0xcbf2_9ce4_8422_2325u64, |h, &d| {
                    (h ^ d as u64).wrapping_mul(0x100_0000_01b3)
                });
            b[16 + 8 * (DIMS - 1)..].copy_from_slice(&digest.to_le_bytes());
        }
        b
    }

    /// Gathers every rank's header and checks them against rank 0's; `what` names the call,
    /// `describe` a header in words (dtype and shape).
    pub(crate) fn agree(
        &self,
        comm: &Comm,
        what: &str,
        describe: &dyn Fn(&[u8]) -> String,
    ) -> Result<()> {
        let mine = self.encode();
        let n = comm.size();
        let mut all = vec![0u8; LEN * n];
        comm.all_gather(&mine, &mut all)?;
        let of = |r: usize| &all[LEN * r..LEN * (r + 1)];
        if let Some(r) = (0..n).find(|&r| of(r)[3] != 0) {
            return Err(Error::InvalidArgument(format!(
                "{what}: rank {r} refused the call or could not read its tensor (its own error \
                 says why)"
            )));
        }
        if let Some(r) = (1..n).find(|&r| of(r) != of(0)) {
            return Err(Error::InvalidArgument(format!(
                "{what}: rank {r} passed {} where rank 0 passed {}",
                describe(of(r)),
                describe(of(0))
            )));
        }
        Ok(())
    }
}

/// A header's fields for messages: (op, reduce, dtype, arg, dims as far as kept).
pub(crate) fn fields(b: &[u8]) -> (u8, u8, u8, u32, Vec<u64>) {
    let arg = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let n = u64::from_le_bytes(b[8..16].try_into().unwrap_or([0; 8])) as usize;
    let dims = (0..n.min(DIMS))
        .map(|i| u64::from_le_bytes(b[16 + 8 * i..24 + 8 * i].try_into().unwrap_or([0; 8])))
        .collect();
    (b[0], b[1], b[2], arg, dims)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_differ_exactly_when_the_calls_do() {
        let h = Header {
            op: 1,
            reduce: 0,
            dtype: 8,
            failed: false,
            arg: 2,
            dims: (1..=10).collect(),
        };
        let same = h.clone().encode();
        assert_eq!(h.encode(), same);
        let (op, _, dtype, arg, dims) = fields(&same);
        assert_eq!((op, dtype, arg), (1, 8, 2));
        assert_eq!(dims.len(), 8);
        for change in 0..6 {
            let mut o = h.clone();
            match change {
                0 => o.op = 2,
                1 => o.reduce = 3,
                2 => o.dtype = 9,
                3 => o.arg = 1,
                4 => o.dims[9] = 11, // past the eighth: in the digest
                _ => o.dims = vec![2, 1],
            }
            assert_ne!(o.encode(), same, "change {change}");
        }
    }
}
