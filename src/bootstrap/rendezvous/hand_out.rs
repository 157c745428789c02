//! Rank 0's last step of the rendezvous: every rank is in, so each gets its route along the
//! tree and its table (`table.rs`, `fanout.rs`), and rank 0 keeps the side channel and its
//! control port.

use super::fanout::{children_of, parent_of, Route};
use super::hello::{Card, Hello};
use super::outcome::Rendezvous;
use super::table;
use crate::bootstrap::side_channel::SideChannel;
use crate::bootstrap::wire::auth::{digest, mac, random, KEY};
use crate::bootstrap::wire::port::Control;
use crate::bootstrap::wire::*;
use crate::config::Config;
use crate::error::{Error, Result};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// A rank that joined.
pub(super) struct Joined {
    pub(super) sock: TcpStream,
    pub(super) hello: Hello,
    /// With a secret, until its card came: the bytes so far, rank 0's challenge, a deadline.
    pub(super) awaiting: Option<(Vec<u8>, [u8; KEY], Instant)>,
}

/// Every rank is in: each gets its own table (and its route along the tree), then the side
/// channel and the control port are kept.
pub(super) fn hand_out(
    cfg: &Config,
    card: &Card,
    sa: SocketAddr,
    control: Option<(TcpListener, u16)>,
    joined: Vec<Option<Joined>>,
    secret: Option<&[u8]>,
    deadline: Instant,
) -> Result<Rendezvous> {
    let n = cfg.world_size;
    // Every rank is in: each gets its own table.
    let session = random::<KEY>();
    let mut full: Vec<Card> = vec![card.clone()];
    let mut addrs: Vec<String> = vec![cfg.bind_addr.clone().unwrap_or_else(|| sa.ip().to_string())];
    let mut socks: Vec<(TcpStream, [u8; KEY])> = Vec::with_capacity(n - 1);
    let mut ports = vec![control.as_ref().map_or(0, |(_, p)| *p)];
    for j in joined.into_iter().skip(1) {
        let j = j.expect("every rank joined");
        full.push(j.hello.card);
        addrs.push(j.hello.addr);
        ports.push(j.hello.port);
        socks.push((j.sock, j.hello.nonce));
    }
    // Every card was checked for n entries (decode_card; ours is the transport's own).
    let no_entry =
        |q: usize, r: usize| Error::Bootstrap(format!("rank {q}'s card has no entry for rank {r}"));
    let cards: Vec<Vec<u8>> = (0..n)
        .map(|q| full[q].for_rank(0).ok_or_else(|| no_entry(q, 0)))
        .collect::<Result<_>>()?;
    let (tables_from, mut table_bytes) = (Instant::now(), 0);
    // One table for all where no card has a per-rank entry (every transport's); else one each.
    let shared = full.iter().all(|c| c.entry == 0);
    let table_for = |r: usize| -> Result<Vec<u8>> {
        let rows = (0..n)
            .map(|q| {
                Ok((
                    addrs[q].as_bytes(),
                    full[q].for_rank(r).ok_or_else(|| no_entry(q, r))?,
                    ports[q],
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(table::encode(&session, rows.into_iter()))
    };
    let tables: Vec<Vec<u8>> = if shared {
        vec![table_for(0)?]
    } else {
        (1..n).map(table_for).collect::<Result<_>>()?
    };
    // Each joiner's route (`fanout.rs`): one shared table fans out along the tree, rank 0
    // writing it to its first FANOUT ranks only; tables of their own go to each from rank 0.
    let digests: Vec<[u8; KEY]> = tables.iter().map(|t| digest(t)).collect();
    let routes: Vec<Vec<u8>> = (1..n)
        .map(|r| {
            let k = if shared { 0 } else { r - 1 };
            let (t, parent) = (&tables[k], if shared { parent_of(r) } else { 0 });
            Route {
                digest: digests[k],
                len: t.len(),
                parent,
                parent_addr: addrs[parent].clone(),
                kids: if shared {
                    children_of(r, n)
                        .map(|c| (addrs[c].clone(), ports[c]))
                        .collect()
                } else {
                    Vec::new()
                },
            }
            .encode()
        })
        .collect();
    table_bytes += send_tables(&socks, &routes, &tables, shared, secret, &addrs, deadline)?;
    let mut streams: Vec<Option<TcpStream>> = vec![None];
    for (sock, _) in socks {
        sock.set_write_timeout(None)?;
        streams.push(Some(sock));
    }
    // Rank 0's part that grows with the world (the cost model's table term).
    log::debug!(
        "rendezvous of {n} ranks: {table_bytes} bytes of routes and tables sent in {:.1} ms",
        tables_from.elapsed().as_secs_f64() * 1e3
    );
    let mut side = SideChannel::new(0, streams, addrs.clone(), cfg.timeout);
    if let Some((listener, _)) = control {
        side.keep_control(Control {
            rank: 0,
            listener,
            addrs: addrs.clone(),
            ports,
            session,
        });
    }
    Ok(Rendezvous {
        cards,
        addrs,
        session,
        side,
    })
}

/// Sends each joiner its route, then the table to those rank 0 writes it to (`shared`: one
/// table along the tree; else one each), by `deadline` (a second at least); the bytes sent.
/// A joiner that stops reading fails the rendezvous, and every other one is told.
fn send_tables(
    socks: &[(TcpStream, [u8; KEY])],
    routes: &[Vec<u8>],
    tables: &[Vec<u8>],
    shared: bool,
    secret: Option<&[u8]>,
    addrs: &[String],
    deadline: Instant,
) -> Result<usize> {
    let n = socks.len() + 1;
    let mut table_bytes = 0;
    let tags: Vec<[u8; KEY]> = socks
        .iter()
        .zip(routes)
        .map(|((_, nonce), route)| secret.map_or([0; KEY], |s| mac(s, &[b"route", nonce, route])))
        .collect();
    let mut outs: Vec<table::Out> = socks
        .iter()
        .zip(routes.iter().zip(&tags))
        .map(|((sock, _), (route, tag))| {
            table_bytes += route.len() + KEY;
            table::Out::new(sock, ROUTE, route, tag)
        })
        .collect();
    // A joiner that stops reading cannot hold rank 0 past its deadline, nor the others up.
    let by = deadline.max(Instant::now() + Duration::from_secs(1));
    let mut sent = table::send_all(&mut outs, by);
    if sent.is_ok() {
        let direct = if shared { children_of(0, n) } else { 1..n };
        outs = direct
            .map(|r| {
                let t = &tables[if shared { 0 } else { r - 1 }];
                table_bytes += t.len();
                table::Out::new(&socks[r - 1].0, TABLE, t, &[])
            })
            .collect();
        sent = table::send_all(&mut outs, by);
    }
    if let Err((i, e)) = sent {
        let reason = format!("sending its table: {e} (it stopped reading?)");
        // Ranks that took their table are on to their set-up barrier: told what ended it.
        let mut body = ((i + 1) as u32).to_le_bytes().to_vec();
        put_bytes(
            &mut body,
            format!("rank 0 stopped the rendezvous: {reason}").as_bytes(),
        );
        // A frame half-written cannot take another after it: that joiner sees its end. (An
        // index of `outs` is a joiner's: rank 1 first, in either step.)
        let half: Vec<usize> = (0..outs.len()).filter(|&j| !outs[j].done()).collect();
        drop(outs);
        for (j, (sock, _)) in socks.iter().enumerate().filter(|&(j, _)| j != i) {
            if half.contains(&j) {
                let _ = sock.shutdown(std::net::Shutdown::Both);
            } else {
                let _ = sock.set_write_timeout(Some(Duration::from_millis(100)));
                let _ = send_frame(sock, ABORT, &body);
            }
        }
        return Err(Error::PeerFailed {
            peer: crate::Peer {
                rank: i + 1,
                addr: addrs[i + 1].clone(),
            },
            reason,
        });
    }
    Ok(table_bytes)
}
