//! The table fans out along a tree, so that rank 0's work grows with the world, not its square.
//!
//! Once every rank is in, rank 0 sends each joiner a ROUTE (a few dozen bytes: the table's digest
//! and length, the rank that passes it the table, the addresses of the ranks it passes it to;
//! with a secret, a MAC over the joiner's nonce) and the table itself only to ranks
//! 1..=[`FANOUT`]. Rank r passes it on to ranks r·FANOUT+1 ..= r·FANOUT+FANOUT, which take it
//! on a listener they opened before their HELLO and keep it only if it matches the digest rank
//! 0 vouched for (a stranger's bytes are dropped). A rank that cannot reach one it passes the
//! table to tells the group through rank 0. A rank whose table never comes names the rank that
//! was to pass it, and passes that verdict down its own subtree (proved by the digest, which no
//! stranger knows), whose ranks wait a little longer a level: every rank below a rank that hung
//! names that rank, not the one above it that waited too.

use super::table::{send_all, Out};
use crate::bootstrap::side_channel::parse_abort;
use crate::bootstrap::wire::auth::{digest, KEY};
use crate::bootstrap::wire::*;
use crate::error::{Error, Result};
use crate::Peer;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// Ranks each rank passes the table to (rank 0 too): a 256-rank table goes three levels deep.
pub(super) const FANOUT: usize = 8;
/// Connections to a waiting rank's listener held at once (strangers among them); past it one
/// that has not begun a frame of this group is closed.
const MAX_PENDING: usize = 64;
/// Longest a connection to that listener may stay silent.
const SILENT_WITHIN: Duration = Duration::from_secs(10);
/// How much longer a rank waits for its table than the rank above it: time for that rank's
/// verdict to come down first.
const LEVEL_LATER: Duration = Duration::from_secs(1);
/// The most bytes of a verdict's reason.
const REASON_BYTES: usize = 1024;

/// The rank that passes rank `r` (not 0) its table.
pub(super) fn parent_of(r: usize) -> usize {
    (r - 1) / FANOUT
}

/// The ranks that rank `r` of `n` passes the table to.
pub(super) fn children_of(r: usize, n: usize) -> std::ops::Range<usize> {
    let first = r.saturating_mul(FANOUT).saturating_add(1).min(n);
    first..first.saturating_add(FANOUT).min(n)
}

/// How many ranks pass the table on before it reaches rank `r` (0 for rank 0 and its first
/// [`FANOUT`], which take it from rank 0).
pub(super) fn levels_above(r: usize) -> u32 {
    let (mut r, mut k) = (r, 0);
    while r > FANOUT {
        r = parent_of(r);
        k += 1;
    }
    k
}

/// How long rank `r` waits for its table from the rank above it, `floor` at the least.
pub(super) fn wait_for(r: usize, floor: Duration) -> Duration {
    floor + LEVEL_LATER * levels_above(r)
}

/// What rank 0 tells one joiner of the table: which table, from whom, to whom.
#[derive(Debug, PartialEq)]
pub(super) struct Route {
    pub digest: [u8; KEY],
    pub len: usize,
    /// The rank that passes this one the table (0: rank 0 itself, on the rendezvous connection).
    pub parent: usize,
    pub parent_addr: String,
    /// The address and listener port of each rank this one passes the table to
    /// ([`children_of`]).
    pub kids: Vec<(String, u16)>,
}

impl Route {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut b = self.digest.to_vec();
        b.extend_from_slice(&(self.len as u32).to_le_bytes());
        b.extend_from_slice(&(self.parent as u32).to_le_bytes());
        put_bytes(&mut b, self.parent_addr.as_bytes());
        b.push(self.kids.len() as u8);
        for (addr, port) in &self.kids {
            put_bytes(&mut b, addr.as_bytes());
            b.extend_from_slice(&port.to_le_bytes());
        }
        b
    }

    /// A route for rank `me` of `n`; `None` for bytes that are not one (a parent that is not
    /// above `me`, more children than the tree gives it, a table past a frame).
    pub(super) fn decode(b: &[u8], me: usize, n: usize) -> Option<Route> {
        let mut r = Reader(b);
        let digest = r.take(KEY).ok()?.try_into().ok()?;
        let len = r.u32().ok()? as usize;
        let parent = r.u32().ok()? as usize;
        let parent_addr = String::from_utf8_lossy(r.bytes().ok()?).into_owned();
        let count = r.take(1).ok()?[0] as usize;
        let kids = (0..count)
            .map(|_| {
                let addr = String::from_utf8_lossy(r.bytes().ok()?).into_owned();
                let port = u16::from_le_bytes(r.take(2).ok()?.try_into().ok()?);
                Some((addr, port))
            })
            .collect::<Option<Vec<_>>>()?;
        let tree_ok = (parent == 0 || parent_of(me) == parent)
            && (count == 0 || count == children_of(me, n).len());
        (r.0.is_empty() && me < n && parent < me && tree_ok && len <= MAX_FRAME).then_some(Route {
            digest,
            len,
            parent,
            parent_addr,
            kids,
        })
    }
}

/// The listener a rank that takes its table from another opens before its HELLO: on its own
/// bind address, else the address its connection to rank 0 left from.
pub(super) fn listen_beside(
    to_rank0: &TcpStream,
    bind: Option<IpAddr>,
) -> std::io::Result<TcpListener> {
    // The connection's own address keeps an IPv6 link-local scope, which its IP alone loses.
    let mut at = match bind {
        Some(ip) => SocketAddr::new(ip, 0),
        None => to_rank0.local_addr()?,
    };
    at.set_port(0);
    listen(at)
}

/// One connection to the listener, its bytes so far and when it must next say something.
struct Pending {
    sock: TcpStream,
    buf: Vec<u8>,
    until: Instant,
}

impl Pending {
    /// Whether its first bytes begin a frame this group sends here (the table, or a verdict).
    fn begun(&self, route: &Route) -> bool {
        self.buf.len() >= 5
            && match self.buf[4] {
                TABLE => frame_len(&self.buf) == 1 + route.len,
                ABORT => {
                    frame_len(&self.buf) >= 1 + KEY + 4
                        && self.buf.len() >= 5 + KEY
                        && self.buf[5..5 + KEY] == route.digest
                }
                _ => false,
            }
    }
}

fn frame_len(buf: &[u8]) -> usize {
    u32::from_le_bytes(buf[..4].try_into().expect("4 bytes")) as usize
}

/// Rank `me` takes its table from the rank `route` names, on `listener`, within `wait`;
/// meanwhile rank 0's connection `to_rank0` may bring the group's end (an abort), and the rank
/// above a verdict on a rank further up. A connection whose frame is neither the table the
/// route vouches for nor a verdict proved by its digest is a stranger's: dropped, never fatal.
pub(super) fn take_forwarded(
    listener: &TcpListener,
    to_rank0: &TcpStream,
    route: &Route,
    me: usize,
    n: usize,
    wait: Duration,
) -> Result<Vec<u8>> {
    let deadline = Instant::now() + wait;
    listener.set_nonblocking(true)?;
    to_rank0.set_nonblocking(true)?;
    let parent = Peer {
        rank: route.parent,
        addr: route.parent_addr.clone(),
    };
    let mut head = vec![0u8; 64 << 10];
    let mut pending: Vec<Pending> = Vec::new();
    let mut polls = Vec::new();
    let limit = (1 + route.len).max(1 + KEY + 4 + 4 + REASON_BYTES);
    let result = loop {
        let mut busy = false;
        // Rank 0: the group ended meanwhile (an abort naming who failed), or rank 0 is gone.
        // Peeked until whole: what follows the table there is the side channel's.
        let (frame, gone, partial) = peek_frame(to_rank0, &mut head);
        if let Some(f) = frame {
            let (failed, why) = match f.first() {
                Some(&ABORT) => parse_abort(&f[1..], 0, n),
                k => (
                    0,
                    format!("rank 0 sent message {k:?} while this rank waited for its table"),
                ),
            };
            break Err(named(route, failed, why));
        }
        if let Some(why) = gone {
            break Err(Error::PeerFailed {
                peer: Peer {
                    rank: 0,
                    addr: to_rank0
                        .peer_addr()
                        .map_or(String::new(), |a| a.to_string()),
                },
                reason: format!(
                    "{why}, while rank {me} waited for its table from rank {}",
                    route.parent
                ),
            });
        }
        let (got, accept_failed) = accept_callers(listener, &mut pending, route);
        busy |= got;
        let (got, found) = read_callers(&mut pending, route, limit, n);
        busy |= got;
        if let Some(t) = found {
            break t;
        }
        if Instant::now() >= deadline {
            break Err(Error::Timeout {
                peer: parent.clone(),
                what: format!("rank {me}'s endpoint table, which that rank passes on"),
                after: wait,
            });
        }
        if !busy {
            // Asleep until a byte or a connection comes (hundreds of waiting ranks share
            // cores); a part-frame from rank 0 or a refused accept is looked at again soon.
            let read = |fd| crate::sys::Wait {
                fd,
                read: true,
                write: false,
            };
            let fds = (!partial)
                .then(|| to_rank0.as_raw_fd())
                .into_iter()
                .chain((!accept_failed).then(|| listener.as_raw_fd()))
                .chain(pending.iter().map(|p| p.sock.as_raw_fd()))
                .map(read);
            let cap = if partial || accept_failed { 5 } else { 100 };
            let left = deadline.saturating_duration_since(Instant::now());
            let ms = left.min(Duration::from_millis(cap)).as_millis() as u64;
            crate::sys::wait(fds, ms, &mut polls);
        }
    };
    let _ = to_rank0.set_nonblocking(false);
    result
}

/// Takes the connections waiting at `listener` into `pending` (at most MAX_PENDING held: the
/// oldest that has not begun a frame of this group makes room); whether any came, and whether
/// accepting failed (out of descriptors: those held go on, accepting pauses).
fn accept_callers(
    listener: &TcpListener,
    pending: &mut Vec<Pending>,
    route: &Route,
) -> (bool, bool) {
    let mut busy = false;
    let (mut accept_failed, mut accepted) = (false, 0);
    loop {
        // When full, those just accepted are read before any is judged to make room.
        if pending.len() >= MAX_PENDING && accepted > 0 {
            break;
        }
        match listener.accept() {
            Ok((sock, _)) => {
                busy = true;
                accepted += 1;
                if pending.len() >= MAX_PENDING {
                    // The oldest that has not begun a frame of this group makes room.
                    let i = (0..pending.len())
                        .filter(|&i| !pending[i].begun(route))
                        .min_by_key(|&i| pending[i].until)
                        .unwrap_or(0);
                    note_stray(&pending.swap_remove(i).sock, "closed: too many held");
                }
                if sock.set_nonblocking(true).is_ok() {
                    pending.push(Pending {
                        sock,
                        buf: Vec::new(),
                        until: Instant::now() + SILENT_WITHIN,
                    });
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            // Out of descriptors and the like: the connections held go on, accepting pauses.
            Err(_) => {
                accept_failed = true;
                break;
            }
        }
    }
    (busy, accept_failed)
}

/// Reads what each caller in `pending` sent: the table rank 0 vouched for (its digest), or a
/// verdict from the rank above; anything else is closed as a stray. Whether any bytes came.
fn read_callers(
    pending: &mut Vec<Pending>,
    route: &Route,
    limit: usize,
    n: usize,
) -> (bool, Option<Result<Vec<u8>>>) {
    let mut busy = false;
    let mut found = None;
    let mut i = 0;
    while i < pending.len() {
        let p = &mut pending[i];
        let (moved, gone) = read_some(&p.sock, &mut p.buf, limit);
        if moved {
            busy = true;
            p.until = Instant::now() + SILENT_WITHIN;
        }
        let whole = whole_frame(&p.buf, limit);
        if gone.is_none() && whole == Ok(false) && Instant::now() < p.until {
            i += 1;
            continue;
        }
        let p = pending.swap_remove(i);
        if whole == Ok(true) && p.begun(route) {
            let body = &p.buf[5..4 + frame_len(&p.buf)];
            if p.buf[4] == TABLE && digest(body) == route.digest {
                found = Some(Ok(body.to_vec()));
                break;
            }
            if p.buf[4] == ABORT {
                // A verdict from the rank above, proved by the digest.
                let (failed, why) = parse_abort(&body[KEY..], route.parent, n);
                found = Some(Err(named(route, failed, why)));
                break;
            }
        }
        note_stray(&p.sock, gone.unwrap_or("not the table rank 0 vouched for"));
    }
    (busy, found)
}

/// The error naming rank `failed` (its address where it is the parent) for `reason`.
fn named(route: &Route, failed: usize, reason: String) -> Error {
    Error::PeerFailed {
        peer: Peer {
            rank: failed,
            addr: if failed == route.parent {
                route.parent_addr.clone()
            } else {
                String::new()
            },
        },
        reason,
    }
}

/// A whole frame (kind and body) waiting on `s`, taken only once whole (rank 0 sends short ones
/// here); why the connection is no use; whether part of a frame waits.
fn peek_frame(mut s: &TcpStream, head: &mut [u8]) -> (Option<Vec<u8>>, Option<&'static str>, bool) {
    use std::io::Read;
    match s.peek(head) {
        Ok(0) => (None, Some("closed"), false),
        Ok(k) if k >= 4 => {
            let len = frame_len(head);
            if len == 0 || 4 + len > head.len() {
                (None, Some("a malformed frame"), false)
            } else if k >= 4 + len {
                let mut f = vec![0u8; 4 + len];
                match s.read_exact(&mut f) {
                    Ok(()) => (Some(f.split_off(4)), None, false),
                    Err(_) => (None, Some("connection failed"), false),
                }
            } else {
                (None, None, true)
            }
        }
        Ok(_) => (None, None, true),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
            ) =>
        {
            (None, None, false)
        }
        Err(_) => (None, Some("connection failed"), false),
    }
}

fn note_stray(s: &TcpStream, what: &str) {
    static SAID: crate::diag::Repeated = crate::diag::Repeated::new();
    if let Some(before) = SAID.allow() {
        let from = s.peer_addr().map_or("?".to_string(), |a| a.to_string());
        log::warn!(
            "ignored a connection to this rank's table listener from {from}: {what} ({before} \
             ignored before)"
        );
    }
}

/// A connection to `addr`:`port` (a rank's table listener, open since before its HELLO: a
/// refusal is final, a slow network is tried again) by `deadline`.
fn reach(addr: &str, port: u16, deadline: Instant) -> std::result::Result<TcpStream, String> {
    crate::bootstrap::wire::port::reach(addr, port, deadline).map_err(|e| e.to_string())
}

/// Rank `me` passes `table` to the ranks `kids` (rank, address, listener port), all at once,
/// by `deadline`: an error naming the first it could not reach or write to. A connection the
/// rank below closed (as one of too many, or silent too long) is made again.
pub(super) fn pass_on(
    table: &[u8],
    me: usize,
    kids: &[(usize, String, u16)],
    deadline: Instant,
) -> Result<()> {
    let failed = |c: usize, why: String| Error::PeerFailed {
        peer: Peer {
            rank: kids[c].0,
            addr: kids[c].1.clone(),
        },
        reason: format!("rank {me} could not pass it the endpoint table: {why}"),
    };
    let mut left: Vec<usize> = (0..kids.len()).collect();
    for attempt in 0..3 {
        let mut socks = Vec::with_capacity(left.len());
        for &c in &left {
            let (_, addr, port) = &kids[c];
            socks.push(reach(addr, *port, deadline).map_err(|why| failed(c, why))?);
        }
        let mut outs: Vec<Out> = socks
            .iter()
            .map(|s| Out::new(s, TABLE, table, &[]))
            .collect();
        match send_all(&mut outs, deadline) {
            Ok(()) => return Ok(()),
            Err((i, e)) if attempt == 2 || Instant::now() >= deadline => {
                return Err(failed(left[i], e.to_string()))
            }
            Err(_) => {
                // Again, for those not written whole.
                let done: Vec<bool> = outs.iter().map(|o| o.done()).collect();
                left = left
                    .iter()
                    .zip(done)
                    .filter(|&(_, d)| !d)
                    .map(|(&c, _)| c)
                    .collect();
            }
        }
    }
    Ok(())
}

/// Rank `me`, whose table never came, tells the ranks below it why (`failed` and `reason`),
/// proved by the table's `digest`; at most a second, and what fails is let go (they time out,
/// later than this rank, naming it).
pub(super) fn pass_verdict(
    digest: &[u8; KEY],
    kids: &[(String, u16)],
    failed: usize,
    reason: &str,
) {
    let deadline = Instant::now() + Duration::from_secs(1);
    let mut body = digest.to_vec();
    body.extend_from_slice(&(failed as u32).to_le_bytes());
    let reason = &reason.as_bytes()[..reason.len().min(REASON_BYTES)];
    put_bytes(&mut body, reason);
    let socks: Vec<TcpStream> = kids
        .iter()
        .filter_map(|(addr, port)| reach(addr, *port, deadline).ok())
        .collect();
    let mut outs: Vec<Out> = socks
        .iter()
        .map(|s| Out::new(s, ABORT, &body, &[]))
        .collect();
    let _ = send_all(&mut outs, deadline);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_has_one_parent_below_it_and_the_tree_covers_the_world() {
        for n in [1, 2, 9, 10, 73, 256, 1000] {
            let mut seen = vec![0; n];
            for r in 0..n {
                for c in children_of(r, n) {
                    assert_eq!(parent_of(c), r, "n {n}: child {c} of {r}");
                    assert!(c > r);
                    seen[c] += 1;
                }
            }
            assert_eq!(seen[0], 0);
            assert!(seen[1..].iter().all(|&k| k == 1), "n {n}: {seen:?}");
        }
        assert_eq!(children_of(0, 9), 1..9);
        assert_eq!(
            [1, 8, 9, 72, 73, 584, 585].map(levels_above),
            [0, 0, 1, 1, 2, 2, 3]
        );
        assert_eq!(children_of(1, 12), 9..12);
        assert_eq!(children_of(2, 12), 12..12);
    }

    #[test]
    fn a_route_reads_back_and_a_wrong_one_is_none() {
        let route = Route {
            digest: [3; KEY],
            len: 4096,
            parent: 1,
            parent_addr: "10.0.0.1".into(),
            kids: vec![("10.0.0.2".into(), 4000); 8],
        };
        let b = route.encode();
        assert_eq!(Route::decode(&b, 9, 100), Some(route));
        assert!(
            Route::decode(&b, 9, 12).is_none(),
            "8 children where the tree gives 3"
        );
        assert!(
            Route::decode(&b, 17, 200).is_none(),
            "rank 17's parent is 2"
        );
        for cut in 0..b.len() {
            assert!(Route::decode(&b[..cut], 9, 100).is_none(), "cut at {cut}");
        }
    }

    /// A connected pair of sockets: (rank 0's end, the joiner's end).
    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (l.accept().unwrap().0, c)
    }

    fn frame(kind: u8, body: &[u8]) -> Vec<u8> {
        let mut f = ((body.len() + 1) as u32).to_le_bytes().to_vec();
        f.push(kind);
        f.extend_from_slice(body);
        f
    }

    #[test]
    fn strangers_at_the_listener_are_dropped_and_the_vouched_table_taken() {
        use std::io::Write;
        let table = b"the table of this group".to_vec();
        let route = Route {
            digest: digest(&table),
            len: table.len(),
            parent: 2,
            parent_addr: "127.0.0.1".into(),
            kids: Vec::new(),
        };
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        let (_rank0, to_rank0) = pair();
        // An idle stranger, a stranger's table of the right length, a frame too long, then the
        // table itself.
        let _idle = TcpStream::connect(at).unwrap();
        let mut forged = TcpStream::connect(at).unwrap();
        forged
            .write_all(&frame(TABLE, b"the table of that group"))
            .unwrap();
        let mut long = TcpStream::connect(at).unwrap();
        long.write_all(&frame(TABLE, &[0; 4096])).unwrap();
        let mut real = TcpStream::connect(at).unwrap();
        real.write_all(&frame(TABLE, &table)).unwrap();
        let got = take_forwarded(&l, &to_rank0, &route, 17, 20, Duration::from_secs(5)).unwrap();
        assert_eq!(got, table);

        // No table, then rank 0's abort naming rank 5: that rank is named, with its cause.
        let (mut rank0, to_rank0) = pair();
        let mut body = 5u32.to_le_bytes().to_vec();
        put_bytes(&mut body, b"it died");
        rank0.write_all(&frame(ABORT, &body)).unwrap();
        let e = take_forwarded(&l, &to_rank0, &route, 17, 20, Duration::from_secs(5)).unwrap_err();
        assert_eq!(e.peer().map(|p| p.rank), Some(5), "{e}");
        assert!(e.to_string().contains("it died"), "{e}");

        // The rank above's verdict, proved by the digest, names the rank it names; one with
        // another digest is a stranger's.
        let (_rank0, to_rank0) = pair();
        let verdict = |d: &[u8; KEY]| {
            let mut body = d.to_vec();
            body.extend_from_slice(&1u32.to_le_bytes());
            put_bytes(&mut body, b"rank 9: rank 1 hung");
            frame(ABORT, &body)
        };
        let mut fake = TcpStream::connect(at).unwrap();
        fake.write_all(&verdict(&[0; KEY])).unwrap();
        let mut real = TcpStream::connect(at).unwrap();
        real.write_all(&verdict(&route.digest)).unwrap();
        let e = take_forwarded(&l, &to_rank0, &route, 17, 20, Duration::from_secs(5)).unwrap_err();
        assert_eq!(e.peer().map(|p| p.rank), Some(1), "{e}");
        assert!(e.to_string().contains("rank 1 hung"), "{e}");

        // The rank above began its frame, then a flood of idle strangers, all queued before
        // this rank looks: those make room, not it (it was closed as the oldest, first).
        let (_rank0, to_rank0) = pair();
        let whole = frame(TABLE, &table);
        let mut real = TcpStream::connect(at).unwrap();
        real.write_all(&whole[..5]).unwrap();
        let _flood: Vec<TcpStream> = (0..2 * MAX_PENDING)
            .map(|_| TcpStream::connect(at).unwrap())
            .collect();
        let taker = std::thread::scope(|sc| {
            let t =
                sc.spawn(|| take_forwarded(&l, &to_rank0, &route, 17, 20, Duration::from_secs(5)));
            std::thread::sleep(Duration::from_millis(200));
            real.write_all(&whole[5..]).unwrap();
            t.join().unwrap()
        });
        assert_eq!(taker.unwrap(), table);

        // Nothing at all: the rank that was to pass the table is named.
        let (_rank0, to_rank0) = pair();
        let e =
            take_forwarded(&l, &to_rank0, &route, 17, 20, Duration::from_millis(200)).unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert_eq!(e.peer().map(|p| p.rank), Some(2), "{e}");
    }
}
