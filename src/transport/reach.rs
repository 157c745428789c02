//! Where a rank takes data connections, and how its card says so: the data listener's address
//! (`RDMACOMM_BIND_ADDR`, else the one this host reaches the coordinator from), the way it
//! connects (`RDMACOMM_CONNECT`), and the socket options of a data connection. The dialer
//! (`dial.rs`) makes the connections.

use crate::bootstrap::Reader;
use crate::config::{Config, Connect};
use crate::error::{Error, Result};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};

/// The address this rank's data listener binds: `RDMACOMM_BIND_ADDR`, else the one this host
/// reaches the coordinator from (a loopback coordinator, loopback).
pub(crate) fn data_ip(cfg: &Config) -> Result<IpAddr> {
    if let Some(a) = &cfg.bind_addr {
        return a
            .parse()
            .map_err(|_| Error::Config(format!("RDMACOMM_BIND_ADDR={a:?} is not an IP address")));
    }
    let sa: SocketAddr = cfg
        .coordinator
        .parse()
        .or_else(|_| {
            use std::net::ToSocketAddrs;
            cfg.coordinator
                .to_socket_addrs()
                .ok()
                .and_then(|mut i| i.next())
                .ok_or(())
        })
        .map_err(|_| {
            Error::Config(format!(
                "coordinator address {:?} does not resolve",
                cfg.coordinator
            ))
        })?;
    if sa.ip().is_loopback() {
        return Ok(sa.ip());
    }
    // The coordinator's address family: an IPv6 coordinator, an IPv6 data path.
    let any = if sa.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" };
    Ok(std::net::UdpSocket::bind(any)
        .and_then(|u| u.connect(sa).and_then(|_| u.local_addr()))
        .map(|a| a.ip())
        .unwrap_or(sa.ip()))
}

/// A listener for this rank's data connections, and its address as its card carries it.
pub(crate) fn listen(cfg: &Config) -> Result<(TcpListener, String)> {
    let ip = data_ip(cfg)?;
    let l = crate::bootstrap::listen(SocketAddr::new(ip, 0))
        .map_err(|e| Error::Bootstrap(format!("rank {} cannot listen on {ip}: {e}", cfg.rank)))?;
    let text = l.local_addr()?.to_string();
    Ok((l, text))
}

/// Appends the part of a card a dialer needs: how this rank connects (`RDMACOMM_CONNECT`) and
/// where its data listener is (`addr`, from [`listen`]).
pub(crate) fn put_reach(common: &mut Vec<u8>, cfg: &Config, addr: &str) {
    common.extend_from_slice(&(cfg.connect as u32).to_le_bytes());
    common.extend_from_slice(&(addr.len() as u32).to_le_bytes());
    common.extend_from_slice(addr.as_bytes());
}

/// Reads what [`put_reach`] wrote into rank `p`'s card: its data listener's address, once its
/// way of connecting is found to be this rank's (a rank that differs is named).
pub(crate) fn read_reach(r: &mut Reader, p: usize, cfg: &Config) -> Result<SocketAddr> {
    let connect = r.u32()?;
    if connect != cfg.connect as u32 {
        return Err(Error::Config(format!(
            "rank {p} connects {} but rank {} {}: set RDMACOMM_CONNECT alike everywhere",
            Connect::name_of(connect),
            cfg.rank,
            cfg.connect.name()
        )));
    }
    let a = String::from_utf8_lossy(r.bytes()?).into_owned();
    a.parse::<SocketAddr>()
        .map_err(|_| Error::Bootstrap(format!("rank {p} sent a bad address {a:?}")))
}

/// Appends the ranks this rank kept a connection to from the generation before (held by
/// rank: `held[p]` is some for each kept one).
pub(crate) fn put_kept<T>(common: &mut Vec<u8>, held: &[Option<T>]) {
    let kept = held.iter().filter(|h| h.is_some()).count();
    common.extend_from_slice(&(kept as u32).to_le_bytes());
    for (p, _) in held.iter().enumerate().filter(|(_, h)| h.is_some()) {
        common.extend_from_slice(&(p as u32).to_le_bytes());
    }
}

/// Reads what [`put_kept`] wrote into a peer's card: whether it kept its connection to `me` (a
/// connection is used where both ends kept it).
pub(crate) fn read_kept(r: &mut Reader, me: usize) -> Result<bool> {
    let k = r.u32()?;
    let mut keeps_me = false;
    for _ in 0..k {
        keeps_me |= r.u32()? as usize == me;
    }
    Ok(keeps_me)
}

/// Low latency and buffers large enough for a chunk in flight.
pub(crate) fn tune(s: &TcpStream) -> Result<()> {
    s.set_nodelay(true)?;
    let sr = socket2::SockRef::from(s);
    let _ = sr.set_send_buffer_size(4 << 20);
    let _ = sr.set_recv_buffer_size(4 << 20);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_card_that_connects_otherwise_or_sends_a_bad_address_is_named() {
        let mine = Config::defaults(0, 2, "127.0.0.1:1");
        let mut theirs = mine.clone();
        theirs.connect = Connect::Eager;
        let mut card = Vec::new();
        put_reach(&mut card, &mine, "127.0.0.1:4000");
        let at = read_reach(&mut Reader(&card), 1, &mine).unwrap();
        assert_eq!(at, SocketAddr::from(([127, 0, 0, 1], 4000)));
        let mut other = Vec::new();
        put_reach(&mut other, &theirs, "127.0.0.1:4000");
        let e = read_reach(&mut Reader(&other), 1, &mine)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rank 1 connects eager") && e.contains("RDMACOMM_CONNECT"),
            "{e}"
        );
        let mut bad = Vec::new();
        put_reach(&mut bad, &mine, "nowhere");
        let e = read_reach(&mut Reader(&bad), 1, &mine)
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank 1 sent a bad address"), "{e}");
        assert!(read_reach(&mut Reader(&card[..5]), 1, &mine).is_err());
    }

    #[test]
    fn a_card_says_which_ranks_it_kept_a_connection_to() {
        let held = [None, Some(()), None, Some(())];
        let mut card = Vec::new();
        put_kept(&mut card, &held);
        for (me, kept) in [(0, false), (1, true), (2, false), (3, true)] {
            assert_eq!(
                read_kept(&mut Reader(&card), me).unwrap(),
                kept,
                "rank {me}"
            );
        }
        // A list longer than the card is a malformed card, not a short read.
        assert!(read_kept(&mut Reader(&card[..card.len() - 1]), 3).is_err());
    }
}
