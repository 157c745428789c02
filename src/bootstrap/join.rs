//! A non-zero rank's side of the rendezvous: reach rank 0, answer its challenge with a HELLO,
//! (with a secret) check its proof before sending the card, and take the table.

use super::auth::{digest, mac, mac_ok, random, KEY};
use super::hello::{encode_card, encode_hello, Card};
use super::outcome::{resolve, Rendezvous};
use super::table;
use super::wire::*;
use super::SideChannel;
use crate::config::Config;
use crate::error::{Error, Result};
use std::io::ErrorKind;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// A non-zero rank's side; with `own_error`, only to tell rank 0 that this rank's configuration
/// is bad.
pub(super) fn join(
    cfg: &Config,
    card: &Card,
    deadline: Instant,
    own_error: Option<&str>,
) -> Result<Rendezvous> {
    let sa = resolve(&cfg.coordinator)?;
    let bind = match &cfg.bind_addr {
        Some(a) => Some(a.parse::<std::net::IpAddr>().map_err(|_| {
            Error::Config(format!("RDMACOMM_BIND_ADDR={a:?} is not an IP address"))
        })?),
        None => None,
    };
    let coord = crate::Peer {
        rank: 0,
        addr: sa.to_string(),
    };
    let connect = || -> std::io::Result<TcpStream> {
        let sock = socket2::Socket::new(
            socket2::Domain::for_address(sa),
            socket2::Type::STREAM,
            None,
        )?;
        if let Some(ip) = bind {
            sock.bind(&SocketAddr::new(ip, 0).into())?;
        }
        sock.connect_timeout(&sa.into(), Duration::from_secs(1))?;
        Ok(sock.into())
    };
    // Wait a little past our own deadline for the coordinator's verdict (which names the
    // missing ranks): it is sent at its deadline, which started no earlier than ours.
    let grace = (cfg.timeout / 4).max(Duration::from_secs(2));
    let (s, challenge) = loop {
        let attempt = connect().and_then(|s| {
            s.set_nodelay(true)?;
            // A listener that is not (yet) a coordinator sends no challenge: try again.
            let until = (Instant::now() + Duration::from_secs(2)).min(deadline + grace);
            match recv_frame(&s, until) {
                Ok((CHALLENGE, nonce)) if nonce.len() == KEY => Ok((s, nonce)),
                Ok((REJECT | ABORT, why)) => Err(std::io::Error::other(format!(
                    "refused: {}",
                    String::from_utf8_lossy(&why)
                ))),
                Ok(_) => Err(std::io::Error::other("no challenge")),
                Err(e) => Err(e),
            }
        });
        match attempt {
            Ok(x) => break x,
            Err(e) => {
                if Instant::now() >= deadline {
                    return Err(Error::Bootstrap(format!(
                        "rank {} could not reach the coordinator (rank 0) at {sa} within {:?}: {e}",
                        cfg.rank, cfg.timeout
                    )));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    };
    let nonce = random::<KEY>();
    let secret = cfg.secret.as_ref().map(|s| s.bytes());
    // With a secret, the card goes only to a rank 0 that proved it.
    let blank = Card::default();
    let body = encode_hello(
        cfg,
        if secret.is_some() { &blank } else { card },
        own_error.unwrap_or(""),
        &nonce,
    );
    let tag = secret.map_or([0; KEY], |k| mac(k, &[&challenge, &body]));
    let mut hello = body;
    hello.extend_from_slice(&tag);
    s.set_write_timeout(Some(Duration::from_secs(5)))?;
    send_frame(&s, HELLO, &hello).map_err(|e| Error::PeerFailed {
        peer: coord.clone(),
        reason: format!("sending hello: {e}"),
    })?;
    let refused = |body: &[u8]| {
        Error::Bootstrap(format!(
            "rank {}: the coordinator refused the group: {}",
            cfg.rank,
            String::from_utf8_lossy(body)
        ))
    };
    if let Some(k) = secret {
        let (kind, proof) = recv_frame(&s, deadline + grace).map_err(|e| Error::PeerFailed {
            peer: coord.clone(),
            reason: format!("waiting for rank 0's proof of the secret: {e}"),
        })?;
        match kind {
            PROOF if mac_ok(k, &[b"rank 0", &nonce, &challenge], &proof) => {}
            REJECT | ABORT => return Err(refused(&proof)),
            _ => {
                return Err(Error::Bootstrap(format!(
                    "rank {}: the coordinator at {sa} failed authentication (RDMACOMM_SECRET \
                     differs?); this rank's card was not sent",
                    cfg.rank
                )))
            }
        }
        let c = encode_card(card);
        let tag = mac(k, &[b"card", &challenge, &c]);
        let mut frame = c;
        frame.extend_from_slice(&tag);
        send_frame(&s, CARD, &frame).map_err(|e| Error::PeerFailed {
            peer: coord.clone(),
            reason: format!("sending its card: {e}"),
        })?;
    }
    let (kind, body) = recv_frame(&s, deadline + grace).map_err(|e| {
        if e.kind() == ErrorKind::TimedOut {
            Error::Bootstrap(format!(
                "rank {}: the coordinator {sa} did not complete the rendezvous within {:?} \
                 (some rank never joined?)",
                cfg.rank, cfg.timeout
            ))
        } else {
            Error::PeerFailed {
                peer: coord.clone(),
                reason: format!("waiting for the endpoint table: {e}"),
            }
        }
    })?;
    match kind {
        TABLE => {}
        REJECT | ABORT => return Err(refused(&body)),
        k => {
            return Err(Error::Bootstrap(format!(
                "unexpected message {k} from the coordinator"
            )))
        }
    }
    if body.len() < 2 * KEY {
        return Err(Error::Bootstrap(
            "a short table from the coordinator".into(),
        ));
    }
    let (table, tag) = body.split_at(body.len() - KEY);
    if let Some(k) = secret {
        if !mac_ok(k, &[&nonce, &digest(table)], tag) {
            return Err(Error::Bootstrap(format!(
                "rank {}: the coordinator at {sa} failed authentication (RDMACOMM_SECRET differs?)",
                cfg.rank
            )));
        }
    }
    let (session, addrs, cards) = table::decode(table, cfg.world_size)?;
    let mut streams: Vec<Option<TcpStream>> = (0..cfg.world_size).map(|_| None).collect();
    s.set_write_timeout(None)?;
    streams[0] = Some(s);
    Ok(Rendezvous {
        cards,
        addrs: addrs.clone(),
        session,
        side: SideChannel::new(cfg.rank, streams, addrs, cfg.timeout),
    })
}
