//! Many sends and receives at once, each peer's in the order given: the engine under sendrecv,
//! batched point-to-point, all_to_all(v), gather and scatter. Every sweep posts the next chunk
//! to each peer and takes the next chunk from each, so no send waits on a receive that its peer
//! can only make after the send (the both-send-first deadlock of two blocking sends).

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

/// The messages to one peer (or from it), in order, and how far they have gone.
struct Lane {
    peer: usize,
    msgs: Vec<usize>,
    /// Index into `msgs` of the message under way, and its next chunk.
    at: usize,
    chunk: usize,
}

/// Groups message indices by peer, lanes in the order peers first appear.
fn lanes(peers: impl Iterator<Item = usize>, n: usize) -> Vec<Lane> {
    let mut index = vec![usize::MAX; n];
    let mut out: Vec<Lane> = Vec::new();
    for (i, p) in peers.enumerate() {
        if index[p] == usize::MAX {
            index[p] = out.len();
            out.push(Lane {
                peer: p,
                msgs: Vec::new(),
                at: 0,
                chunk: 0,
            });
        }
        out[index[p]].msgs.push(i);
    }
    out
}

/// Sends every `(peer, data)` of `sends` and receives into every `(peer, buffer)` of `recvs`
/// (exactly the buffer's length), all at once; messages to or from one peer go in list order.
/// Peers must be other ranks of `link`.
pub fn exchange(
    link: &mut dyn Link,
    sends: &[(usize, &[u8])],
    recvs: &mut [(usize, &mut [u8])],
) -> Result<()> {
    let max = link.max_chunk();
    let n = link.size();
    let mut out = lanes(sends.iter().map(|s| s.0), n);
    let mut inn = lanes(recvs.iter().map(|r| r.0), n);
    let one_post = link.takes_return_credits();
    link.begin();
    loop {
        let mut did = false;
        let mut waiting = None;
        for lane in out.iter_mut().filter(|l| l.at < l.msgs.len()) {
            // Several chunks per sweep where a take frees nothing a peer waits for.
            loop {
                let data = sends[lane.msgs[lane.at]].1;
                if !link.try_post(lane.peer, &data[piece(lane.chunk, data.len(), max)])? {
                    waiting.get_or_insert(lane.peer);
                    break;
                }
                did = true;
                lane.chunk += 1;
                if lane.chunk == pieces(data.len(), max) {
                    lane.at += 1;
                    lane.chunk = 0;
                }
                if one_post || lane.at == lane.msgs.len() {
                    break;
                }
            }
        }
        for lane in inn.iter_mut().filter(|l| l.at < l.msgs.len()) {
            let buf = &mut *recvs[lane.msgs[lane.at]].1;
            let total = buf.len();
            let part = &mut buf[piece(lane.chunk, total, max)];
            let got = link.try_take_into(lane.peer, part).map_err(|e| match e {
                Error::InvalidArgument(why) => Error::InvalidArgument(format!(
                    "receive of {total} bytes from rank {}: {why} (the sender's length differs)",
                    lane.peer
                )),
                e => e,
            })?;
            if got {
                did = true;
                lane.chunk += 1;
                if lane.chunk == pieces(total, max) {
                    lane.at += 1;
                    lane.chunk = 0;
                }
            } else {
                waiting = Some(lane.peer);
            }
        }
        let open = |ls: &[Lane]| ls.iter().any(|l| l.at < l.msgs.len());
        if !open(&out) && !open(&inn) {
            return Ok(());
        }
        if !did {
            let peer = waiting.unwrap_or_else(|| {
                out.iter()
                    .chain(inn.iter())
                    .find(|l| l.at < l.msgs.len())
                    .map_or(0, |l| l.peer)
            });
            link.progress(peer)?;
        }
    }
}
