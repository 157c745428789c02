//! nuvec's point-to-point as a byte stream per peer over rdmacomm's exact-length messages.
//!
//! nuvec sends an array as several `send` calls and, after a header it did not expect, drains
//! the payload in reads of its own size: one send may be read by several receives and one
//! receive may span several sends. Each send goes as a fixed-size frame (its length, and the
//! bytes themselves when they fit), then the bytes as a message of their own when they do not;
//! a receive takes frames until it has its bytes and keeps what it did not read for the next.

use crate::api::Communicator;
use crate::comm::Comm;
use crate::error::{Error, Result};

/// Every frame's size: the length (8 bytes, little-endian) and up to [`INLINE`] bytes.
const FRAME: usize = 256;
/// The bytes a frame carries itself.
const INLINE: usize = FRAME - 8;

/// What has come from one peer and was not read yet.
#[derive(Default)]
pub(crate) struct Stream {
    held: Vec<u8>,
    at: usize,
}

impl Stream {
    /// Moves held bytes to the front of `out`; returns how many.
    fn take_into(&mut self, out: &mut [u8]) -> usize {
        let k = (self.held.len() - self.at).min(out.len());
        out[..k].copy_from_slice(&self.held[self.at..self.at + k]);
        self.at += k;
        if self.at == self.held.len() {
            self.held.clear();
            self.at = 0;
        }
        k
    }

    /// Keeps `rest` for the next receive (nothing is held when this is called).
    fn hold(&mut self, rest: &[u8]) {
        self.held.clear();
        self.held.extend_from_slice(rest);
        self.at = 0;
    }
}

/// Sends `data` to `dst` (nothing at all for no bytes, as a stream would).
pub(crate) fn send(comm: &Comm, dst: usize, data: &[u8]) -> Result<()> {
    if data.is_empty() {
        return Ok(());
    }
    let mut frame = [0u8; FRAME];
    frame[..8].copy_from_slice(&(data.len() as u64).to_le_bytes());
    if data.len() <= INLINE {
        frame[8..8 + data.len()].copy_from_slice(data);
        return comm.send(dst, &frame);
    }
    comm.send(dst, &frame)?;
    comm.send(dst, data)
}

/// Fills `out` from what `src` sent, in order, across as many sends as it takes.
pub(crate) fn recv(comm: &Comm, stream: &mut Stream, src: usize, out: &mut [u8]) -> Result<()> {
    let mut filled = stream.take_into(out);
    while filled < out.len() {
        let mut frame = [0u8; FRAME];
        comm.recv(src, &mut frame)?;
        let declared = u64::from_le_bytes(frame[..8].try_into().unwrap_or([0; 8]));
        let n = usize::try_from(declared).unwrap_or(usize::MAX);
        let want = out.len() - filled;
        if n == 0 {
            return Err(malformed(src, "declares an empty send"));
        }
        if n <= INLINE {
            let k = n.min(want);
            out[filled..filled + k].copy_from_slice(&frame[8..8 + k]);
            stream.hold(&frame[8 + k..8 + n]);
            filled += k;
        } else if n <= want {
            comm.recv(src, &mut out[filled..filled + n])?;
            filled += n;
        } else {
            let mut rest = Vec::new();
            if rest.try_reserve_exact(n).is_err() {
                return Err(malformed(
                    src,
                    &format!("declares {n} bytes, more than memory"),
                ));
            }
            rest.resize(n, 0);
            comm.recv(src, &mut rest)?;
            out[filled..].copy_from_slice(&rest[..want]);
            stream.held = rest;
            stream.at = want;
            filled += want;
        }
    }
    Ok(())
}

#[cold]
fn malformed(src: usize, what: &str) -> Error {
    Error::InvalidArgument(format!(
        "recv from rank {src}: its send frame {what} (is rank {src} running the same rdmacomm?)"
    ))
}
