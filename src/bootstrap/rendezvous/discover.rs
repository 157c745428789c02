//! Where the rendezvous meets when no address is given ([`Discovery`]): rank 0 binds its
//! listener first, then publishes the address through the launcher's PMIx store, or listens at
//! Slurm's first node and derived port; the other ranks fetch or derive it.

use crate::bootstrap::rendezvous::pmix::Pmix;
use crate::config::{Config, Discovery};
use crate::error::{Error, Result};
use std::net::{IpAddr, TcpListener, ToSocketAddrs, UdpSocket};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The rendezvous' address, known.
pub struct MeetingPoint {
    /// The configuration with `coordinator` filled in.
    pub cfg: Config,
    /// Rank 0's listener, bound before its address was told.
    pub listener: Option<TcpListener>,
    /// The PMIx session, held until the rendezvous is over.
    _pmix: Option<Pmix>,
}

/// Communicators made through PMIx in this process: each publishes under its own key (every
/// rank makes them in the same order, as they are collective).
static PUBLISHED: AtomicUsize = AtomicUsize::new(0);

/// Finds the rendezvous of `cfg` (binding rank 0's listener where it must come first).
pub fn meeting_point(cfg: &Config) -> Result<MeetingPoint> {
    let mut cfg = cfg.clone();
    // Found once: what follows meets at `coordinator` (on `listener`, for rank 0).
    let discovery = std::mem::replace(&mut cfg.discovery, Discovery::Given);
    match discovery {
        Discovery::Given => Ok(MeetingPoint {
            cfg,
            listener: None,
            _pmix: None,
        }),
        Discovery::Slurm => {
            let listener = if cfg.rank == 0 {
                let port = cfg
                    .coordinator
                    .rsplit_once(':')
                    .and_then(|(_, p)| p.parse::<u16>().ok())
                    .ok_or_else(|| {
                        Error::Config(format!("coordinator {:?} has no port", cfg.coordinator))
                    })?;
                Some(listen_everywhere(port)?)
            } else {
                None
            };
            Ok(MeetingPoint {
                cfg,
                listener,
                _pmix: None,
            })
        }
        Discovery::Pmix => {
            let pmix = Pmix::init(cfg.timeout)?;
            if pmix.rank() as usize != cfg.rank {
                return Err(Error::Config(format!(
                    "PMIx says this is rank {} of namespace {}, the launcher's variables say rank \
                     {}",
                    pmix.rank(),
                    pmix.namespace(),
                    cfg.rank
                )));
            }
            let key = format!(
                "rdmacomm.coordinator.{}",
                PUBLISHED.fetch_add(1, Ordering::Relaxed)
            );
            let mut listener = None;
            if cfg.rank == 0 {
                let ip = own_ip(&cfg)?;
                let l = crate::bootstrap::wire::listen((ip.as_str(), 0))
                    .map_err(|e| Error::Bootstrap(format!("rank 0 cannot listen on {ip}: {e}")))?;
                cfg.coordinator = l.local_addr()?.to_string();
                pmix.publish(&key, &cfg.coordinator)?;
                listener = Some(l);
            } else {
                cfg.coordinator = pmix.fetch(0, &key, cfg.timeout)?;
            }
            Ok(MeetingPoint {
                cfg,
                listener,
                _pmix: Some(pmix),
            })
        }
    }
}

/// A listener on `port` of every interface (IPv6 and IPv4 where the host has both).
fn listen_everywhere(port: u16) -> Result<TcpListener> {
    crate::bootstrap::wire::listen(("::", port))
        .or_else(|_| crate::bootstrap::wire::listen(("0.0.0.0", port)))
        .map_err(|e| {
            Error::Bootstrap(format!(
                "rank 0 cannot listen on port {port} (derived from SLURM_JOB_ID and \
                 SLURM_STEP_ID): {e}; set MASTER_PORT to another"
            ))
        })
}

/// The address rank 0 publishes: `RDMACOMM_BIND_ADDR`; loopback when every rank is on this
/// host; else the host name's first address off loopback, or the default route's source.
fn own_ip(cfg: &Config) -> Result<String> {
    if let Some(ip) = &cfg.bind_addr {
        return Ok(ip.clone());
    }
    if cfg.local_world == Some(cfg.world_size) {
        return Ok("127.0.0.1".into());
    }
    let off_loopback = |ip: IpAddr| !ip.is_loopback() && !ip.is_unspecified();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    if let Ok(addrs) = (host.trim(), 0).to_socket_addrs() {
        if let Some(a) = addrs.map(|a| a.ip()).find(|&ip| off_loopback(ip)) {
            return Ok(a.to_string());
        }
    }
    // Connecting a UDP socket picks the route's source address and sends nothing.
    if let Ok(s) = UdpSocket::bind(("0.0.0.0", 0)) {
        if s.connect(("192.0.2.1", 9)).is_ok() {
            if let Ok(a) = s.local_addr() {
                if off_loopback(a.ip()) {
                    return Ok(a.ip().to_string());
                }
            }
        }
    }
    Err(Error::Bootstrap(format!(
        "rank 0 found no address off loopback to publish (host name {:?}); set \
         RDMACOMM_BIND_ADDR",
        host.trim()
    )))
}
