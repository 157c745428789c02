//! Setting up the TCP transport (its listener and card; with `RDMACOMM_CONNECT=eager`, every
//! connection before the first operation) and closing it.

use super::*;

impl TcpTransport {
    /// Listens, meets every rank through `meet` (which exchanges cards and returns the side
    /// channel: the bootstrap, or a parent communicator for `split`), and, with
    /// `RDMACOMM_CONNECT=eager`, connects to every rank (rank j dials every rank i < j); else
    /// each connection is made at its first use. Every rank of `cfg.world_size` must call this.
    ///
    /// It starts with the drained connections `kept` (by rank of this group) that a
    /// communicator before held ([`TcpTransport::keep`]): each rank's card lists the ranks it
    /// kept one to, and a connection is used where both ends kept it (else closed, and dialed
    /// again when first needed).
    pub(crate) fn connect_keeping(
        cfg: &Config,
        kept: Vec<(usize, KeptConn)>,
        meet: &mut dyn FnMut(&Card) -> Result<Rendezvous>,
    ) -> Result<Self> {
        cfg.validate()?;
        let n = cfg.world_size;
        let (listener, text) = reach::listen(cfg)?;
        let mut common = Vec::new();
        common.extend_from_slice(&TAG_TCP.to_le_bytes());
        common.extend_from_slice(&(cfg.tcp_chunk as u32).to_le_bytes());
        reach::put_reach(&mut common, cfg, &text);
        let mut held: Vec<Option<Conn>> = (0..n).map(|_| None).collect();
        for (p, KeptConn(c)) in kept {
            if p < n && p != cfg.rank {
                held[p] = Some(c);
            }
        }
        reach::put_kept(&mut common, &held);
        let card = Card {
            common,
            entry: 0,
            each: Vec::new(),
        };
        let rv = meet(&card)?;
        check_tags(&rv.cards, &rv.addrs, cfg.rank, TAG_TCP)?;
        let mut side = rv.side;
        // Every step to the barrier is told to the group if it fails here.
        let peer = |p: usize| Peer {
            rank: p,
            addr: rv.addrs[p].clone(),
        };
        let failed = |(p, reason): (usize, String)| Error::PeerFailed {
            peer: peer(p),
            reason,
        };
        let made = (|| -> Result<(Vec<Option<TcpStream>>, Dialer)> {
            let mut addrs_data = Vec::with_capacity(n);
            for (p, c) in rv.cards.iter().enumerate() {
                let mut r = Reader(&c[4..]);
                let chunk = r.u32()? as usize;
                if chunk != cfg.tcp_chunk {
                    return Err(Error::Config(format!(
                        "rank {p} uses RDMACOMM_TCP_CHUNK={chunk} but rank {} uses {}: set it alike everywhere",
                        cfg.rank, cfg.tcp_chunk
                    )));
                }
                addrs_data.push(reach::read_reach(&mut r, p, cfg)?);
                if !reach::read_kept(&mut r, cfg.rank)? {
                    held[p] = None;
                }
            }
            let mut dialer = Dialer::new(cfg.rank, listener, addrs_data, rv.session)?;
            for p in (0..n).filter(|&p| held[p].is_some()) {
                dialer.connected(p);
            }
            let mut socks: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
            if cfg.connect == Connect::Eager {
                // Every rank dials the ranks below it (no two dial each other).
                let deadline = Instant::now() + cfg.timeout;
                let mut events = Vec::new();
                let wanted = |socks: &[Option<TcpStream>], p: usize| {
                    socks[p].is_none() && held[p].is_none() && p != cfg.rank
                };
                while (0..n).any(|p| wanted(&socks, p)) {
                    // Again after a dial shed unanswered (a no-op while one is under way).
                    for p in (0..cfg.rank).filter(|&p| wanted(&socks, p)) {
                        dialer.dial(p).map_err(failed)?;
                    }
                    let moved = dialer.step(&mut events)?;
                    for e in events.drain(..) {
                        match e {
                            Event::Up(p, s) => socks[p] = Some(s),
                            Event::Failed(p, why) => return Err(failed((p, why))),
                        }
                    }
                    if moved {
                        continue;
                    }
                    if Instant::now() >= deadline {
                        let missing = (0..n).find(|&p| wanted(&socks, p));
                        return Err(Error::Timeout {
                            peer: peer(missing.unwrap_or(0)),
                            what: "data connection".into(),
                            after: cfg.timeout,
                        });
                    }
                    let mut fds = Vec::new();
                    crate::sys::wait(dialer.waits(), 2, &mut fds);
                }
            }
            Ok((socks, dialer))
        })();
        let (socks, dialer) = side.told(made)?;
        side.barrier()?;
        side.set_async()?;
        // Received chunks are read into a buffer of four chunks and reduced from there: small
        // chunks keep it in the cache (see `Config::tcp_chunk`).
        let chunk = cfg.tcp_chunk;
        // Spin while waiting only as long as it cannot take a core another local rank needs.
        let spin_for = match cfg.poll {
            Poll::Spin => Duration::MAX,
            Poll::Yield => Duration::ZERO,
            Poll::Auto if oversubscribed(&rv.addrs, cfg.rank, cfg.local_world) => Duration::ZERO,
            Poll::Auto => Duration::from_micros(50),
        };
        let mut conns = Vec::with_capacity(n);
        for (s, h) in socks.into_iter().zip(held) {
            conns.push(match h {
                Some(c) => Some(c),
                None => s.map(|s| Conn::new(s, chunk)).transpose()?,
            });
        }
        let up = (0..n).filter(|&p| conns[p].is_some()).collect();
        Ok(TcpTransport {
            conns,
            up,
            watch: Watch::new(side, cfg.rank, rv.addrs),
            max_chunk: chunk,
            pacer: Pacer::new(cfg.timeout, spin_for, YIELD_FOR.max(spin_for)),
            timeout: cfg.timeout,
            fds: Vec::with_capacity(n),
            numbering: Numbering::new(cfg.rank, n),
            props: Props {
                // Each connection's receive buffer holds four chunks.
                peers_max: crate::transport::PEER_MEMORY / (4 * (chunk + super::HDR)),
                ..Props::new(cfg.rank, n, chunk, Medium::Tcp)
            },
            dialer,
            events: Vec::new(),
            lookout: Lookout::default(),
            ledger: Default::default(),
        })
    }

    /// Writes everything queued (bounded by the timeout).
    pub fn flush(&mut self) -> Result<()> {
        self.begin();
        while let Some(p) = self.queued() {
            self.progress(p)?;
        }
        Ok(())
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.timeout = self.timeout.min(Duration::from_secs(10));
        self.pacer.set_timeout(self.timeout);
        if self.watch.healthy() {
            let _ = self.flush();
        }
        self.watch.close(self.timeout);
    }
}
