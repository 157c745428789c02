//! A rank's RDMA transport coming up (device, memory, queue pairs, the exchange of cards) and
//! going down (flushing its writes, the close barrier).

use super::*;

impl RdmaTransport {
    /// Opens the device, registers memory, creates one QP per peer, meets every rank through
    /// `meet` (which exchanges cards and returns the side channel: the bootstrap, or a parent
    /// communicator for `split`), and connects. Every rank of `cfg.world_size` must call this.
    pub fn connect_with(
        cfg: &Config,
        meet: &mut dyn FnMut(&Card) -> Result<Rendezvous>,
    ) -> Result<Self> {
        cfg.validate()?;
        let n = cfg.world_size;
        let (ctx, sel) = verbs::open(&cfg.device)?;
        let pd = ctx.alloc_pd().map_err(|e| Error::Verbs {
            op: "allocate protection domain",
            detail: e.to_string(),
            source: Some(Box::new(e)),
        })?;
        let layout = Layout {
            n,
            slots: cfg.slots,
            slot: cfg.slot_bytes,
        };
        let windows: Vec<_> = (0..n)
            .filter(|&p| p != cfg.rank)
            .map(|p| layout.window(p))
            .collect();
        let buf = RegisteredBuffer::with_windows(&pd, layout.total(), &windows)?;
        let s = cfg.slots as u32;
        let send_depth = 2 * s + 16;
        let cq_depth = ((send_depth + s) * (n as u32 - 1).max(1)).max(64);
        let cq = CompletionQueue::new(&ctx, cq_depth)?;
        let mut qps: Vec<Option<RcQueuePair>> = Vec::with_capacity(n);
        for p in 0..n {
            qps.push(if p == cfg.rank {
                None
            } else {
                Some(RcQueuePair::new(&pd, &cq, &sel, send_depth, s)?)
            });
        }
        // Our card: geometry and buffer address for every rank; for each rank, the endpoint of
        // its queue pair and the key of the one block it may write.
        let mut common = Vec::new();
        common.extend_from_slice(&TAG_RDMA.to_le_bytes());
        common.extend_from_slice(&(cfg.slots as u32).to_le_bytes());
        common.extend_from_slice(&(cfg.slot_bytes as u32).to_le_bytes());
        common.extend_from_slice(&buf.addr().to_le_bytes());
        let mut each = Vec::with_capacity(n * (Endpoint::BYTES + 4));
        for (p, qp) in qps.iter().enumerate() {
            let e = qp.as_ref().map(|q| q.endpoint()).unwrap_or_default();
            each.extend_from_slice(&e.to_bytes());
            let key = if p == cfg.rank {
                0
            } else {
                buf.rkey_at(layout.window(p).start)
            };
            each.extend_from_slice(&key.to_le_bytes());
        }
        let card = Card {
            common,
            entry: Endpoint::BYTES + 4,
            each,
        };
        let rv = meet(&card)?;
        check_tags(&rv.cards, &rv.addrs, cfg.rank, TAG_RDMA)?;
        let mut side = rv.side;
        // Every step to the barrier is told to the group if it fails here.
        let peers = (|| -> Result<Vec<Option<PeerState>>> {
            let policy = RetryPolicy::for_limit(cfg.timeout, cfg.ib_timeout, cfg.ib_retry);
            let mut peers: Vec<Option<PeerState>> = Vec::with_capacity(n);
            for (p, qp) in qps.into_iter().enumerate() {
                let Some(mut qp) = qp else {
                    peers.push(None);
                    continue;
                };
                let addr_p = &rv.addrs[p];
                let mut r = Reader(&rv.cards[p][4..]);
                let (slots, slot) = (r.u32()? as usize, r.u32()? as usize);
                if slots != cfg.slots || slot != cfg.slot_bytes {
                    return Err(Error::Config(format!(
                        "rank {p} ({addr_p}) uses {slots} slots of {slot} bytes but rank {} uses {} of {}: \
                         set RDMACOMM_SLOTS / RDMACOMM_SLOT_BYTES alike on every rank",
                        cfg.rank, cfg.slots, cfg.slot_bytes
                    )));
                }
                let addr = r.u64()?;
                // The endpoint of p's queue pair for us, and the key of our block in p's buffer.
                let mine = Endpoint::from_bytes(r.take(Endpoint::BYTES)?).expect("BYTES taken");
                let remote = Remote {
                    addr,
                    rkey: r.u32()?,
                };
                for k in 0..cfg.slots as u64 {
                    qp.post_recv(wr_id(KIND_RECV, p, k))?;
                }
                qp.connect(&mine, policy).map_err(|e| Error::PeerFailed {
                    peer: Peer {
                        rank: p,
                        addr: addr_p.clone(),
                    },
                    reason: format!("connecting the queue pair: {e}"),
                })?;
                peers.push(Some(PeerState {
                    qp,
                    remote,
                    sent: 0,
                    send_done: 0,
                    wr_posted: 0,
                    wr_done: 0,
                    unsignaled: 0,
                    chunk_wr: vec![0; cfg.slots],
                    cq_next: 0,
                    consumed: 0,
                    returned: 0,
                    peer_consumed: 0,
                    lens: vec![EMPTY; cfg.slots],
                    probe: None,
                }));
            }
            Ok(peers)
        })();
        let peers = side.told(peers)?;
        // Nobody writes before every QP is ready to receive.
        side.barrier()?;
        side.set_async()?;
        let events = AsyncEvents::new(&ctx)?;
        // Spin for the first 100 us of idleness (a round trip; not at all with more local ranks
        // than cores), yield up to 2 ms, then sleep on the completion channel (see `MIN_NAP`):
        // no core burnt on a long wait. RDMACOMM_POLL=spin never stops spinning; =yield never spins.
        let crowded = oversubscribed(&rv.addrs, cfg.rank, cfg.local_world);
        let pacer = pacer::for_setting(cfg.poll, cfg.timeout, crowded, SPIN, YIELD);
        let zc_min = cfg.zero_copy_min;
        // A peer waits for our credits once its slots are full; we return them as we take.
        let props = Props {
            takes_return_credits: true,
            ..Props::new(cfg.rank, cfg.world_size, layout.slot, Medium::Rdma)
        };
        Ok(RdmaTransport {
            peers,
            lent: None,
            registered: Vec::new(),
            next_registration: 0,
            zc: VecDeque::with_capacity(n * cfg.slots),
            zc_min,
            cq,
            buf,
            _pd: pd,
            _ctx: ctx,
            watch: Watch::new(side, cfg.rank, rv.addrs),
            events,
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
            numbering: Numbering::new(cfg.rank, cfg.world_size),
            props,
        })
    }

    /// Waits (bounded) until every posted work request has completed, e.g. before teardown.
    pub fn flush(&mut self) -> Result<()> {
        self.begin();
        // A signaled probe behind any unsignaled tail, so its completion retires the tail
        // (inline writes free their slots when posted, so only completions show they landed).
        for p in 0..self.peers.len() {
            if self.peers[p].as_ref().is_some_and(|s| s.unsignaled > 0) {
                self.post(p, KIND_PROBE, 0, 0, self.layout.credit_off(self.rank), None)?;
                self.state(p).probe = Some(Instant::now());
            }
        }
        loop {
            let pending = (0..self.peers.len()).find(|&p| {
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
