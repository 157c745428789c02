//! Shared memory between the ranks of one host.
//!
//! Each rank creates one segment (an anonymous `memfd_create` file, its pages reserved up front
//! so that exhausted memory is an error at start-up, not a `SIGBUS` later) holding a ring per peer: the
//! peer's count of chunks posted, this rank's count of chunks taken (each on a cache line of its
//! own), then [`SLOTS`] slots of a 64-byte header (length, operation descriptor) and
//! [`CHUNK`] bytes. A writer copies a chunk into the reader's ring and publishes the count
//! (release); the reader sees it (acquire), reduces or copies straight from the slot, then
//! publishes its own count, which frees the slot: one copy in, no copy out. Each card carries
//! the segment's `/proc/<pid>/fd/<fd>` path, which only processes allowed to inspect this one
//! (its user's) can open; every rank maps every peer's segment, and after a barrier each closes
//! its descriptor. Nothing is ever named in `/dev/shm`, so nothing can be left there, however
//! the processes end. Failures travel on the side channel as with the other
//! transports (a dead process closes its connection).

use crate::config::Config;
use crate::error::{Error, Peer, Result};
use crate::transport::bootstrap::{check_tags, Reader, TAG_SHM};
use crate::transport::op::{self, OpDesc, OpKind, Scope};
use crate::transport::pacer::{self, oversubscribed, Pacer, Wait};
use crate::transport::rendezvous::{Card, Rendezvous};
use crate::transport::watch::Watch;
use crate::transport::Link;
use std::fs::File;
use std::os::fd::FromRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Slots per ring.
pub const SLOTS: usize = 8;
/// Bytes per slot: the largest chunk.
pub const CHUNK: usize = 64 << 10;
/// Bytes of a slot's header: the chunk's length, then its operation descriptor.
const HEAD: usize = 64;
/// Where a slot's descriptor sits in its header.
const DESC_AT: usize = 16;
/// The two counters' cache lines ahead of a ring's slots.
const COUNTERS: usize = 128;
/// Bytes of one ring.
const RING: usize = COUNTERS + SLOTS * (HEAD + CHUNK);

/// How long waits spin before they yield: a handoff through the cache takes well under this.
const SPIN: Duration = Duration::from_micros(50);
/// Idleness after which waits nap instead of yielding.
const YIELD: Duration = Duration::from_millis(2);
/// A nap's length.
const NAP: Duration = Duration::from_micros(50);

/// A shared mapping of a segment: an anonymous file (`memfd_create`), so nothing is ever named
/// in `/dev/shm` and the memory goes with the last process that maps it, however it ends.
struct Segment {
    map: memmap2::MmapRaw,
    /// Open until every peer has opened it through `/proc/<pid>/fd/<fd>`.
    file: Option<File>,
}

impl Segment {
    /// Creates a segment of `len` bytes (its pages reserved now: on a full tmpfs a later first
    /// touch would raise SIGBUS) and maps it.
    fn create(len: usize) -> Result<Segment> {
        let fail = |why: String| {
            Error::Config(format!(
                "cannot create {len} bytes of shared memory: {why}; set RDMACOMM_SHM=0 to do \
                 without"
            ))
        };
        // SAFETY: a NUL-terminated name; the flags are valid.
        let fd = unsafe { libc::memfd_create(c"rdmacomm".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(fail(std::io::Error::last_os_error().to_string()));
        }
        // SAFETY: fd was just opened and is owned by nobody else.
        let file = unsafe { File::from_raw_fd(fd) };
        // SAFETY: fd is open for writing.
        let r = unsafe { libc::posix_fallocate(fd, 0, len as libc::off_t) };
        if r != 0 {
            return Err(fail(format!(
                "{} (is the memory or a container's limit exhausted?)",
                std::io::Error::from_raw_os_error(r)
            )));
        }
        let map = memmap2::MmapOptions::new()
            .len(len)
            .map_raw(&file)
            .map_err(|e| fail(format!("mmap: {e}")))?;
        Ok(Segment {
            map,
            file: Some(file),
        })
    }

    /// Where a peer on this host opens this segment.
    fn path(&self) -> String {
        use std::os::fd::AsRawFd;
        let fd = self.file.as_ref().map_or(-1, |f| f.as_raw_fd());
        format!("/proc/{}/fd/{fd}", std::process::id())
    }

    /// Maps the peer's segment at `path`, which must be `len` bytes.
    fn open(path: &str, len: usize) -> std::result::Result<Segment, String> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| {
                format!(
                    "cannot open its shared memory {path}: {e} (another host, PID namespace or \
                     user? set RDMACOMM_TRANSPORT=tcp or rdma)"
                )
            })?;
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

    /// Closes the descriptor (the mapping stays).
    fn close(&mut self) {
        self.file = None;
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

/// Offsets in a segment: ring `p` is written by rank `p`.
fn posted_at(p: usize) -> usize {
    p * RING
}
fn taken_at(p: usize) -> usize {
    p * RING + 64
}
fn slot_at(p: usize, k: u64) -> usize {
    p * RING + COUNTERS + (k as usize % SLOTS) * (HEAD + CHUNK)
}

/// What this rank knows of one peer.
#[derive(Default)]
struct PeerState {
    /// Chunks posted to it, and taken from it.
    posted: u64,
    taken: u64,
    /// Operation numbers in each direction (see [`op::OpDesc::seq`]).
    seq_out: u64,
    seq_in: u64,
    /// The current operation's first chunk from it passed the descriptor check.
    verified: bool,
}

/// The shared-memory transport of one rank (every rank of the group on this host).
pub struct ShmTransport {
    /// The segment peers write to this rank.
    mine: Segment,
    /// Each peer's segment, which this rank writes (None for itself).
    theirs: Vec<Option<Segment>>,
    state: Vec<PeerState>,
    watch: Watch,
    pacer: Pacer,
    rank: usize,
    n: usize,
    timeout: Duration,
    op: OpDesc,
    op_wire: [u8; op::WIRE],
}

impl ShmTransport {
    /// Creates this rank's segment, meets every rank through `meet`, and maps theirs. Every rank
    /// must be on this host (else an error names the first that is not).
    pub fn connect_with(
        cfg: &Config,
        meet: &mut dyn FnMut(&Card) -> Result<Rendezvous>,
    ) -> Result<Self> {
        cfg.validate()?;
        let n = cfg.world_size;
        let len = n * RING;
        let mut mine = Segment::create(len)?;
        let host = cfg.host_id.clone();
        let mut common = TAG_SHM.to_le_bytes().to_vec();
        for v in [SLOTS as u32, CHUNK as u32] {
            common.extend_from_slice(&v.to_le_bytes());
        }
        for s in [host.as_bytes(), mine.path().as_bytes()] {
            common.extend_from_slice(&(s.len() as u32).to_le_bytes());
            common.extend_from_slice(s);
        }
        let card = Card {
            common,
            entry: 0,
            each: Vec::new(),
        };
        let rv = meet(&card)?;
        check_tags(&rv.cards, &rv.addrs, cfg.rank, TAG_SHM)?;
        let mut side = rv.side;
        // Every card is checked before any segment is opened: a rank that fails on a card
        // exits, and the segments of ranks that exited cannot be opened any more.
        let mut paths: Vec<Option<String>> = Vec::with_capacity(n);
        for (p, c) in rv.cards.iter().enumerate() {
            if p == cfg.rank {
                paths.push(None);
                continue;
            }
            let mut r = Reader(&c[4..]);
            let (slots, chunk) = (r.u32()? as usize, r.u32()? as usize);
            let their_host = String::from_utf8_lossy(r.bytes()?).into_owned();
            if their_host != host {
                return Err(Error::Config(format!(
                    "rank {p} ({}) is on another host ({their_host}, this is {host}): shared \
                     memory needs every rank on one host; set RDMACOMM_TRANSPORT=rdma or tcp",
                    rv.addrs[p]
                )));
            }
            if (slots, chunk) != (SLOTS, CHUNK) {
                return Err(Error::Config(format!(
                    "rank {p} uses {slots} shared-memory slots of {chunk} bytes, this rank \
                     {SLOTS} of {CHUNK}: every rank must run the same rdmacomm"
                )));
            }
            paths.push(Some(String::from_utf8_lossy(r.bytes()?).into_owned()));
        }
        let mut theirs: Vec<Option<Segment>> = Vec::with_capacity(n);
        for (p, path) in paths.iter().enumerate() {
            let Some(path) = path else {
                theirs.push(None);
                continue;
            };
            let peer = Peer {
                rank: p,
                addr: rv.addrs[p].clone(),
            };
            theirs.push(Some(
                Segment::open(path, len).map_err(|reason| Error::PeerFailed { peer, reason })?,
            ));
        }
        // Every rank has mapped every segment: nobody opens ours again.
        side.barrier()?;
        mine.close();
        side.set_async()?;
        let crowded = oversubscribed(&rv.addrs, cfg.rank);
        let pacer = pacer::for_setting(cfg.poll, cfg.timeout, crowded, SPIN, YIELD);
        let state = (0..n)
            .map(|_| PeerState {
                seq_out: u64::MAX,
                seq_in: u64::MAX,
                ..PeerState::default()
            })
            .collect();
        Ok(ShmTransport {
            mine,
            theirs,
            state,
            watch: Watch::new(side, cfg.rank, rv.addrs),
            pacer,
            rank: cfg.rank,
            n,
            timeout: cfg.timeout,
            op: OpDesc::new(OpKind::Barrier, 0),
            op_wire: OpDesc::new(OpKind::Barrier, 0).encode(),
        })
    }

    /// The side channel and failure record.
    pub(crate) fn watch(&self) -> &Watch {
        &self.watch
    }

    /// Whether every peer is still there (its side-channel connection open), without blocking.
    pub fn health(&mut self) -> Result<()> {
        self.watch.poll()
    }

    /// This rank failed: tell every peer.
    pub fn abort(&mut self, reason: String) {
        self.watch.abort_self(reason);
    }

    fn fail(&mut self, p: usize, reason: String) -> Error {
        self.watch.fail(p, reason)
    }
}

impl Link for ShmTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.n
    }

    fn peer(&self, rank: usize) -> Peer {
        self.watch.peer(rank)
    }

    fn max_chunk(&self) -> usize {
        CHUNK
    }

    fn shares_memory(&self) -> bool {
        true
    }

    fn take_between_posts(&self) -> bool {
        // A take frees the peer's slot at once: its next post may be waiting for it.
        true
    }

    fn try_post(&mut self, p: usize, data: &[u8]) -> Result<bool> {
        assert!(data.len() <= CHUNK, "a chunk larger than max_chunk");
        let me = self.rank;
        let st = &self.state[p];
        let seg = self.theirs[p].as_ref().expect("no link to self");
        let k = st.posted;
        let taken = seg.counter(taken_at(me)).load(Ordering::Acquire);
        if taken > k {
            let e = format!("protocol error: took {taken} chunks of {k} posted");
            return Err(self.fail(p, e));
        }
        if k - taken >= SLOTS as u64 {
            return Ok(false);
        }
        let slot = slot_at(me, k);
        let desc = OpDesc::numbered(self.op_wire, st.seq_out);
        // SAFETY: the slot lies in the mapping (slot_at, RING) and is ours to write: the reader
        // took chunk k - SLOTS (checked above) and reads this slot only after we publish k + 1.
        unsafe {
            let head = std::slice::from_raw_parts_mut(seg.at(slot), HEAD);
            head[..4].copy_from_slice(&(data.len() as u32).to_le_bytes());
            head[DESC_AT..DESC_AT + op::WIRE].copy_from_slice(&desc);
            let body = std::slice::from_raw_parts_mut(seg.at(slot + HEAD), data.len());
            crate::copy::copy(body, data);
        }
        seg.counter(posted_at(me)).store(k + 1, Ordering::Release);
        self.state[p].posted = k + 1;
        self.pacer.progress();
        Ok(true)
    }

    fn try_take(&mut self, p: usize, f: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<bool> {
        let k = self.state[p].taken;
        let posted = self.mine.counter(posted_at(p)).load(Ordering::Acquire);
        if posted <= k {
            if posted < k {
                let e = format!("protocol error: posted count went back to {posted} from {k}");
                return Err(self.fail(p, e));
            }
            return Ok(false);
        }
        if posted - k > SLOTS as u64 {
            let e = format!("protocol error: {posted} chunks posted, {k} taken, {SLOTS} slots");
            return Err(self.fail(p, e));
        }
        let slot = slot_at(p, k);
        // SAFETY: the header lies in our mapping; the writer published it (acquire above) and
        // does not touch the slot again until we publish k + 1.
        let head = unsafe { std::slice::from_raw_parts(self.mine.at(slot), HEAD) };
        let len = u32::from_le_bytes(head[..4].try_into().expect("4 bytes")) as usize;
        if len > CHUNK {
            let e = format!("protocol error: chunk {k} has {len} bytes (at most {CHUNK})");
            return Err(self.fail(p, e));
        }
        if !self.state[p].verified {
            let got = &head[DESC_AT..DESC_AT + op::WIRE];
            let seq = self.state[p].seq_in;
            if got != OpDesc::numbered(self.op_wire, seq) {
                let mine = OpDesc { seq, ..self.op };
                if let Err(why) = mine.check(got, p, self.rank) {
                    return Err(self.watch.mismatch(p, why));
                }
            }
            self.state[p].verified = true;
        }
        // SAFETY: as for the header: len bytes after it, in the slot (len <= CHUNK checked).
        let body = unsafe { std::slice::from_raw_parts(self.mine.at(slot + HEAD), len) };
        f(body)?;
        self.mine
            .counter(taken_at(p))
            .store(k + 1, Ordering::Release);
        self.state[p].taken = k + 1;
        self.pacer.progress();
        Ok(true)
    }

    fn progress(&mut self, waiting_on: usize) -> Result<()> {
        self.watch.waiting_on(Some(waiting_on));
        self.watch.poll_sometimes()?;
        match self.pacer.idle() {
            Wait::Spin => std::hint::spin_loop(),
            Wait::Yield => std::thread::yield_now(),
            Wait::BackOff => {
                self.watch.poll()?;
                std::thread::sleep(NAP);
            }
            Wait::Expired => return Err(self.watch.stalled(waiting_on, self.timeout)),
        }
        Ok(())
    }

    fn begin(&mut self) {
        self.pacer.begin();
    }

    fn start(&mut self, op: &OpDesc, scope: Scope) {
        self.op = *op;
        self.watch.waiting_on(None);
        self.op_wire = op.encode();
        for (p, st) in self.state.iter_mut().enumerate() {
            if p == self.rank {
                continue;
            }
            if scope.counts(p, true) {
                st.seq_out = st.seq_out.wrapping_add(1);
            }
            if scope.counts(p, false) {
                st.seq_in = st.seq_in.wrapping_add(1);
                st.verified = false;
            }
        }
    }
}

impl Drop for ShmTransport {
    fn drop(&mut self) {
        self.timeout = self.timeout.min(Duration::from_secs(10));
        self.watch.close(self.timeout);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_segment_is_one_memory_for_its_openers_and_has_no_name() {
        let shm_before = std::fs::read_dir("/dev/shm")
            .map(|d| d.count())
            .unwrap_or(0);
        let mut s = Segment::create(2 * RING).unwrap();
        let other = Segment::open(&s.path(), 2 * RING).unwrap();
        other.counter(taken_at(1)).store(7, Ordering::Release);
        assert_eq!(
            s.counter(taken_at(1)).load(Ordering::Acquire),
            7,
            "one memory"
        );
        assert!(
            Segment::open(&s.path(), RING).is_err(),
            "a size that differs is refused"
        );
        let path = s.path();
        s.close();
        assert!(
            Segment::open(&path, 2 * RING).is_err(),
            "closed: nobody opens it again"
        );
        assert_eq!(
            other.counter(taken_at(1)).load(Ordering::Acquire),
            7,
            "still mapped"
        );
        let shm_after = std::fs::read_dir("/dev/shm")
            .map(|d| d.count())
            .unwrap_or(0);
        assert_eq!(shm_before, shm_after, "nothing named in /dev/shm");
    }
}
