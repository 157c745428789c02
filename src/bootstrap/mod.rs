//! The bootstrap: how the ranks of a communicator meet and how they tell each other of
//! failures, below the transports (which move the data). Four folders, each importing only
//! those before it:
//! - `wire/`: length-prefixed frames over TCP (`mod.rs`), MACs and keys (`auth.rs`), and a
//!   rank's control port (`port.rs`: its listener, sealed messages, reading it against
//!   strangers, reaching another's);
//! - `side_channel/`: the rendezvous' connections kept open for barriers, aborts, stall reports,
//!   probes and goodbyes (`mod.rs`), rank 0's relay thread (`relay.rs`) and its judge of stalled
//!   waits (`stalls.rs`);
//! - `rendezvous/`: who is rank 0 and where it listens (`discover.rs`, `pmix.rs`), rank 0's side
//!   (`coordinate.rs`, its policy in `admission.rs`) and a joiner's (`join.rs`), their HELLO
//!   (`hello.rs`), the table (`table.rs`) and its tree (`fanout.rs`), what each rank gets
//!   (`outcome.rs`);
//! - `elastic/`: after a failure, the survivors' agreement (a state machine without I/O in
//!   `agreement/`, checked by a model checker; its frames, sending and driver), the answers of
//!   ended agreements at old ports (`retired.rs`), and where newcomers join a growing group
//!   (`lobby.rs`).
//!
//! It reads the configuration and nothing above it.

pub(crate) mod elastic;
pub mod rendezvous;
pub(crate) mod side_channel;
pub(crate) mod wire;

pub(crate) use rendezvous::Stop;
pub use side_channel::stalls::{STALL_VERDICT, STALL_WINDOW};
pub use side_channel::{Probe, SideChannel, MAX_PROBES};
pub(crate) use wire::port::Control;
pub(crate) use wire::*;

/// Bytes of an operation descriptor as probes carry it (`transport::op::WIRE`, which checks
/// that the two agree).
pub const DESC_BYTES: usize = 16;
