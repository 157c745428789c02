//! The verbs layer: safe owners of RDMA objects on top of `sideway` (which loads libibverbs at
//! run time). Every object is one Rust value released in `Drop`. Outside this layer, `unsafe` is
//! confined to the kernels (`reduce.rs`, `copy.rs`), the raw system calls (`sys.rs`), PMIx's FFI,
//! the shared-memory rings, registered-memory lending and the overlap queue's hand-overs; every
//! block says why it is sound (`clippy::undocumented_unsafe_blocks` is on for the crate).

pub mod device;
pub mod events;
pub mod memory;
pub mod queue;
pub mod registry;

pub(crate) use device::mtu_bytes;
#[cfg_attr(not(feature = "unstable"), allow(unused_imports))]
pub use device::{list_ports, open, DeviceChoice, HcaList, PortInfo, Selected};
pub use events::AsyncEvent;
#[cfg_attr(not(feature = "unstable"), allow(unused_imports))]
pub use events::AsyncEvents;
pub use memory::{LentRegion, RegisteredBuffer};
#[cfg_attr(not(feature = "unstable"), allow(unused_imports))]
pub use queue::{status_str, Completion, CompletionQueue, Endpoint, RcQueuePair, RetryPolicy, Sge};
pub use registry::Device;
