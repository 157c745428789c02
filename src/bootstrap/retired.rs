//! Control ports answered by a thread while their rank does not read them: a rank asking a
//! coordinator, or meeting with its new group, answers that it follows that coordinator (so a
//! rank that finds nobody else joins the group forming); a port whose group went on answers a
//! rank of its old group that asks late (one stopped, or cut off, while the others shrank) that
//! the group went on without it, so that rank fails, named, instead of going on as a group of
//! its own. One thread serves every such port of the process.

use super::control::{seal, Door, DROPPED, FOLLOWING};
use super::outcome::Control;
use super::wire::send_frame;
use std::time::Duration;

/// A served control port, and what it answers (a sealed frame of kind `kind`).
struct Retired {
    id: u64,
    ctl: Control,
    epoch: u32,
    kind: u8,
    reply: Vec<u8>,
    door: Door,
}

/// What a served port answers.
pub(crate) enum Reply {
    /// Its rank follows this coordinator (FOLLOWING).
    Following(usize),
    /// Its group went on (or is meeting) as these ranks, at the next epoch (DROPPED).
    WentOn(Vec<usize>),
}

/// Every retired control port of this process, served by one thread.
static RETIRED: std::sync::Mutex<Vec<Retired>> = std::sync::Mutex::new(Vec::new());

/// A control port answered by the process's serving thread until this is dropped (the port
/// itself closes with the last descriptor of it).
pub(crate) struct Answerer {
    id: u64,
}

impl Answerer {
    /// Answers on `ctl`'s port (of epoch `epoch`) with `reply` until dropped.
    pub(crate) fn start(ctl: Control, epoch: u32, reply: Reply) -> Answerer {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(1);
        static SERVING: AtomicBool = AtomicBool::new(false);
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        let (kind, body) = match reply {
            Reply::Following(c) => (FOLLOWING, (c as u32).to_le_bytes().to_vec()),
            Reply::WentOn(members) => (
                DROPPED,
                format!(
                    "the group went on as epoch {} with ranks {members:?} without it (rank {} \
                     answered)",
                    epoch + 1,
                    ctl.rank
                )
                .into_bytes(),
            ),
        };
        let reply = seal(&ctl.session, kind, epoch, &body);
        if ctl.listener.set_nonblocking(true).is_ok() {
            let mut all = RETIRED.lock().unwrap_or_else(|e| e.into_inner());
            all.push(Retired {
                id,
                ctl,
                epoch,
                kind,
                reply,
                door: Door::default(),
            });
        }
        // One thread for the process; started again where it could not be.
        if !SERVING.swap(true, Ordering::AcqRel)
            && std::thread::Builder::new()
                .name("rdmacomm-ports".into())
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

/// The thread that answers at every served port.
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
                    if r.kind == DROPPED {
                        log::warn!(
                            "rank {} told rank {} of epoch {} that its group went on without it",
                            r.ctl.rank,
                            a.rank,
                            r.epoch
                        );
                    }
                    let _ = sock.set_nonblocking(false);
                    let _ = sock.set_write_timeout(Some(Duration::from_millis(200)));
                    let _ = send_frame(&sock, r.kind, &r.reply);
                }
            }
        }
        if !busy {
            // Nothing served: it only looks now and then.
            std::thread::sleep(Duration::from_millis(if idle { 200 } else { 20 }));
        }
    }
}
