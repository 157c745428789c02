//! Hierarchical all_reduce for worlds of several hosts with several ranks each, as NCCL and
//! oneCCL run it: a reduce-scatter among the ranks of each host (over shared memory), an
//! all_reduce of each rank's part among the ranks of the same local index on every host (over
//! the network), and an all-gather among the ranks of each host. The network carries 1/L of the
//! flat algorithms' bytes (L ranks per host). Each element's final value is computed by the one
//! cross-host all_reduce that owns it and copied from there, so every rank gets the same bits.

use crate::collectives::ring::{self, chunks};
use crate::collectives::subset::Subset;
use crate::collectives::{tuning, Algo};
use crate::dtype::{AllReduce, DType};
use crate::error::Result;
use crate::transport::Link;

/// Where a rank stands in a regular layout of `hosts` (every host with the same number of
/// ranks, at least two hosts and two ranks each): the ranks of its host and the ranks of its
/// local index on every host, both in rank order, and its index in each. `None` otherwise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// The ranks on this rank's host.
    pub local: Vec<usize>,
    /// The ranks with this rank's local index, one per host.
    pub cross: Vec<usize>,
    /// This rank's index in `local`.
    pub local_index: usize,
    /// This rank's index in `cross`.
    pub cross_index: usize,
}

impl Layout {
    /// The layout of rank `me` among ranks whose hosts are `hosts` (a host number per rank).
    pub fn of(hosts: &[usize], me: usize) -> Option<Layout> {
        let nhosts = hosts.iter().max().map_or(0, |m| m + 1);
        if nhosts < 2 || me >= hosts.len() {
            return None;
        }
        let on = |h: usize| -> Vec<usize> { (0..hosts.len()).filter(|&r| hosts[r] == h).collect() };
        let per = on(0).len();
        if per < 2 || (1..nhosts).any(|h| on(h).len() != per) {
            return None;
        }
        let local = on(hosts[me]);
        let local_index = local.iter().position(|&r| r == me).expect("on its host");
        let cross: Vec<usize> = (0..nhosts).map(|h| on(h)[local_index]).collect();
        let cross_index = hosts[me];
        Some(Layout {
            local,
            cross,
            local_index,
            cross_index,
        })
    }
}

/// In-place all_reduce over `link`, hierarchically by `layout` (this rank's [`Layout::of`] the
/// link's hosts, worked out once by the caller: it allocates), else by the flat algorithm
/// [`Algo::Auto`] picks.
pub fn all_reduce(
    link: &mut dyn Link,
    layout: Option<&Layout>,
    op: AllReduce,
    dtype: DType,
    data: &mut [u8],
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let Some(l) = layout else {
        let limits = tuning::limits(link.props().medium, link.size());
        let algo = Algo::Auto.choose(link.size(), data.len(), limits, false, false);
        return flat(link, algo, op, dtype, data, scratch);
    };
    let es = dtype.size();
    let parts = chunks(data.len() / es, l.local.len(), es);
    {
        let mut host = Subset::new(&mut *link, &l.local, l.local_index);
        ring::reduce_scatter_in(&mut host, op, dtype, data, parts)?;
    }
    let (off, len) = parts.get(l.local_index);
    {
        let mut across = Subset::new(&mut *link, &l.cross, l.cross_index);
        let part = &mut data[off..off + len];
        let limits = tuning::limits(across.props().medium, l.cross.len());
        let algo = Algo::Auto.choose(l.cross.len(), len, limits, false, false);
        flat(&mut across, algo, op, dtype, part, scratch)?;
    }
    let mut host = Subset::new(link, &l.local, l.local_index);
    ring::all_gather_in(&mut host, data, parts)
}

/// A flat algorithm (never [`Algo::Hierarchical`] or [`Algo::Auto`]) over `link`.
fn flat(
    link: &mut dyn Link,
    algo: Algo,
    op: AllReduce,
    dtype: DType,
    data: &mut [u8],
    scratch: &mut Vec<u8>,
) -> Result<()> {
    use crate::collectives::{direct, halving};
    match algo {
        Algo::Direct => direct::all_reduce_direct(link, op, dtype, data, scratch),
        Algo::Doubling => halving::all_reduce_doubling(link, op, dtype, data, scratch),
        Algo::Halving => halving::all_reduce_halving(link, op, dtype, data, scratch),
        _ => ring::all_reduce(link, op, dtype, data),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regular_layouts_only() {
        let l = Layout::of(&[0, 0, 1, 1], 2).unwrap();
        assert_eq!(
            l,
            Layout {
                local: vec![2, 3],
                cross: vec![0, 2],
                local_index: 0,
                cross_index: 1
            }
        );
        // Hosts interleaved, three of three.
        let l = Layout::of(&[0, 1, 2, 0, 1, 2, 0, 1, 2], 7).unwrap();
        assert_eq!((l.local, l.cross), (vec![1, 4, 7], vec![6, 7, 8]));
        assert_eq!((l.local_index, l.cross_index), (2, 1));
        for hosts in [
            &[0, 1, 1, 2][..],
            &[0, 0, 0, 1],
            &[0, 1, 2, 3],
            &[0, 0, 0, 0],
            &[],
        ] {
            for me in 0..hosts.len() {
                assert_eq!(Layout::of(hosts, me), None, "{hosts:?}");
            }
        }
    }
}
