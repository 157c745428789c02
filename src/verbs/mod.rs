//! The verbs layer: safe owners of RDMA objects on top of `sideway` (which loads libibverbs at
//! run time). Every object is one Rust value released in `Drop`; `unsafe` lives only here and in
//! the reduction kernels.

pub mod device;
pub mod events;
pub mod memory;
pub mod queue;

pub(crate) use device::mtu_bytes;
pub use device::{list_ports, open, DeviceChoice, HcaList, PortInfo, Selected};
pub use events::{AsyncEvent, AsyncEvents};
pub use memory::{LentRegion, RegisteredBuffer};
pub use queue::{status_str, Completion, CompletionQueue, Endpoint, RcQueuePair, RetryPolicy, Sge};
