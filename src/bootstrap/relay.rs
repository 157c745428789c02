//! Rank 0's relay: a thread that reads every rank's side-channel connection and passes on at
//! once what the others must learn (aborts, departures, probes), whatever rank 0's own thread
//! is doing meanwhile (another communicator's operation, the application's own work); it also
//! judges stalled waits, so a verdict never waits for rank 0's own thread. Rank 0's side channel
//! takes what the thread read from its inbox.

use super::stalls::{verdict, STALL_WINDOW};
use super::wire::*;
use std::collections::VecDeque;
use std::io::{ErrorKind, Read};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

/// What the relay read from rank `r`'s connection.
pub(super) enum Event {
    /// A frame: its kind and body.
    Frame(usize, u8, Vec<u8>),
    /// The connection ended or broke (the reason, empty after a goodbye), or sent a malformed
    /// frame; nothing more is read from it.
    Ended(usize, String),
}

/// What rank 0's side channel and its relay share.
pub(super) struct Shared {
    /// Held for every frame written, so the two threads' frames never interleave.
    pub write_lock: Mutex<()>,
    /// Whether an abort went to every rank already.
    pub abort_sent: AtomicBool,
    inbox: Mutex<VecDeque<Event>>,
    stop: AtomicBool,
    /// Whom rank 0's own thread waits on now, and whom it reported a stall on (`NONE`: nobody).
    waiting: AtomicUsize,
    own_stall: AtomicUsize,
}

const NONE: usize = usize::MAX;

impl Default for Shared {
    fn default() -> Self {
        Shared {
            write_lock: Mutex::new(()),
            abort_sent: AtomicBool::new(false),
            inbox: Mutex::new(VecDeque::new()),
            stop: AtomicBool::new(false),
            waiting: AtomicUsize::new(NONE),
            own_stall: AtomicUsize::new(NONE),
        }
    }
}

impl Shared {
    /// What the relay read since the last call.
    pub fn take(&self) -> VecDeque<Event> {
        std::mem::take(&mut *self.inbox.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Rank 0's own thread waits on `p` now (or on nobody).
    #[inline]
    pub fn set_waiting(&self, p: Option<usize>) {
        self.waiting.store(p.unwrap_or(NONE), Ordering::Relaxed);
    }

    /// Rank 0's own wait on `p` ran out.
    pub fn stalled_on(&self, p: usize) {
        self.own_stall.store(p, Ordering::SeqCst);
    }

    fn push(&self, e: Event) {
        self.inbox
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(e);
    }
}

/// The running relay: stopped and joined on drop (after the caller shut the connections down,
/// which wakes it).
pub(super) struct Relay {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Relay {
    /// Starts relaying over `streams` (rank 0's connections, non-blocking, by rank).
    pub fn start(streams: &[Option<TcpStream>], shared: Arc<Shared>) -> std::io::Result<Relay> {
        let mut conns = Vec::with_capacity(streams.len());
        for s in streams {
            conns.push(match s {
                Some(s) => Some((s.try_clone()?, s.try_clone()?)),
                None => None,
            });
        }
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name("rdmacomm-relay".into())
            .spawn(move || run(conns, &sh))?;
        Ok(Relay {
            shared,
            thread: Some(thread),
        })
    }

    /// Asks the thread to stop at its next wake-up.
    pub fn stop(&self) {
        self.shared.stop.store(true, Ordering::SeqCst);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The thread: per rank a (reader, writer) pair of handles on one connection.
fn run(mut conns: Vec<Option<(TcpStream, TcpStream)>>, sh: &Shared) {
    let n = conns.len();
    let mut pending = vec![Vec::new(); n];
    let mut left = vec![false; n];
    let mut leaving = vec![false; n];
    let mut stalls = Stalls {
        reported: vec![None; n],
        since: None,
    };
    let mut buf = [0u8; 4096];
    let mut fds = Vec::with_capacity(n);
    loop {
        stalls.judge(&mut conns, sh);
        if sh.stop.load(Ordering::SeqCst) {
            return;
        }
        if conns.iter().all(Option::is_none) {
            return;
        }
        let socks = conns.iter().flatten().map(|(r, _)| crate::sys::Wait {
            fd: r.as_raw_fd(),
            read: true,
            write: false,
        });
        crate::sys::wait(socks, 100, &mut fds);
        if sh.stop.load(Ordering::SeqCst) {
            return;
        }
        for r in 0..n {
            let mut ended = None;
            while let Some((rd, _)) = conns[r].as_mut() {
                match rd.read(&mut buf) {
                    Ok(0) => {
                        ended = Some("its side-channel connection closed without a goodbye (process died or host unreachable); seen by rank 0".to_string());
                        break;
                    }
                    Ok(k) => pending[r].extend_from_slice(&buf[..k]),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => {
                        ended = Some(format!(
                            "side-channel connection failed: {e}; seen by rank 0"
                        ));
                        break;
                    }
                }
            }
            // Whole frames first: a goodbye just before the end makes the end no failure.
            while let Some((kind, body)) = next_frame(&mut pending[r]) {
                match kind {
                    Some(STALLED) => stalls.report(r, &body),
                    Some(kind) => relay(&mut conns, sh, r, kind, body, &mut left, &mut leaving),
                    None => {
                        sh.push(Event::Ended(
                            r,
                            format!("sent a malformed side-channel frame ({} bytes)", body.len()),
                        ));
                        conns[r] = None;
                        break;
                    }
                }
            }
            if let Some(why) = ended {
                // Shut down by rank 0's own side channel while closing: no failure.
                if sh.stop.load(Ordering::SeqCst) {
                    return;
                }
                let why = if left[r] { String::new() } else { why };
                if !why.is_empty() && !sh.abort_sent.swap(true, Ordering::SeqCst) {
                    let mut body = (r as u32).to_le_bytes().to_vec();
                    put_bytes(&mut body, why.as_bytes());
                    send_all(&mut conns, sh, ABORT, &body, None);
                }
                conns[r] = None;
                sh.push(Event::Ended(r, why));
            }
        }
    }
}

/// The stall reports the relay gathers.
struct Stalls {
    /// Whom each rank said it waits on after its wait ran out.
    reported: Vec<Option<usize>>,
    /// When the first report came.
    since: Option<Instant>,
}

impl Stalls {
    /// Rank `r` reported a stall (body: the rank it waits on).
    fn report(&mut self, r: usize, body: &[u8]) {
        let on = Reader(body).u32().map_or(NONE, |w| w as usize);
        if on < self.reported.len() {
            self.reported[r] = Some(on);
            self.since.get_or_insert_with(Instant::now);
        }
    }

    /// Once reports have gathered for [`STALL_WINDOW`] and nothing else was told: names the rank
    /// the waits lead to, to every rank and to rank 0's own side channel.
    fn judge(&mut self, conns: &mut [Option<(TcpStream, TcpStream)>], sh: &Shared) {
        let own = sh.own_stall.load(Ordering::SeqCst);
        if own < self.reported.len() && self.reported[0].is_none() {
            self.reported[0] = Some(own);
            self.since.get_or_insert_with(Instant::now);
        }
        let Some(since) = self.since else { return };
        if since.elapsed() < STALL_WINDOW || sh.abort_sent.load(Ordering::SeqCst) {
            return;
        }
        self.since = None;
        let mut waiting = vec![None; self.reported.len()];
        waiting[0] = Some(sh.waiting.load(Ordering::Relaxed)).filter(|&w| w != NONE);
        let Some((culprit, why)) = verdict(&self.reported, &waiting) else {
            return;
        };
        if sh.abort_sent.swap(true, Ordering::SeqCst) {
            return;
        }
        let mut body = (culprit as u32).to_le_bytes().to_vec();
        put_bytes(&mut body, why.as_bytes());
        send_all(conns, sh, ABORT, &body, None);
        sh.push(Event::Frame(0, ABORT, body));
    }
}

/// The next whole frame of `p`, taken out: `Some(None)` with the length as body for a
/// malformed one.
#[allow(clippy::type_complexity)]
fn next_frame(p: &mut Vec<u8>) -> Option<(Option<u8>, Vec<u8>)> {
    if p.len() < 4 {
        return None;
    }
    let len = u32::from_le_bytes(p[..4].try_into().expect("4 bytes")) as usize;
    if len == 0 || len > MAX_FRAME {
        p.clear();
        return Some((None, vec![0; len.min(64)]));
    }
    if p.len() < 4 + len {
        return None;
    }
    let kind = p[4];
    let body = p[5..4 + len].to_vec();
    p.drain(..4 + len);
    Some((Some(kind), body))
}

/// Passes on what the other ranks must learn from `r`'s frame, and keeps the frame for rank
/// 0's side channel (except a probe for another rank).
fn relay(
    conns: &mut [Option<(TcpStream, TcpStream)>],
    sh: &Shared,
    r: usize,
    kind: u8,
    body: Vec<u8>,
    left: &mut [bool],
    leaving: &mut [bool],
) {
    match kind {
        ABORT if !sh.abort_sent.swap(true, Ordering::SeqCst) => {
            send_all(conns, sh, ABORT, &body, None);
        }
        LEAVING => {
            let who = Reader(&body).u32().map_or(r, |w| w as usize);
            let who = if who < leaving.len() { who } else { r };
            if !leaving[who] {
                leaving[who] = true;
                send_all(conns, sh, LEAVING, &body, Some(who));
            }
        }
        PROBE => {
            let to = Reader(&body).u32().map_or(0, |t| t as usize);
            if to != 0 {
                if let Some((_, w)) = conns.get_mut(to).and_then(Option::as_mut) {
                    let _g = sh.write_lock.lock().unwrap_or_else(|e| e.into_inner());
                    let _ = send_frame_nb(w, PROBE, &body);
                }
                return;
            }
        }
        BYE => left[r] = true,
        _ => {}
    }
    sh.push(Event::Frame(r, kind, body));
}

fn send_all(
    conns: &mut [Option<(TcpStream, TcpStream)>],
    sh: &Shared,
    kind: u8,
    body: &[u8],
    except: Option<usize>,
) {
    let _g = sh.write_lock.lock().unwrap_or_else(|e| e.into_inner());
    for (q, c) in conns.iter_mut().enumerate() {
        if let Some((_, w)) = c.as_mut().filter(|_| Some(q) != except) {
            let _ = send_frame_nb(w, kind, body);
        }
    }
}
