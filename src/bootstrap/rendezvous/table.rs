//! The table rank 0 sends every rank at the end of the rendezvous, and how it is sent.
//!
//! A table is the session key, then each rank's address and card, each front-coded against the
//! rank's before it: the bytes it shares with the previous one's start are counted, not sent
//! (ranks of one host differ in a port's digits), so a table takes a few bytes a rank, not whole
//! entries. Where no card has a per-rank entry (every transport's cards), one table
//! serves every rank: rank 0 builds it and takes its digest once, MACs the digest with each
//! joiner's nonce (O(1) a joiner, not a hash of the whole table), and writes to every joiner at
//! once, so a joiner slow to read holds no other up.

use crate::bootstrap::wire::auth::KEY;
use crate::bootstrap::wire::{Reader, MAX_FRAME};
use crate::error::{Error, Result};
use std::io::{ErrorKind, IoSlice, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// Appends `v` as LEB128.
fn put_varint(out: &mut Vec<u8>, mut v: usize) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Reads a LEB128 value of at most 32 bits.
fn get_varint(r: &mut Reader) -> Result<usize> {
    let mut v = 0usize;
    for shift in (0..35).step_by(7) {
        let b = r.take(1)?[0];
        v |= ((b & 0x7f) as usize) << shift;
        if b & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err(malformed("a length past 32 bits"))
}

fn malformed(why: &str) -> Error {
    Error::Bootstrap(format!("a malformed table from the coordinator: {why}"))
}

/// Appends `cur` as the length of its common start with `prev`, then the rest.
fn put_front(out: &mut Vec<u8>, prev: &[u8], cur: &[u8]) {
    let shared = prev.iter().zip(cur).take_while(|(a, b)| a == b).count();
    put_varint(out, shared);
    put_varint(out, cur.len() - shared);
    out.extend_from_slice(&cur[shared..]);
}

/// Reads what [`put_front`] wrote against `prev`.
fn get_front(r: &mut Reader, prev: &[u8]) -> Result<Vec<u8>> {
    let shared = get_varint(r)?;
    let rest = get_varint(r)?;
    if shared > prev.len() {
        return Err(malformed("an entry sharing more than the one before has"));
    }
    let mut v = prev[..shared].to_vec();
    v.extend_from_slice(r.take(rest)?);
    Ok(v)
}

/// The table of `session` and every rank's (address, card, control port), in rank order.
pub(super) fn encode<'a>(
    session: &[u8; KEY],
    rows: impl Iterator<Item = (&'a [u8], Vec<u8>, u16)>,
) -> Vec<u8> {
    let mut out = session.to_vec();
    let (mut prev_addr, mut prev_card): (&[u8], Vec<u8>) = (&[], Vec::new());
    for (addr, card, port) in rows {
        put_front(&mut out, prev_addr, addr);
        put_front(&mut out, &prev_card, &card);
        put_varint(&mut out, port as usize);
        prev_addr = addr;
        prev_card = card;
    }
    out
}

/// A table read: the session key, and every rank's address, card and control port.
#[derive(Debug)]
pub(super) struct Decoded {
    pub session: [u8; KEY],
    pub addrs: Vec<String>,
    pub cards: Vec<Vec<u8>>,
    pub ports: Vec<u16>,
}

/// What a table holds: the session key, then every rank's address, card and control port (`n`
/// of them); an error for anything else, never a panic.
pub(super) fn decode(table: &[u8], n: usize) -> Result<Decoded> {
    let mut r = Reader(table);
    let session: [u8; KEY] = r
        .take(KEY)
        .map_err(|_| malformed("no session key"))?
        .try_into()
        .expect("KEY bytes");
    let (mut addrs, mut cards) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let mut ports = Vec::with_capacity(n);
    let (mut addr, mut card) = (Vec::new(), Vec::new());
    // Front coding lets a few bytes stand for a whole card: what they stand for is bounded as a
    // table sent whole was (a coordinator cannot make a rank allocate without end).
    let mut total = 0usize;
    for _ in 0..n {
        addr = get_front(&mut r, &addr)?;
        card = get_front(&mut r, &card)?;
        let port =
            u16::try_from(get_varint(&mut r)?).map_err(|_| malformed("a port past 65535"))?;
        total = total.saturating_add(addr.len() + card.len());
        if total > MAX_FRAME {
            return Err(malformed("entries past a frame's 64 MiB"));
        }
        addrs.push(String::from_utf8_lossy(&addr).into_owned());
        cards.push(card.clone());
        ports.push(port);
    }
    if !r.0.is_empty() {
        return Err(malformed("bytes past the last rank"));
    }
    Ok(Decoded {
        session,
        addrs,
        cards,
        ports,
    })
}

/// One frame being written: its head, a body (the table, or a route) and a tail (a tag, or
/// nothing).
pub(super) struct Out<'a> {
    pub sock: &'a TcpStream,
    body: &'a [u8],
    tail: &'a [u8],
    head: [u8; 5],
    at: usize,
}

impl<'a> Out<'a> {
    /// Frame `kind` of `body`, then `tail`, to `sock`.
    pub(super) fn new(sock: &'a TcpStream, kind: u8, body: &'a [u8], tail: &'a [u8]) -> Self {
        let mut head = [0u8; 5];
        head[..4].copy_from_slice(&((body.len() + tail.len()) as u32 + 1).to_le_bytes());
        head[4] = kind;
        Out {
            sock,
            body,
            tail,
            head,
            at: 0,
        }
    }

    fn len(&self) -> usize {
        5 + self.body.len() + self.tail.len()
    }

    /// Whether the whole frame was written.
    pub(super) fn done(&self) -> bool {
        self.at == self.len()
    }

    /// Writes what the socket takes now; whether the frame is whole.
    fn step(&mut self) -> std::io::Result<bool> {
        while self.at < self.len() {
            let (h, t) = (5, 5 + self.body.len());
            let parts = [
                &self.head[self.at.min(h)..],
                &self.body[self.at.clamp(h, t) - h..],
                &self.tail[self.at.max(t) - t..],
            ];
            let slices = parts.map(IoSlice::new);
            let mut w = self.sock;
            match w.write_vectored(&slices) {
                Ok(0) => return Err(ErrorKind::WriteZero.into()),
                Ok(k) => self.at += k,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }
}

/// Writes every frame of `outs` at once (their sockets non-blocking meanwhile) by `deadline`:
/// the index of the first that failed or was still unwritten then, and why.
pub(super) fn send_all(
    outs: &mut [Out],
    deadline: Instant,
) -> std::result::Result<(), (usize, std::io::Error)> {
    for (i, o) in outs.iter().enumerate() {
        o.sock.set_nonblocking(true).map_err(|e| (i, e))?;
    }
    let mut left: Vec<usize> = (0..outs.len()).collect();
    let mut fds = Vec::new();
    let result = loop {
        let mut i = 0;
        let mut failed = None;
        while i < left.len() {
            match outs[left[i]].step() {
                Ok(true) => {
                    left.swap_remove(i);
                }
                Ok(false) => i += 1,
                Err(e) => {
                    failed = Some((left[i], e));
                    break;
                }
            }
        }
        if let Some(f) = failed {
            break Err(f);
        }
        let Some(&first) = left.first() else {
            break Ok(());
        };
        let now = Instant::now();
        if now >= deadline {
            let o = &outs[first];
            let why = format!("{} of {} bytes written by the deadline", o.at, o.len());
            break Err((first, std::io::Error::new(ErrorKind::TimedOut, why)));
        }
        let waits = left.iter().map(|&j| crate::sys::Wait {
            fd: outs[j].sock.as_raw_fd(),
            read: false,
            write: true,
        });
        let ms = (deadline - now).min(Duration::from_millis(100)).as_millis() as u64;
        crate::sys::wait(waits, ms, &mut fds);
    };
    for o in outs.iter() {
        let _ = o.sock.set_nonblocking(false);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn rows(n: usize) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
        let addrs = (0..n)
            .map(|q| format!("10.0.{}.{}", q / 64, q % 3).into_bytes())
            .collect();
        let cards = (0..n)
            .map(|q| {
                let mut c = b"TCP\0\x00\x00\x01\x00".to_vec();
                c.extend_from_slice(format!("10.0.{}.1:{}", q / 64, 40000 + 7 * q).as_bytes());
                c
            })
            .collect();
        (addrs, cards)
    }

    fn table_of(addrs: &[Vec<u8>], cards: &[Vec<u8>]) -> Vec<u8> {
        let rows = addrs
            .iter()
            .zip(cards.iter().cloned())
            .enumerate()
            .map(|(q, (a, c))| (a.as_slice(), c, 40000 + q as u16));
        encode(&[5; KEY], rows)
    }

    #[test]
    fn a_table_reads_back_in_a_few_bytes_a_rank() {
        let (addrs, cards) = rows(256);
        let t = table_of(&addrs, &cards);
        let Decoded {
            session,
            addrs: a,
            cards: c,
            ports,
        } = decode(&t, 256).unwrap();
        assert_eq!(session, [5; KEY]);
        assert_eq!(c, cards);
        assert_eq!(ports, (0..256).map(|q| 40000 + q).collect::<Vec<u16>>());
        let want: Vec<String> = addrs
            .iter()
            .map(|a| String::from_utf8(a.clone()).unwrap())
            .collect();
        assert_eq!(a, want);
        let whole: usize = addrs
            .iter()
            .zip(&cards)
            .map(|(a, c)| a.len() + c.len() + 8)
            .sum();
        assert!(
            t.len() < KEY + 15 * 256,
            "{} bytes (whole entries: {whole})",
            t.len()
        );
    }

    #[test]
    fn a_malformed_table_is_an_error_never_a_panic() {
        let (addrs, cards) = rows(4);
        let t = table_of(&addrs, &cards);
        assert!(decode(&t, 5).is_err(), "too few ranks");
        assert!(decode(&t, 3).is_err(), "bytes left over");
        for cut in 0..t.len() {
            assert!(decode(&t[..cut], 4).is_err(), "cut at {cut}");
        }
        // Sharing more than the entry before has; a length past 32 bits.
        let mut bad = [5u8; KEY].to_vec();
        bad.extend_from_slice(&[3, 0]);
        assert!(decode(&bad, 1).is_err());
        let mut huge = [5u8; KEY].to_vec();
        huge.extend_from_slice(&[0xff; 6]);
        assert!(decode(&huge, 1).is_err());
        // A 1 MiB card, then ranks that each repeat it in four bytes: refused past 64 MiB,
        // not allocated.
        let mut bomb = [5u8; KEY].to_vec();
        put_front(&mut bomb, &[], b"a");
        put_front(&mut bomb, &[], &vec![7u8; 1 << 20]);
        for _ in 0..100 {
            put_varint(&mut bomb, 0);
            put_front(&mut bomb, b"a", b"a");
            put_varint(&mut bomb, 1 << 20);
            put_varint(&mut bomb, 0);
        }
        let e = decode(&bomb, 101).unwrap_err().to_string();
        assert!(e.contains("64 MiB"), "{e}");
    }

    #[test]
    fn frames_reach_every_reader_and_a_reader_that_stops_is_named() {
        let l = crate::bootstrap::listen("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        let mut readers: Vec<TcpStream> = (0..3).map(|_| TcpStream::connect(at).unwrap()).collect();
        let socks: Vec<TcpStream> = (0..3).map(|_| l.accept().unwrap().0).collect();
        // Small socket buffers, and a table far past them: a reader that reads nothing fills
        // its socket, while the others take a MiB in well under the deadline, even emulated.
        for s in &socks {
            socket2::SockRef::from(s)
                .set_send_buffer_size(32 << 10)
                .unwrap();
        }
        for r in &readers {
            socket2::SockRef::from(r)
                .set_recv_buffer_size(32 << 10)
                .unwrap();
        }
        let table = vec![9u8; 1 << 20];
        let _stuck = readers.pop().unwrap();
        let tags: Vec<[u8; KEY]> = (0..3).map(|i| [i as u8; KEY]).collect();
        let mut outs: Vec<Out> = socks
            .iter()
            .zip(&tags)
            .map(|(s, tag)| Out::new(s, 3, &table, tag))
            .collect();
        // Readers 0 and 1 read; reader 2 never does, and its socket fills.
        let handles: Vec<_> = readers
            .into_iter()
            .map(|mut r| {
                std::thread::spawn(move || {
                    let mut got = Vec::new();
                    r.read_to_end(&mut got).unwrap();
                    got
                })
            })
            .collect();
        let e = send_all(&mut outs, Instant::now() + Duration::from_secs(3)).unwrap_err();
        assert_eq!(e.0, 2, "{e:?}");
        drop(outs);
        drop(socks);
        for (i, h) in handles.into_iter().enumerate() {
            let got = h.join().unwrap();
            assert_eq!(got.len(), 5 + table.len() + KEY, "reader {i}");
            assert_eq!(got[4], 3);
            assert!(got[5..5 + table.len()].iter().all(|&b| b == 9));
            assert!(got[5 + table.len()..].iter().all(|&b| b == i as u8));
        }
    }
}
