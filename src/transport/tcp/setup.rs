//! Setting up the TCP transport (its listener and card; with `RDMACOMM_CONNECT=eager`, every
//! connection before the first operation) and closing it.

use super::*;

impl TcpTransport {
    /// Listens, meets every rank through `meet` (which exchanges cards and returns the side
    /// channel: the bootstrap, or a parent communicator for `split`), and, with
    /// `RDMACOMM_CONNECT=eager`, connects to every rank (rank j dials every rank i < j); else
    /// each connection is made at its first use. Every rank of `cfg.world_size` must call this.
    pub fn connect_with(
        cfg: &Config,
        meet: &mut dyn FnMut(&Card) -> Result<Rendezvous>,
    ) -> Result<Self> {
        cfg.validate()?;
        let n = cfg.world_size;
        let (listener, text) = dial::listen(cfg)?;
        let mut common = Vec::new();
        common.extend_from_slice(&TAG_TCP.to_le_bytes());
        common.extend_from_slice(&(cfg.tcp_chunk as u32).to_le_bytes());
        dial::put_reach(&mut common, cfg, &text);
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
                addrs_data.push(dial::read_reach(&mut r, p, cfg)?);
            }
            let mut dialer = Dialer::new(cfg.rank, listener, addrs_data, rv.session)?;
            let mut socks: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
            if cfg.connect == Connect::Eager {
                // Every rank dials the ranks below it (no two dial each other).
                let deadline = Instant::now() + cfg.timeout;
                let mut events = Vec::new();
                while socks
                    .iter()
                    .enumerate()
                    .any(|(p, s)| s.is_none() && p != cfg.rank)
                {
                    // Again after a dial shed unanswered (a no-op while one is under way).
                    for p in (0..cfg.rank).filter(|&p| socks[p].is_none()) {
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
                        let missing = (0..n).find(|&p| socks[p].is_none() && p != cfg.rank);
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
        for s in socks {
            conns.push(s.map(|s| Conn::new(s, chunk)).transpose()?);
        }
        Ok(TcpTransport {
            conns,
            watch: Watch::new(side, cfg.rank, rv.addrs),
            n,
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
        })
    }

    /// Writes everything queued (bounded by the timeout).
    pub fn flush(&mut self) -> Result<()> {
        self.begin();
        while let Some(p) =
            (0..self.n).find(|&p| self.conns[p].as_ref().is_some_and(|c| !c.out.is_empty()))
        {
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
