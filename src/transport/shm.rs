//! The shared-memory transport: every rank of the group on one host, each pair of ranks through
//! a ring in shared memory ([`super::rings`]). Failures travel on the side channel as with the
//! other transports (a dead process closes its connection).

use crate::bootstrap::rendezvous::{Card, Rendezvous};
use crate::bootstrap::{check_tags, TAG_SHM};
use crate::config::Config;
use crate::error::{Error, Peer, Result};
use crate::transport::op::{OpDesc, Partners};
use crate::transport::pacer::{self, oversubscribed, Pacer, Wait};
use crate::transport::shm_slots::{Fault, Fit, Pending, Slots, CHUNK, SLOTS};
use crate::transport::watch::Watch;
use crate::transport::{Link, Medium, Props};
use std::time::Duration;

/// How long waits spin before they yield: a handoff through the cache takes well under this.
pub(crate) const SPIN: Duration = Duration::from_micros(50);
/// Idleness after which waits nap instead of yielding.
pub(crate) const YIELD: Duration = Duration::from_millis(2);
/// A nap's length.
pub(crate) const NAP: Duration = Duration::from_micros(50);

/// The shared-memory transport of one rank (every rank of the group on this host).
pub struct ShmTransport {
    rings: Slots,
    watch: Watch,
    pacer: Pacer,
    timeout: Duration,
    props: Props,
}

impl ShmTransport {
    /// Creates this rank's segment, meets every rank through `meet`, and maps theirs. Every rank
    /// must be on this host (else an error names the first that is not).
    pub fn connect_with(
        cfg: &Config,
        meet: &mut dyn FnMut(&Card) -> Result<Rendezvous>,
    ) -> Result<Self> {
        cfg.validate()?;
        let pending = Pending::new(&cfg.host_id, SLOTS, CHUNK, Fit::Host)?;
        let mut common = TAG_SHM.to_le_bytes().to_vec();
        common.extend_from_slice(&pending.payload());
        let card = Card {
            common,
            entry: 0,
            each: Vec::new(),
        };
        let rv = meet(&card)?;
        let mut side = rv.side;
        let tags = check_tags(&rv.cards, &rv.addrs, cfg.rank, TAG_SHM);
        side.told(tags)?;
        let payloads: Vec<Vec<u8>> = rv.cards.iter().map(|c| c[4..].to_vec()).collect();
        let rings = pending.finish(cfg.rank, &payloads, &rv.addrs, &mut side, true);
        let rings = side.told(rings)?;
        side.set_async()?;
        let crowded = oversubscribed(&rv.addrs, cfg.rank, cfg.local_world);
        let props = Props {
            shares_memory: true,
            // A take frees the peer's slot at once: its next post may be waiting for it.
            takes_return_credits: true,
            relays: true,
            // The reader publishes each take at once.
            window: rings.slots() - 1,
            ..Props::new(
                cfg.rank,
                cfg.world_size,
                rings.chunk(),
                Medium::SharedMemory,
            )
        };
        Ok(ShmTransport {
            props,
            rings,
            watch: Watch::new(side, cfg.rank, rv.addrs),
            pacer: pacer::for_setting(cfg.poll, cfg.timeout, crowded, SPIN, YIELD),
            timeout: cfg.timeout,
        })
    }

    /// The side channel and failure record.
    pub(crate) fn watch(&self) -> &Watch {
        &self.watch
    }

    /// The side channel and failure record, to record a failure.
    pub(crate) fn watch_mut(&mut self) -> &mut Watch {
        &mut self.watch
    }

    /// Whether every peer is still there (its side-channel connection open), without blocking.
    pub fn health(&mut self) -> Result<()> {
        self.watch.poll()
    }

    /// This rank failed: tell every peer.
    pub fn abort(&mut self, reason: String) {
        self.watch.abort_self(reason);
    }
}

/// Turns a ring's fault with peer `p` into an error, told to the group through `watch`.
pub(crate) fn blame(watch: &mut Watch, p: usize, fault: Fault) -> Error {
    match fault {
        Fault::Protocol(why) => watch.fail(p, why),
        Fault::Mismatch(why) => watch.mismatch(p, why),
        Fault::Other(e) => e,
    }
}

impl Link for ShmTransport {
    fn props(&self) -> &crate::transport::Props {
        &self.props
    }

    fn peer(&self, rank: usize) -> Peer {
        self.watch.peer(rank)
    }

    fn try_post(&mut self, p: usize, data: &[u8]) -> Result<bool> {
        match self.rings.try_post(p, data) {
            Ok(posted) => {
                if posted {
                    self.pacer.progress();
                }
                Ok(posted)
            }
            Err(f) => Err(blame(&mut self.watch, p, f)),
        }
    }

    fn try_take(&mut self, p: usize, f: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<bool> {
        match self.rings.try_take(p, f) {
            Ok(took) => {
                if took {
                    self.pacer.progress();
                }
                Ok(took)
            }
            Err(f) => Err(blame(&mut self.watch, p, f)),
        }
    }

    fn try_relay(
        &mut self,
        from: usize,
        to: usize,
        len: usize,
        _at: Option<usize>,
        f: &mut crate::transport::Relay<'_>,
    ) -> Result<bool> {
        match self.rings.try_relay(from, to, len, f) {
            Ok(moved) => {
                if moved {
                    self.pacer.progress();
                }
                Ok(moved)
            }
            Err((p, f)) => Err(blame(&mut self.watch, p, f)),
        }
    }

    fn sends_in_place(&self, _data: &[u8]) -> bool {
        false
    }

    fn ledger_mut(&mut self) -> Option<&mut crate::transport::Ledger> {
        Some(&mut self.rings.ledger)
    }

    fn progress(&mut self, waiting_on: usize) -> Result<()> {
        self.watch.waiting_on(Some(waiting_on));
        self.watch.poll_sometimes()?;
        match self.watch.idle(&mut self.pacer, waiting_on, self.timeout)? {
            Wait::Spin => std::hint::spin_loop(),
            Wait::Yield => std::thread::yield_now(),
            Wait::BackOff => {
                std::thread::sleep(NAP);
            }
            Wait::Expired => {}
        }
        Ok(())
    }

    fn begin(&mut self) {
        self.pacer.begin();
    }

    fn start(&mut self, op: &OpDesc, scope: Partners) {
        self.watch.waiting_on(None);
        self.rings.start(op, scope);
    }
}

impl Drop for ShmTransport {
    fn drop(&mut self) {
        self.timeout = self.timeout.min(Duration::from_secs(10));
        self.watch.close(self.timeout);
    }
}

impl crate::transport::Transport for ShmTransport {
    fn health(&mut self) -> Result<()> {
        ShmTransport::health(self)
    }
    fn describe(&self) -> String {
        format!("shared memory ({} ranks on this host)", self.size())
    }
    fn local_rank(&self) -> (usize, usize) {
        self.watch().local_rank()
    }
    fn abort(&mut self, reason: String) {
        ShmTransport::abort(self, reason)
    }
    fn watch_mut(&mut self) -> &mut crate::transport::watch::Watch {
        ShmTransport::watch_mut(self)
    }
    fn poll_now(&mut self) -> Result<bool> {
        // Nothing to move: posts land in the peer's memory at once.
        self.watch_mut().poll_sometimes()?;
        Ok(false)
    }
    fn note_progress(&mut self) {}
    fn holds(&self) -> crate::transport::Holdings {
        self.rings.holds()
    }
    fn ledger(&self) -> crate::transport::Ledger {
        self.rings.ledger
    }
}
