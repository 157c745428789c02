//! Collective algorithms over a [`Link`](crate::transport::Link); they know nothing of RDMA.

pub mod bcast;
pub mod halving;
pub mod p2p;
pub mod ring;

use crate::dtype::{AllReduce, DType};
use crate::error::{Error, Result};

/// Lands a received chunk in `dst`: copies it, or reduces it in (`dst = op(dst, src)`). A length
/// other than `dst`'s means the ranks passed buffers of different lengths.
pub(crate) fn land(
    dst: &mut [u8],
    src: &[u8],
    reduce: Option<(AllReduce, DType)>,
    from: usize,
) -> Result<()> {
    if src.len() != dst.len() {
        return Err(Error::InvalidArgument(format!(
            "received {} bytes from rank {from} where {} were expected: do all ranks pass buffers of the same length?",
            src.len(),
            dst.len()
        )));
    }
    match reduce {
        Some((op, dtype)) => crate::reduce::reduce_unchecked(op, dtype, dst, src),
        None => dst.copy_from_slice(src),
    }
    Ok(())
}
