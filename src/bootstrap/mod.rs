//! The bootstrap: how the ranks of a communicator meet and how they tell each other of
//! failures, below the transports (which move the data). Who is rank 0 and where it listens
//! (`discover.rs`, with `pmix.rs` for launchers that run a PMIx server); the rendezvous there,
//! which checks every joiner and hands out the transports' cards (`rendezvous.rs`, the table in
//! `table.rs`, its tree in `fanout.rs`); its wire
//! (length-prefixed frames over TCP, `wire.rs`); the side channel those connections become, kept
//! open for barriers, aborts, stall reports, probes and goodbyes (`side_channel.rs`), with rank
//! 0's relay thread (`relay.rs`), which also judges stalled waits (`stalls.rs`); after a failure,
//! the survivors' agreement over every rank's control port (`elastic/`: a state machine without
//! I/O, checked by a model checker, and its driver; the port itself in `control.rs`, the answers
//! of ended agreements in `retired.rs`), and where newcomers join a growing group (`lobby.rs`).
//! It reads the configuration and nothing above it.

mod admission;
mod auth;
mod control;
mod coordinate;
pub mod discover;
pub(crate) mod elastic;
mod fanout;
mod hello;
mod join;
pub(crate) mod lobby;
mod outcome;
pub mod pmix;
mod relay;
pub mod rendezvous;
pub(crate) mod retired;
mod side_channel;
mod stalls;
mod table;
mod wire;

pub(crate) use coordinate::Stop;
pub(crate) use outcome::Control;
pub use side_channel::{Probe, SideChannel, MAX_PROBES};
pub use stalls::{STALL_VERDICT, STALL_WINDOW};
pub(crate) use wire::*;

/// Bytes of an operation descriptor as probes carry it (`transport::op::WIRE`, which checks
/// that the two agree).
pub const DESC_BYTES: usize = 16;
