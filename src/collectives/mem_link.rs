//! An in-memory [`Link`] between threads, for unit tests of the algorithms: per ordered pair a
//! queue of at most `slots` chunks of at most `chunk` bytes (a full queue refuses a post, as a
//! transport out of credits does), and an optional host map. Deterministic and fast: an
//! algorithm bug shows here in milliseconds instead of in a multi-process run.

use crate::error::{Error, Peer, Result};
use crate::transport::op::{OpDesc, Partners};
use crate::transport::{Link, Pass};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One rank's end of the mesh.
pub(crate) struct MemLink {
    me: usize,
    n: usize,
    /// Queue of chunks from rank a to rank b at `a * n + b`.
    queues: Arc<Vec<Mutex<VecDeque<Chunk>>>>,
    slots: usize,
    chunk: usize,
    props: crate::transport::Props,
    idle_since: Instant,
    /// The peers posted to or taken from (an algorithm's partners).
    pub(crate) used: std::collections::BTreeSet<usize>,
    /// What its posts and takes did to the bytes.
    pub(crate) ledger: crate::transport::Ledger,
    /// Whether its posts count as sent in place (as from a buffer registered on this rank alone).
    pub(crate) in_place: bool,
    /// Whether chunks land in the receiver's buffer ([`Link::lands`]), where it offers a window
    /// (as an RDMA rank does for a buffer it registered: here, where `in_place`).
    pub(crate) landing: bool,
    /// The start of the window this rank offered each peer in the operation under way.
    offered: Vec<(usize, usize)>,
    /// The peers whose offer gave this rank a window.
    windows: Vec<usize>,
}

/// What a queue holds: a chunk's bytes, an offer (whether it gives a window), or bytes that
/// land at `at` in the receiver's window.
enum Chunk {
    Data(Vec<u8>),
    Offer(bool),
    Landed(usize, Vec<u8>),
}

/// How long a wait without progress lasts before it fails (a deadlock in an algorithm).
const STUCK: Duration = Duration::from_secs(10);

/// A mesh of `n` ranks with `slots` chunks of `chunk` bytes in flight per ordered pair.
pub(crate) fn mesh(n: usize, slots: usize, chunk: usize, hosts: Option<&[usize]>) -> Vec<MemLink> {
    let queues: Arc<Vec<_>> = Arc::new((0..n * n).map(|_| Mutex::new(VecDeque::new())).collect());
    (0..n)
        .map(|me| MemLink {
            me,
            n,
            queues: queues.clone(),
            slots,
            chunk,
            props: crate::transport::Props {
                hosts: hosts.map(<[usize]>::to_vec),
                ..crate::transport::Props::new(me, n, chunk, crate::transport::Medium::Memory)
            },
            idle_since: Instant::now(),
            used: Default::default(),
            ledger: Default::default(),
            in_place: false,
            landing: false,
            offered: Vec::new(),
            windows: Vec::new(),
        })
        .collect()
}

/// `links` made to stage their posts and relay ([`Link::try_relay`]), as RDMA and shared memory
/// do; a take frees its slot at once, so the window is one short of the slots.
pub(crate) fn relaying(mut links: Vec<MemLink>) -> Vec<MemLink> {
    for l in &mut links {
        l.props.relays = true;
        l.props.window = l.slots - 1;
    }
    links
}

/// Runs `f` on every rank of `links`, each in a thread of its own, and returns what each
/// returned, by rank.
pub(crate) fn on_every_rank<T: Send + 'static>(
    links: Vec<MemLink>,
    f: impl Fn(&mut MemLink) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let threads: Vec<_> = links
        .into_iter()
        .map(|mut l| {
            let f = f.clone();
            std::thread::spawn(move || f(&mut l))
        })
        .collect();
    threads
        .into_iter()
        .map(|t| t.join().expect("rank thread"))
        .collect()
}

impl MemLink {
    fn queue(&self, from: usize, to: usize) -> &Mutex<VecDeque<Chunk>> {
        &self.queues[from * self.n + to]
    }
}

impl Link for MemLink {
    fn props(&self) -> &crate::transport::Props {
        &self.props
    }

    fn peer(&self, rank: usize) -> Peer {
        Peer {
            rank,
            addr: "memory".into(),
        }
    }
    fn try_post(&mut self, peer: usize, data: &[u8]) -> Result<bool> {
        assert!(peer != self.me && peer < self.n, "post to {peer}");
        assert!(data.len() <= self.chunk, "a chunk of {} bytes", data.len());
        self.used.insert(peer);
        {
            let mut q = self.queue(self.me, peer).lock().unwrap();
            if q.len() >= self.slots {
                return Ok(false);
            }
            q.push_back(Chunk::Data(data.to_vec()));
        }
        if !self.in_place {
            self.ledger.count(Pass::CopyIn, data.len());
        }
        self.ledger.count(Pass::Wire, data.len());
        self.idle_since = Instant::now();
        Ok(true)
    }
    fn try_relay(
        &mut self,
        from: usize,
        to: usize,
        len: usize,
        at: Option<usize>,
        f: &mut crate::transport::Relay<'_>,
    ) -> Result<bool> {
        assert!(self.props.relays, "a relay on a link that has none");
        assert!(len <= self.chunk, "a chunk of {len} bytes");
        if self.queue(self.me, to).lock().unwrap().len() >= self.slots {
            return Ok(false);
        }
        let Some(c) = self.queue(from, self.me).lock().unwrap().pop_front() else {
            return Ok(false);
        };
        let Chunk::Data(c) = c else {
            panic!("rank {}: a relay took an offer or a landed chunk", self.me)
        };
        let mut out = vec![0u8; len];
        f(&c, &mut out)?;
        let out = match at.filter(|_| self.windows.contains(&to)) {
            Some(at) => Chunk::Landed(at, out),
            None => Chunk::Data(out),
        };
        self.queue(self.me, to).lock().unwrap().push_back(out);
        self.ledger.count(Pass::Wire, len);
        self.used.extend([from, to]);
        self.idle_since = Instant::now();
        Ok(true)
    }
    fn lands(&self, _peer: usize) -> bool {
        self.landing
    }
    fn try_offer(&mut self, peer: usize, dst: &[u8]) -> Result<bool> {
        let mut q = self.queue(self.me, peer).lock().unwrap();
        if q.len() >= self.slots {
            return Ok(false);
        }
        q.push_back(Chunk::Offer(self.in_place));
        drop(q);
        self.offered.retain(|&(p, _)| p != peer);
        if self.in_place {
            self.offered.push((peer, dst.as_ptr() as usize));
        }
        Ok(true)
    }
    fn try_accept(&mut self, peer: usize) -> Result<bool> {
        let mut q = self.queue(peer, self.me).lock().unwrap();
        match q.pop_front() {
            Some(Chunk::Offer(w)) => {
                drop(q);
                self.windows.retain(|&p| p != peer);
                if w {
                    self.windows.push(peer);
                }
                Ok(true)
            }
            Some(_) => panic!("rank {}: an accept found no offer first", self.me),
            None => Ok(false),
        }
    }
    fn try_post_at(&mut self, peer: usize, data: &[u8], at: usize) -> Result<bool> {
        if !self.windows.contains(&peer) {
            return self.try_post(peer, data);
        }
        let mut q = self.queue(self.me, peer).lock().unwrap();
        if q.len() >= self.slots {
            return Ok(false);
        }
        q.push_back(Chunk::Landed(at, data.to_vec()));
        drop(q);
        if !self.in_place {
            self.ledger.count(Pass::CopyIn, data.len());
        }
        self.ledger.count(Pass::Wire, data.len());
        Ok(true)
    }
    fn try_take_landed(&mut self, peer: usize, dst: &mut [u8]) -> Result<bool> {
        let Some(&(_, base)) = self.offered.iter().find(|(p, _)| *p == peer) else {
            return self.try_take_into(peer, dst);
        };
        let chunk = self.queue(peer, self.me).lock().unwrap().pop_front();
        match chunk {
            Some(Chunk::Landed(at, c)) => {
                // The writer's offset is the receiver's: the same range of the same layout.
                assert_eq!(
                    at,
                    dst.as_ptr() as usize - base,
                    "rank {}: landed off place",
                    self.me
                );
                assert_eq!(c.len(), dst.len());
                // What the NIC would have written: no pass of this rank's.
                dst.copy_from_slice(&c);
                self.idle_since = Instant::now();
                Ok(true)
            }
            Some(_) => panic!("rank {}: a landed take found another chunk", self.me),
            None => Ok(false),
        }
    }
    fn sends_in_place(&self, _data: &[u8]) -> bool {
        !self.props.relays || self.in_place
    }
    fn ledger_mut(&mut self) -> Option<&mut crate::transport::Ledger> {
        Some(&mut self.ledger)
    }
    fn try_take(&mut self, peer: usize, f: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<bool> {
        assert!(peer != self.me && peer < self.n, "take from {peer}");
        self.used.insert(peer);
        let chunk = self.queue(peer, self.me).lock().unwrap().pop_front();
        match chunk {
            Some(Chunk::Data(c)) => {
                self.idle_since = Instant::now();
                f(&c).map(|_| true)
            }
            Some(_) => panic!("rank {}: a take found an offer or a landed chunk", self.me),
            None => Ok(false),
        }
    }
    fn progress(&mut self, waiting_on: usize) -> Result<()> {
        std::thread::yield_now();
        if self.idle_since.elapsed() > STUCK {
            return Err(Error::Timeout {
                peer: self.peer(waiting_on),
                what: format!("rank {} made no progress (an algorithm deadlock)", self.me),
                after: STUCK,
            });
        }
        Ok(())
    }
    fn begin(&mut self) {
        self.idle_since = Instant::now();
    }
    fn start(&mut self, _op: &OpDesc, _scope: Partners) {}
}

/// Little-endian f32s of a byte buffer.
pub(crate) fn f32s(v: &[u8]) -> Vec<f32> {
    v.chunks(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// The little-endian bytes of f32s.
pub(crate) fn bytes(v: impl Iterator<Item = f32>) -> Vec<u8> {
    v.flat_map(f32::to_le_bytes).collect()
}
