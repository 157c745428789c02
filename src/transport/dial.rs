//! Data connections made when first needed: either rank of a pair may dial the other (the
//! first to post or take to it), both prove the group's session key, and where both dialed at
//! once the lower rank's connection is kept. A connection that names no rank of the group or
//! cannot prove the key is dropped without a word (a stranger is never fatal). TCP sends its
//! data over the connection; RDMA exchanges its queue pairs' endpoints over it.

use crate::bootstrap::rendezvous::{mac, mac_ok, KEY};
use crate::error::{Error, Result};
use socket2::{Domain, SockAddr, Socket, Type};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// Bytes of a dialer's hello: its rank, then its proof.
const HELLO: usize = 4 + KEY;
/// Bytes of an answer: kept (1) or not (0), then the answerer's proof over it.
const ANSWER: usize = 1 + KEY;
/// Accepted connections still proving themselves, at most (past it the oldest is closed for the
/// newest: a flood of idle strangers cannot shut a rank's dial out).
const MAX_INBOUND: usize = 1024;
/// How long an accepted connection may take to prove itself.
const HELLO_WITHIN: Duration = Duration::from_secs(5);

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

/// The answer of rank `from` to rank `to`'s dial: the verdict and the proof over it.
fn answer(session: &[u8; KEY], from: usize, to: usize, keep: bool) -> [u8; ANSWER] {
    let (f, t) = ((from as u32).to_le_bytes(), (to as u32).to_le_bytes());
    let mut a = [0u8; ANSWER];
    a[0] = keep as u8;
    let tag = mac(session, &[b"rdmacomm tcp answer", &f, &t, &[keep as u8]]);
    a[1..].copy_from_slice(&tag);
    a
}

fn answer_ok(session: &[u8; KEY], from: usize, to: usize, a: &[u8]) -> bool {
    let (f, t) = ((from as u32).to_le_bytes(), (to as u32).to_le_bytes());
    mac_ok(session, &[b"rdmacomm tcp answer", &f, &t, &a[..1]], &a[1..])
}

/// Connects rank `me`, listening on `listener`, to rank `peer` of a group listening at `addrs`
/// and sharing `session`, as a transport does (dialing, answering, proving), within `within`:
/// the proven connection, blocking. For a test that plays a rank by hand.
#[cfg_attr(not(feature = "unstable"), allow(dead_code))]
pub fn connect_to(
    me: usize,
    listener: TcpListener,
    addrs: Vec<SocketAddr>,
    session: [u8; KEY],
    peer: usize,
    within: Duration,
) -> Result<TcpStream> {
    let mut d = Dialer::new(me, listener, addrs, session)?;
    let until = Instant::now() + within;
    let mut events = Vec::new();
    loop {
        d.dial(peer).map_err(|(_, why)| Error::Bootstrap(why))?;
        d.step(&mut events)?;
        for e in events.drain(..) {
            match e {
                Event::Up(p, s) if p == peer => {
                    s.set_nonblocking(false)?;
                    return Ok(s);
                }
                Event::Up(..) => {}
                Event::Failed(_, why) => return Err(Error::Bootstrap(why)),
            }
        }
        if Instant::now() >= until {
            return Err(Error::Bootstrap(format!(
                "rank {peer} did not connect within {within:?}"
            )));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Idle turns of a wait between looks at the listener while no connection is under way: counted,
/// not timed, since where the clocksource traps (an emulated CPU) a clock read on every turn
/// slows small operations (docs/BENCHMARKS.md); a wait that naps looks after every nap too.
const LOOK_EVERY: u32 = 256;

/// When a wait looks at the listener: a peer may dial this rank while it waits on another.
#[derive(Debug, Default)]
pub(crate) struct Lookout {
    turns: u32,
}

impl Lookout {
    /// Counts an idle turn: whether this one looks.
    pub(crate) fn due(&mut self) -> bool {
        self.turns = self.turns.wrapping_add(1);
        self.turns % LOOK_EVERY == 0
    }
}

/// A dial under way to one peer.
enum Outgoing {
    /// The TCP handshake is under way.
    Connecting(Socket),
    /// Connected; `sent` bytes of the hello written, then `got` bytes of the answer read.
    Proving {
        sock: TcpStream,
        sent: usize,
        got: Vec<u8>,
    },
    /// The peer kept its own dial to this rank: wait for it.
    Declined,
}

/// An accepted connection reading its hello.
struct Inbound {
    sock: TcpStream,
    got: Vec<u8>,
    until: Instant,
}

/// What changed in a [`Dialer::step`].
pub(crate) enum Event {
    /// A peer's connection is up and proven both ways.
    Up(usize, TcpStream),
    /// A dial to a peer failed: the peer and why.
    Failed(usize, String),
}

/// One rank's listener and its dials: the connections of a TCP transport, made on demand.
pub(crate) struct Dialer {
    me: usize,
    listener: TcpListener,
    addrs: Vec<SocketAddr>,
    session: [u8; KEY],
    out: Vec<Option<Outgoing>>,
    inbound: Vec<Inbound>,
    /// Peers up (connected and proven), so that a late dial from one is declined.
    up: Vec<bool>,
    /// Dials connecting or proving (kept by `dial` and `step`: `busy` is asked on every wait).
    under_way: usize,
    /// [`MAX_INBOUND`] (fewer in tests).
    max_inbound: usize,
}

impl Dialer {
    /// A dialer for rank `me` listening on `listener` (non-blocking from here on), whose peers
    /// listen at `addrs` and share `session`.
    pub(crate) fn new(
        me: usize,
        listener: TcpListener,
        addrs: Vec<SocketAddr>,
        session: [u8; KEY],
    ) -> Result<Dialer> {
        listener.set_nonblocking(true)?;
        let n = addrs.len();
        Ok(Dialer {
            me,
            listener,
            out: (0..n).map(|_| None).collect(),
            inbound: Vec::new(),
            up: vec![false; n],
            addrs,
            session,
            under_way: 0,
            max_inbound: MAX_INBOUND,
        })
    }

    /// Whether a dial or an accepted connection is under way.
    /// Ends every connection under way, dialed or accepted: this generation makes no more
    /// (a peer that had accepted one of them then sees it close).
    pub(crate) fn abandon(&mut self) {
        self.out.iter_mut().for_each(|o| *o = None);
        self.inbound.clear();
        self.under_way = 0;
    }

    /// Peer `p` is connected already (a connection carried over from a communicator before):
    /// a dial from it is declined, as from any peer up.
    pub(crate) fn connected(&mut self, p: usize) {
        if let Some(u) = self.up.get_mut(p) {
            *u = true;
        }
    }

    pub(crate) fn busy(&self) -> bool {
        !self.inbound.is_empty() || self.under_way > 0
    }

    /// Starts a dial to `p` unless one is under way, `p` is up, or `p` keeps its own.
    pub(crate) fn dial(&mut self, p: usize) -> std::result::Result<(), (usize, String)> {
        if self.up[p] || self.out[p].is_some() || p == self.me {
            return Ok(());
        }
        let (sa, me) = (self.addrs[p], self.me);
        // Out of descriptors, buffers or local ports is this rank's failure, not the peer's.
        let local = |e: std::io::Error| {
            let why = format!("cannot open a socket to dial rank {p} at {sa}: {e}");
            (me, why)
        };
        let s = Socket::new(Domain::for_address(sa), Type::STREAM, None).map_err(local)?;
        s.set_nonblocking(true).map_err(local)?;
        match s.connect(&SockAddr::from(sa)) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) if e.raw_os_error() == Some(libc::EADDRNOTAVAIL) => return Err(local(e)),
            Err(e) => return Err((p, format!("cannot dial its data connection at {sa}: {e}"))),
        }
        self.out[p] = Some(Outgoing::Connecting(s));
        self.under_way += 1;
        Ok(())
    }

    /// The sockets a wait should wake on: the listener, and every connection under way.
    pub(crate) fn waits(&self) -> impl Iterator<Item = crate::sys::Wait> + '_ {
        let listen = std::iter::once(crate::sys::Wait {
            fd: self.listener.as_raw_fd(),
            read: true,
            write: false,
        });
        // No walk over the world while no dial is under way.
        let dials = if self.under_way > 0 {
            &self.out[..]
        } else {
            &[]
        };
        let out = dials.iter().flatten().filter_map(|o| match o {
            Outgoing::Connecting(s) => Some(crate::sys::Wait {
                fd: s.as_raw_fd(),
                read: false,
                write: true,
            }),
            Outgoing::Proving { sock, sent, .. } => Some(crate::sys::Wait {
                fd: sock.as_raw_fd(),
                read: *sent == HELLO,
                write: *sent < HELLO,
            }),
            Outgoing::Declined => None,
        });
        let inb = self.inbound.iter().map(|i| crate::sys::Wait {
            fd: i.sock.as_raw_fd(),
            read: true,
            write: false,
        });
        listen.chain(out).chain(inb)
    }

    /// Moves every connection under way as far as it goes without waiting; what came up or
    /// failed goes to `events`. Returns whether a peer came up (or a dial failed): only that is
    /// progress, so that neither a stranger's connection nor a dial shed and made again holds a
    /// wait off its deadline.
    pub(crate) fn step(&mut self, events: &mut Vec<Event>) -> Result<bool> {
        let before = events.len();
        self.accept();
        if self.under_way > 0 {
            for p in 0..self.out.len() {
                self.advance(p, events);
            }
        }
        let mut i = 0;
        while i < self.inbound.len() {
            if self.read_hello(i, events) {
                i += 1;
            }
        }
        // Only a dial under way can end in a step (none starts in one): no walk over the world
        // when none was.
        if self.under_way > 0 {
            self.under_way = self
                .out
                .iter()
                .filter(|o| matches!(o, Some(Outgoing::Connecting(_) | Outgoing::Proving { .. })))
                .count();
        }
        Ok(events.len() > before)
    }

    /// Accepts what the listener holds.
    fn accept(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((s, _)) => {
                    if self.inbound.len() >= self.max_inbound {
                        let oldest = (0..self.inbound.len()).min_by_key(|&i| self.inbound[i].until);
                        oldest.map(|i| self.inbound.swap_remove(i));
                    }
                    if s.set_nonblocking(true).is_ok() {
                        self.inbound.push(Inbound {
                            sock: s,
                            got: Vec::with_capacity(HELLO),
                            until: Instant::now() + HELLO_WITHIN,
                        });
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                // Drained; or the peer reset it before it was accepted, or the process is out
                // of descriptors for now: what a later step may retry.
                Err(_) => return,
            }
        }
    }

    /// Moves the dial to `p` as far as it goes now (what came of it goes to `events`).
    fn advance(&mut self, p: usize, events: &mut Vec<Event>) {
        let sa = self.addrs[p];
        let failed = |e: String| Event::Failed(p, format!("its data connection at {sa}: {e}"));
        match self.out[p].take() {
            None => {}
            Some(Outgoing::Declined) => self.out[p] = Some(Outgoing::Declined),
            Some(Outgoing::Connecting(s)) => match s.take_error() {
                Ok(Some(e)) | Err(e) => events.push(failed(format!("cannot connect: {e}"))),
                Ok(None) if s.peer_addr().is_err() => self.out[p] = Some(Outgoing::Connecting(s)),
                Ok(None) => {
                    let sock: TcpStream = s.into();
                    self.out[p] = Some(Outgoing::Proving {
                        sock,
                        sent: 0,
                        got: Vec::with_capacity(ANSWER),
                    });
                    self.advance(p, events);
                }
            },
            Some(Outgoing::Proving {
                mut sock,
                mut sent,
                mut got,
            }) => {
                let mut hello = [0u8; HELLO];
                hello[..4].copy_from_slice(&(self.me as u32).to_le_bytes());
                hello[4..].copy_from_slice(&proof(&self.session, self.me, p));
                while sent < HELLO {
                    match sock.write(&hello[sent..]) {
                        Ok(k) => sent += k,
                        Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == ErrorKind::Interrupted => {}
                        Err(e) => {
                            events.push(failed(format!("cannot send its hello: {e}")));
                            return;
                        }
                    }
                }
                let mut buf = [0u8; ANSWER];
                while sent == HELLO && got.len() < ANSWER {
                    match sock.read(&mut buf[..ANSWER - got.len()]) {
                        // Closed unanswered (the listener shed it under a flood of strangers):
                        // dialed again at the next post or take. No progress: a peer that only
                        // ever closes is named at the wait's deadline. A peer gone refuses the
                        // next dial, which fails naming it.
                        Ok(0) => return,
                        Ok(k) => got.extend_from_slice(&buf[..k]),
                        Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == ErrorKind::Interrupted => {}
                        Err(_) => return,
                    }
                }
                if got.len() < ANSWER {
                    self.out[p] = Some(Outgoing::Proving { sock, sent, got });
                } else if !answer_ok(&self.session, p, self.me, &got) {
                    events.push(failed(
                        "answered without the group's session proof (another process \
                         listens at that address?)"
                            .into(),
                    ));
                } else if got[0] == 1 {
                    self.up[p] = true;
                    events.push(Event::Up(p, sock));
                } else {
                    self.out[p] = Some(Outgoing::Declined);
                }
            }
        }
    }

    /// Reads inbound connection `i`'s hello and answers it: whether it is still there (false:
    /// answered, or dropped as a stranger's or a late one's).
    fn read_hello(&mut self, i: usize, events: &mut Vec<Event>) -> bool {
        let c = &mut self.inbound[i];
        let mut buf = [0u8; HELLO];
        let mut drop_it = Instant::now() >= c.until;
        while c.got.len() < HELLO && !drop_it {
            match c.sock.read(&mut buf[..HELLO - c.got.len()]) {
                Ok(0) => drop_it = true,
                Ok(k) => c.got.extend_from_slice(&buf[..k]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => drop_it = true,
            }
        }
        if drop_it {
            self.inbound.swap_remove(i);
            return false;
        }
        if c.got.len() < HELLO {
            return true;
        }
        let Inbound { mut sock, got, .. } = self.inbound.swap_remove(i);
        let p = u32::from_le_bytes(got[..4].try_into().expect("4 bytes")) as usize;
        let n = self.addrs.len();
        if p >= n || p == self.me || !proof_ok(&self.session, p, self.me, &got[4..]) {
            return false; // a stranger, or another group's rank
        }
        // Where both dialed, the lower rank's dial is kept; a peer already up is declined.
        let ours = matches!(
            self.out[p],
            Some(Outgoing::Connecting(_) | Outgoing::Proving { .. })
        );
        let ours_wins = ours && self.me < p;
        let keep = !(self.up[p] || ours_wins);
        let a = answer(&self.session, self.me, p, keep);
        // A fresh socket's buffer takes 33 bytes at once; a peer gone by now is found later.
        let wrote = matches!(sock.write(&a), Ok(k) if k == ANSWER);
        if keep && wrote {
            self.out[p] = None;
            self.up[p] = true;
            events.push(Event::Up(p, sock));
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Dialers for ranks `0..n` on loopback sharing `session`.
    fn group(n: usize, session: [u8; KEY]) -> Vec<Dialer> {
        let ls: Vec<TcpListener> = (0..n)
            .map(|_| crate::bootstrap::listen(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap())
            .collect();
        let addrs: Vec<SocketAddr> = ls.iter().map(|l| l.local_addr().unwrap()).collect();
        ls.into_iter()
            .enumerate()
            .map(|(r, l)| Dialer::new(r, l, addrs.clone(), session).unwrap())
            .collect()
    }

    /// Steps every dialer until `done` says so (at most 5 s); returns each one's events.
    fn run(ds: &mut [Dialer], done: impl Fn(&[Vec<Event>]) -> bool) -> Vec<Vec<Event>> {
        let mut got: Vec<Vec<Event>> = ds.iter().map(|_| Vec::new()).collect();
        let until = Instant::now() + Duration::from_secs(5);
        while !done(&got) {
            assert!(Instant::now() < until, "no progress in 5 s");
            for (d, g) in ds.iter_mut().zip(got.iter_mut()) {
                d.step(g).unwrap();
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        got
    }

    fn ups(ev: &[Event]) -> Vec<usize> {
        ev.iter()
            .map(|e| match e {
                Event::Up(p, _) => *p,
                Event::Failed(p, why) => panic!("rank {p} failed: {why}"),
            })
            .collect()
    }

    fn stream(ev: &mut Vec<Event>) -> TcpStream {
        match ev.pop() {
            Some(Event::Up(_, s)) => s,
            _ => panic!("no connection"),
        }
    }

    /// Rank 1 dials rank 0, and both see the one connection come up.
    fn rank_1_connects_to_rank_0(ds: &mut [Dialer]) {
        ds[1].dial(0).unwrap();
        let got = run(ds, |g| !g[0].is_empty() && !g[1].is_empty());
        assert_eq!((ups(&got[0]), ups(&got[1])), (vec![1], vec![0]));
    }

    /// The same connection seen from both ends: bytes written at one are read at the other.
    fn same(mut a: TcpStream, mut b: TcpStream) {
        b.set_nonblocking(false).unwrap();
        a.write_all(b"ping").unwrap();
        let mut buf = [0u8; 4];
        b.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"ping");
    }

    #[test]
    fn two_ranks_dialing_each_other_at_once_keep_one_connection() {
        for first in [0, 1] {
            let mut ds = group(2, [7; KEY]);
            ds[first].dial(1 - first).unwrap();
            ds[1 - first].dial(first).unwrap();
            let mut got = run(&mut ds, |g| g.iter().all(|e| !e.is_empty()));
            // Settle: a declined dial must not bring a second connection later.
            for _ in 0..50 {
                for (d, g) in ds.iter_mut().zip(got.iter_mut()) {
                    d.step(g).unwrap();
                }
            }
            assert_eq!((ups(&got[0]), ups(&got[1])), (vec![1], vec![0]));
            assert!(!ds[0].busy() && !ds[1].busy());
            let (b, a) = (stream(&mut got[1]), stream(&mut got[0]));
            same(a, b);
        }
    }

    #[test]
    fn strangers_are_dropped_and_ranks_still_connect() {
        let mut ds = group(3, [7; KEY]);
        let at = ds[0].addrs[0];
        // Junk naming rank 1; a rank of another group (another session) naming rank 2.
        let mut junk = TcpStream::connect(at).unwrap();
        let mut hello = [0u8; HELLO];
        hello[..4].copy_from_slice(&1u32.to_le_bytes());
        junk.write_all(&hello).unwrap();
        let mut other = TcpStream::connect(at).unwrap();
        hello[..4].copy_from_slice(&2u32.to_le_bytes());
        hello[4..].copy_from_slice(&proof(&[8; KEY], 2, 0));
        other.write_all(&hello).unwrap();
        ds[1].dial(0).unwrap();
        ds[2].dial(0).unwrap();
        let got = run(&mut ds, |g| g[0].len() == 2);
        let mut from: Vec<usize> = ups(&got[0]);
        from.sort();
        assert_eq!(from, vec![1, 2]);
        // Both strangers were closed without an answer.
        for mut s in [junk, other] {
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut b = [0u8; 1];
            assert!(matches!(s.read(&mut b), Ok(0) | Err(_)));
        }
    }

    #[test]
    fn a_strangers_connection_is_no_progress() {
        let mut ds = group(2, [7; KEY]);
        let mut junk = TcpStream::connect(ds[0].addrs[0]).unwrap();
        junk.write_all(b"GET / HTTP/1.0").unwrap();
        let mut ev = Vec::new();
        for _ in 0..20 {
            // Accepted, read, then dropped: none of it may restart a wait's clock.
            assert!(!ds[0].step(&mut ev).unwrap());
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(ev.is_empty());
        rank_1_connects_to_rank_0(&mut ds);
    }

    #[test]
    fn a_flood_of_idle_strangers_cannot_shut_a_rank_out() {
        let mut ds = group(2, [7; KEY]);
        ds[0].max_inbound = 4;
        let at = ds[0].addrs[0];
        let _idle: Vec<TcpStream> = (0..8).map(|_| TcpStream::connect(at).unwrap()).collect();
        ds[0].step(&mut Vec::new()).unwrap();
        assert_eq!(ds[0].inbound.len(), 4, "the newest four held");
        rank_1_connects_to_rank_0(&mut ds);
    }

    #[test]
    fn a_dial_shed_unanswered_is_made_again() {
        let mut ds = group(2, [7; KEY]);
        ds[0].max_inbound = 1;
        let at = ds[0].addrs[0];
        ds[1].dial(0).unwrap();
        // Rank 1's connection and hello are in rank 0's backlog, then a stranger's behind it:
        // rank 0 sheds rank 1's (the oldest) for the stranger's, unanswered.
        let until = Instant::now() + Duration::from_secs(5);
        while !matches!(ds[1].out[0], Some(Outgoing::Proving { sent: HELLO, .. })) {
            assert!(Instant::now() < until);
            ds[1].step(&mut Vec::new()).unwrap();
        }
        let _stranger = TcpStream::connect(at).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        let mut got: Vec<Vec<Event>> = vec![Vec::new(), Vec::new()];
        ds[0].step(&mut got[0]).unwrap();
        assert!(got[0].is_empty(), "rank 1's dial was shed");
        while got[1].is_empty() {
            assert!(Instant::now() < until, "rank 1 never came up");
            ds[1].dial(0).unwrap(); // what the next post or take does
            for (d, g) in ds.iter_mut().zip(got.iter_mut()) {
                d.step(g).unwrap();
            }
        }
        assert_eq!(ups(&got[1]), vec![0]);
    }

    #[test]
    fn a_dial_nobody_answers_at_the_address_fails_naming_the_peer() {
        let mut ds = group(2, [7; KEY]);
        // Nothing listens at rank 1's address any more.
        let gone = ds.pop().unwrap();
        drop(gone);
        ds[0].dial(1).unwrap();
        let mut ev = Vec::new();
        let until = Instant::now() + Duration::from_secs(5);
        while ev.is_empty() && Instant::now() < until {
            ds[0].step(&mut ev).unwrap();
        }
        match ev.as_slice() {
            [Event::Failed(1, why)] => assert!(why.contains("cannot connect"), "{why}"),
            _ => panic!("expected the dial to rank 1 to fail"),
        }
    }
}
