//! What a rendezvous gives each rank (every rank's card for it, the addresses, the session key,
//! the side channel), and where it meets.

use crate::bootstrap::side_channel::SideChannel;
use crate::bootstrap::wire::auth::KEY;
use crate::error::{Error, Result};
use std::net::{SocketAddr, ToSocketAddrs};

/// What the rendezvous returns: every rank's card as seen by this rank, its host address, the
/// session key and the side channel.
pub struct Rendezvous {
    /// Card of each rank (its common bytes, then its entry for this rank), by rank.
    pub cards: Vec<Vec<u8>>,
    /// Host address of each rank, by rank.
    pub addrs: Vec<String>,
    /// The group's session key: the data path's connections prove it.
    pub session: [u8; KEY],
    /// The connections, kept open.
    pub side: SideChannel,
}

/// The coordinator's socket address (IPv6 literals in brackets).
pub fn resolve(addr: &str) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .map_err(|e| Error::Config(format!("coordinator address {addr:?}: {e}")))?
        .next()
        .ok_or_else(|| Error::Config(format!("coordinator address {addr:?} resolves to nothing")))
}
