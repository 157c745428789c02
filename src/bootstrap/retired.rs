//! The control ports of generations that went on: each answers a rank of its old group that asks
//! late (one stopped, or cut off, while the others shrank) that the group went on without it,
//! so that rank fails, named, instead of going on as a group of its own. One thread serves every
//! retired port of the process.

use super::control::{seal, Door, DROPPED};
use super::outcome::Control;
use super::wire::send_frame;
use std::time::Duration;

/// A retired control port: its group went on as `members` at the next epoch.
struct Retired {
    id: u64,
    ctl: Control,
    epoch: u32,
    refusal: Vec<u8>,
    door: Door,
}

/// Every retired control port of this process, served by one thread.
static RETIRED: std::sync::Mutex<Vec<Retired>> = std::sync::Mutex::new(Vec::new());

/// After a shrink, a rank's old control port answers the ranks of the old group that ask late
/// (one stopped, or cut off, while the others went on): they were left out, so they fail,
/// named, instead of going on as a group of their own. One thread serves every retired port of
/// the process; a port closes when its answerer drops.
pub(crate) struct Answerer {
    id: u64,
}

impl Answerer {
    /// Answers on `ctl`'s port (of epoch `epoch`) until dropped: the group went on as `members`.
    pub(crate) fn start(ctl: Control, epoch: u32, members: Vec<usize>) -> Answerer {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(1);
        static SERVING: AtomicBool = AtomicBool::new(false);
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        let why = format!(
            "the group went on as epoch {} with ranks {members:?} without it (rank {} answered)",
            epoch + 1,
            ctl.rank
        );
        let refusal = seal(&ctl.session, DROPPED, epoch, why.as_bytes());
        if ctl.listener.set_nonblocking(true).is_ok() {
            let mut all = RETIRED.lock().unwrap_or_else(|e| e.into_inner());
            all.push(Retired {
                id,
                ctl,
                epoch,
                refusal,
                door: Door::default(),
            });
        }
        // One thread for the process; started again where it could not be.
        if !SERVING.swap(true, Ordering::AcqRel)
            && std::thread::Builder::new()
                .name("rdmacomm-retired".into())
                .spawn(serve_retired)
                .is_err()
        {
            SERVING.store(false, Ordering::Release);
        }
        Answerer { id }
    }
}

impl Drop for Answerer {
    fn drop(&mut self) {
        let mut all = RETIRED.lock().unwrap_or_else(|e| e.into_inner());
        all.retain(|r| r.id != self.id);
    }
}

/// The thread that answers at every retired port.
fn serve_retired() {
    loop {
        let (mut busy, mut idle) = (false, false);
        {
            let mut all = RETIRED.lock().unwrap_or_else(|e| e.into_inner());
            idle |= all.is_empty();
            for r in all.iter_mut() {
                let (asks, got) = r.door.poll(&r.ctl, r.epoch);
                busy |= got;
                for (_, a, sock) in asks {
                    log::warn!(
                        "rank {} told rank {} of epoch {} that its group went on without it",
                        r.ctl.rank,
                        a.rank,
                        r.epoch
                    );
                    let _ = sock.set_nonblocking(false);
                    let _ = sock.set_write_timeout(Some(Duration::from_millis(200)));
                    let _ = send_frame(&sock, DROPPED, &r.refusal);
                }
            }
        }
        if !busy {
            // Nothing retired: it only looks now and then.
            std::thread::sleep(Duration::from_millis(if idle { 200 } else { 20 }));
        }
    }
}
