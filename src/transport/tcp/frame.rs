//! Frames on a TCP connection: headers, padding to 64 bytes, and the send and receive queues
//! a non-blocking socket needs.

/// What is left of the last chunk after a non-blocking write took only part of it. The socket's
/// own buffer is the send queue: a new chunk is accepted only when this is empty, so at most
/// one partial chunk is ever copied, and a full socket turns into back-pressure on the caller.
#[derive(Default)]
pub(super) struct OutQueue {
    pub(super) buf: Vec<u8>,
    /// Bytes of `buf` already written.
    pub(super) head: usize,
}

impl OutQueue {
    pub(super) fn is_empty(&self) -> bool {
        self.head == self.buf.len()
    }

    /// Notes `k` more bytes written.
    pub(super) fn advance(&mut self, k: usize) {
        self.head += k;
        if self.is_empty() {
            self.buf.clear();
            self.head = 0;
        }
    }

    /// Keeps what is left of a frame (`parts` in order) after `done` of its bytes were written.
    pub(super) fn keep_rest(&mut self, parts: &[&[u8]], mut done: usize) {
        for part in parts {
            let skip = done.min(part.len());
            self.buf.extend_from_slice(&part[skip..]);
            done -= skip;
        }
    }
}

/// Bytes of a frame's header: the payload's length (u32, little-endian), then zeros. 64, so that
/// payloads start 64-byte aligned in the socket's pages (measured: docs/DESIGN.md, "Measured
/// reasons in the code").
pub(super) const HDR: usize = 64;

/// Where the operation's descriptor ([`op::WIRE`] bytes) sits in a frame's header.
pub(super) const OP_AT: usize = 8;

/// Zeros that pad a frame to a multiple of 64 bytes.
pub(super) const PAD: [u8; 64] = [0; 64];

/// Zero bytes after a `len`-byte payload.
pub(super) fn pad(len: usize) -> usize {
    len.next_multiple_of(64) - len
}

/// Bytes received on one connection and not yet taken, in a buffer of fixed capacity that is
/// read into directly (no intermediate copy); unconsumed bytes move to its front only when the
/// room behind them is too small for a whole chunk.
pub(super) struct InQueue {
    buf: Vec<u8>,
    start: usize,
    pub(super) end: usize,
}

impl InQueue {
    /// Bytes it holds allocated.
    pub(super) fn capacity(&self) -> usize {
        self.buf.len()
    }

    pub(super) fn new(cap: usize) -> InQueue {
        InQueue {
            buf: vec![0; cap],
            start: 0,
            end: 0,
        }
    }

    pub(super) fn pending(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// The length of the next chunk, once its header is here; an error if it exceeds `max`.
    pub(super) fn next_len(&self, max: usize) -> std::result::Result<Option<usize>, String> {
        let p = self.pending();
        if p.len() < HDR {
            return Ok(None);
        }
        let len = u32::from_le_bytes(p[..4].try_into().expect("4 bytes")) as usize;
        if len > max {
            return Err(format!(
                "sent a {len}-byte chunk, more than the {max} agreed: corrupt stream"
            ));
        }
        Ok(Some(len))
    }

    pub(super) fn consume(&mut self, k: usize) {
        self.start += k;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    /// The free room to read into, making room for `want` bytes first if needed; empty when
    /// the buffer is full of unconsumed bytes (back-pressure: TCP's window then holds the sender).
    pub(super) fn room(&mut self, want: usize) -> &mut [u8] {
        if self.buf.len() - self.end < want && self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        &mut self.buf[self.end..]
    }
}

#[cfg(test)]
mod tests {
    use super::{pad, InQueue, OutQueue, HDR};

    #[test]
    fn out_queue_keeps_exactly_the_unwritten_rest() {
        let (header, data, tail) = (7u32.to_le_bytes(), *b"abcdefg", [0u8; 3]);
        let parts = [&header[..], &data[..], &tail[..]];
        let want = parts.concat();
        for done in 0..=want.len() {
            let mut q = OutQueue::default();
            if done < want.len() {
                q.keep_rest(&parts, done);
            }
            assert_eq!(
                &q.buf[q.head..],
                &want[done..],
                "after {done} bytes written"
            );
            q.advance(q.buf.len() - q.head);
            assert!(q.is_empty() && q.buf.is_empty() && q.head == 0);
        }
    }

    #[test]
    fn frames_are_whole_multiples_of_64_bytes() {
        for len in [0, 1, 8, 63, 64, 65, 4096, 65407, 65408] {
            let frame = HDR + len + pad(len);
            assert_eq!(frame % 64, 0, "{len}-byte payload");
            assert!(pad(len) < 64, "{len}-byte payload");
        }
    }

    #[test]
    fn in_queue_compacts_only_when_a_chunk_would_not_fit() {
        let mut q = InQueue::new(16);
        q.room(8)[..10].copy_from_slice(b"0123456789");
        q.end += 10;
        q.consume(6);
        // 6 bytes free behind the 4 pending: enough for 6, so nothing moves.
        assert_eq!(q.room(6).len(), 6);
        assert_eq!((q.start, q.pending()), (6, &b"6789"[..]));
        // 8 do not fit behind: the pending bytes move to the front.
        assert_eq!(q.room(8).len(), 12);
        assert_eq!((q.start, q.pending()), (0, &b"6789"[..]));
        q.consume(4);
        assert_eq!((q.start, q.end), (0, 0));
    }
}
