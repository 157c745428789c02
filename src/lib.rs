//! rdmacomm: collective communication between the ranks of a training job over RDMA.
#![warn(missing_docs)]

pub mod dtype;
pub mod error;
pub mod reduce;
pub mod verbs;

pub use dtype::{AllReduce, DType};
pub use error::{Error, Peer, Result};
