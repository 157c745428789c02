//! Where a collective waits on a peer ([`wait_on`]): the one point at which an operation that
//! its caller only tests (`RDMACOMM_PROGRESS=caller`) stops until the caller's next call.

use crate::error::Result;
use crate::transport::Link;
use std::cell::RefCell;
use std::sync::Arc;

/// Whether the thread running an operation stops where the operation would wait.
pub(crate) trait Pause: Send + Sync {
    /// Called where the operation can go no further without a peer; returns once it may go on,
    /// and whether it stopped meanwhile.
    fn at_wait(&self) -> bool;
}

thread_local! {
    /// The calling thread's pause, if its operations stop at waits.
    static PAUSE: RefCell<Option<Arc<dyn Pause>>> = const { RefCell::new(None) };
}

/// Makes the calling thread's operations stop at waits as `pause` says (None: never).
pub(crate) fn set(pause: Option<Arc<dyn Pause>>) {
    PAUSE.with(|p| *p.borrow_mut() = pause);
}

/// Nothing moved in the last sweep: waits on `peer` through [`Link::progress`], first stopping
/// if the calling thread's pause says so.
pub(crate) fn wait_on(link: &mut dyn Link, peer: usize) -> Result<()> {
    let stopped = PAUSE.with(|p| p.borrow().as_ref().is_some_and(|p| p.at_wait()));
    if stopped {
        link.resume();
    }
    link.progress(peer)
}

/// The end of an operation: what is still queued for a peer leaves through [`wait_on`] (where
/// an operation its caller only tests stops, as at any wait on a late peer), then the link
/// completes what it posted.
pub(crate) fn finish(link: &mut dyn Link) -> Result<()> {
    let mut began = false;
    while let Some(peer) = link.unsent()? {
        if !began {
            // The peer's silence is measured from here, not from the operation's last step.
            link.begin();
            began = true;
        }
        wait_on(link, peer)?;
    }
    link.finish()
}
