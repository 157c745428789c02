//! Connections carried into a communicator's next generation (`Comm::shrink`): both ends of a
//! connection to a survivor send a fence and drop what the failed generation still had in
//! flight up to the peer's fence, so the stream starts clean for the next, with no new
//! rendezvous of its own.

use super::*;

/// A frame header's length field that marks a fence (no chunk is this long); the generation it
/// opens follows as a u32.
const FENCE: u32 = u32::MAX;

/// A drained connection to a survivor, for the next generation's transport.
pub(crate) struct KeptConn(pub(super) Conn);

/// One connection's drain: bytes still to drop (the rest of a frame under way), whether the
/// peer's fence came, whether the fence this end sent is out.
struct Drain {
    skip: usize,
    fenced: bool,
}

impl TcpTransport {
    /// Hands over the connections to the ranks of `members` (old ranks, in their new order) that
    /// are up, each drained by a fence exchange for generation `epoch` within `until`: a
    /// connection whose peer's fence did not come, or that failed, is closed (the next
    /// generation dials it again). Every member calls it with the same arguments, at once.
    pub(crate) fn keep(
        &mut self,
        members: &[usize],
        epoch: u32,
        until: Instant,
    ) -> Vec<(usize, KeptConn)> {
        // A dial under way is closed: its peer, which may count it up, sees it end.
        self.dialer.abandon();
        let mut kept: Vec<(usize, Conn, Drain)> = Vec::new();
        for (new, &old) in members.iter().enumerate() {
            let Some(mut c) = self.conns.get_mut(old).and_then(Option::take) else {
                continue;
            };
            if c.closed {
                continue;
            }
            // A frame half placed into a caller's buffer: its rest is dropped.
            let skip = match c.direct {
                Direct::Placing { placed, len } => len + pad(len) - placed,
                _ => 0,
            };
            c.direct = Direct::Off;
            let mut fence = [0u8; HDR];
            fence[..4].copy_from_slice(&FENCE.to_le_bytes());
            fence[4..8].copy_from_slice(&epoch.to_le_bytes());
            c.out.keep_rest(&[&fence], 0);
            kept.push((
                new,
                c,
                Drain {
                    skip,
                    fenced: false,
                },
            ));
        }
        self.up.retain(|&p| self.conns[p].is_some());
        let max = self.max_chunk;
        let mut fds = Vec::new();
        loop {
            let mut moved = false;
            for (_, c, d) in kept.iter_mut() {
                moved |= drain_step(c, d, epoch, max);
            }
            let done = |(_, c, d): &(usize, Conn, Drain)| c.closed || d.fenced && c.out.is_empty();
            if kept.iter().all(done) || Instant::now() >= until {
                break;
            }
            if !moved {
                let waits = kept
                    .iter()
                    .filter(|k| !done(k))
                    .map(|(_, c, _)| crate::sys::Wait {
                        fd: c.sock.as_raw_fd(),
                        read: true,
                        write: !c.out.is_empty(),
                    });
                crate::sys::wait(waits, 1, &mut fds);
            }
        }
        kept.into_iter()
            .filter(|(_, c, d)| !c.closed && d.fenced && c.out.is_empty())
            .map(|(new, c, _)| (new, KeptConn(c)))
            .collect()
    }
}

/// Moves one connection's drain as far as it goes now: writes what is queued (the rest of a
/// frame, then the fence), reads and drops frames up to the peer's fence for `epoch` (an older
/// generation's fence is dropped too). Whether anything moved. A failure marks it closed.
fn drain_step(c: &mut Conn, d: &mut Drain, epoch: u32, max: usize) -> bool {
    let mut moved = c.write_queued().unwrap_or_else(|_| {
        c.closed = true;
        false
    });
    while !d.fenced && !c.closed {
        // Drop what is buffered up to the fence; only then read more (what follows the fence
        // belongs to the next generation and stays in the buffer).
        let k = d.skip.min(c.inp.pending().len());
        c.inp.consume(k);
        d.skip -= k;
        moved |= k > 0;
        if d.skip == 0 && c.inp.pending().len() >= HDR {
            let h = c.inp.pending();
            let len = u32::from_le_bytes(h[..4].try_into().expect("4 bytes"));
            if len == FENCE {
                let theirs = u32::from_le_bytes(h[4..8].try_into().expect("4 bytes"));
                c.inp.consume(HDR);
                d.fenced = theirs == epoch;
            } else if len as usize <= max {
                d.skip = HDR + len as usize + pad(len as usize);
            } else {
                c.closed = true; // not a stream of frames: not kept
            }
            moved = true;
            continue;
        }
        match c.read_some(HDR + max) {
            Ok(true) => moved = true,
            Ok(false) => break,
            Err(_) => c.closed = true,
        }
    }
    moved
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A connected pair of connections on loopback.
    fn pair(chunk: usize) -> (Conn, Conn) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (Conn::new(a, chunk).unwrap(), Conn::new(b, chunk).unwrap())
    }

    fn frame(payload: &[u8]) -> Vec<u8> {
        let mut f = vec![0u8; HDR];
        f[..4].copy_from_slice(&(payload.len() as u32).to_le_bytes());
        f.extend_from_slice(payload);
        f.extend(std::iter::repeat_n(0u8, pad(payload.len())));
        f
    }

    /// Runs both ends' drains to completion (one thread, alternating), as two ranks would.
    fn drain_both(a: &mut Conn, b: &mut Conn, epoch: u32, max: usize) -> (Drain, Drain) {
        let fence = |c: &mut Conn| {
            let mut f = [0u8; HDR];
            f[..4].copy_from_slice(&FENCE.to_le_bytes());
            f[4..8].copy_from_slice(&epoch.to_le_bytes());
            c.out.keep_rest(&[&f], 0);
        };
        fence(a);
        fence(b);
        let (mut da, mut db) = (
            Drain {
                skip: 0,
                fenced: false,
            },
            Drain {
                skip: 0,
                fenced: false,
            },
        );
        let until = Instant::now() + Duration::from_secs(10);
        while !(da.fenced && db.fenced && a.out.is_empty() && b.out.is_empty()) {
            assert!(Instant::now() < until, "drains did not meet");
            drain_step(a, &mut da, epoch, max);
            drain_step(b, &mut db, epoch, max);
        }
        (da, db)
    }

    /// What the failed generation left on a connection (whole frames, a frame half read into
    /// the receive buffer, an older generation's fence, frames still in the socket) is dropped
    /// by the drain; a frame sent after the fence is the first thing the next generation reads.
    #[test]
    fn a_drain_drops_what_came_before_the_fence_and_keeps_what_follows() {
        let max = 4096;
        let (mut a, mut b) = pair(max);
        let mut junk = Vec::new();
        junk.extend(frame(&[1; 100]));
        let mut old_fence = vec![0u8; HDR];
        old_fence[..4].copy_from_slice(&FENCE.to_le_bytes());
        old_fence[4..8].copy_from_slice(&6u32.to_le_bytes());
        junk.extend(old_fence);
        junk.extend(frame(&[2; 4096]));
        junk.extend(frame(&[3; 7]));
        // a's last frame was only half written: its rest is queued.
        let half = frame(&[4; 1000]);
        (&a.sock).write_all(&junk).unwrap();
        (&a.sock).write_all(&half[..300]).unwrap();
        a.out.keep_rest(&[&half[300..]], 0);
        // b had read part of the junk into its buffer before the failure.
        std::thread::sleep(Duration::from_millis(20));
        let room = b.inp.room(HDR + max);
        let k = (&b.sock).read(&mut room[..200]).unwrap();
        b.inp.end += k;
        drain_both(&mut a, &mut b, 7, max);
        // The next generation's first frame from a reaches b whole, and nothing before it.
        let next = frame(b"next generation");
        (&a.sock).write_all(&next).unwrap();
        let until = Instant::now() + Duration::from_secs(5);
        while b.inp.pending().len() < next.len() {
            assert!(Instant::now() < until);
            let room = b.inp.room(HDR + max);
            if let Ok(k) = (&b.sock).read(room) {
                b.inp.end += k;
            }
        }
        assert_eq!(b.inp.pending(), &next[..]);
        assert!(a.inp.pending().is_empty(), "b sent nothing but its fence");
    }

    /// A frame half placed into a caller's buffer when the generation failed: the drain drops
    /// the rest of it, whatever its length.
    #[test]
    fn the_rest_of_a_half_placed_frame_is_dropped() {
        let max = 64 << 10;
        let (mut a, mut b) = pair(max);
        let f = frame(&[9; 50_000]);
        let sent = std::thread::spawn({
            let s = a.sock.try_clone().unwrap();
            let f = f.clone();
            move || (&s).write_all(&f)
        });
        // b read the header and 10 000 payload bytes straight into a caller's buffer.
        let mut head = [0u8; HDR + 10_000];
        b.sock.set_nonblocking(false).unwrap();
        (&b.sock).read_exact(&mut head).unwrap();
        b.sock.set_nonblocking(true).unwrap();
        sent.join().unwrap().unwrap();
        let mut db = Drain {
            skip: 50_000 + pad(50_000) - 10_000,
            fenced: false,
        };
        let mut da = Drain {
            skip: 0,
            fenced: false,
        };
        let mut f7 = [0u8; HDR];
        f7[..4].copy_from_slice(&FENCE.to_le_bytes());
        f7[4..8].copy_from_slice(&1u32.to_le_bytes());
        a.out.keep_rest(&[&f7], 0);
        b.out.keep_rest(&[&f7], 0);
        let until = Instant::now() + Duration::from_secs(10);
        while !(da.fenced && db.fenced) {
            assert!(Instant::now() < until, "drains did not meet");
            drain_step(&mut a, &mut da, 1, max);
            drain_step(&mut b, &mut db, 1, max);
        }
        assert!(!a.closed && !b.closed);
        assert!(b.inp.pending().is_empty() && a.inp.pending().is_empty());
    }
}
