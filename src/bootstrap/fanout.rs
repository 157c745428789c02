//! The table fans out along a tree, so that rank 0's work grows with the world, not its square.
//!
//! Once every rank is in, rank 0 sends each joiner a ROUTE (a few dozen bytes: the table's digest
//! and length, the rank that passes it the table, the ports of the ranks it passes it to; with a
//! secret, a MAC over the joiner's nonce) and the table itself only to ranks 1..=[`FANOUT`].
//! Rank r passes it on to ranks r·FANOUT+1 ..= r·FANOUT+FANOUT, which take it on a listener they
//! opened before their HELLO and keep it only if it matches the digest rank 0 vouched for (a
//! stranger's bytes are dropped). A rank that cannot reach one it passes the table to tells the
//! group through rank 0; a rank whose table never comes names the rank that was to pass it.

use super::auth::{digest, KEY};
use super::side_channel::parse_abort;
use super::table::{send_all, Out};
use super::wire::*;
use crate::error::{Error, Result};
use crate::Peer;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// Ranks each rank passes the table to (rank 0 too): a 256-rank table goes three levels deep.
pub(super) const FANOUT: usize = 8;
/// Connections to a waiting rank's listener held at once (strangers among them); past it the
/// oldest is closed.
const MAX_PENDING: usize = 64;
/// Longest a connection to that listener may take to deliver the table.
const TABLE_WITHIN: Duration = Duration::from_secs(10);

/// The rank that passes rank `r` (not 0) its table.
pub(super) fn parent_of(r: usize) -> usize {
    (r - 1) / FANOUT
}

/// The ranks that rank `r` of `n` passes the table to.
pub(super) fn children_of(r: usize, n: usize) -> std::ops::Range<usize> {
    let first = r.saturating_mul(FANOUT).saturating_add(1).min(n);
    first..first.saturating_add(FANOUT).min(n)
}

/// What rank 0 tells one joiner of the table: which table, from whom, to whom.
#[derive(Debug, PartialEq)]
pub(super) struct Route {
    pub digest: [u8; KEY],
    pub len: usize,
    /// The rank that passes this one the table (0: rank 0 itself, on the rendezvous connection).
    pub parent: usize,
    pub parent_addr: String,
    /// The listener ports of the ranks this one passes the table to ([`children_of`]).
    pub ports: Vec<u16>,
}

impl Route {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut b = self.digest.to_vec();
        b.extend_from_slice(&(self.len as u32).to_le_bytes());
        b.extend_from_slice(&(self.parent as u32).to_le_bytes());
        put_bytes(&mut b, self.parent_addr.as_bytes());
        b.push(self.ports.len() as u8);
        for p in &self.ports {
            b.extend_from_slice(&p.to_le_bytes());
        }
        b
    }

    /// A route for rank `me` of `n`; `None` for bytes that are not one (a parent that is not
    /// below `me`, more children than the tree gives it, a table past a frame).
    pub(super) fn decode(b: &[u8], me: usize, n: usize) -> Option<Route> {
        let mut r = Reader(b);
        let digest = r.take(KEY).ok()?.try_into().ok()?;
        let len = r.u32().ok()? as usize;
        let parent = r.u32().ok()? as usize;
        let parent_addr = String::from_utf8_lossy(r.bytes().ok()?).into_owned();
        let count = r.take(1).ok()?[0] as usize;
        let ports = (0..count)
            .map(|_| Some(u16::from_le_bytes(r.take(2).ok()?.try_into().ok()?)))
            .collect::<Option<Vec<u16>>>()?;
        let tree_ok = (parent == 0 || parent_of(me) == parent)
            && (count == 0 || count == children_of(me, n).len());
        (r.0.is_empty() && me < n && parent < me && tree_ok && len <= MAX_FRAME).then_some(Route {
            digest,
            len,
            parent,
            parent_addr,
            ports,
        })
    }
}

/// The listener a rank that takes its table from another opens before its HELLO: on its own
/// bind address, else the address its connection to rank 0 left from.
pub(super) fn listen_beside(
    to_rank0: &TcpStream,
    bind: Option<IpAddr>,
) -> std::io::Result<TcpListener> {
    let ip = match bind {
        Some(ip) => ip,
        None => to_rank0.local_addr()?.ip(),
    };
    listen(SocketAddr::new(ip, 0))
}

/// One connection to the listener, its bytes so far and its deadline.
struct Pending {
    sock: TcpStream,
    buf: Vec<u8>,
    until: Instant,
}

/// Rank `me` takes its table from the rank `route` names, on `listener`, within `wait`;
/// meanwhile rank 0's connection `to_rank0` may bring the group's end (an abort). A connection
/// whose table does not match the route's digest is a stranger's: dropped, noted, never fatal.
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
    let limit = 1 + route.len;
    let result = loop {
        let mut busy = false;
        // Rank 0: the group ended meanwhile (an abort naming who failed), or rank 0 is gone.
        // Only peeked: what follows the table on that connection is the side channel's.
        let (frame, gone) = peek_frame(to_rank0, &mut head);
        if let Some(f) = frame {
            let (failed, why) = match f.first() {
                Some(&ABORT) => parse_abort(&f[1..], 0, n),
                k => (
                    0,
                    format!("rank 0 sent message {k:?} while this rank waited for its table"),
                ),
            };
            let addr = if failed == route.parent {
                route.parent_addr.clone()
            } else {
                String::new()
            };
            break Err(Error::PeerFailed {
                peer: Peer { rank: failed, addr },
                reason: why,
            });
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
        loop {
            match listener.accept() {
                Ok((sock, _)) => {
                    busy = true;
                    if pending.len() >= MAX_PENDING {
                        if let Some(i) = (0..pending.len()).min_by_key(|&i| pending[i].until) {
                            note_stray(&pending.swap_remove(i).sock, "oldest of too many");
                        }
                    }
                    if sock.set_nonblocking(true).is_ok() {
                        pending.push(Pending {
                            sock,
                            buf: Vec::new(),
                            until: Instant::now() + TABLE_WITHIN,
                        });
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                // Out of descriptors and the like: the connections held go on, accepting pauses.
                Err(_) => break,
            }
        }
        let mut found = None;
        let mut i = 0;
        while i < pending.len() {
            let p = &mut pending[i];
            let (moved, gone) = read_some(&p.sock, &mut p.buf, limit);
            busy |= moved;
            let whole = whole_frame(&p.buf, limit);
            if gone.is_none() && whole == Ok(false) && Instant::now() < p.until {
                i += 1;
                continue;
            }
            let p = pending.swap_remove(i);
            let table = &p.buf[5.min(p.buf.len())..];
            if whole == Ok(true)
                && p.buf[4] == TABLE
                && table.len() == route.len
                && digest(table) == route.digest
            {
                found = Some(table.to_vec());
                break;
            }
            note_stray(&p.sock, gone.unwrap_or("not the table rank 0 vouched for"));
        }
        if let Some(t) = found {
            break Ok(t);
        }
        if Instant::now() >= deadline {
            break Err(Error::Timeout {
                peer: parent.clone(),
                what: format!("rank {me}'s endpoint table, which that rank passes on"),
                after: wait,
            });
        }
        if !busy {
            // Asleep until a byte or a connection comes (hundreds of waiting ranks share cores).
            let read = |fd| crate::sys::Wait {
                fd,
                read: true,
                write: false,
            };
            let fds = [to_rank0.as_raw_fd(), listener.as_raw_fd()]
                .into_iter()
                .chain(pending.iter().map(|p| p.sock.as_raw_fd()))
                .map(read);
            let left = deadline.saturating_duration_since(Instant::now());
            crate::sys::wait(
                fds,
                left.min(Duration::from_millis(100)).as_millis() as u64,
                &mut polls,
            );
        }
    };
    let _ = to_rank0.set_nonblocking(false);
    result
}

/// A whole frame (kind and body) waiting on `s`, read only when whole (rank 0 sends short ones
/// here), or why the connection is no use; `(None, None)` while nothing whole has come.
fn peek_frame(mut s: &TcpStream, head: &mut [u8]) -> (Option<Vec<u8>>, Option<&'static str>) {
    use std::io::Read;
    match s.peek(head) {
        Ok(0) => (None, Some("closed")),
        Ok(k) if k >= 4 => {
            let len = u32::from_le_bytes(head[..4].try_into().expect("4 bytes")) as usize;
            if len == 0 || 4 + len > head.len() {
                (None, Some("a malformed frame"))
            } else if k >= 4 + len {
                let mut f = vec![0u8; 4 + len];
                match s.read_exact(&mut f) {
                    Ok(()) => (Some(f.split_off(4)), None),
                    Err(_) => (None, Some("connection failed")),
                }
            } else {
                (None, None)
            }
        }
        Ok(_) => (None, None),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
            ) =>
        {
            (None, None)
        }
        Err(_) => (None, Some("connection failed")),
    }
}

fn note_stray(s: &TcpStream, what: &str) {
    static SAID: crate::diag::Repeated = crate::diag::Repeated::new();
    if let Some(before) = SAID.allow() {
        let from = s.peer_addr().map_or("?".to_string(), |a| a.to_string());
        log::warn!("ignored a connection to this rank's table listener from {from}: {what} ({before} ignored before)");
    }
}

/// Rank `me` passes `table` to each of `children` (rank, address, listener port), all at once,
/// by `deadline`: an error naming the first it could not reach or write to.
pub(super) fn pass_on(
    table: &[u8],
    me: usize,
    children: &[(usize, String, u16)],
    deadline: Instant,
) -> Result<()> {
    let failed = |c: usize, why: String| Error::PeerFailed {
        peer: Peer {
            rank: children[c].0,
            addr: children[c].1.clone(),
        },
        reason: format!("rank {me} could not pass it the endpoint table: {why}"),
    };
    let mut socks = Vec::with_capacity(children.len());
    for (c, (_, addr, port)) in children.iter().enumerate() {
        let ip: IpAddr = addr
            .parse()
            .map_err(|_| failed(c, format!("its address {addr:?} is not an IP address")))?;
        let at = SocketAddr::new(ip, *port);
        // Its listener was open before its HELLO: a refusal is final, a slow network is retried.
        let sock = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match TcpStream::connect_timeout(
                &at,
                left.min(Duration::from_secs(1))
                    .max(Duration::from_millis(1)),
            ) {
                Ok(s) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut && !left.is_zero() => {}
                Err(e) => return Err(failed(c, format!("connecting to {at}: {e}"))),
            }
        };
        let _ = sock.set_nodelay(true);
        socks.push(sock);
    }
    let mut outs: Vec<Out> = socks
        .iter()
        .map(|s| Out::new(s, TABLE, table, &[]))
        .collect();
    send_all(&mut outs, deadline).map_err(|(c, e)| failed(c, e.to_string()))
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
            ports: vec![4000; 8],
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
            ports: Vec::new(),
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

        // Nothing at all: the rank that was to pass the table is named.
        let (_rank0, to_rank0) = pair();
        let e =
            take_forwarded(&l, &to_rank0, &route, 17, 20, Duration::from_millis(200)).unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert_eq!(e.peer().map(|p| p.rank), Some(2), "{e}");
    }
}
