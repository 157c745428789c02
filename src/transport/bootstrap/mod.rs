//! The bootstrap: its wire (length-prefixed frames over TCP, `wire.rs`) and the side channel
//! (`side_channel.rs`): the rendezvous' connections (rank 0 to every rank), kept open for
//! barriers, aborts, stall reports and goodbyes. The rendezvous itself is
//! [`crate::transport::rendezvous`].

mod relay;
mod side_channel;
mod wire;

pub use side_channel::{Probe, SideChannel, STALL_VERDICT, STALL_WINDOW};
pub(crate) use wire::*;
