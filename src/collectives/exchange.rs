//! Many sends and receives at once, each peer's in the order given: the engine under sendrecv,
//! batched point-to-point, all_to_all(v), gather and scatter. Every sweep posts the next chunk
//! to each peer and takes the next chunk from each, so no send waits on a receive that its peer
//! can only make after the send (the both-send-first deadlock of two blocking sends).

use crate::collectives::pause::wait_on;
use crate::error::{Error, Result};
use crate::transport::Link;

/// Number of chunks a message of `len` bytes takes (an empty message is one empty chunk, so
/// that every send matches exactly one receive).
pub(crate) fn pieces(len: usize, max: usize) -> usize {
    len.div_ceil(max).max(1)
}

/// Chunk `i` of a message of `len` bytes cut at `max`.
fn piece(i: usize, len: usize, max: usize) -> std::ops::Range<usize> {
    (i * max).min(len)..((i + 1) * max).min(len)
}

/// The messages of one exchange, by index: each one's peer, and its bytes (a send) or the
/// buffer it fills (a receive). A peer's messages go in index order.
pub(crate) trait Plan {
    /// Messages sent.
    fn sends(&self) -> usize;
    /// The peer send `i` goes to.
    fn send_peer(&self, i: usize) -> usize;
    /// Send `i`'s bytes.
    fn send(&self, i: usize) -> &[u8];
    /// Messages received.
    fn recvs(&self) -> usize;
    /// The peer receive `i` comes from.
    fn recv_peer(&self, i: usize) -> usize;
    /// The buffer receive `i` fills (exactly).
    fn recv(&mut self, i: usize) -> &mut [u8];
}

/// Lists of messages as slices (allocates its per-peer state: for batches and tests).
struct Lists<'s, 'a, 'b> {
    sends: &'s [(usize, &'a [u8])],
    recvs: &'s mut [(usize, &'b mut [u8])],
}

impl Plan for Lists<'_, '_, '_> {
    fn sends(&self) -> usize {
        self.sends.len()
    }
    fn send_peer(&self, i: usize) -> usize {
        self.sends[i].0
    }
    fn send(&self, i: usize) -> &[u8] {
        self.sends[i].1
    }
    fn recvs(&self) -> usize {
        self.recvs.len()
    }
    fn recv_peer(&self, i: usize) -> usize {
        self.recvs[i].0
    }
    fn recv(&mut self, i: usize) -> &mut [u8] {
        self.recvs[i].1
    }
}

/// Sends every `(peer, data)` of `sends` and receives into every `(peer, buffer)` of `recvs`
/// (exactly the buffer's length), all at once; messages to or from one peer go in list order.
/// Peers must be other ranks of `link`. (The algorithm tests call it; `Comm` keeps counters
/// across calls through [`exchange_with`].)
#[cfg(test)]
pub fn exchange(
    link: &mut dyn Link,
    sends: &[(usize, &[u8])],
    recvs: &mut [(usize, &mut [u8])],
) -> Result<()> {
    run(link, &mut Lists { sends, recvs }, &mut Vec::new())
}

/// [`exchange`], keeping its per-peer state in `state` (reused from call to call).
pub(crate) fn exchange_with(
    link: &mut dyn Link,
    sends: &[(usize, &[u8])],
    recvs: &mut [(usize, &mut [u8])],
    state: &mut Vec<usize>,
) -> Result<()> {
    run(link, &mut Lists { sends, recvs }, state)
}

/// No message under way.
const NONE: usize = usize::MAX;

/// Runs `plan`'s messages all at once, keeping per-peer state in `state` (reused from call to
/// call, so that a repeated exchange allocates nothing): for each peer, the send under way and
/// its next chunk, then the same for receives. Only the plan's peers' entries are touched, so a
/// call costs its messages, not the world size.
pub(crate) fn run(link: &mut dyn Link, plan: &mut dyn Plan, state: &mut Vec<usize>) -> Result<()> {
    let max = link.props().max_chunk;
    let n = link.size();
    if state.len() < 4 * n {
        state.resize(4 * n, NONE);
    }
    let (out_at, rest) = state.split_at_mut(n);
    let (out_chunk, rest) = rest.split_at_mut(n);
    let (in_at, rest) = rest.split_at_mut(n);
    let in_chunk = &mut rest[..n];
    let (ns, nr) = (plan.sends(), plan.recvs());
    // Each peer's first message, each way; `open` counts the peers and directions under way.
    for i in 0..ns {
        out_at[plan.send_peer(i)] = NONE;
    }
    for i in 0..nr {
        in_at[plan.recv_peer(i)] = NONE;
    }
    let mut open = 0;
    for i in (0..ns).rev() {
        let p = plan.send_peer(i);
        open += usize::from(out_at[p] == NONE);
        out_at[p] = i;
        out_chunk[p] = 0;
    }
    for i in (0..nr).rev() {
        let p = plan.recv_peer(i);
        open += usize::from(in_at[p] == NONE);
        in_at[p] = i;
        in_chunk[p] = 0;
    }
    let one_post = link.props().takes_return_credits;
    link.begin();
    loop {
        let mut did = false;
        let mut waiting = None;
        for i in 0..ns {
            let p = plan.send_peer(i);
            if out_at[p] != i {
                continue;
            }
            // Several chunks per sweep where a take frees nothing a peer waits for (a
            // finished message's successor to the same peer comes later in this sweep).
            loop {
                let data = plan.send(i);
                if !link.try_post(p, &data[piece(out_chunk[p], data.len(), max)])? {
                    waiting.get_or_insert(p);
                    break;
                }
                did = true;
                out_chunk[p] += 1;
                if out_chunk[p] == pieces(data.len(), max) {
                    out_at[p] = (i + 1..ns)
                        .find(|&j| plan.send_peer(j) == p)
                        .unwrap_or(NONE);
                    out_chunk[p] = 0;
                    open -= usize::from(out_at[p] == NONE);
                    break;
                }
                if one_post {
                    break;
                }
            }
        }
        for i in 0..nr {
            let p = plan.recv_peer(i);
            if in_at[p] != i {
                continue;
            }
            let buf = plan.recv(i);
            let total = buf.len();
            let part = &mut buf[piece(in_chunk[p], total, max)];
            let got = link.try_take_into(p, part).map_err(|e| match e {
                Error::InvalidArgument(why) => Error::InvalidArgument(format!(
                    "receive of {total} bytes from rank {p}: {why} (the sender's length differs)"
                )),
                e => e,
            })?;
            if got {
                did = true;
                in_chunk[p] += 1;
                if in_chunk[p] == pieces(total, max) {
                    in_at[p] = (i + 1..nr)
                        .find(|&j| plan.recv_peer(j) == p)
                        .unwrap_or(NONE);
                    in_chunk[p] = 0;
                    open -= usize::from(in_at[p] == NONE);
                }
            } else {
                waiting = Some(p);
            }
        }
        if open == 0 {
            return Ok(());
        }
        if !did {
            // Every lane under way tried and failed, so `waiting` names one.
            wait_on(link, waiting.expect("an open lane that could not move"))?;
        }
    }
}
