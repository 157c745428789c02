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
//! Layers, top down: [`api`] (the [`Communicator`] trait) and [`comm`] (its implementation over
//! a transport) → [`collectives`] (algorithms over a narrow per-peer [`transport::Link`]) →
//! [`transport`] (bootstrap over TCP; RDMA, TCP and shared-memory data paths) → [`verbs`] (safe
//! owners of verbs objects).
//! Beside them: [`config`] (the environment), [`pin`] (optional core pinning), [`reduce`] (the
//! reduction kernels).
#![warn(missing_docs)]

pub mod api;
pub mod collectives;
pub mod comm;
pub mod config;
pub mod copy;
mod diag;
pub mod dtype;
pub mod error;
#[cfg(feature = "fuel")]
pub mod fuel;
pub mod group;
mod hostfile;
mod identity;
pub mod launch;
#[cfg(feature = "nuvec")]
pub mod nuvec;
pub mod overlap;
pub mod pin;
pub mod reduce;
#[cfg(feature = "fuel")]
mod relayout;
#[cfg(any(feature = "nuvec", feature = "fuel"))]
mod serial;
pub mod transport;
pub mod verbs;
#[cfg(any(feature = "nuvec", feature = "fuel"))]
mod wide16;

pub use api::{Communicator, P2p};
pub use comm::{Algo, Comm};
pub use config::{Config, Progress};
pub use diag::Level as DebugLevel;
pub use dtype::{AllReduce, DType, Element};
pub use error::{Error, Peer, Result};
pub use group::Group;
pub use identity::IdentityComm;
pub use overlap::{Overlap, Pending};
