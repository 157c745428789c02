//! Internals that rdmacomm's own tools, benchmarks and tests reach for: the verbs owners, the
//! rendezvous, the reduction and copy kernels, the local launcher. No stability promise: any of
//! it may change in any release. Applications use the crate root.

/// The verbs owners (device, memory, queues), as the RDMA transport uses them.
pub mod verbs {
    pub use crate::verbs::*;
}

/// The rendezvous: how ranks meet at rank 0 and exchange their cards.
pub mod rendezvous {
    pub use crate::bootstrap::rendezvous::{rendezvous, rendezvous_on, Card, Rendezvous};
}

/// The data connections a rank makes at first use, and what RDMA exchanges over them: a
/// queue pair's INFO (endpoint, block address and key), then READY once it is connected.
pub mod connect {
    pub use crate::transport::dial::connect_to;
    pub use crate::transport::rdma::{info, INFO, READY};
}

/// The shrink's agreement as a state machine without I/O, for the model checker.
pub mod agreement {
    pub use crate::bootstrap::elastic::agreement::*;
}

/// The reduction kernels and their reference.
pub mod reduce {
    pub use crate::reduce::{choose_simd, reduce_into, reference, simd_level, SimdLevel};
}

pub use crate::config::launcher_device_from_env as device_from_env;
pub use crate::transport::rdma::MAX_REGISTERED;
