//! The device's asynchronous events (port down, QP fatal, device fatal), read without blocking.

use crate::error::{Error, Result};
use rdma_mummy_sys::{ibv_ack_async_event, ibv_async_event, ibv_get_async_event};
use sideway::ibverbs::device_context::DeviceContext;
use std::sync::Arc;

/// One asynchronous event, in words that matter to a communicator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AsyncEvent {
    /// A port went down.
    PortError(u8),
    /// A port came (back) up.
    PortActive(u8),
    /// A queue pair hit a fatal error (its number).
    QpFatal(u32),
    /// A completion queue overran or failed (its address, [`crate::verbs::CompletionQueue::id`]).
    CqError(usize),
    /// The device failed.
    DeviceFatal,
    /// Anything else (the `ibv_event_type` number).
    Other(u32),
}

impl AsyncEvent {
    /// Whether the event means communication is broken.
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            AsyncEvent::PortError(_)
                | AsyncEvent::QpFatal(_)
                | AsyncEvent::CqError(_)
                | AsyncEvent::DeviceFatal
        )
    }
}

/// Reads a device context's async events without blocking (its async fd set O_NONBLOCK).
pub struct AsyncEvents {
    ctx: Arc<DeviceContext>,
}

impl AsyncEvents {
    /// Switches `ctx`'s async event fd to non-blocking mode.
    pub fn new(ctx: &Arc<DeviceContext>) -> Result<Self> {
        // SAFETY: the context is alive (we hold its Arc); async_fd is a plain fd owned by it.
        let fd = unsafe { (*ctx.context().as_ptr()).async_fd };
        // SAFETY: fcntl on a valid fd with valid flags.
        let ok = unsafe {
            let fl = libc::fcntl(fd, libc::F_GETFL);
            fl >= 0 && libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) == 0
        };
        if !ok {
            return Err(Error::Verbs {
                op: "set async event fd non-blocking",
                detail: std::io::Error::last_os_error().to_string(),
                source: None,
            });
        }
        Ok(AsyncEvents {
            ctx: Arc::clone(ctx),
        })
    }

    /// Every pending event (none when nothing is pending); never blocks.
    pub fn drain(&self) -> Vec<AsyncEvent> {
        let mut out = Vec::new();
        loop {
            // SAFETY: zero is a valid bit pattern for this C struct (a union of pointers/ints
            // and an enum) which ibv_get_async_event fills.
            let mut ev: ibv_async_event = unsafe { std::mem::zeroed() };
            // SAFETY: valid context; ev is writable; the fd is non-blocking (EAGAIN when empty).
            if unsafe { ibv_get_async_event(self.ctx.context().as_ptr(), &mut ev) } != 0 {
                return out;
            }
            let kind = ev.event_type as u32;
            // SAFETY: the union member read matches the event type (libibverbs' contract).
            let e = unsafe {
                match kind {
                    0 => AsyncEvent::CqError(ev.element.cq as usize),
                    1..=3 => AsyncEvent::QpFatal(if ev.element.qp.is_null() {
                        0
                    } else {
                        (*ev.element.qp).qp_num
                    }),
                    8 => AsyncEvent::DeviceFatal,
                    9 => AsyncEvent::PortActive(ev.element.port_num as u8),
                    10 => AsyncEvent::PortError(ev.element.port_num as u8),
                    k => AsyncEvent::Other(k),
                }
            };
            // SAFETY: every event returned must be acknowledged exactly once.
            unsafe { ibv_ack_async_event(&mut ev) };
            out.push(e);
        }
    }
}
