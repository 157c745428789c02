//! A non-zero rank's side of the rendezvous: reach rank 0, answer its challenge with a HELLO,
//! (with a secret) check its proof before sending the card, and take the table.

use super::fanout::{self, children_of, Route};
use super::hello::{encode_card, encode_hello, Card};
use super::outcome::{resolve, Rendezvous};
use super::table;
use crate::bootstrap::side_channel::SideChannel;
use crate::bootstrap::wire::auth::{digest, mac, mac_ok, random, KEY};
use crate::bootstrap::wire::port::Control;
use crate::bootstrap::wire::*;
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
    // A rank below rank 0's first FANOUT takes its table from another rank on this listener,
    // and every rank keeps it as its control port (`Control`); one that cannot open it tells
    // the group so in its HELLO.
    let mut own_error = own_error.map(str::to_string);
    let listener = if own_error.is_none() {
        match fanout::listen_beside(&s, bind) {
            Ok(l) => Some(l),
            Err(e) => {
                own_error = Some(format!("it cannot listen for its endpoint table: {e}"));
                None
            }
        }
    } else {
        None
    };
    let port = listener
        .as_ref()
        .and_then(|l| l.local_addr().ok())
        .map_or(0, |a| a.port());
    // With a secret, the card goes only to a rank 0 that proved it.
    let blank = Card::default();
    let body = encode_hello(
        cfg,
        if secret.is_some() { &blank } else { card },
        own_error.as_deref().unwrap_or(""),
        &nonce,
        port,
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
    let from_rank0 = |what: &str, until: Instant| {
        recv_frame(&s, until).map_err(|e| {
            if e.kind() == ErrorKind::TimedOut {
                Error::Bootstrap(format!(
                    "rank {}: the coordinator {sa} did not complete the rendezvous within {:?} \
                     (some rank never joined?)",
                    cfg.rank, cfg.timeout
                ))
            } else {
                Error::PeerFailed {
                    peer: coord.clone(),
                    reason: format!("waiting for {what}: {e}"),
                }
            }
        })
    };
    let (kind, body) = from_rank0("the table's route", deadline + grace)?;
    match kind {
        ROUTE => {}
        REJECT | ABORT => return Err(refused(&body)),
        k => {
            return Err(Error::Bootstrap(format!(
                "unexpected message {k} from the coordinator"
            )))
        }
    }
    let forged = || {
        Error::Bootstrap(format!(
            "rank {}: the coordinator at {sa} failed authentication (RDMACOMM_SECRET differs?)",
            cfg.rank
        ))
    };
    let (route, tag) = body.split_at(body.len().saturating_sub(KEY));
    if secret.is_some_and(|k| !mac_ok(k, &[b"route", &nonce, route], tag)) {
        return Err(forged());
    }
    let n = cfg.world_size;
    let route = Route::decode(route, cfg.rank, n)
        .ok_or_else(|| Error::Bootstrap("a malformed route from the coordinator".into()))?;
    // The table comes from rank 0 (by its deadline, as the route did) or from the rank it
    // names: that wait, at least a grace from now, ends after rank 0 would have told of a rank
    // that stopped the table on its way.
    let table = if route.parent == 0 {
        match from_rank0("the endpoint table", deadline + grace)? {
            (TABLE, t) => t,
            (REJECT | ABORT, why) => return Err(refused(&why)),
            (k, _) => {
                return Err(Error::Bootstrap(format!(
                    "unexpected message {k} from the coordinator"
                )))
            }
        }
    } else {
        let l = listener
            .as_ref()
            .ok_or_else(|| Error::Bootstrap("a route to a rank without a listener".into()))?;
        // A level below its parent, a rank waits a little longer: the parent's verdict on a
        // rank above it comes down first.
        let floor = (deadline + grace).max(Instant::now() + grace) - Instant::now();
        let wait = fanout::wait_for(cfg.rank, floor);
        match fanout::take_forwarded(l, &s, &route, cfg.rank, n, wait) {
            Ok(t) => t,
            Err(e) => {
                // Rank 0 learns whom to blame from this rank, not from its closed connection,
                // and so do the ranks below it.
                if let Some(p) = e.peer() {
                    let why = format!("rank {}: {e}", cfg.rank);
                    let mut body = (p.rank as u32).to_le_bytes().to_vec();
                    put_bytes(&mut body, why.as_bytes());
                    let _ = send_frame(&s, ABORT, &body);
                    fanout::pass_verdict(&route.digest, &route.kids, p.rank, &why);
                }
                return Err(e);
            }
        }
    };
    if table.len() != route.len || digest(&table) != route.digest {
        return Err(forged());
    }
    let table = &table[..];
    let table::Decoded {
        session,
        addrs,
        cards,
        ports,
    } = table::decode(table, cfg.world_size)?;
    let mut streams: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
    s.set_write_timeout(None)?;
    streams[0] = Some(s);
    let kids: Vec<(usize, String, u16)> = children_of(cfg.rank, n)
        .zip(&route.kids)
        .map(|(c, (addr, port))| (c, addr.clone(), *port))
        .collect();
    let mut rv = Rendezvous {
        cards,
        addrs: addrs.clone(),
        session,
        side: SideChannel::new(cfg.rank, streams, addrs.clone(), cfg.timeout),
    };
    if let Some(listener) = listener {
        rv.side.keep_control(Control {
            rank: cfg.rank,
            listener,
            addrs,
            ports,
            session,
        });
    }
    if !kids.is_empty() {
        if crate::diag::test_fault("exit-before-passing-table") {
            std::process::exit(3);
        }
        if crate::diag::test_fault("hang-before-passing-table") {
            std::thread::sleep(cfg.timeout * 3);
            std::process::exit(3);
        }
        let passed = fanout::pass_on(table, cfg.rank, &kids, Instant::now() + cfg.timeout);
        rv.side.told_during(passed, "pass on the endpoint table")?;
    }
    Ok(rv)
}
