//! Thresholds the algorithm choice takes from what a link is ([`Medium`], a fact the transport
//! reports), in one place: transports say what they are, the collectives decide. The
//! measurements behind each number are in docs/DESIGN.md ("Algorithm choice").

use crate::collectives::DOUBLING_MAX_BYTES;
use crate::transport::Medium;

/// The largest all_reduce (bytes) that `Algo::Auto` runs as recursive doubling on `n` ranks
/// over `medium`, where one exchange of the whole vector beats halving-doubling's two.
pub fn doubling_max(medium: Medium, n: usize) -> usize {
    match medium {
        // Two ranks over TCP: doubling ties or wins up to 256 KiB on loopback.
        Medium::Tcp if n == 2 => 256 << 10,
        _ => DOUBLING_MAX_BYTES,
    }
}

/// What one message's fixed cost is worth in bytes over `medium` (alpha / beta of the cost model
/// in docs/DESIGN.md): loopback TCP 8-10 us at 3.6-4.0 GB/s, shared memory 1.2 us at 15 GB/s,
/// InfiniBand about 2 us at 12.5 GB/s (100 Gb/s) and more on faster links.
pub fn latency_bytes(medium: Medium) -> usize {
    match medium {
        Medium::SharedMemory => 16 << 10,
        _ => 32 << 10,
    }
}

/// The largest all_reduce (bytes) that `Algo::Auto` runs as halving-doubling on a world of `n`
/// ranks that is not a power of two (past it, the ring). Halving-doubling there folds the extra
/// ranks in and out (the whole vector twice more) but takes 2 log2(n) steps to the ring's
/// 2 (n - 1): it wins while the ring's extra steps cost more than the fold's bytes, below
/// (n - 1 - log2 n) messages' worth of bytes. Measured over loopback TCP (docs/BENCHMARKS.md):
/// halving wins 3-8x at 16-256 KiB on 12, 24 and 48 ranks, ties near 1 MiB (wins at 48) and
/// loses at 4 MiB; this bound (256 KiB, 608 KiB, 1.3 MiB there) stays on the safe side.
pub fn fold_max(medium: Medium, n: usize) -> usize {
    let lg = usize::BITS - n.max(1).leading_zeros(); // ceil(log2 n) + (1 for a power of two)
    n.saturating_sub(lg as usize) * latency_bytes(medium)
}

/// The largest all_reduce (bytes) that `Algo::Auto` runs flat rather than hierarchically on
/// hosts of `local` ranks each. The hierarchy's in-host ring takes 2 (L - 1) steps where
/// halving-doubling's in-host part takes 2 log2 L: below (L - 1 - log2 L) shared-memory
/// messages' worth of bytes those extra steps cost more than the network bytes it saves (0 up
/// to 4 ranks a host; 912 KiB at 64, where a 32 KiB all_reduce would otherwise wait on 126
/// in-host steps).
pub fn hier_min(local: usize) -> usize {
    let lg = usize::BITS - 1 - local.max(1).leading_zeros(); // floor(log2 L)
    local
        .saturating_sub(1 + lg as usize)
        .saturating_mul(latency_bytes(Medium::SharedMemory))
}

/// The sizes up to which `Algo::Auto` takes the latency-bound algorithms on `n` ranks over
/// `medium` (with no host layout: see [`Limits::on_hosts_of`]).
pub fn limits(medium: Medium, n: usize) -> Limits {
    Limits {
        doubling_max: doubling_max(medium, n),
        fold_max: fold_max(medium, n),
        hier_min: 0,
        ring_min: usize::MAX,
    }
}

/// Past this many bytes a link that relays ([`crate::transport::Props::relays`]) runs the ring
/// rather than halving-doubling on more than 2 ranks: never, by default. The relay saves nearly
/// a CPU pass per wire byte, which on an HCA should pay for the ring's 2 (n - 1) - 2 log2 n extra
/// steps, but over soft-RoCE (where the wire, not the CPU, is the limit) 4 ranks ran no faster
/// by ring than by halving-doubling (docs/BENCHMARKS.md): unmeasured on hardware, the choice
/// stays with `RDMACOMM_ALGO=ring`. On 2 ranks both take the same two
/// steps, so the ring runs wherever doubling does not.
pub const RELAY_RING_MIN: usize = usize::MAX;

impl Limits {
    /// These limits on a world laid out as hosts of `local` ranks each ([`hier_min`]).
    pub fn on_hosts_of(self, local: usize) -> Limits {
        Limits {
            hier_min: hier_min(local),
            ..self
        }
    }

    /// These limits on a link of `n` ranks that relays ([`RELAY_RING_MIN`]).
    pub fn relaying(self, n: usize) -> Limits {
        Limits {
            ring_min: if n == 2 { 0 } else { RELAY_RING_MIN },
            ..self
        }
    }
}

/// See [`limits`].
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Recursive doubling up to this many bytes ([`doubling_max`]).
    pub doubling_max: usize,
    /// Halving-doubling rather than the ring up to this many bytes where `n` is not a power of
    /// two ([`fold_max`]).
    pub fold_max: usize,
    /// Hierarchical, where the hosts form a regular layout, only above this many bytes
    /// ([`hier_min`]).
    pub hier_min: usize,
    /// The ring rather than halving-doubling above this many bytes ([`Limits::relaying`]).
    pub ring_min: usize,
}

/// The largest all_reduce (bytes) run in one piece over `medium`: a larger one runs as
/// consecutive all_reduces of at most this many bytes, each reduced and sent on while its bytes
/// are still in the cache (NCCL loops over its buffer in slices alike).
pub fn slice_bytes(medium: Medium) -> usize {
    match medium {
        // TCP copies every byte through the kernel: 2 MiB slices keep them cached.
        Medium::Tcp => 2 << 20,
        _ => usize::MAX,
    }
}

/// The largest reduce to a root (bytes) run as a binomial tree (log2(n) steps of the whole
/// vector); above it, a ring reduce-scatter then a gather of the parts (bandwidth-optimal).
pub fn reduce_tree_max(medium: Medium) -> usize {
    match medium {
        // 4 ranks on loopback: the tree wins to 64 KiB, the ring and gather from 128 KiB.
        Medium::Tcp => 64 << 10,
        // 4 ranks on soft-RoCE: the tree wins to 128 KiB, the ring and gather from 512 KiB.
        _ => 128 << 10,
    }
}

/// The smallest block (bytes) from which an all_to_all of `n` ranks over `medium` exchanges
/// with one peer at a time (pairwise) instead of with every peer at once (measurements in
/// docs/BENCHMARKS.md, "all_to_all and reduce beside Open MPI"). Over RDMA every peer at once
/// was as fast or faster at every block size with 4 ranks; over TCP pairwise wins with large
/// blocks; in wider worlds large blocks to every peer at once contend for one NIC, so there it
/// goes pairwise from 1 MiB blocks, as MPI libraries do.
pub fn all_to_all_pairwise_min(medium: Medium, n: usize) -> usize {
    match medium {
        _ if n > 8 => 1 << 20,
        Medium::Tcp => 8 << 20,
        _ => usize::MAX,
    }
}

/// Whether an operation that exchanges with every other rank (all_to_all, gather and scatter
/// at the root, reduce's gather of parts) stays within `peers_max` connections on `n` ranks;
/// where not, it runs as a tree of log2(n) peers (`bruck`, `binomial`).
pub fn every_peer_fits(n: usize, peers_max: usize) -> bool {
    n.saturating_sub(1) <= peers_max
}

/// Whether `Bcast::Auto` broadcasts `bytes` to `n` ranks as a binomial tree (fewer hops)
/// rather than the pipelined chain. Measured on 4 ranks over lo-rxe: the tree up to 8 KiB on
/// more than 2 ranks (docs/DESIGN.md).
pub fn broadcast_tree(n: usize, bytes: usize) -> bool {
    n > 2 && bytes <= 8 << 10
}

/// Whether a sum_scatter of `n` ranks runs as halving (recursive halving, log2(n) steps) rather
/// than the ring: where `n` is a power of two.
pub fn sum_scatter_halving(n: usize) -> bool {
    n.is_power_of_two()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fold_limit_follows_the_extra_steps_of_the_ring() {
        // (n - 1 - floor(log2 n)) messages' worth: 8 at 12 ranks, 19 at 24, 42 at 48.
        for (n, steps) in [(3, 1), (5, 2), (12, 8), (24, 19), (48, 42), (1000, 990)] {
            assert_eq!(fold_max(Medium::Tcp, n), steps * (32 << 10), "{n} ranks");
        }
        assert_eq!(fold_max(Medium::SharedMemory, 12), 8 * (16 << 10));
        assert_eq!(fold_max(Medium::Tcp, 1), 0);
    }

    #[test]
    fn the_hierarchy_starts_where_its_in_host_ring_stops_costing_more() {
        // (L - 1 - floor(log2 L)) shared-memory messages' worth.
        for (l, steps) in [(1, 0), (2, 0), (4, 1), (8, 4), (16, 11), (64, 57)] {
            assert_eq!(hier_min(l), steps * (16 << 10), "{l} ranks a host");
        }
    }

    #[test]
    fn thresholds_by_medium() {
        assert_eq!(doubling_max(Medium::Tcp, 2), 256 << 10);
        assert_eq!(doubling_max(Medium::Tcp, 4), DOUBLING_MAX_BYTES);
        for m in [Medium::Rdma, Medium::SharedMemory, Medium::Memory] {
            assert_eq!(doubling_max(m, 2), DOUBLING_MAX_BYTES);
            assert_eq!(slice_bytes(m), usize::MAX);
        }
        assert_eq!(slice_bytes(Medium::Tcp), 2 << 20);
        assert_eq!(reduce_tree_max(Medium::Tcp), 64 << 10);
        assert_eq!(reduce_tree_max(Medium::Rdma), 128 << 10);
        assert_eq!(all_to_all_pairwise_min(Medium::Tcp, 4), 8 << 20);
        assert_eq!(all_to_all_pairwise_min(Medium::Rdma, 8), usize::MAX);
        assert_eq!(all_to_all_pairwise_min(Medium::Rdma, 9), 1 << 20);
        assert!(every_peer_fits(5, 4) && !every_peer_fits(6, 4) && every_peer_fits(1, 0));
        assert!(broadcast_tree(4, 8 << 10) && !broadcast_tree(4, (8 << 10) + 1));
        assert!(!broadcast_tree(2, 8));
        assert!(sum_scatter_halving(8) && !sum_scatter_halving(6));
    }
}
