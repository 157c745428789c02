//! Collective algorithms over a [`crate::transport::Link`]; they know nothing of RDMA.

pub mod bcast;
pub mod binomial;
pub mod bruck;
pub mod direct;
pub mod exchange;
pub(crate) mod gate;
pub mod halving;
pub mod hier;
pub mod p2p;
pub(crate) mod pause;
pub mod ring;
pub mod rooted;
pub(crate) mod subset;
pub mod tuning;

#[cfg(test)]
mod algo_tests;
#[cfg(test)]
mod mem_link;
#[cfg(test)]
mod set_tests;

use crate::dtype::{AllReduce, DType};
use crate::error::{Error, Result};
use crate::transport::{Link, Pass};

/// Memory an operation reuses from call to call, so that repeated calls allocate nothing: bytes
/// (copies, partial sums; what it derefs to) and an exchange's per-peer counters.
#[derive(Debug, Default)]
pub struct Scratch {
    /// Bytes.
    pub bytes: Vec<u8>,
    /// An exchange's counters (per peer and direction: the message under way, its next chunk).
    pub counters: Vec<usize>,
    /// A batch's sends' then receives' positions among its operations.
    pub index: Vec<usize>,
    /// Bruck's all_to_all's buffers.
    pub bruck: bruck::Buffers,
}

impl std::ops::Deref for Scratch {
    type Target = Vec<u8>;
    fn deref(&self) -> &Vec<u8> {
        &self.bytes
    }
}

impl std::ops::DerefMut for Scratch {
    fn deref_mut(&mut self) -> &mut Vec<u8> {
        &mut self.bytes
    }
}

pub use crate::config::Algo;

/// all_reduce buffers up to this many bytes use recursive doubling under [`Algo::Auto`], unless
/// [`tuning::doubling_max`] says otherwise for the link's medium.
pub const DOUBLING_MAX_BYTES: usize = 16 << 10;

/// all_reduce buffers up to this many bytes take one step ([`Algo::Direct`]) under
/// [`Algo::Auto`] where peers share memory ([`crate::transport::Props::shares_memory`]): one
/// copy to each peer costs less there than waiting on log2(n) dependent steps.
pub const DIRECT_MAX_BYTES: usize = 4 << 10;

impl Algo {
    /// The algorithm [`Algo::Auto`] runs for `bytes` on `n` ranks over a link whose limits are
    /// `limits` ([`tuning::limits`]) and whose peers share memory or not (`shared`): one step up
    /// to [`DIRECT_MAX_BYTES`] where they share it, doubling up to the doubling limit, then
    /// hierarchical where the link's hosts form a regular layout (`layered`, [`hier::Layout`]),
    /// the ring past [`tuning::Limits::ring_min`] (a link that relays), else halving-doubling on a power of two, and on other worlds up to the fold limit (where
    /// the ring's 2 (n - 1) steps cost more than folding the extra ranks in), then the ring.
    pub(crate) fn choose(
        self,
        n: usize,
        bytes: usize,
        limits: tuning::Limits,
        shared: bool,
        layered: bool,
    ) -> Algo {
        match self {
            Algo::Auto if shared && n > 2 && bytes <= DIRECT_MAX_BYTES => Algo::Direct,
            Algo::Auto if bytes <= limits.doubling_max => Algo::Doubling,
            Algo::Auto if layered && bytes > limits.hier_min => Algo::Hierarchical,
            Algo::Auto if bytes > limits.ring_min => Algo::Ring,
            Algo::Auto if n.is_power_of_two() || bytes <= limits.fold_max => Algo::Halving,
            Algo::Auto => Algo::Ring,
            a => a,
        }
    }
}

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
            crate::transport::settle(link, dst)?;
            let took = link.try_take(from, &mut |src: &[u8]| land(dst, src, reduce, from))?;
            if took {
                link.count(Pass::Reduce, dst.len());
            }
            Ok(took)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::op::ALL_REDUCE_ALGOS;

    #[test]
    fn auto_chooses_by_size_world_and_link() {
        let auto = Algo::Auto;
        let d = tuning::Limits {
            doubling_max: DOUBLING_MAX_BYTES,
            fold_max: 0,
            hier_min: 0,
            ring_min: usize::MAX,
        };
        let lim = |doubling_max| tuning::Limits {
            doubling_max,
            fold_max: 0,
            hier_min: 0,
            ring_min: usize::MAX,
        };
        let dd = DOUBLING_MAX_BYTES;
        // Where the link relays: the ring from the doubling limit on 2 ranks (on more, only
        // past RELAY_RING_MIN: not by default).
        assert_eq!(
            auto.choose(4, 64 << 20, d.relaying(4), false, false),
            Algo::Halving
        );
        assert_eq!(
            auto.choose(2, dd + 1, d.relaying(2), false, false),
            Algo::Ring
        );
        assert_eq!(
            auto.choose(2, dd, d.relaying(2), false, false),
            Algo::Doubling
        );
        assert_eq!(
            auto.choose(4, DIRECT_MAX_BYTES, d, true, false),
            Algo::Direct
        );
        assert_eq!(
            auto.choose(4, DIRECT_MAX_BYTES + 1, d, true, false),
            Algo::Doubling
        );
        assert_eq!(
            auto.choose(2, 8, d, true, false),
            Algo::Doubling,
            "two ranks: one exchange"
        );
        assert_eq!(
            auto.choose(4, 8, d, false, false),
            Algo::Doubling,
            "not over a network"
        );
        assert_eq!(auto.choose(4, dd + 1, d, false, false), Algo::Halving);
        assert_eq!(auto.choose(3, dd + 1, d, true, false), Algo::Ring);
        // A world not a power of two: halving-doubling (with its fold) up to the fold limit.
        let folds = tuning::Limits {
            fold_max: 1 << 20,
            ..d
        };
        assert_eq!(auto.choose(12, 1 << 20, folds, false, false), Algo::Halving);
        assert_eq!(
            auto.choose(12, (1 << 20) + 1, folds, false, false),
            Algo::Ring
        );
        assert_eq!(
            auto.choose(2, 256 << 10, lim(256 << 10), false, false),
            Algo::Doubling
        );
        assert_eq!(auto.choose(4, 8, d, false, true), Algo::Doubling);
        assert_eq!(
            auto.choose(4, dd + 1, d, false, true),
            Algo::Hierarchical,
            "hosts of several ranks, past the doubling range"
        );
        for forced in [
            Algo::Ring,
            Algo::Halving,
            Algo::Doubling,
            Algo::Direct,
            Algo::Hierarchical,
        ] {
            assert_eq!(forced.choose(4, 8, lim(usize::MAX), true, true), forced);
        }
    }

    /// The choice on 256-1024 ranks, one rank a core on hosts of 64 (layered) or one rank a
    /// host (flat), with the thresholds the links report: doubling for latency, halving-doubling
    /// up to where the hierarchy's 126 in-host ring steps pay for themselves, then the
    /// hierarchy; flat worlds not a power of two fold up to the ring's break-even.
    #[test]
    fn auto_stays_right_at_256_to_1024_ranks() {
        use crate::transport::Medium::{Rdma, Tcp};
        let auto = Algo::Auto;
        let pick = |medium, n: usize, local: Option<usize>, bytes: usize| {
            let mut limits = tuning::limits(medium, n);
            if let Some(l) = local {
                limits = limits.on_hosts_of(l);
            }
            auto.choose(n, bytes, limits, false, local.is_some())
        };
        let (k, m) = (1usize << 10, 1usize << 20);
        for medium in [Rdma, Tcp] {
            for (n, local) in [(1024, Some(64)), (768, Some(64)), (256, Some(64))] {
                assert_eq!(pick(medium, n, local, 8), Algo::Doubling, "{n} ranks, 8 B");
                assert_eq!(pick(medium, n, local, 16 * k), Algo::Doubling);
                // 32 KiB-912 KiB: log2 n steps, not a 64-rank ring twice.
                for bytes in [32 * k, 256 * k, 912 * k] {
                    assert_eq!(
                        pick(medium, n, local, bytes),
                        Algo::Halving,
                        "{n}: {bytes} B"
                    );
                }
                for bytes in [912 * k + 1, 4 * m, 64 * m] {
                    assert_eq!(pick(medium, n, local, bytes), Algo::Hierarchical);
                }
            }
            // Flat: a power of two stays on halving-doubling; 1000 ranks fold up to 990
            // messages' worth (30.9 MiB), past which the ring's 2 x 999 steps cost less.
            assert_eq!(pick(medium, 1024, None, 64 * m), Algo::Halving);
            assert_eq!(pick(medium, 1000, None, 30 * m), Algo::Halving);
            assert_eq!(pick(medium, 1000, None, 64 * m), Algo::Ring);
        }
    }

    #[test]
    fn names_parse_and_match_the_wire_table() {
        for (name, algo) in [
            ("ring", Algo::Ring),
            ("halving", Algo::Halving),
            ("doubling", Algo::Doubling),
            ("auto", Algo::Auto),
            ("direct", Algo::Direct),
            ("hierarchical", Algo::Hierarchical),
        ] {
            assert_eq!(Algo::parse(name).unwrap(), algo);
            assert_eq!(ALL_REDUCE_ALGOS[algo.code() as usize], name);
        }
        assert_eq!(Algo::parse("rabenseifner").unwrap(), Algo::Halving);
        let e = Algo::parse("fastest").unwrap_err().to_string();
        assert!(
            e.contains("direct") && e.contains("ring") && e.contains("hierarchical"),
            "{e}"
        );
    }
}
