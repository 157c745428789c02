//! Transports: move chunks between ranks. The collectives see only [`Link`], a narrow per-peer
//! interface (post a chunk, take a chunk, make progress), as NCCL's net plugins
//! (isend/irecv/test) and Gloo's transport pairs are kept apart from algorithms.

pub mod bootstrap;
pub mod rdma;

use crate::error::{Peer, Result};

/// A chunk-granular, per-peer, ordered, flow-controlled link to every other rank.
///
/// Chunks to one peer arrive in the order posted. `try_post` and `try_take` never block;
/// `progress` polls completions and waits a little, failing after the configured timeout
/// without progress, naming the peer waited on.
pub trait Link {
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// A peer's identity (rank and address), for errors.
    fn peer(&self, rank: usize) -> Peer;
    /// The largest chunk one post can carry.
    fn max_chunk(&self) -> usize;
    /// Posts `data` (at most `max_chunk` bytes) to `peer` if a slot is free; `Ok(false)` if not.
    fn try_post(&mut self, peer: usize, data: &[u8]) -> Result<bool>;
    /// If the next chunk from `peer` has arrived, hands it to `f` and frees its slot.
    fn try_take(&mut self, peer: usize, f: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<bool>;
    /// Polls for completions; when nothing happened, backs off briefly. Fails when nothing has
    /// happened for the timeout, naming `waiting_on`.
    fn progress(&mut self, waiting_on: usize) -> Result<()>;
    /// Marks the start of an operation (resets the no-progress clock).
    fn begin(&mut self);
}
