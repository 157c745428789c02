//! rdmacomm: collective communication between the ranks of a training job over RDMA
//! (InfiniBand, RoCE v2, soft-RoCE).
//!
//! Layers, top down: [`api`] (the [`Communicator`] trait) and [`comm`] (its RDMA implementation)
//! → [`collectives`] (algorithms over a narrow per-peer [`transport::Link`]) → [`transport`]
//! (bootstrap over TCP, slots and credits over RDMA) → [`verbs`] (safe owners of verbs objects).
//! Beside them: [`config`] (the environment), [`pin`] (optional core pinning), [`reduce`] (the
//! reduction kernels).
#![warn(missing_docs)]

pub mod api;
pub mod collectives;
pub mod comm;
pub mod config;
pub mod copy;
pub mod dtype;
pub mod error;
pub mod group;
pub mod launch;
pub mod pin;
pub mod reduce;
pub mod tensor;
pub mod transport;
pub mod verbs;

pub use api::Communicator;
pub use comm::{Algo, Comm};
pub use config::Config;
pub use dtype::{AllReduce, DType};
pub use error::{Error, Peer, Result};
pub use group::Group;
pub use tensor::{CommInfo, IdentityComm, ReduceOp, Tensor};
