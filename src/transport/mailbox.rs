//! The byte layout of a mailbox chunk: a chunk of at most [`MAX_PAYLOAD`] bytes written by one
//! plain RDMA WRITE into a fixed 64-byte entry at the reader, which finds it by reading memory
//! instead of polling a completion.
//!
//! The write ends where the entry ends: the payload, then one 8-byte tag that names the chunk
//! and carries the writer's consumed count of the reader's chunks (credits ride along): its low
//! 8 bits the length, the next 16 the consumed count's low 16 bits (the reader completes it, as
//! it does an immediate's), the top 40 `k + 1` for chunk number `k`. The reader knows the chunk
//! has landed when the entry's last word names the chunk it expects: tags start at 1 and the
//! reader's buffer starts zeroed, so an entry never written names no chunk, and an entry's
//! previous chunk (`k - slots`) names another. The entry is one aligned cache line, so the scheme
//! relies on a write's bytes within one cache line landing together or in address order (rxe
//! copies them forward; an HCA writes them to host memory as one PCIe write), not on any order
//! across lines. Few bytes on the wire matter here: on soft-RoCE in the VM each byte of a small
//! write costs time (flagging every line instead, as NCCL's LL protocols do, doubled a 64-byte
//! write and made it slower than a write with an immediate), which is why the trailer is one
//! word.

/// Bytes of one mailbox entry: one cache line.
pub const ENTRY: usize = 64;
/// Bytes after the payload: the tag.
pub const TRAILER: usize = 8;
/// The largest chunk a mailbox carries.
pub const MAX_PAYLOAD: usize = ENTRY - TRAILER;

/// Chunk numbers as the tag keeps them.
const K_BITS: u32 = 40;

/// The tag that ends chunk `k` of `len` bytes, written by a rank that has consumed `consumed`
/// of the reader's chunks.
pub fn tag(k: u64, len: usize, consumed: u64) -> u64 {
    debug_assert!(len <= MAX_PAYLOAD);
    ((k + 1) & ((1 << K_BITS) - 1)) << 24 | (consumed & 0xffff) << 8 | len as u64
}

/// The length a tag gives, if it names chunk `k`.
pub fn tag_len(tag: u64, k: u64) -> Option<usize> {
    (tag >> 24 == (k + 1) & ((1 << K_BITS) - 1)).then_some((tag & 0xff) as usize)
}

/// The low 16 bits of the writer's consumed count, from a tag.
pub fn tag_consumed(tag: u64) -> u16 {
    (tag >> 8) as u16
}

/// Lays chunk `k` (`payload`, at most [`MAX_PAYLOAD`] bytes) and the writer's `consumed` count
/// into `out`; returns how many bytes to write, to the entry's end.
pub fn encode(k: u64, consumed: u64, payload: &[u8], out: &mut [u8]) -> usize {
    let n = payload.len();
    assert!(n <= MAX_PAYLOAD, "mailbox payload too long");
    out[..n].copy_from_slice(payload);
    out[n..n + 8].copy_from_slice(&tag(k, n, consumed).to_le_bytes());
    n + TRAILER
}

/// Where in an entry a write of `wire` bytes (from [`encode`]) starts.
pub fn write_offset(wire: usize) -> usize {
    ENTRY - wire
}

/// The payload range within an entry of a chunk of `len` bytes.
pub fn payload(len: usize) -> std::ops::Range<usize> {
    MAX_PAYLOAD - len..MAX_PAYLOAD
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_length_lands_at_the_entry_end_and_round_trips() {
        for len in 0..=MAX_PAYLOAD {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + len + 1) as u8).collect();
            let mut staged = [0u8; ENTRY];
            let k = 1000 + len as u64;
            let wire = encode(k, 70_000 + len as u64, &data, &mut staged);
            assert_eq!(wire, len + TRAILER);
            // What the peer's entry holds after the write: its old bytes, then the write.
            let mut entry = [0xEEu8; ENTRY];
            entry[write_offset(wire)..].copy_from_slice(&staged[..wire]);
            assert!(entry[..write_offset(wire)].iter().all(|&b| b == 0xEE));
            let t = u64::from_le_bytes(entry[ENTRY - 8..].try_into().unwrap());
            assert_eq!(tag_len(t, k), Some(len), "len {len}");
            assert_eq!(&entry[payload(len)], &data[..], "len {len}");
            assert_eq!(tag_consumed(t), (70_000 + len as u64) as u16, "len {len}");
        }
    }

    #[test]
    fn a_tag_names_one_chunk_only() {
        let t = tag(41, 48, 5);
        assert_eq!(tag_len(t, 41), Some(48));
        // The entry's previous chunk (k - slots), the next, and a zeroed entry never match.
        assert_eq!(tag_len(t, 37), None);
        assert_eq!(tag_len(t, 42), None);
        assert_eq!(tag_len(0, 0), None);
    }
}
