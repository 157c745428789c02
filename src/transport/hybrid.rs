//! A network transport (RDMA or TCP) whose same-host peers are reached through shared memory
//! instead: chosen per peer at the rendezvous from the host identities in the cards.
//!
//! The network transport reaches every rank (TCP connects only those it carries, on demand) and
//! owns the side channel (failures, stalls,
//! teardown); the rings ([`super::rings`]) carry the chunks to same-host peers. With shared
//! memory on, every rank's card starts with a prefix (tag, length, the rings' payload), stripped
//! before the network transport reads its own card; without it the card is the network
//! transport's alone. Either way a rank whose `RDMACOMM_SHM` differs is named at the rendezvous.

use crate::bootstrap::rendezvous::{Card, Rendezvous};
use crate::bootstrap::{Reader, TAG_HYBRID, TAG_SHM};
use crate::config::Config;
use crate::error::{Error, Peer, Result};
use crate::transport::op::{OpDesc, Partners};
use crate::transport::pacer::{self, oversubscribed, Pacer, Wait};
use crate::transport::shm::{blame, NAP, SPIN, YIELD};
use crate::transport::shm_slots::{slots_for, Fit, Pending, Slots};
use crate::transport::{rdma, tcp, Kept, Lending, Link, Props, Transport};
use std::time::Duration;

/// A network transport with shared memory to same-host peers.
pub struct HybridTransport {
    // Dropped first: its teardown waits until no peer still writes.
    net: Box<dyn Transport>,
    rings: Slots,
    /// Paces waits on same-host peers (the network transport paces its own).
    pacer: Pacer,
    timeout: Duration,
    props: Props,
}

/// Connects RDMA (`rdma`) or TCP to every rank through `meet`, with shared memory to the ranks on
/// this host where [`Config::shm_for_peers`] says so (returned as the network transport alone
/// where this rank has no such peer).
pub(crate) fn connect_with(
    cfg: &Config,
    rdma: bool,
    kept: Kept,
    meet: &mut dyn FnMut(&Card) -> Result<Rendezvous>,
) -> Result<Box<dyn Transport>> {
    cfg.validate()?;
    if !cfg.shm_for_peers() {
        // The network transport's own card, as a peer without shared memory expects it.
        return Ok(if rdma {
            Box::new(rdma::RdmaTransport::connect_keeping(cfg, kept.rdma, meet)?)
        } else {
            Box::new(tcp::TcpTransport::connect_keeping(cfg, kept.tcp, meet)?)
        });
    }
    let chunk = if rdma { cfg.slot_bytes } else { cfg.tcp_chunk };
    // A same-host peer buffers at least as many chunks as a network peer: a program's sends
    // must not block sooner (and deadlock where they did not) because its peer shares the host.
    // Where a host is crowded the rings' chunk shrinks instead, alike on every rank, and the
    // link's chunks with it.
    let slots = slots_for(chunk).max(cfg.slots);
    let fit = Fit::World {
        min_slots: cfg.slots,
    };
    let mut pending = Some(Pending::new(&cfg.host_id, slots, chunk, fit)?);
    let payload = pending.as_ref().map(Pending::payload).unwrap_or_default();
    let mut rings = None;
    let mut crowded = false;
    let mut wrapped = |card: &Card| -> Result<Rendezvous> {
        let mut common = TAG_HYBRID.to_le_bytes().to_vec();
        common.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        common.extend_from_slice(&payload);
        common.extend_from_slice(&card.common);
        let mut rv = meet(&Card {
            common,
            entry: card.entry,
            each: card.each.clone(),
        })?;
        let payloads = strip(&mut rv, cfg.rank)?;
        crowded = oversubscribed(&rv.addrs, cfg.rank, cfg.local_world);
        if let Some(p) = pending.take() {
            let r = p.finish(cfg.rank, &payloads, &rv.addrs, &mut rv.side, false);
            rings = Some(rv.side.told(r)?);
        }
        Ok(rv)
    };
    let mut net: Box<dyn Transport> = if rdma {
        Box::new(rdma::RdmaTransport::connect_keeping(
            cfg,
            kept.rdma,
            &mut wrapped,
        )?)
    } else {
        Box::new(tcp::TcpTransport::connect_keeping(
            cfg,
            kept.tcp,
            &mut wrapped,
        )?)
    };
    Ok(match rings {
        // Alone on its host, a rank still cuts its chunks as the rings do elsewhere.
        Some(rings) if rings.peers() > 0 || rings.chunk() < net.props().max_chunk => {
            if rings.chunk() > net.props().max_chunk {
                // The rings were sized before the network was up; its posts must fit them.
                let why = format!(
                    "shared-memory rings of {} B chunks beside a network of {} B chunks",
                    rings.chunk(),
                    net.props().max_chunk
                );
                net.abort(why.clone());
                return Err(crate::Error::Bootstrap(why));
            }
            let crowded = crowded || rings.peers() + 1 > cores();
            let pacer = pacer::for_setting(cfg.poll, cfg.timeout, crowded, SPIN, YIELD);
            let props = Props {
                hosts: Some(rings.hosts().to_vec()),
                max_chunk: rings.chunk(),
                // A take on a ring frees the peer's slot at once: its next post may wait for it.
                takes_return_credits: true,
                // Relays within the rings or within the network (not from one to the other),
                // at the window both allow; segments go in the same order on every rank.
                relays: net.props().relays,
                window: net.props().window.min(rings.slots() - 1),
                ..net.props().clone()
            };
            Box::new(HybridTransport {
                props,
                net,
                rings,
                pacer,
                timeout: cfg.timeout,
            })
        }
        _ => net,
    })
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |c| c.get())
}

/// Removes every card's prefix, returning the rings' payloads by rank; a rank without the prefix
/// (shared memory only, or a network transport without it) is named.
fn strip(rv: &mut Rendezvous, me: usize) -> Result<Vec<Vec<u8>>> {
    let mut payloads = Vec::with_capacity(rv.cards.len());
    for (p, c) in rv.cards.iter_mut().enumerate() {
        let mut r = Reader(c);
        let tag = r.u32().unwrap_or(0);
        let pl = match r.bytes() {
            Ok(pl) if tag == TAG_HYBRID && !pl.is_empty() => pl.to_vec(),
            _ => {
                let theirs = if tag == TAG_SHM {
                    "uses shared memory only"
                } else {
                    "does not use shared memory for same-host peers"
                };
                return Err(Error::Config(format!(
                    "rank {p} ({}) {theirs} but rank {me} uses RDMA or TCP with shared memory \
                     to same-host peers: set RDMACOMM_SHM and RDMACOMM_TRANSPORT alike on every \
                     rank",
                    rv.addrs[p]
                )));
            }
        };
        c.drain(..8 + pl.len());
        payloads.push(pl);
    }
    Ok(payloads)
}

impl HybridTransport {
    fn local(&self, p: usize) -> bool {
        self.rings.reaches(p)
    }

    /// A move on the rings: both clocks restart.
    fn moved(&mut self) {
        self.pacer.progress();
        self.net.note_progress();
    }
}

impl Link for HybridTransport {
    fn props(&self) -> &crate::transport::Props {
        &self.props
    }

    fn peer(&self, rank: usize) -> Peer {
        self.net.peer(rank)
    }

    fn try_post(&mut self, p: usize, data: &[u8]) -> Result<bool> {
        if !self.local(p) {
            return self.net.try_post(p, data);
        }
        match self.rings.try_post(p, data) {
            Ok(posted) => {
                if posted {
                    self.moved();
                }
                Ok(posted)
            }
            Err(f) => Err(blame(self.net.watch_mut(), p, f)),
        }
    }

    fn try_take(&mut self, p: usize, f: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<bool> {
        if !self.local(p) {
            return self.net.try_take(p, f);
        }
        match self.rings.try_take(p, f) {
            Ok(took) => {
                if took {
                    self.moved();
                }
                Ok(took)
            }
            Err(f) => Err(blame(self.net.watch_mut(), p, f)),
        }
    }

    fn try_take_into(&mut self, p: usize, dst: &mut [u8]) -> Result<bool> {
        if !self.local(p) {
            return self.net.try_take_into(p, dst);
        }
        let took = self.try_take(p, &mut |src: &[u8]| super::copy_chunk(src, dst, p))?;
        if took {
            self.rings
                .ledger
                .count(crate::transport::Pass::CopyOut, dst.len());
        }
        Ok(took)
    }

    fn try_relay(
        &mut self,
        from: usize,
        to: usize,
        len: usize,
        at: Option<usize>,
        f: &mut crate::transport::Relay<'_>,
    ) -> Result<bool> {
        match (self.local(from), self.local(to)) {
            (false, false) => self.net.try_relay(from, to, len, at, f),
            (true, true) => match self.rings.try_relay(from, to, len, f) {
                Ok(moved) => {
                    if moved {
                        self.moved();
                    }
                    Ok(moved)
                }
                Err((p, f)) => Err(blame(self.net.watch_mut(), p, f)),
            },
            _ => Err(Error::InvalidArgument(format!(
                "no relay from rank {from} to rank {to}: one is on this host, one is not"
            ))),
        }
    }

    fn relays_between(&self, from: usize, to: usize) -> bool {
        if self.local(from) && self.local(to) {
            true
        } else if !self.local(from) && !self.local(to) {
            self.net.relays_between(from, to)
        } else {
            false
        }
    }

    fn lands(&self, p: usize) -> bool {
        !self.local(p) && self.net.lands(p)
    }

    fn try_offer(&mut self, p: usize, dst: &[u8]) -> Result<bool> {
        self.net.try_offer(p, dst)
    }

    fn try_accept(&mut self, p: usize) -> Result<bool> {
        self.net.try_accept(p)
    }

    fn try_post_at(&mut self, p: usize, data: &[u8], at: usize) -> Result<bool> {
        if self.local(p) {
            return self.try_post(p, data);
        }
        self.net.try_post_at(p, data, at)
    }

    fn try_take_landed(&mut self, p: usize, dst: &mut [u8]) -> Result<bool> {
        if self.local(p) {
            return self.try_take_into(p, dst);
        }
        self.net.try_take_landed(p, dst)
    }

    fn sends_in_place(&self, data: &[u8]) -> bool {
        // Posts to the rings copy; the network's may send from a registered buffer.
        self.net.sends_in_place(data)
    }

    fn ledger_mut(&mut self) -> Option<&mut crate::transport::Ledger> {
        Some(&mut self.rings.ledger)
    }

    fn progress(&mut self, waiting_on: usize) -> Result<()> {
        if !self.local(waiting_on) {
            return self.net.progress(waiting_on);
        }
        // Waiting on a same-host peer: keep the network's sends and completions moving without
        // sleeping in its wait (a post to the rings wakes nothing there).
        self.net.watch_mut().waiting_on(Some(waiting_on));
        if self.net.poll_now()? {
            self.pacer.progress();
            return Ok(());
        }
        let timeout = self.timeout;
        match self
            .net
            .watch_mut()
            .idle(&mut self.pacer, waiting_on, timeout)?
        {
            Wait::Spin => std::hint::spin_loop(),
            Wait::Yield => std::thread::yield_now(),
            Wait::BackOff => std::thread::sleep(NAP),
            Wait::Expired => {}
        }
        Ok(())
    }

    fn begin(&mut self) {
        self.pacer.begin();
        self.net.begin();
    }

    fn resume(&mut self) {
        self.pacer.begin();
        self.net.resume();
    }

    fn start(&mut self, op: &OpDesc, scope: Partners) {
        self.net.start(op, scope);
        self.rings.start(op, scope);
    }

    fn lending(&mut self) -> Option<&mut dyn Lending> {
        // Posts to the rings copy at once: only the network's may still read a lent buffer.
        self.net.lending()
    }

    fn unsent(&mut self) -> Result<Option<usize>> {
        self.net.unsent()
    }

    fn finish(&mut self) -> Result<()> {
        self.net.finish()
    }
}

impl Transport for HybridTransport {
    fn health(&mut self) -> Result<()> {
        self.net.health()
    }
    fn describe(&self) -> String {
        let k = self.rings.peers();
        let s = if k == 1 { "" } else { "s" };
        let hosts = self.rings.hosts();
        let count = |h: usize| hosts.iter().filter(|&&x| x == h).count();
        let nh = hosts.iter().max().map_or(0, |m| m + 1);
        let layout = if (0..nh).all(|h| count(h) == count(0)) {
            format!("{nh} hosts of {} ranks", count(0))
        } else {
            let each: Vec<String> = (0..nh).map(|h| count(h).to_string()).collect();
            format!("hosts of {} ranks", each.join(", "))
        };
        format!(
            "{}, shared memory to {k} same-host peer{s} ({layout})",
            self.net.describe()
        )
    }
    fn local_rank(&self) -> (usize, usize) {
        self.net.local_rank()
    }
    fn abort(&mut self, reason: String) {
        self.net.abort(reason);
    }
    fn watch_mut(&mut self) -> &mut crate::transport::watch::Watch {
        self.net.watch_mut()
    }
    fn poll_now(&mut self) -> Result<bool> {
        self.net.poll_now()
    }
    fn note_progress(&mut self) {
        self.net.note_progress();
    }
    fn holds(&self) -> crate::transport::Holdings {
        self.net.holds() + self.rings.holds()
    }
    fn ledger(&self) -> crate::transport::Ledger {
        self.net.ledger() + self.rings.ledger
    }
    fn keep(&mut self, members: &[usize], epoch: u32, until: std::time::Instant) -> Kept {
        self.net.keep(members, epoch, until)
    }
}
