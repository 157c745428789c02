//! Collective algorithms over a [`crate::transport::Link`]; they know nothing of RDMA.

pub mod bcast;
pub mod halving;
pub mod p2p;
pub mod ring;

use crate::dtype::{AllReduce, DType};
use crate::error::{Error, Result};
use crate::transport::Link;

/// Takes the next chunk from `from` into `dst`: reduced in (`dst = op(dst, src)`) through
/// [`Link::try_take`], or, without `reduce`, placed by [`Link::try_take_into`] (which a transport
/// may do without staging). Until it returns true, call it again with the same `dst`.
pub(crate) fn take(
    link: &mut dyn Link,
    from: usize,
    dst: &mut [u8],
    reduce: Option<(AllReduce, DType)>,
) -> Result<bool> {
    match reduce {
        None => link.try_take_into(from, dst),
        Some(_) => {
            link.settle(dst)?;
            link.try_take(from, &mut |src: &[u8]| land(dst, src, reduce, from))
        }
    }
}

/// Lands a received chunk in `dst`: copies it, or reduces it in (`dst = op(dst, src)`). A length
/// other than `dst`'s means the ranks passed buffers of different lengths.
pub(crate) fn land(
    dst: &mut [u8],
    src: &[u8],
    reduce: Option<(AllReduce, DType)>,
    from: usize,
) -> Result<()> {
    if src.len() != dst.len() {
        return Err(Error::length_mismatch(src.len(), dst.len(), from));
    }
    match reduce {
        Some((op, dtype)) => crate::reduce::reduce_unchecked(op, dtype, dst, src),
        None => crate::copy::copy(dst, src),
    }
    Ok(())
}
