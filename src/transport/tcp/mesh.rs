//! Connecting the TCP mesh (every pair proves the group's session key) and closing it.

use super::*;

/// What rank `from` sends rank `to` to show it holds the group's session key.
fn proof(session: &[u8; KEY], from: usize, to: usize) -> [u8; KEY] {
    let (f, t) = ((from as u32).to_le_bytes(), (to as u32).to_le_bytes());
    mac(session, &[b"rdmacomm tcp", &f, &t])
}

/// Whether `tag` is [`proof`]`(session, from, to)`, compared in constant time.
fn proof_ok(session: &[u8; KEY], from: usize, to: usize, tag: &[u8]) -> bool {
    let (f, t) = ((from as u32).to_le_bytes(), (to as u32).to_le_bytes());
    mac_ok(session, &[b"rdmacomm tcp", &f, &t], tag)
}

fn tune(s: &TcpStream) -> Result<()> {
    s.set_nodelay(true)?;
    let sr = socket2::SockRef::from(s);
    let _ = sr.set_send_buffer_size(4 << 20);
    let _ = sr.set_recv_buffer_size(4 << 20);
    Ok(())
}

impl TcpTransport {
    /// Meets every rank through `meet` (which exchanges cards and returns the side channel: the
    /// bootstrap, or a parent communicator for `split`) and connects a TCP mesh (rank j connects
    /// to every rank i < j). Every rank of `cfg.world_size` must call this.
    pub fn connect_with(
        cfg: &Config,
        meet: &mut dyn FnMut(&Card) -> Result<Rendezvous>,
    ) -> Result<Self> {
        cfg.validate()?;
        let n = cfg.world_size;
        let ip: std::net::IpAddr = match &cfg.bind_addr {
            Some(a) => a.parse().map_err(|_| {
                Error::Config(format!("RDMACOMM_BIND_ADDR={a:?} is not an IP address"))
            })?,
            None => {
                // The address we reach the coordinator from is one peers can reach us at.
                let sa: SocketAddr = cfg
                    .coordinator
                    .parse()
                    .or_else(|_| {
                        use std::net::ToSocketAddrs;
                        cfg.coordinator
                            .to_socket_addrs()
                            .ok()
                            .and_then(|mut i| i.next())
                            .ok_or(())
                    })
                    .map_err(|_| {
                        Error::Config(format!(
                            "coordinator address {:?} does not resolve",
                            cfg.coordinator
                        ))
                    })?;
                if sa.ip().is_loopback() {
                    sa.ip()
                } else {
                    // The coordinator's address family: an IPv6 coordinator, an IPv6 data path.
                    let any = if sa.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" };
                    std::net::UdpSocket::bind(any)
                        .and_then(|u| u.connect(sa).and_then(|_| u.local_addr()))
                        .map(|a| a.ip())
                        .unwrap_or(sa.ip())
                }
            }
        };
        let listener = crate::bootstrap::listen(SocketAddr::new(ip, 0)).map_err(|e| {
            Error::Bootstrap(format!("rank {} cannot listen on {ip}: {e}", cfg.rank))
        })?;
        let me = listener.local_addr()?;
        let text = me.to_string();
        let mut common = Vec::new();
        common.extend_from_slice(&TAG_TCP.to_le_bytes());
        common.extend_from_slice(&(cfg.tcp_chunk as u32).to_le_bytes());
        common.extend_from_slice(&(text.len() as u32).to_le_bytes());
        common.extend_from_slice(text.as_bytes());
        let card = Card {
            common,
            entry: 0,
            each: Vec::new(),
        };
        let rv = meet(&card)?;
        check_tags(&rv.cards, &rv.addrs, cfg.rank, TAG_TCP)?;
        let mut side = rv.side;
        // Every step to the barrier is told to the group if it fails here.
        let socks = (|| -> Result<Vec<Option<TcpStream>>> {
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
                let a = String::from_utf8_lossy(r.bytes()?).into_owned();
                addrs_data.push(
                    a.parse::<SocketAddr>().map_err(|_| {
                        Error::Bootstrap(format!("rank {p} sent a bad address {a:?}"))
                    })?,
                );
            }
            let deadline = Instant::now() + cfg.timeout;
            let peer = |p: usize| Peer {
                rank: p,
                addr: rv.addrs[p].clone(),
            };
            let mut socks: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
            // Connect to lower ranks, announcing our rank.
            for (p, sa) in addrs_data.iter().enumerate().take(cfg.rank) {
                let mut s = loop {
                    match TcpStream::connect_timeout(sa, Duration::from_secs(1)) {
                        Ok(s) => break s,
                        Err(e) if Instant::now() >= deadline => {
                            return Err(Error::PeerFailed {
                                peer: peer(p),
                                reason: format!("cannot connect the data connection to {sa}: {e}"),
                            })
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(20)),
                    }
                };
                // Our rank, and the proof that we were at the rendezvous.
                let mut hello = (cfg.rank as u32).to_le_bytes().to_vec();
                hello.extend_from_slice(&proof(&rv.session, cfg.rank, p));
                s.write_all(&hello)?;
                tune(&s)?;
                socks[p] = Some(s);
            }
            // Accept from higher ranks: a connection counts once it names a rank that has yet to
            // connect and proves the session key; any other is dropped, without holding up the rest.
            listener.set_nonblocking(true)?;
            let mut pending: Vec<(TcpStream, Vec<u8>, Instant)> = Vec::new();
            let mut waiting = n - 1 - cfg.rank;
            let want = 4 + KEY;
            while waiting > 0 {
                let mut busy = false;
                match listener.accept() {
                    Ok((s, _)) if pending.len() < 1024 => {
                        busy = true;
                        s.set_nonblocking(true)?;
                        pending.push((s, Vec::new(), Instant::now() + Duration::from_secs(5)));
                    }
                    Ok(_) => {}
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return Err(e.into()),
                }
                let mut i = 0;
                while i < pending.len() {
                    let (s, buf, until) = &mut pending[i];
                    let mut b = [0u8; 64];
                    let mut drop_it = Instant::now() >= *until;
                    match s.read(&mut b[..want - buf.len()]) {
                        Ok(0) => drop_it = true,
                        Ok(k) => {
                            busy = true;
                            buf.extend_from_slice(&b[..k]);
                        }
                        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                        Err(_) => drop_it = true,
                    }
                    if buf.len() == want {
                        let (s, buf, _) = pending.swap_remove(i);
                        let p = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
                        if p > cfg.rank
                            && p < n
                            && socks[p].is_none()
                            && proof_ok(&rv.session, p, cfg.rank, &buf[4..])
                        {
                            s.set_nonblocking(false)?;
                            tune(&s)?;
                            socks[p] = Some(s);
                            waiting -= 1;
                        }
                        continue;
                    }
                    if drop_it {
                        pending.swap_remove(i);
                        continue;
                    }
                    i += 1;
                }
                if waiting > 0 && !busy {
                    if Instant::now() >= deadline {
                        let missing = (cfg.rank + 1..n).find(|&p| socks[p].is_none()).unwrap_or(0);
                        return Err(Error::Timeout {
                            peer: peer(missing),
                            what: "data connection".into(),
                            after: cfg.timeout,
                        });
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
            }
            Ok(socks)
        })();
        let socks = side.told(socks)?;
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
            conns.push(match s {
                Some(s) => {
                    s.set_read_timeout(None)?;
                    s.set_nonblocking(true)?;
                    Some(Conn {
                        sock: s,
                        out: OutQueue::default(),
                        inp: InQueue::new(4 * (chunk + HDR)),
                        direct: Direct::Off,
                        closed: false,
                    })
                }
                None => None,
            });
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
            props: Props::new(cfg.rank, n, chunk, Medium::Tcp),
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
