//! Slots in shared memory between the ranks of one host: the data path of the shared-memory
//! transport, and of the same-host peers of a network transport ([`super::hybrid`]).
//!
//! Each rank creates one segment (an anonymous `memfd_create` file, its pages reserved up front
//! so that exhausted memory is an error at start-up, not a `SIGBUS` later) holding a ring per
//! same-host peer: the peer's count of chunks posted, this rank's count of chunks taken (each on
//! a cache line of its own), then the slots, each a 64-byte header (length, operation
//! descriptor) and `chunk` bytes. A writer copies a chunk into the reader's ring and publishes
//! the count (release); the reader sees it (acquire), reduces or copies straight from the slot,
//! then publishes its own count, which frees the slot: one copy in, no copy out. Each card
//! carries the segment's `/proc/<pid>/fd/<fd>` path, which only processes allowed to inspect
//! this one (its user's, in its PID namespace) can open; after a barrier every same-host rank
//! maps every same-host peer's segment, and after a second one each closes its descriptor.
//! Nothing is ever named in `/dev/shm`, so nothing can be left there, however the processes end.

use crate::bootstrap::{Reader, SideChannel};
use crate::error::{Error, Peer, Result};
use crate::transport::numbering::Numbering;
use crate::transport::op::{self, OpDesc, Partners};
use crate::transport::{Ledger, Pass};
use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};

/// Slots per ring of the shared-memory transport.
pub const SLOTS: usize = 8;
/// Bytes per slot of the shared-memory transport: its largest chunk.
pub const CHUNK: usize = 64 << 10;
/// Bytes of a slot's header: the chunk's length, then its operation descriptor.
const HEAD: usize = 64;
/// Where a slot's descriptor sits in its header.
const DESC_AT: usize = 16;
/// The two counters' cache lines ahead of a ring's slots.
const COUNTERS: usize = 128;

/// Bytes of a rank's segment (a ring for each rank of its host): past it the rings' geometry
/// shrinks ([`fit`]), so that a host's shared memory grows with its ranks, not their square
/// (64 ranks: 256 MiB at most).
pub const RING_BUDGET: usize = 4 << 20;
/// Bytes of all the rings of a host beside a network ([`Fit::World`]): there the rings keep the
/// network's chunk while a host can hold them (a few ranks a host: 8 MiB a rank with 1 MiB RDMA
/// chunks) and shrink only where they would pass this, so that a host still holds at most this.
pub const HOST_BUDGET: usize = 256 << 20;
/// The smallest chunk [`fit`] shrinks a ring's slots to.
const MIN_CHUNK: usize = 4 << 10;

/// The fewest slots [`fit`] leaves a ring (what the algorithms are proven with: a peer buffers as
/// many chunks as a network peer's default four).
const MIN_SLOTS: usize = 4;

/// The geometry of the rings of a host of `peers` + 1 ranks, from `slots` x `chunk` bytes each:
/// halved slots down to `min_slots` (at least [`MIN_SLOTS`]), then halved chunks down to
/// [`MIN_CHUNK`], until a rank's segment fits `budget` ([`RING_BUDGET`] alone on a host: up to
/// 128 ranks a host; past it that floor). Every rank that computes it from the same inputs gets
/// the same.
pub(crate) fn fit(
    slots: usize,
    chunk: usize,
    peers: usize,
    min_slots: usize,
    budget: usize,
) -> (usize, usize) {
    let (mut s, mut c) = (slots, chunk);
    let floor = min_slots.max(MIN_SLOTS).min(slots);
    let room = |s: usize, c: usize| (peers + 1) * (COUNTERS + s * (HEAD + c));
    while room(s, c) > budget {
        if s > floor {
            s = (s / 2).max(floor);
        } else if c > MIN_CHUNK {
            c = (c / 2).max(MIN_CHUNK);
        } else {
            break;
        }
    }
    (s, c)
}

/// Slots per ring for chunks of `chunk` bytes: [`SLOTS`] x [`CHUNK`] of room, two at least.
pub fn slots_for(chunk: usize) -> usize {
    (SLOTS * CHUNK / chunk.max(1)).clamp(2, SLOTS)
}

/// What went wrong on a ring, for the owning transport to turn into an error (its watch tells
/// the group).
pub(crate) enum Fault {
    /// The peer broke the protocol.
    Protocol(String),
    /// The peer's operation differs from this rank's.
    Mismatch(String),
    /// An error of the caller's (a take's consumer).
    Other(Error),
}

/// A shared mapping of a segment.
struct Segment {
    map: memmap2::MmapRaw,
    /// Open until every peer has opened it through `/proc/<pid>/fd/<fd>`.
    file: Option<File>,
}

/// Creates an empty anonymous memory file, so nothing is ever named in `/dev/shm` and its
/// memory goes with the last process that maps it, however it ends.
fn create_file() -> Result<File> {
    crate::sys::memory_file(c"rdmacomm").map_err(|e| no_memory(0, e.to_string()))
}

fn no_memory(len: usize, why: String) -> Error {
    Error::Config(format!(
        "cannot create {len} bytes of shared memory: {why}; set RDMACOMM_SHM=0 to do without"
    ))
}

/// What `/proc/self/fd/<fd>` reads as for a segment's file (`memfd_create`'s name).
const MEMFD_LINK: &str = "/memfd:rdmacomm ";

/// Whether `path` has the form `/proc/<pid>/fd/<fd>` (decimal numbers, nothing else).
fn is_fd_path(path: &str) -> bool {
    let num = |s: &str| !s.is_empty() && s.len() <= 10 && s.bytes().all(|b| b.is_ascii_digit());
    let mut parts = path.split('/');
    matches!(
        (parts.next(), parts.next(), parts.next(), parts.next(), parts.next(), parts.next()),
        (Some(""), Some("proc"), Some(pid), Some("fd"), Some(fd), None) if num(pid) && num(fd)
    )
}

/// Where a process on this host opens `file`, an open file of this one.
fn path_of(file: &File) -> String {
    use std::os::fd::AsRawFd;
    format!("/proc/{}/fd/{}", std::process::id(), file.as_raw_fd())
}

impl Segment {
    /// Gives `file` `len` bytes (reserved now: on a full tmpfs a later first touch would raise
    /// SIGBUS) and maps it.
    fn size(file: File, len: usize) -> Result<Segment> {
        if let Err(e) = crate::sys::reserve(&file, len) {
            return Err(no_memory(
                len,
                format!("{e} (is the memory or a container's limit exhausted?)"),
            ));
        }
        let map = memmap2::MmapOptions::new()
            .len(len)
            .map_raw(&file)
            .map_err(|e| no_memory(len, format!("mmap: {e}")))?;
        Ok(Segment {
            map,
            file: Some(file),
        })
    }

    /// Maps the peer's segment at `path`, which must be `len` bytes: a path of the form
    /// `/proc/<pid>/fd/<fd>` whose file, as opened, is an rdmacomm memory file (a peer's card
    /// can name no other file for this rank to map and write).
    fn open(path: &str, len: usize) -> std::result::Result<Segment, String> {
        if !is_fd_path(path) {
            return Err(format!(
                "its shared memory is named {path:?}, not /proc/<pid>/fd/<fd>: refused"
            ));
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| {
                format!(
                    "cannot open its shared memory {path}: {e} (another host, PID namespace or \
                     user? set RDMACOMM_HOST_ID apart, or RDMACOMM_SHM=0)"
                )
            })?;
        let what = {
            use std::os::fd::AsRawFd;
            std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
                .map(|t| t.to_string_lossy().into_owned())
                .unwrap_or_default()
        };
        if !what.starts_with(MEMFD_LINK) {
            return Err(format!(
                "its shared memory {path} is {what:?}, not an rdmacomm memory file: refused"
            ));
        }
        let size = file.metadata().map_err(|e| e.to_string())?.len() as usize;
        if size != len {
            return Err(format!(
                "its shared memory {path} has {size} bytes, not {len}"
            ));
        }
        let map = memmap2::MmapOptions::new()
            .len(len)
            .map_raw(&file)
            .map_err(|e| format!("cannot map its shared memory {path}: {e}"))?;
        Ok(Segment { map, file: None })
    }

    /// Byte `off` of the mapping.
    fn at(&self, off: usize) -> *mut u8 {
        assert!(off < self.map.len(), "offset {off} past the segment");
        // SAFETY: in bounds (asserted).
        unsafe { self.map.as_mut_ptr().add(off) }
    }

    /// The counter at `off` (8-aligned, inside the mapping).
    fn counter(&self, off: usize) -> &AtomicU64 {
        assert!(off % 8 == 0 && off + 8 <= self.map.len());
        // SAFETY: aligned and in bounds (asserted; the mapping is page-aligned); AtomicU64 has
        // u64's layout; the mapping lives as long as &self; the other processes touch it only
        // atomically too.
        unsafe { &*(self.at(off) as *const AtomicU64) }
    }
}

/// What this rank knows of one same-host peer.
#[derive(Default)]
struct PeerState {
    /// Chunks posted to it, and taken from it.
    posted: u64,
    taken: u64,
    /// Its index among the ranks of this host.
    local: usize,
}

/// How the rings shrink where many ranks share a host ([`fit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fit {
    /// Shared memory alone: by the ranks of this host.
    Host,
    /// Beside a network: by the ranks of the most crowded host, within [`HOST_BUDGET`] a host,
    /// so that every rank of the world cuts its chunks alike (the link's largest chunk becomes
    /// the rings'), keeping at least this many slots (as many as a network peer has: fewer
    /// deadlocked a program whose sends a network peer buffers).
    World { min_slots: usize },
}

/// A segment created, its path to be sent in the card: the rings before the rendezvous.
pub(crate) struct Pending {
    file: File,
    host: String,
    slots: usize,
    chunk: usize,
    fit: Fit,
}

impl Pending {
    /// Creates this rank's (empty) segment for rings of `slots` x `chunk` bytes on `host`
    /// (fewer or smaller when many ranks share a host, as `fit` says: see [`fit`]).
    pub(crate) fn new(host: &str, slots: usize, chunk: usize, fit: Fit) -> Result<Pending> {
        Ok(Pending {
            file: create_file()?,
            host: host.to_string(),
            slots,
            chunk,
            fit,
        })
    }

    /// What the card carries: slots, chunk, host and the segment's path.
    pub(crate) fn payload(&self) -> Vec<u8> {
        let mut v = Vec::new();
        for x in [self.slots as u32, self.chunk as u32] {
            v.extend_from_slice(&x.to_le_bytes());
        }
        for s in [self.host.as_bytes(), path_of(&self.file).as_bytes()] {
            v.extend_from_slice(&(s.len() as u32).to_le_bytes());
            v.extend_from_slice(s);
        }
        v
    }

    /// After the rendezvous (`payloads[p]`: rank p's [`Pending::payload`]): sizes this rank's
    /// segment for its same-host peers, waits until every rank has (`side`'s barrier), maps
    /// theirs, waits until every rank has, and closes the descriptor. With `all_local`, a rank
    /// on another host is an error naming it. Every rank calls this (both barriers are global).
    pub(crate) fn finish(
        self,
        me: usize,
        payloads: &[Vec<u8>],
        addrs: &[String],
        side: &mut SideChannel,
        all_local: bool,
    ) -> Result<Slots> {
        let n = payloads.len();
        let mut paths: Vec<Option<String>> = vec![None; n];
        let mut locals = Vec::new();
        let mut names: Vec<String> = Vec::new();
        let mut hosts = Vec::with_capacity(n);
        for (p, pl) in payloads.iter().enumerate() {
            let mut r = Reader(pl);
            let (slots, chunk) = (r.u32()? as usize, r.u32()? as usize);
            let host = String::from_utf8_lossy(r.bytes()?).into_owned();
            let path = String::from_utf8_lossy(r.bytes()?).into_owned();
            hosts.push(names.iter().position(|h| *h == host).unwrap_or_else(|| {
                names.push(host.clone());
                names.len() - 1
            }));
            // Beside a network every rank sizes its rings from the same inputs: alike everywhere.
            let alike = host == self.host || matches!(self.fit, Fit::World { .. });
            if alike && (slots, chunk) != (self.slots, self.chunk) {
                return Err(Error::Config(format!(
                    "rank {p} ({}) uses {slots} shared-memory slots of {chunk} bytes, rank {me} \
                     {} of {}: every rank must run the same rdmacomm with the same settings",
                    addrs[p], self.slots, self.chunk
                )));
            }
            if host != self.host {
                if all_local {
                    return Err(Error::Config(format!(
                        "rank {p} ({}) is on another host ({host}, this is {}): shared memory \
                         needs every rank on one host; set RDMACOMM_TRANSPORT=auto, rdma or tcp",
                        addrs[p], self.host
                    )));
                }
                continue;
            }
            if p != me {
                paths[p] = Some(path);
            }
            locals.push(p);
        }
        let (slots, chunk) = match self.fit {
            Fit::Host => fit(
                self.slots,
                self.chunk,
                locals.len().saturating_sub(1),
                0,
                RING_BUDGET,
            ),
            Fit::World { min_slots } => {
                let crowd = (0..names.len())
                    .map(|h| hosts.iter().filter(|&&x| x == h).count())
                    .max()
                    .unwrap_or(1);
                let budget = HOST_BUDGET / crowd;
                fit(self.slots, self.chunk, crowd - 1, min_slots, budget)
            }
        };
        let ring = COUNTERS + slots * (HEAD + chunk);
        let len = locals.len() * ring;
        // Alone on its host, a rank maps nothing (but still meets the others at the barriers).
        let mut mine = if locals.len() > 1 {
            Some(Segment::size(self.file, len)?)
        } else {
            None
        };
        side.barrier()?;
        let mut theirs: Vec<Option<Segment>> = Vec::with_capacity(n);
        for (p, path) in paths.iter().enumerate() {
            let Some(path) = path else {
                theirs.push(None);
                continue;
            };
            let peer = Peer {
                rank: p,
                addr: addrs[p].clone(),
            };
            // This rank's own failure (its user, PID namespace or host differs from p's), told
            // while its own segment is still open: a peer that opens it later then fails naming
            // this cause, not a segment gone.
            let seg = Segment::open(path, len).map_err(|reason| {
                Error::Config(format!("rank {} ({}): {reason}", peer.rank, peer.addr))
            });
            theirs.push(Some(side.told_or_echo(seg)?));
        }
        // Every rank has mapped every segment it needs: nobody opens ours again.
        side.barrier()?;
        if let Some(m) = mine.as_mut() {
            m.file = None;
        }
        let mut state: Vec<Option<PeerState>> = (0..n).map(|_| None).collect();
        for (i, &p) in locals.iter().enumerate() {
            state[p] = Some(PeerState {
                local: i,
                ..PeerState::default()
            });
        }
        let my_local = state[me].as_ref().map_or(0, |s| s.local);
        state[me] = None;
        Ok(Slots {
            mine,
            theirs,
            state,
            my_local,
            hosts,
            slots,
            chunk,
            ring,
            numbering: Numbering::new(me, n),
            ledger: Ledger::default(),
        })
    }
}

/// One rank's rings with its same-host peers.
pub(crate) struct Slots {
    /// The segment same-host peers write to this rank (none when it has no such peer).
    mine: Option<Segment>,
    /// Each same-host peer's segment, which this rank writes, by rank.
    theirs: Vec<Option<Segment>>,
    /// By rank: Some for same-host peers.
    state: Vec<Option<PeerState>>,
    my_local: usize,
    /// Every rank's host, numbered in order of first appearance.
    hosts: Vec<usize>,
    slots: usize,
    chunk: usize,
    ring: usize,
    /// The operation under way and its numbers with each peer (every slot carries its
    /// descriptor; the first of an operation from a peer is checked).
    numbering: Numbering,
    /// What its posts did to the bytes (copies in, bytes on the wire).
    pub(crate) ledger: Ledger,
}

impl Slots {
    /// What these rings hold: this rank's segment, and the peers' it maps.
    pub(crate) fn holds(&self) -> crate::transport::Holdings {
        crate::transport::Holdings {
            shared: self.mine.as_ref().map_or(0, |m| m.map.len()),
            mapped: self.theirs.iter().flatten().map(|s| s.map.len()).sum(),
            ..Default::default()
        }
    }

    /// Whether rank `p` is a same-host peer (reached through these rings).
    pub(crate) fn reaches(&self, p: usize) -> bool {
        self.state.get(p).is_some_and(|s| s.is_some())
    }

    /// The number of same-host peers.
    pub(crate) fn peers(&self) -> usize {
        self.state.iter().filter(|s| s.is_some()).count()
    }

    /// Every rank's host (numbered from 0 in order of first appearance).
    pub(crate) fn hosts(&self) -> &[usize] {
        &self.hosts
    }

    /// The slots of each ring.
    pub(crate) fn slots(&self) -> usize {
        self.slots
    }

    /// The largest chunk.
    pub(crate) fn chunk(&self) -> usize {
        self.chunk
    }

    /// Offsets in a segment: the ring written by the rank of local index `w`.
    fn posted_at(&self, w: usize) -> usize {
        w * self.ring
    }
    fn taken_at(&self, w: usize) -> usize {
        w * self.ring + 64
    }
    fn slot_at(&self, w: usize, k: u64) -> usize {
        w * self.ring + COUNTERS + (k as usize % self.slots) * (HEAD + self.chunk)
    }

    /// The body of the next slot to same-host peer `p`, its header written for `len` bytes (at
    /// most [`Slots::chunk`]), if one is free: fill it, then [`Slots::publish`] it.
    fn claim(&mut self, p: usize, len: usize) -> std::result::Result<Option<*mut u8>, Fault> {
        assert!(len <= self.chunk, "a chunk larger than max_chunk");
        let me = self.my_local;
        let st = self.state[p].as_ref().expect("a same-host peer");
        let seg = self.theirs[p].as_ref().expect("its segment is mapped");
        let k = st.posted;
        let taken = seg.counter(self.taken_at(me)).load(Ordering::Acquire);
        if taken > k {
            return Err(Fault::Protocol(format!(
                "protocol error: took {taken} chunks of {k} posted"
            )));
        }
        if k - taken >= self.slots as u64 {
            return Ok(None);
        }
        let slot = self.slot_at(me, k);
        let desc = self.numbering.desc_to(p);
        // SAFETY: the slot lies in the mapping (slot_at, ring) and is ours to write: the reader
        // took chunk k - slots (checked above) and reads this slot only after we publish k + 1.
        unsafe {
            let head = std::slice::from_raw_parts_mut(seg.at(slot), HEAD);
            head[..4].copy_from_slice(&(len as u32).to_le_bytes());
            head[DESC_AT..DESC_AT + op::WIRE].copy_from_slice(&desc);
        }
        Ok(Some(seg.at(slot + HEAD)))
    }

    /// Publishes the slot [`Slots::claim`] gave for `p`, of `len` bytes.
    fn publish(&mut self, p: usize, len: usize) {
        let at = self.posted_at(self.my_local);
        let st = self.state[p].as_mut().expect("a same-host peer");
        let seg = self.theirs[p].as_ref().expect("its segment is mapped");
        st.posted += 1;
        seg.counter(at).store(st.posted, Ordering::Release);
        self.ledger.count(Pass::Wire, len);
    }

    /// Posts `data` (at most [`Slots::chunk`] bytes) to same-host peer `p` if a slot is free.
    pub(crate) fn try_post(&mut self, p: usize, data: &[u8]) -> std::result::Result<bool, Fault> {
        let Some(body) = self.claim(p, data.len())? else {
            return Ok(false);
        };
        // SAFETY: the claimed slot's body, data.len() <= chunk bytes, ours until published.
        crate::copy::copy(
            unsafe { std::slice::from_raw_parts_mut(body, data.len()) },
            data,
        );
        self.ledger.count(Pass::CopyIn, data.len());
        self.publish(p, data.len());
        Ok(true)
    }

    /// Takes the next chunk from same-host peer `from` and posts to `to` the `len` bytes `f`
    /// writes from it straight into the slot ([`crate::transport::Link::try_relay`]). A fault
    /// names the peer it came from.
    pub(crate) fn try_relay(
        &mut self,
        from: usize,
        to: usize,
        len: usize,
        f: &mut crate::transport::Relay<'_>,
    ) -> std::result::Result<bool, (usize, Fault)> {
        let Some(body) = self.claim(to, len).map_err(|e| (to, e))? else {
            return Ok(false);
        };
        // SAFETY: the claimed slot's body (len <= chunk), in `to`'s segment, which no chunk
        // from `from` lies in; ours until published.
        let out = unsafe { std::slice::from_raw_parts_mut(body, len) };
        let took = self.try_take(from, &mut |src: &[u8]| f(src, out));
        if !took.map_err(|e| (from, e))? {
            return Ok(false);
        }
        self.publish(to, len);
        Ok(true)
    }

    /// If the next chunk from same-host peer `p` has arrived, hands it to `f` and frees its slot.
    pub(crate) fn try_take(
        &mut self,
        p: usize,
        f: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> std::result::Result<bool, Fault> {
        let st = self.state[p].as_ref().expect("a same-host peer");
        let (k, w) = (st.taken, st.local);
        let mine = self
            .mine
            .as_ref()
            .expect("mapped: this rank has a same-host peer");
        let posted = mine.counter(self.posted_at(w)).load(Ordering::Acquire);
        if posted <= k {
            if posted < k {
                return Err(Fault::Protocol(format!(
                    "protocol error: posted count went back to {posted} from {k}"
                )));
            }
            return Ok(false);
        }
        if posted - k > self.slots as u64 {
            return Err(Fault::Protocol(format!(
                "protocol error: {posted} chunks posted, {k} taken, {} slots",
                self.slots
            )));
        }
        let slot = self.slot_at(w, k);
        // SAFETY: the header lies in our mapping; the writer published it (acquire above) and
        // does not touch the slot again until we publish k + 1.
        let head = unsafe { std::slice::from_raw_parts(mine.at(slot), HEAD) };
        let len = u32::from_le_bytes(head[..4].try_into().expect("4 bytes")) as usize;
        if len > self.chunk {
            return Err(Fault::Protocol(format!(
                "protocol error: chunk {k} has {len} bytes (at most {})",
                self.chunk
            )));
        }
        if self.numbering.first_from(p) {
            let got = &head[DESC_AT..DESC_AT + op::WIRE];
            if let Err(why) = self.numbering.check_from(p, got) {
                return Err(Fault::Mismatch(why));
            }
        }
        // SAFETY: as for the header: len bytes after it, in the slot (len <= chunk checked).
        let body = unsafe { std::slice::from_raw_parts(mine.at(slot + HEAD), len) };
        f(body).map_err(Fault::Other)?;
        mine.counter(self.taken_at(w))
            .store(k + 1, Ordering::Release);
        let st = self.state[p].as_mut().expect("a same-host peer");
        st.taken = k + 1;
        self.numbering.took_from(p);
        Ok(true)
    }

    /// Starts operation `op` with the same-host peers of `scope` (numbers and descriptors as in
    /// [`crate::transport::Link::start`]).
    pub(crate) fn start(&mut self, op: &OpDesc, scope: Partners) {
        self.numbering.start(op, scope);
    }
}

#[cfg(test)]
#[path = "shm_slots_tests.rs"]
mod tests;
