//! What a rendezvous gives each rank (every rank's card for it, the addresses, the session key,
//! the side channel), and where it meets.

use super::auth::KEY;
use super::SideChannel;
use crate::error::{Error, Result};
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};

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

/// What a rank keeps of the rendezvous to reach the others without the data path or rank 0 (a
/// shrink after a failure): its own open listener and every rank's control port.
pub struct Control {
    /// This rank.
    pub rank: usize,
    /// Its control port, open for the communicator's life (connections wait in its backlog).
    pub listener: TcpListener,
    /// Every rank's host address, by rank.
    pub addrs: Vec<String>,
    /// Every rank's control port, by rank (0: it has none).
    pub ports: Vec<u16>,
    /// The group's session key, which control messages prove.
    pub session: [u8; KEY],
}

impl Control {
    /// A second handle on the same port (its listener's descriptor duplicated), for a thread
    /// that answers on it while this one is kept.
    pub fn try_clone(&self) -> std::io::Result<Control> {
        Ok(Control {
            rank: self.rank,
            listener: self.listener.try_clone()?,
            addrs: self.addrs.clone(),
            ports: self.ports.clone(),
            session: self.session,
        })
    }
}

/// The coordinator's socket address (IPv6 literals in brackets).
pub fn resolve(addr: &str) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .map_err(|e| Error::Config(format!("coordinator address {addr:?}: {e}")))?
        .next()
        .ok_or_else(|| Error::Config(format!("coordinator address {addr:?} resolves to nothing")))
}
