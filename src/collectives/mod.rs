//! Collective algorithms over a [`Link`](crate::transport::Link); they know nothing of RDMA.

pub mod bcast;
pub mod halving;
pub mod p2p;
pub mod ring;
