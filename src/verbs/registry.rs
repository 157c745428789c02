//! The devices this process has open: one context per device choice, shared by every
//! communicator that chooses it (a `dup` or `split` opens nothing), as NCCL keeps one context
//! per device per process. A context has one async event queue; each event read is handed to
//! every communicator's subscription, and each keeps what concerns it (a QP's event its own
//! QPs', a port's or the device's every one).

use super::device::{open, DeviceChoice, Selected};
use super::events::{AsyncEvent, AsyncEvents};
use crate::error::Result;
use sideway::ibverbs::device_context::DeviceContext;
use std::sync::{Arc, Mutex, Weak};

/// An open device and the subscriptions to its events.
struct Opened {
    ctx: Arc<DeviceContext>,
    sel: Selected,
    events: Mutex<Fanout>,
}

/// The device's event queue, and each live subscriber's share of what it held.
struct Fanout {
    source: AsyncEvents,
    queues: Vec<Weak<Mutex<Vec<AsyncEvent>>>>,
}

/// The choices open now (held weakly: a device closes with its last communicator).
static OPEN: Mutex<Vec<(DeviceChoice, Weak<Opened>)>> = Mutex::new(Vec::new());

/// One communicator's hold on an open device: its context, what was selected, its events.
pub struct Device {
    opened: Arc<Opened>,
    queue: Arc<Mutex<Vec<AsyncEvent>>>,
}

impl Device {
    /// Opens the device `choice` names, or shares it where this process has it open.
    pub fn open(choice: &DeviceChoice) -> Result<Device> {
        let mut open_now = OPEN.lock().unwrap_or_else(|e| e.into_inner());
        open_now.retain(|(_, w)| w.strong_count() > 0);
        let found = open_now
            .iter()
            .find(|(c, _)| c == choice)
            .and_then(|(_, w)| w.upgrade());
        let opened = match found {
            Some(o) => o,
            None => {
                let (ctx, sel) = open(choice)?;
                let source = AsyncEvents::new(&ctx)?;
                let o = Arc::new(Opened {
                    ctx,
                    sel,
                    events: Mutex::new(Fanout {
                        source,
                        queues: Vec::new(),
                    }),
                });
                open_now.push((choice.clone(), Arc::downgrade(&o)));
                o
            }
        };
        drop(open_now);
        let queue = Arc::new(Mutex::new(Vec::new()));
        let mut f = opened.events.lock().unwrap_or_else(|e| e.into_inner());
        f.queues.retain(|q| q.strong_count() > 0);
        f.queues.push(Arc::downgrade(&queue));
        drop(f);
        Ok(Device { opened, queue })
    }

    /// The device context.
    pub fn context(&self) -> &Arc<DeviceContext> {
        &self.opened.ctx
    }

    /// The device, port and GID in use.
    pub fn selected(&self) -> &Selected {
        &self.opened.sel
    }

    /// Every event since the last call (each subscriber sees every event once); never blocks.
    pub fn events(&self) -> Vec<AsyncEvent> {
        let f = self.opened.events.lock().unwrap_or_else(|e| e.into_inner());
        let new = f.source.drain();
        if !new.is_empty() {
            for q in f.queues.iter().filter_map(Weak::upgrade) {
                q.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .extend(new.iter().cloned());
            }
        }
        drop(f);
        std::mem::take(&mut *self.queue.lock().unwrap_or_else(|e| e.into_inner()))
    }
}
