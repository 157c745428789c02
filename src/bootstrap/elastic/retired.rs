//! Control ports whose agreement has ended, answered by a thread: the ended machine tells a
//! member that asks late (it missed the GO) that its group holds, and a rank left out (stopped,
//! or cut off, while the others shrank) that the group went on without it, so that rank fails,
//! named, instead of going on as a group of its own. One thread serves every such port of the
//! process, for the life of the communicators that follow.

use super::agreement::{Event, Msg};
use super::codec::{decode, encode, is_agreement_kind};
use super::driver::Ended;
use super::outbox::{Outbox, Ports};
use crate::bootstrap::wire::port::{Control, Door};
use std::sync::Arc;
use std::time::Duration;

/// A served control port and the agreement that ended on it.
struct Retired {
    id: u64,
    ctl: Control,
    /// Where its group's ranks are, for answers.
    ports: Arc<Ports>,
    tag: u32,
    ended: Ended,
    door: Door,
}

/// Every retired control port of this process, served by one thread.
static RETIRED: std::sync::Mutex<Vec<Retired>> = std::sync::Mutex::new(Vec::new());

/// A control port answered by the process's serving thread until this is dropped (the port
/// itself closes with the last descriptor of it).
pub(crate) struct Answerer {
    id: u64,
}

impl Answerer {
    /// Answers on `ctl`'s port, for the agreement tagged `tag` that ended as `ended`, until
    /// dropped.
    pub(crate) fn start(ctl: Control, tag: u32, mut ended: Ended) -> Answerer {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(1);
        static SERVING: AtomicBool = AtomicBool::new(false);
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        if ctl.listener.set_nonblocking(true).is_ok() {
            let mut all = RETIRED.lock().unwrap_or_else(|e| e.into_inner());
            let ports = Arc::new(Ports {
                addrs: ctl.addrs.clone(),
                ports: ctl.ports.clone(),
            });
            all.push(Retired {
                id,
                ports,
                ctl,
                tag,
                // A frame half read when the agreement ended is read on, not dropped.
                door: std::mem::take(&mut ended.door),
                ended,
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

/// The thread that answers at every served port; its answers go out through one outbox.
fn serve_retired() {
    let none = Ports {
        addrs: Vec::new(),
        ports: Vec::new(),
    };
    let out = Outbox::new(none, Duration::from_secs(1), 2);
    loop {
        // Nobody acts on a retired group's refusals: they are only drained.
        drop(out.lost());
        let (mut busy, mut idle) = (false, false);
        {
            let mut all = RETIRED.lock().unwrap_or_else(|e| e.into_inner());
            idle |= all.is_empty();
            for r in all.iter_mut() {
                let (frames, got) = r.door.poll(&r.ctl.listener, &[r.tag], is_agreement_kind);
                busy |= got;
                for (kind, body) in frames {
                    answer(r, kind, &body, &out);
                }
            }
        }
        if !busy {
            // Nothing served: it only looks now and then.
            std::thread::sleep(Duration::from_millis(if idle { 200 } else { 20 }));
        }
    }
}

/// The ended machine's answer to one frame, sent off this thread through `out`.
fn answer(r: &mut Retired, kind: u8, body: &[u8], out: &Outbox) {
    let (n, me) = (r.ctl.ports.len(), r.ctl.rank);
    let Some(m) = decode(&r.ctl.session, r.tag, kind, body, n, 0) else {
        return;
    };
    let from = m.from;
    let sends = r.ended.machine.handle(0, Event::Recv { from, msg: m.msg });
    if sends.is_empty() {
        return;
    }
    for s in sends {
        if let Msg::Out(d) = &s.msg {
            log::warn!(
                "rank {me} told rank {} that its group went on as ranks {:?} without it",
                s.to,
                d.members
            );
        }
        let (kind, frame) = encode(&r.ctl.session, r.tag, me, &s.msg, &r.ended.meet, 0);
        out.send_to(r.ports.clone(), s.to, kind, frame);
    }
}
