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
use std::net::{SocketAddr, TcpListener, TcpStream};
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
    // Wait a little past our own deadline for the coordinator's verdict (which names the
    // missing ranks): it is sent at its deadline, which started no earlier than ours.
    let grace = (cfg.timeout / 4).max(Duration::from_secs(2));
    let (s, challenge) = reach_rank0(cfg, sa, bind, deadline, grace)?;
    let j = Joining {
        cfg,
        sa,
        coord: crate::Peer {
            rank: 0,
            addr: sa.to_string(),
        },
        s,
        challenge,
        nonce: random::<KEY>(),
        secret: cfg.secret.as_ref().map(|s| s.bytes()),
        until: deadline + grace,
        grace,
    };
    let listener = j.hello(card, bind, own_error)?;
    let route = j.route()?;
    let table = j.table(&route, listener.as_ref())?;
    if table.len() != route.len || digest(&table) != route.digest {
        return Err(j.forged());
    }
    j.keep(&table, &route, listener)
}

/// A connection to rank 0 (from `bind`, if given) and its challenge, by `deadline`.
fn reach_rank0(
    cfg: &Config,
    sa: SocketAddr,
    bind: Option<std::net::IpAddr>,
    deadline: Instant,
    grace: Duration,
) -> Result<(TcpStream, Vec<u8>)> {
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
    loop {
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
            Ok(x) => return Ok(x),
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
    }
}

/// A joiner's rendezvous once rank 0 has greeted it.
struct Joining<'a> {
    cfg: &'a Config,
    sa: SocketAddr,
    coord: crate::Peer,
    s: TcpStream,
    challenge: Vec<u8>,
    nonce: [u8; KEY],
    secret: Option<&'a [u8]>,
    /// Rank 0's verdict may come until then (its deadline and a grace).
    until: Instant,
    grace: Duration,
}

impl Joining<'_> {
    fn refused(&self, body: &[u8]) -> Error {
        Error::Bootstrap(format!(
            "rank {}: the coordinator refused the group: {}",
            self.cfg.rank,
            String::from_utf8_lossy(body)
        ))
    }

    fn forged(&self) -> Error {
        Error::Bootstrap(format!(
            "rank {}: the coordinator at {} failed authentication (RDMACOMM_SECRET differs?)",
            self.cfg.rank, self.sa
        ))
    }

    /// A frame from rank 0 (`what`, in errors) by `until`.
    fn await_rank0(&self, what: &str, until: Instant) -> Result<(u8, Vec<u8>)> {
        recv_frame(&self.s, until).map_err(|e| {
            if e.kind() == ErrorKind::TimedOut {
                Error::Bootstrap(format!(
                    "rank {}: the coordinator {} did not complete the rendezvous within {:?} \
                     (some rank never joined?)",
                    self.cfg.rank, self.sa, self.cfg.timeout
                ))
            } else {
                Error::PeerFailed {
                    peer: self.coord.clone(),
                    reason: format!("waiting for {what}: {e}"),
                }
            }
        })
    }

    /// Opens the listener this rank takes its table on (and keeps as its control port), sends
    /// the HELLO and, with a secret, the card once rank 0 proved it; the listener.
    fn hello(
        &self,
        card: &Card,
        bind: Option<std::net::IpAddr>,
        own_error: Option<&str>,
    ) -> Result<Option<TcpListener>> {
        // A rank below rank 0's first FANOUT takes its table from another rank on this listener,
        // and every rank keeps it as its control port (`Control`); one that cannot open it tells
        // the group so in its HELLO.
        let mut own_error = own_error.map(str::to_string);
        let listener = if own_error.is_none() {
            match fanout::listen_beside(&self.s, bind) {
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
            self.cfg,
            if self.secret.is_some() { &blank } else { card },
            own_error.as_deref().unwrap_or(""),
            &self.nonce,
            port,
        );
        let tag = self
            .secret
            .map_or([0; KEY], |k| mac(k, &[&self.challenge, &body]));
        let mut hello = body;
        hello.extend_from_slice(&tag);
        self.s.set_write_timeout(Some(Duration::from_secs(5)))?;
        send_frame(&self.s, HELLO, &hello).map_err(|e| Error::PeerFailed {
            peer: self.coord.clone(),
            reason: format!("sending hello: {e}"),
        })?;
        if let Some(k) = self.secret {
            let (kind, proof) = recv_frame(&self.s, self.until).map_err(|e| Error::PeerFailed {
                peer: self.coord.clone(),
                reason: format!("waiting for rank 0's proof of the secret: {e}"),
            })?;
            match kind {
                PROOF if mac_ok(k, &[b"rank 0", &self.nonce, &self.challenge], &proof) => {}
                REJECT | ABORT => return Err(self.refused(&proof)),
                _ => {
                    return Err(Error::Bootstrap(format!(
                        "rank {}: the coordinator at {} failed authentication (RDMACOMM_SECRET \
                         differs?); this rank's card was not sent",
                        self.cfg.rank, self.sa
                    )))
                }
            }
            let c = encode_card(card);
            let tag = mac(k, &[b"card", &self.challenge, &c]);
            let mut frame = c;
            frame.extend_from_slice(&tag);
            send_frame(&self.s, CARD, &frame).map_err(|e| Error::PeerFailed {
                peer: self.coord.clone(),
                reason: format!("sending its card: {e}"),
            })?;
        }
        Ok(listener)
    }

    /// The route rank 0 sends: where the table comes from, its digest and length, whom to
    /// pass it to.
    fn route(&self) -> Result<Route> {
        let (kind, body) = self.await_rank0("the table's route", self.until)?;
        match kind {
            ROUTE => {}
            REJECT | ABORT => return Err(self.refused(&body)),
            k => {
                return Err(Error::Bootstrap(format!(
                    "unexpected message {k} from the coordinator"
                )))
            }
        }
        let (route, tag) = body.split_at(body.len().saturating_sub(KEY));
        if self
            .secret
            .is_some_and(|k| !mac_ok(k, &[b"route", &self.nonce, route], tag))
        {
            return Err(self.forged());
        }
        Route::decode(route, self.cfg.rank, self.cfg.world_size)
            .ok_or_else(|| Error::Bootstrap("a malformed route from the coordinator".into()))
    }

    /// The table, from rank 0 or from the rank the route names (then on `listener`).
    fn table(&self, route: &Route, listener: Option<&TcpListener>) -> Result<Vec<u8>> {
        // The table comes from rank 0 (by its deadline, as the route did) or from the rank it
        // names: that wait, at least a grace from now, ends after rank 0 would have told of a rank
        // that stopped the table on its way.
        if route.parent == 0 {
            match self.await_rank0("the endpoint table", self.until)? {
                (TABLE, t) => Ok(t),
                (REJECT | ABORT, why) => Err(self.refused(&why)),
                (k, _) => Err(Error::Bootstrap(format!(
                    "unexpected message {k} from the coordinator"
                ))),
            }
        } else {
            let l = listener
                .ok_or_else(|| Error::Bootstrap("a route to a rank without a listener".into()))?;
            // A level below its parent, a rank waits a little longer: the parent's verdict on a
            // rank above it comes down first.
            let floor = self.until.max(Instant::now() + self.grace) - Instant::now();
            let wait = fanout::wait_for(self.cfg.rank, floor);
            match fanout::take_forwarded(
                l,
                &self.s,
                route,
                self.cfg.rank,
                self.cfg.world_size,
                wait,
            ) {
                Ok(t) => Ok(t),
                Err(e) => {
                    // Rank 0 learns whom to blame from this rank, not from its closed connection,
                    // and so do the ranks below it.
                    if let Some(p) = e.peer() {
                        let why = format!("rank {}: {e}", self.cfg.rank);
                        let mut body = (p.rank as u32).to_le_bytes().to_vec();
                        put_bytes(&mut body, why.as_bytes());
                        let _ = send_frame(&self.s, ABORT, &body);
                        fanout::pass_verdict(&route.digest, &route.kids, p.rank, &why);
                    }
                    Err(e)
                }
            }
        }
    }

    /// The rendezvous as this rank keeps it: the side channel over its connection to rank 0,
    /// its control port; the table passed on to the ranks below it first.
    fn keep(
        self,
        table: &[u8],
        route: &Route,
        listener: Option<TcpListener>,
    ) -> Result<Rendezvous> {
        let table::Decoded {
            session,
            addrs,
            cards,
            ports,
        } = table::decode(table, self.cfg.world_size)?;
        let n = self.cfg.world_size;
        let mut streams: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
        self.s.set_write_timeout(None)?;
        streams[0] = Some(self.s);
        let kids: Vec<(usize, String, u16)> = children_of(self.cfg.rank, n)
            .zip(&route.kids)
            .map(|(c, (addr, port))| (c, addr.clone(), *port))
            .collect();
        let mut rv = Rendezvous {
            cards,
            addrs: addrs.clone(),
            session,
            side: SideChannel::new(self.cfg.rank, streams, addrs.clone(), self.cfg.timeout),
        };
        if let Some(listener) = listener {
            rv.side.keep_control(Control {
                rank: self.cfg.rank,
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
                std::thread::sleep(self.cfg.timeout * 3);
                std::process::exit(3);
            }
            let passed = fanout::pass_on(
                table,
                self.cfg.rank,
                &kids,
                Instant::now() + self.cfg.timeout,
            );
            rv.side.told_during(passed, "pass on the endpoint table")?;
        }
        Ok(rv)
    }
}
