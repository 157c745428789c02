//! Rank 0's relay: a thread that reads every rank's side-channel connection and passes on at
//! once what the others must learn (aborts, departures, probes), whatever rank 0's own thread
//! is doing meanwhile (another communicator's operation, the application's own work); it also
//! judges stalled waits, so a verdict never waits for rank 0's own thread. Rank 0's side channel
//! takes what the thread read from its inbox. One thread serves every communicator of the
//! process that it is rank 0 of (`dup`s and `split`s too), waiting on all their connections at
//! once.

use super::stalls::{verdict, STALL_WINDOW};
use crate::bootstrap::wire::*;
use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
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

/// One communicator's relaying, registered with the process's relay thread until dropped
/// (after the caller shut the connections down).
pub(super) struct Relay {
    shared: Arc<Shared>,
}

impl Relay {
    /// Starts relaying over `streams` (rank 0's connections, non-blocking, by rank), which the
    /// side channel keeps using (its writes hold [`Shared::write_lock`]), on the process's one
    /// relay thread (started here if none runs).
    pub fn start(
        streams: &[Option<Arc<TcpStream>>],
        shared: Arc<Shared>,
    ) -> std::io::Result<Relay> {
        let n = streams.len();
        let job = Job {
            conns: streams.to_vec(),
            pending: vec![Vec::new(); n],
            left: vec![false; n],
            leaving: vec![false; n],
            stalls: Stalls {
                reported: vec![None; n],
                since: None,
            },
            sh: shared.clone(),
        };
        let mut reg = registry();
        if reg.wake.is_none() {
            let (rx, tx) = UnixStream::pair()?;
            rx.set_nonblocking(true)?;
            tx.set_nonblocking(true)?;
            reg.wake = Some((rx, tx));
        }
        reg.jobs.push(job);
        if !reg.running {
            std::thread::Builder::new()
                .name("rdmacomm-relay".into())
                .spawn(run)?;
            reg.running = true;
        }
        wake(&reg);
        Ok(Relay { shared })
    }

    /// Asks the thread to stop relaying for this communicator at its next wake-up.
    pub fn stop(&self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        wake(&registry());
    }
}

impl Drop for Relay {
    /// Stops, and waits (at most 1 s) until the thread let go of this communicator's sockets.
    fn drop(&mut self) {
        self.stop();
        let until = Instant::now() + std::time::Duration::from_secs(1);
        let held = |sh: &Arc<Shared>| registry().jobs.iter().any(|j| Arc::ptr_eq(&j.sh, sh));
        while held(&self.shared) && Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }
}

/// Every communicator this process relays for (it is rank 0 of each), and the thread's state.
#[derive(Default)]
struct Registry {
    jobs: Vec<Job>,
    running: bool,
    /// Wakes the thread when a job comes or stops (read end, write end).
    wake: Option<(UnixStream, UnixStream)>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    jobs: Vec::new(),
    running: false,
    wake: None,
});

fn registry() -> std::sync::MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

fn wake(reg: &Registry) {
    if let Some((_, tx)) = reg.wake.as_ref() {
        let _ = (&*tx).write(&[1]); // a full pipe already wakes it
    }
}

/// One communicator's relaying: per rank the connection it shares with the side channel.
struct Job {
    conns: Vec<Option<Arc<TcpStream>>>,
    pending: Vec<Vec<u8>>,
    left: Vec<bool>,
    leaving: Vec<bool>,
    stalls: Stalls,
    sh: Arc<Shared>,
}

/// The process's relay thread: waits on every job's connections at once, then serves each;
/// it ends when no job is left (a later one starts it again).
fn run() {
    let mut buf = [0u8; 4096];
    let mut fds = Vec::new();
    loop {
        let waits: Vec<crate::sys::Wait> = {
            let mut reg = registry();
            reg.jobs.retain(|j| !j.sh.stop.load(Ordering::SeqCst));
            if reg.jobs.is_empty() {
                // Nothing of the thread's stays behind it (its wake pair either).
                reg.running = false;
                reg.wake = None;
                return;
            }
            let socks = reg.jobs.iter().flat_map(|j| j.conns.iter().flatten());
            let wake = reg.wake.as_ref().map(|(rx, _)| rx.as_raw_fd());
            socks
                .map(|r| r.as_raw_fd())
                .chain(wake)
                .map(|fd| crate::sys::Wait {
                    fd,
                    read: true,
                    write: false,
                })
                .collect()
        };
        crate::sys::wait(waits, 100, &mut fds);
        let mut reg = registry();
        if let Some((rx, _)) = reg.wake.as_ref() {
            while matches!((&*rx).read(&mut buf), Ok(k) if k > 0) {}
        }
        reg.jobs.retain_mut(|j| j.serve(&mut buf));
    }
}

impl Job {
    /// Judges stalls, reads every connection and relays what came; false once this job is over
    /// (stopped, or every connection ended).
    fn serve(&mut self, buf: &mut [u8]) -> bool {
        let sh = self.sh.clone();
        self.stalls.judge(&mut self.conns, &sh);
        if sh.stop.load(Ordering::SeqCst) || self.conns.iter().all(Option::is_none) {
            return false;
        }
        for r in 0..self.conns.len() {
            let mut ended = None;
            while let Some(mut rd) = self.conns[r].as_deref() {
                match rd.read(buf) {
                    Ok(0) => {
                        ended = Some("its side-channel connection closed without a goodbye (process died or host unreachable); seen by rank 0".to_string());
                        break;
                    }
                    Ok(k) => self.pending[r].extend_from_slice(&buf[..k]),
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
            while let Some((kind, body)) = next_frame(&mut self.pending[r]) {
                match kind {
                    Some(STALLED) => self.stalls.report(r, &body),
                    Some(kind) => relay(
                        &mut self.conns,
                        &sh,
                        r,
                        kind,
                        body,
                        &mut self.left,
                        &mut self.leaving,
                    ),
                    None => {
                        sh.push(Event::Ended(
                            r,
                            format!("sent a malformed side-channel frame ({} bytes)", body.len()),
                        ));
                        self.conns[r] = None;
                        break;
                    }
                }
            }
            if let Some(why) = ended {
                // Shut down by rank 0's own side channel while closing: no failure.
                if sh.stop.load(Ordering::SeqCst) {
                    return false;
                }
                let why = if self.left[r] { String::new() } else { why };
                if !why.is_empty() && !sh.abort_sent.swap(true, Ordering::SeqCst) {
                    let mut body = (r as u32).to_le_bytes().to_vec();
                    put_bytes(&mut body, why.as_bytes());
                    send_all(&mut self.conns, &sh, ABORT, &body, None);
                }
                self.conns[r] = None;
                sh.push(Event::Ended(r, why));
            }
        }
        true
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
    fn judge(&mut self, conns: &mut [Option<Arc<TcpStream>>], sh: &Shared) {
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
    conns: &mut [Option<Arc<TcpStream>>],
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
                if let Some(w) = conns.get(to).and_then(Option::as_deref) {
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
    conns: &mut [Option<Arc<TcpStream>>],
    sh: &Shared,
    kind: u8,
    body: &[u8],
    except: Option<usize>,
) {
    let _g = sh.write_lock.lock().unwrap_or_else(|e| e.into_inner());
    for (q, c) in conns.iter_mut().enumerate() {
        if let Some(w) = c.as_deref().filter(|_| Some(q) != except) {
            let _ = send_frame_nb(w, kind, body);
        }
    }
}
