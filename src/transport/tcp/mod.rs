//! The TCP transport: the same [`Link`] over non-blocking TCP connections, each made when an
//! operation first exchanges with its peer (`dial.rs`; all at creation with
//! `RDMACOMM_CONNECT=eager`), for hosts without RDMA. Flow control is a bounded queue of unsent chunks per peer (like the RDMA
//! transport's slots) and TCP's own window. Failures and health use the same side channel as
//! RDMA.
//!
//! Framing: a chunk travels as a `HDR`-byte header (its length, little-endian u32, then
//! zeros, with the operation's descriptor at `OP_AT`: every frame is checked against the
//! receiver's operation), the payload, and zeros up to a multiple of 64 bytes. Every frame is a multiple of 64
//! bytes, so a payload starts 64-byte aligned in the sender's socket pages as well as in the
//! stream, and the kernel's copies into and out of those pages run at full speed (a 4-byte
//! header left them misaligned: 15-25% slower from 512 KiB, see `HDR`).

mod frame;
mod keep;
mod link;
mod setup;

pub(crate) use keep::KeptConn;

use crate::bootstrap::rendezvous::{Card, Rendezvous};
use crate::bootstrap::{check_tags, Reader, TAG_TCP};
use crate::config::{Config, Connect, Poll};
use crate::error::{Error, Peer, Result};
use crate::transport::numbering::Numbering;
use crate::transport::op::{self, OpDesc, Partners};
use crate::transport::pacer::{oversubscribed, Pacer, Wait};
use crate::transport::watch::Watch;
use crate::transport::{Link, Medium, Props};
use std::io::{ErrorKind, IoSlice, IoSliceMut, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::transport::dial::{Dialer, Event, Lookout};
use crate::transport::reach::{self, tune};
use frame::{pad, InQueue, OutQueue, HDR, OP_AT, PAD};

/// How long an idle rank yields its core before blocking in poll(2).
const YIELD_FOR: Duration = Duration::from_micros(200);

/// Payload bytes read together with a header by `try_take_into`: a chunk this small is copied
/// from the receive buffer; of a larger one, the rest is read straight into its destination.
const DIRECT_PEEK: usize = 4096;

/// A receive placed straight into the caller's buffer, past the receive buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direct {
    /// None: the pump reads this connection into its receive buffer.
    Off,
    /// The caller waits for the next chunk to land in its buffer: the pump leaves the socket
    /// alone so that the payload is read once, into its destination.
    Armed,
    /// The chunk's header is consumed and this many of its `len` bytes and padding after them
    /// are read.
    Placing { placed: usize, len: usize },
}

/// One peer's connection and buffers.
struct Conn {
    sock: TcpStream,
    out: OutQueue,
    inp: InQueue,
    direct: Direct,
    closed: bool,
}

impl Conn {
    /// Writes what is queued as far as the socket takes it now: whether a byte went.
    fn write_queued(&mut self) -> std::io::Result<bool> {
        let mut moved = false;
        while !self.out.is_empty() {
            match self.sock.write(&self.out.buf[self.out.head..]) {
                Ok(0) => break,
                Ok(k) => {
                    self.out.advance(k);
                    moved = true;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(moved)
    }

    /// Reads into the receive buffer (room for `want` bytes made first) while the socket has
    /// bytes and the buffer has room: whether a byte came. The peer's close marks it closed.
    fn read_some(&mut self, want: usize) -> std::io::Result<bool> {
        let mut moved = false;
        while !self.closed {
            let room = self.inp.room(want);
            let space = room.len();
            if space == 0 {
                break;
            }
            match self.sock.read(room) {
                Ok(0) => self.closed = true,
                Ok(k) => {
                    self.inp.end += k;
                    moved = true;
                    if k < space {
                        break; // drained: skip the read that would say EAGAIN
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(moved)
    }

    /// A connection over `sock` (proven, not yet tuned) for chunks of up to `chunk` bytes.
    fn new(sock: TcpStream, chunk: usize) -> Result<Conn> {
        tune(&sock)?;
        sock.set_read_timeout(None)?;
        sock.set_nonblocking(true)?;
        Ok(Conn {
            sock,
            out: OutQueue::default(),
            inp: InQueue::new(4 * (chunk + HDR)),
            direct: Direct::Off,
            closed: false,
        })
    }
}

/// The TCP transport of one rank.
pub struct TcpTransport {
    conns: Vec<Option<Conn>>,
    /// The peers whose connection is up, in the order they came: what the pump, waits and
    /// health walk, so that their cost grows with the peers connected, not the world.
    up: Vec<usize>,
    /// The side channel and the first failure.
    watch: Watch,
    max_chunk: usize,
    /// How long to spin before blocking in poll(2).
    timeout: Duration,
    /// How waits spin, yield and block, and when they time out.
    pacer: Pacer,
    /// poll(2)'s array, kept between calls.
    fds: Vec<libc::pollfd>,
    /// The operation under way and its numbers with each peer; every frame carries its
    /// descriptor. Once the first frame of an operation from a peer passed
    /// [`TcpTransport::check_op`], its later frames may be read straight into place with their
    /// header (before the check).
    numbering: Numbering,
    props: Props,
    /// The listener and the connections under way (made when first needed).
    dialer: Dialer,
    /// What the dialer's last step brought.
    events: Vec<Event>,
    /// When a wait looks at the listener (a peer may dial while we wait on another).
    lookout: Lookout,
    /// What its posts and takes did to the bytes.
    ledger: crate::transport::Ledger,
}

impl TcpTransport {
    /// What this transport is, in words.
    pub fn device(&self) -> String {
        "TCP".into()
    }

    /// Whether the connection to `p` is up; if not, dials it (unless under way) and moves every
    /// connection under way.
    fn reach(&mut self, p: usize) -> Result<bool> {
        if self.conns[p].is_some() {
            return Ok(true);
        }
        self.dial(p)?;
        self.connect_step()?;
        Ok(self.conns[p].is_some())
    }

    /// Starts a dial to `p` unless one is under way or `p` is up.
    fn dial(&mut self, p: usize) -> Result<()> {
        self.dialer.dial(p).map_err(|(q, why)| self.fail(q, why))
    }

    /// Moves the connections under way; whether anything moved.
    fn connect_step(&mut self) -> Result<bool> {
        let moved = self.dialer.step(&mut self.events)?;
        while let Some(e) = self.events.pop() {
            match e {
                Event::Up(p, s) => {
                    let c = Conn::new(s, self.max_chunk);
                    match c {
                        Ok(c) => {
                            self.conns[p] = Some(c);
                            self.up.push(p);
                        }
                        Err(e) => return Err(self.fail(p, format!("its data connection: {e}"))),
                    }
                }
                Event::Failed(p, why) => return Err(self.fail(p, why)),
            }
        }
        if moved {
            self.pacer.progress();
        }
        Ok(moved)
    }

    /// Records the first failure, tells the group, and returns it as an error.
    fn fail(&mut self, p: usize, reason: String) -> Error {
        self.watch.fail(p, reason)
    }

    /// Failures learned from the side channel (a peer's abort, a closed connection).
    fn check_side(&mut self) -> Result<()> {
        self.watch.poll()
    }

    /// Checks the operation descriptor in the header of the next frame from `p` (buffered)
    /// against this rank's operation: a mismatch fails the link, naming both calls.
    fn check_op(&mut self, p: usize) -> Result<()> {
        let c = self.conns[p].as_mut().expect("present");
        match self
            .numbering
            .check_from(p, &c.inp.pending()[OP_AT..OP_AT + op::WIRE])
        {
            Ok(()) => {
                self.numbering.took_from(p);
                Ok(())
            }
            Err(why) => {
                c.direct = Direct::Off;
                Err(self.watch.mismatch(p, why))
            }
        }
    }

    /// This rank failed: tell every peer.
    pub fn abort(&mut self, reason: String) {
        self.watch.abort_self(reason);
    }

    /// The side channel and failure record (for the group's addresses).
    pub(crate) fn watch(&self) -> &Watch {
        &self.watch
    }

    /// The side channel and failure record, to record a failure.
    pub(crate) fn watch_mut(&mut self) -> &mut Watch {
        &mut self.watch
    }

    /// Moves what the sockets allow and reads the side channel now, without waiting: whether
    /// anything happened.
    pub(crate) fn poll_now(&mut self) -> Result<bool> {
        self.watch.poll_sometimes()?;
        let moved = self.pump()?;
        if moved {
            self.pacer.progress();
        }
        Ok(moved)
    }

    /// Something outside this transport moved (the no-progress clock restarts).
    pub(crate) fn note_progress(&mut self) {
        self.pacer.progress();
    }
}
