//! The one-step all_reduce: every rank sends its whole vector to every other and combines all n
//! in rank order. n-1 times the traffic of one vector, in one step that waits on no other: where
//! peers share memory, small vectors finish before recursive doubling's log2(n) dependent steps.

use crate::collectives::pause::wait_on;
use crate::collectives::{land, take};
use crate::dtype::{AllReduce, DType};
use crate::error::Result;
use crate::transport::Link;

/// all_reduce of `data` by one exchange with every peer, segment by segment; `scratch` keeps
/// this rank's input while `data` accumulates ((x0 op x1) op x2 ...: the same order, so the same
/// bits, on every rank).
pub fn all_reduce_direct(
    link: &mut dyn Link,
    op: AllReduce,
    dtype: DType,
    data: &mut [u8],
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let (n, me) = (link.size(), link.rank());
    scratch.clear();
    scratch.extend_from_slice(data);
    let esize = dtype.size();
    let seg = (link.props().max_chunk / esize * esize).max(esize);
    let len = data.len();
    let pieces = len.div_ceil(seg).max(1);
    link.begin();
    for i in 0..pieces {
        let r = (i * seg).min(len)..((i + 1) * seg).min(len);
        // Posts go to me+1, me+2, ... so that no rank is everyone's first; `q` is the next rank
        // to combine (rank order).
        let (mut sent, mut q) = (1, 0);
        while sent < n || q < n {
            let mut did = false;
            while sent < n && link.try_post((me + sent) % n, &scratch[r.clone()])? {
                sent += 1;
                did = true;
            }
            if q < n {
                let dst = &mut data[r.clone()];
                let done = if q == me {
                    if q > 0 {
                        land(dst, &scratch[r.clone()], Some((op, dtype)), me)?;
                    }
                    true
                } else {
                    take(link, q, dst, (q > 0).then_some((op, dtype)))?
                };
                if done {
                    q += 1;
                    did = true;
                }
            }
            if !did {
                let waiting_on = if q < n && q != me { q } else { (me + sent) % n };
                wait_on(link, waiting_on)?;
            }
        }
    }
    Ok(())
}
