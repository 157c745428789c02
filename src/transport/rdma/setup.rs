//! A rank's RDMA transport coming up (device, memory, queue pairs, the exchange of cards) and
//! going down (flushing its writes, the close barrier).

use super::*;

impl RdmaTransport {
    /// Opens the device, listens for data connections, meets every rank through `meet` (which
    /// exchanges cards and returns the side channel: the bootstrap, or a parent communicator
    /// for `split`), and, with `RDMACOMM_CONNECT=eager`, connects a queue pair to every rank;
    /// else each is connected, and its memory registered, at its first use. Every rank of
    /// `cfg.world_size` must call this.
    ///
    /// It starts with the queue pairs `kept` (by rank of this group) that a communicator before
    /// drained ([`RdmaTransport::keep`]), on their completion queue: each rank's card lists the
    /// ranks it kept one to, and a queue pair is used where both ends kept it (else it ends,
    /// and the pair is connected again when first needed).
    pub(crate) fn connect_keeping(
        cfg: &Config,
        kept: Option<KeptQps>,
        meet: &mut dyn FnMut(&Card) -> Result<Rendezvous>,
    ) -> Result<Self> {
        cfg.validate()?;
        let n = cfg.world_size;
        // The process's context for this device where it has one (a dup opens nothing).
        let device = Device::open(&cfg.device)?;
        let layout = Layout {
            slots: cfg.slots,
            slot: cfg.slot_bytes,
        };
        // Kept queue pairs serve only on the same device context and geometry.
        let kept = kept.filter(|k| {
            Arc::ptr_eq(&k.ctx, device.context())
                && (k.layout.slots, k.layout.slot) == (layout.slots, layout.slot)
        });
        let (ctx, sel) = (Arc::clone(device.context()), device.selected().clone());
        let max_cqe = ctx
            .query_device()
            .map(|a| a.max_cqe().max(64) as u32)
            .unwrap_or(u32::MAX);
        let (pd, cq, mut held, spare) = match kept {
            Some(k) => {
                let mut held: Vec<Option<PeerState>> = (0..n).map(|_| None).collect();
                for (p, st) in k.peers {
                    if p < n && p != cfg.rank {
                        held[p] = Some(st);
                    }
                }
                (k.pd, k.cq, held, k.spare)
            }
            None => {
                let pd = ctx.alloc_pd().map_err(|e| Error::Verbs {
                    op: "allocate protection domain",
                    detail: e.to_string(),
                    source: Some(Box::new(e)),
                })?;
                // Room for two peers' completions (a ring's); it grows as peers connect.
                let each = connect::send_depth(cfg.slots) + cfg.slots as u32;
                let cq = CompletionQueue::new(&ctx, (2 * each).clamp(64, max_cqe))?;
                (pd, cq, (0..n).map(|_| None).collect(), None)
            }
        };
        // A limit on locked memory too low for one peer fails here, naming it.
        let spare = match spare {
            Some(b) => Some(b),
            None => (n > 1)
                .then(|| connect::register(&pd, layout))
                .transpose()?,
        };
        let (listener, text) = reach::listen(cfg)?;
        // Our card: slot geometry, how we connect, where we take data connections, and the
        // ranks we kept a queue pair to.
        let mut common = Vec::new();
        common.extend_from_slice(&TAG_RDMA.to_le_bytes());
        common.extend_from_slice(&(cfg.slots as u32).to_le_bytes());
        common.extend_from_slice(&(cfg.slot_bytes as u32).to_le_bytes());
        reach::put_reach(&mut common, cfg, &text);
        reach::put_kept(&mut common, &held);
        let card = Card {
            common,
            entry: 0,
            each: Vec::new(),
        };
        let rv = meet(&card)?;
        check_tags(&rv.cards, &rv.addrs, cfg.rank, TAG_RDMA)?;
        let mut side = rv.side;
        // Every step to the barrier is told to the group if it fails here.
        let addrs = (|| -> Result<Vec<SocketAddr>> {
            let mut addrs = Vec::with_capacity(n);
            for (p, c) in rv.cards.iter().enumerate() {
                let addr_p = &rv.addrs[p];
                let mut r = Reader(&c[4..]);
                let (slots, slot) = (r.u32()? as usize, r.u32()? as usize);
                if slots != cfg.slots || slot != cfg.slot_bytes {
                    return Err(Error::Config(format!(
                        "rank {p} ({addr_p}) uses {slots} slots of {slot} bytes but rank {} uses {} of {}: \
                         set RDMACOMM_SLOTS / RDMACOMM_SLOT_BYTES alike on every rank",
                        cfg.rank, cfg.slots, cfg.slot_bytes
                    )));
                }
                addrs.push(reach::read_reach(&mut r, p, cfg)?);
                if !reach::read_kept(&mut r, cfg.rank)? {
                    held[p] = None;
                }
            }
            Ok(addrs)
        })();
        let addrs = side.told(addrs)?;
        let mut dialer = side.told(Dialer::new(cfg.rank, listener, addrs, rv.session))?;
        let mut up = Vec::new();
        for p in (0..n).filter(|&p| held[p].is_some()) {
            dialer.connected(p);
            up.push(p);
        }
        side.barrier()?;
        side.set_async()?;
        // Spin for the first 100 us of idleness (a round trip; not at all with more local ranks
        // than cores), yield up to 2 ms, then sleep on the completion channel (see `MIN_NAP`):
        // no core burnt on a long wait. RDMACOMM_POLL=spin never stops spinning; =yield never spins.
        let crowded = oversubscribed(&rv.addrs, cfg.rank, cfg.local_world);
        let pacer = pacer::for_setting(cfg.poll, cfg.timeout, crowded, SPIN, YIELD);
        let zc_min = cfg.zero_copy_min;
        // A peer waits for our credits once its slots are full; we return them as we take.
        let props = Props {
            takes_return_credits: true,
            peers_max: crate::transport::PEER_MEMORY / layout.total(),
            relays: true,
            // A sender sees a take only once its credit comes back (half the slots at a time).
            window: layout.slots - (layout.slots / 2).max(1),
            ..Props::new(cfg.rank, cfg.world_size, layout.slot, Medium::Rdma)
        };
        let mut t = RdmaTransport {
            peers: held,
            coming: (0..n).map(|_| None).collect(),
            pending: Vec::new(),
            up,
            lent: None,
            registered: Vec::new(),
            next_registration: 0,
            zc: VecDeque::with_capacity(2 * cfg.slots),
            zc_min,
            cq,
            spare,
            _pd: pd,
            _ctx: ctx,
            watch: Watch::new(side, cfg.rank, rv.addrs),
            opened: device,
            dialer,
            dial_events: Vec::new(),
            lookout: Lookout::default(),
            fds: Vec::new(),
            policy: RetryPolicy::for_limit(cfg.timeout, cfg.ib_timeout, cfg.ib_retry),
            max_cqe,
            layout,
            rank: cfg.rank,
            timeout: cfg.timeout,
            pacer,
            nap: MIN_NAP,
            device: format!(
                "{} port {} GID[{}] {} MTU {}",
                sel.device,
                sel.port,
                sel.gid_index,
                std::net::Ipv6Addr::from(sel.gid.raw),
                crate::verbs::mtu_bytes(sel.mtu)
            ),
            port: sel.port,
            sel,
            numbering: Numbering::new(cfg.rank, cfg.world_size),
            props,
            ledger: Ledger::default(),
            landing: Default::default(),
        };
        if cfg.connect == Connect::Eager {
            t.connect_all()?;
        }
        Ok(t)
    }

    /// Waits (bounded) until every posted work request has completed, e.g. before teardown.
    pub fn flush(&mut self) -> Result<()> {
        self.begin();
        // A signaled probe behind any unsignaled tail, so its completion retires the tail
        // (inline writes free their slots when posted, so only completions show they landed).
        for i in 0..self.up.len() {
            let p = self.up[i];
            if self.peers[p].as_ref().is_some_and(|s| s.unsignaled > 0) {
                self.post(p, KIND_PROBE, 0, 0, self.layout.credit_off(), None)?;
                self.state(p).probe = Some(Instant::now());
            }
        }
        loop {
            let pending = self.up.iter().copied().find(|&p| {
                self.peers[p]
                    .as_ref()
                    .is_some_and(|s| s.wr_done < s.wr_posted)
            });
            match pending {
                None => return Ok(()),
                Some(p) => self.progress(p)?,
            }
        }
    }
}

impl Drop for RdmaTransport {
    fn drop(&mut self) {
        self.timeout = self.timeout.min(Duration::from_secs(10));
        self.pacer.set_timeout(self.timeout);
        if self.watch.healthy() {
            // Let posted writes land, then wait (bounded) at the close barrier, so no QP is
            // destroyed while a peer still writes to it.
            let _ = self.flush();
        }
        self.watch.close(self.timeout);
    }
}
