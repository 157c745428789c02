//! Closing nuvec's communicators when the process exits: nuvec keeps every group's transport in
//! a static for the life of the process, so none is ever dropped. Without a close, a rank that
//! finishes first would vanish from under a peer still completing the last collective.

use crate::comm::Comm;
use std::sync::{Arc, Mutex, Once, Weak};

static LIVE: Mutex<Vec<Weak<Comm>>> = Mutex::new(Vec::new());

/// Closes `comm` at process exit if it is still alive then.
pub(super) fn close_at_exit(comm: &Arc<Comm>) {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        // SAFETY: registers a function with C's exit handlers; it takes no arguments and
        // does not unwind (it catches panics).
        unsafe {
            libc::atexit(close_all);
        }
    });
    let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
    live.retain(|w| w.strong_count() > 0);
    live.push(Arc::downgrade(comm));
}

extern "C" fn close_all() {
    let _ = std::panic::catch_unwind(|| {
        let live = std::mem::take(&mut *LIVE.lock().unwrap_or_else(|e| e.into_inner()));
        for comm in live.iter().filter_map(Weak::upgrade) {
            comm.close("closed its communicator at process exit");
        }
    });
}
