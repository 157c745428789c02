//! rdmacomm: collective communication between the ranks of a training job over RDMA
//! (InfiniBand, RoCE v2, soft-RoCE), TCP, and shared memory between the ranks of one host.
//!
//! ```no_run
//! use rdmacomm::{AllReduce, Group};
//!
//! // Rank, world size and rank 0's address from torchrun, Open MPI, PMI or Slurm variables.
//! let group = Group::from_env()?;
//! let mut grad = vec![1.0f32; 1 << 20];
//! group.all_reduce(&mut grad, AllReduce::Sum)?;
//! assert!(grad.iter().all(|&g| g == group.size() as f32));
//! # Ok::<(), rdmacomm::Error>(())
//! ```
//!
//! The public API is this root (the [`Communicator`] trait and its [`Comm`], the typed [`Group`],
//! [`Config`] and the settings' types in [`config`], the dtypes and reductions, [`Error`], the
//! non-blocking [`Overlap`] scope) and the framework transports (`nuvec`, `fuel`, behind their
//! features). A hidden `unstable` module, behind the feature of that name, opens a few internals
//! to rdmacomm's own tests and benchmarks, with no stability promise. The layers beneath, top down: the API and `Comm`, the collective
//! algorithms over a narrow per-peer link, the transports (RDMA, TCP, shared memory), the
//! bootstrap (how ranks meet and tell each other of failures), the verbs owners; configuration
//! below them all (docs/DESIGN.md, "Layers and modules").
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod api;
mod bootstrap;
mod collectives;
mod comm;
pub mod config;
mod copy;
mod diag;
mod dtype;
mod error;
#[cfg(feature = "fuel")]
pub mod fuel;
mod group;
mod identity;
mod launch;
mod ledger;
#[cfg(feature = "nuvec")]
pub mod nuvec;
mod overlap;
mod pin;
mod reduce;
#[cfg(feature = "fuel")]
mod relayout;
#[cfg(any(feature = "nuvec", feature = "fuel"))]
mod serial;
mod sys;
mod transport;
#[cfg(feature = "unstable")]
#[doc(hidden)]
pub mod unstable;
mod verbs;
#[cfg(any(feature = "nuvec", feature = "fuel"))]
mod wide16;
mod workers;

pub use api::{Communicator, P2p};
pub use comm::{Agreed, Comm};
pub use config::{Algo, Config, Progress};
pub use diag::Level as DebugLevel;
pub use dtype::{AllReduce, DType, Element};
pub use error::{Error, Peer, Result};
pub use group::Group;
pub use identity::IdentityComm;
pub use launch::{run_local, run_local_with};
pub use ledger::Ledger;

/// The kernels this process chose at run time, in words, for benchmark reports: the reductions'
/// instruction set and the copy kernel (`reduce Avx2, copy Simd`).
pub fn kernels() -> String {
    format!(
        "reduce {:?}, copy {:?}",
        reduce::simd_level(),
        copy::kernel()
    )
}
pub use overlap::{Overlap, Pending};

/// The threads that share a large copy or reduction in this process (`RDMACOMM_REDUCE_THREADS`,
/// chosen by its first communicator; 1: the calling thread alone).
pub fn reduce_threads() -> usize {
    workers::threads()
}
