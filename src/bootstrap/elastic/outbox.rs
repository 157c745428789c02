//! Sending the agreement's messages off the deciding thread: a few workers each dial the
//! receiver's control port, write one frame and close (a stopped rank's kernel holds it until
//! it wakes). A refused connection is a fact sent back: nobody listens there any more.

use crate::bootstrap::wire::port::{reach, Reach};
use crate::bootstrap::wire::send_frame;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Workers at most: a broadcast to many ranks goes out this many at a time.
pub(crate) const WORKERS: usize = 16;

/// Where the ranks' control ports are.
#[derive(Clone)]
pub(crate) struct Ports {
    pub addrs: Vec<String>,
    pub ports: Vec<u16>,
}

struct Job {
    ports: Arc<Ports>,
    to: usize,
    kind: u8,
    frame: Vec<u8>,
}

/// Messages on their way; the ranks found gone.
pub(crate) struct Outbox {
    ports: Arc<Ports>,
    jobs: Option<Sender<Job>>,
    lost: Receiver<usize>,
    pending: Arc<AtomicUsize>,
}

impl Outbox {
    /// Sends to `ports` with up to `workers` threads, each connection tried for `dial_for` at
    /// most.
    pub(crate) fn new(ports: Ports, dial_for: Duration, workers: usize) -> Outbox {
        let (jobs, rx) = channel::<Job>();
        let (lost_tx, lost) = channel();
        let rx = Arc::new(Mutex::new(rx));
        let pending = Arc::new(AtomicUsize::new(0));
        let workers = workers.clamp(1, WORKERS);
        for i in 0..workers {
            let (rx, lost_tx, pending) = (rx.clone(), lost_tx.clone(), pending.clone());
            // Workers that cannot start leave the others the work; a worker drains the queue
            // after the outbox is dropped (a GO still goes out), then ends.
            let _ = std::thread::Builder::new()
                .name(format!("rdmacomm-agree-{i}"))
                .spawn(move || loop {
                    let job = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
                    let Ok(job) = job else { break };
                    if matches!(deliver(&job, dial_for), Err(Reach::Refused)) {
                        let _ = lost_tx.send(job.to);
                    }
                    pending.fetch_sub(1, Ordering::AcqRel);
                });
        }
        Outbox {
            ports: Arc::new(ports),
            jobs: Some(jobs),
            lost,
            pending,
        }
    }

    /// Queues a frame of kind `kind` to rank `to`.
    pub(crate) fn send(&self, to: usize, kind: u8, frame: Vec<u8>) {
        self.send_to(self.ports.clone(), to, kind, frame);
    }

    /// Queues a frame of kind `kind` to rank `to` of another group's `ports`.
    pub(crate) fn send_to(&self, ports: Arc<Ports>, to: usize, kind: u8, frame: Vec<u8>) {
        if let Some(jobs) = &self.jobs {
            self.pending.fetch_add(1, Ordering::AcqRel);
            let job = Job {
                ports,
                to,
                kind,
                frame,
            };
            if jobs.send(job).is_err() {
                self.pending.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }

    /// Ranks whose port refused a message since the last call.
    pub(crate) fn lost(&self) -> Vec<usize> {
        self.lost.try_iter().collect()
    }

    /// Waits until every queued message went out, by `until` at most.
    pub(crate) fn flush(&self, until: Instant) {
        while self.pending.load(Ordering::Acquire) > 0 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for Outbox {
    fn drop(&mut self) {
        // The workers end once the queue is empty.
        self.jobs.take();
    }
}

/// Dials rank `job.to` and writes the frame.
fn deliver(job: &Job, dial_for: Duration) -> Result<(), Reach> {
    let ports = &job.ports;
    let (Some(addr), Some(&port)) = (ports.addrs.get(job.to), ports.ports.get(job.to)) else {
        return Err(Reach::Failed("no such rank".into()));
    };
    let s = reach(addr, port, Instant::now() + dial_for)?;
    let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
    send_frame(&s, job.kind, &job.frame).map_err(|e| Reach::Failed(e.to_string()))
}
