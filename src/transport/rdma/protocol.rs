//! The credit protocol's accounting, pure (no device): which chunk a 16-bit count names, when a
//! writer may post, when a chunk may arrive, when a reader owes credits, which staging slots are
//! free. The data path calls these; the tests below run two ranks' accounting against each other
//! over a model network, past the 16-bit wrap.

/// `chunk_wr` of a chunk whose staging slot is free once posted (sent inline).
pub(super) const FREE_AT_POST: u64 = u64::MAX;

/// A peer's consumed count of our chunks from its low 16 bits (an immediate's or a mailbox
/// tag's): it lies at most `slots` below `sent`, the chunks we posted.
pub(super) fn below(sent: u64, low: u16) -> u64 {
    let behind = sent.wrapping_sub(u64::from(low)) & 0xffff;
    sent - behind.min(sent)
}

/// The chunk number at or above `consumed` whose low 16 bits are `low` (an arriving chunk lies
/// within `slots` above what the reader consumed).
pub(super) fn chunk_number(consumed: u64, low: u16) -> u64 {
    consumed + (u64::from(low).wrapping_sub(consumed) & 0xffff)
}

/// The immediate of chunk `k` from a writer that consumed `consumed` of the reader's chunks:
/// both counts' low 16 bits.
pub(super) fn immediate(k: u64, consumed: u64) -> u32 {
    (k & 0xffff) as u32 | ((consumed & 0xffff) as u32) << 16
}

/// Whether the reader's credits let chunk `k` go: it consumed chunk `k - slots`.
pub(super) fn has_credit(k: u64, credits: u64, slots: u64) -> bool {
    k < credits + slots
}

/// Whether chunk `k` may be posted: credits, and its staging slot is free (the write of chunk
/// `k - slots` is done).
pub(super) fn may_post(k: u64, credits: u64, send_done: u64, slots: u64) -> bool {
    has_credit(k, credits, slots) && k < send_done + slots
}

/// Whether chunk `k` may arrive: not before the next expected, within the credits given.
pub(super) fn arrival_ok(k: u64, next: u64, consumed: u64, slots: u64) -> bool {
    k >= next && k < consumed + slots
}

/// Whether a reader owes its writer a credit write: half its slots consumed unreported (the
/// writer then always has half its slots free or data waiting here, so batching cannot
/// deadlock).
pub(super) fn return_due(consumed: u64, returned: u64, slots: u64) -> bool {
    consumed - returned >= (slots / 2).max(1)
}

/// `send_done` advanced over the chunks, in order, whose staging slots are free: their write
/// completed (`chunk_wr` below `wr_done`) or they went inline ([`FREE_AT_POST`]).
pub(super) fn retired(mut send_done: u64, sent: u64, chunk_wr: &[u64], wr_done: u64) -> u64 {
    let slots = chunk_wr.len() as u64;
    while send_done < sent {
        let wr = chunk_wr[(send_done % slots) as usize];
        if wr != FREE_AT_POST && wr >= wr_done {
            break;
        }
        send_done += 1;
    }
    send_done
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    /// One rank's half of a link to one peer, as `PeerState` keeps it.
    struct End {
        slots: u64,
        // Writer side.
        sent: u64,
        send_done: u64,
        wr_posted: u64,
        wr_done: u64,
        chunk_wr: Vec<u64>,
        peer_consumed: u64,
        credit_word: u64,
        // Reader side.
        consumed: u64,
        returned: u64,
        next: u64,
        /// Unconsumed chunk numbers, by slot.
        held: Vec<Option<u64>>,
    }

    /// A write in flight on one direction's queue pair (RC: in order).
    enum Wire {
        Data { k: u64, imm: u32, wr: u64 },
        Credit { value: u64, wr: u64 },
    }

    impl End {
        fn new(slots: u64) -> End {
            End {
                slots,
                sent: 0,
                send_done: 0,
                wr_posted: 0,
                wr_done: 0,
                chunk_wr: vec![0; slots as usize],
                peer_consumed: 0,
                credit_word: 0,
                consumed: 0,
                returned: 0,
                next: 0,
                held: vec![None; slots as usize],
            }
        }

        fn try_post(&mut self, inline: bool, out: &mut VecDeque<Wire>) -> bool {
            let credits = self.credit_word.max(self.peer_consumed);
            if !may_post(self.sent, credits, self.send_done, self.slots) {
                return false;
            }
            let k = self.sent;
            let wr = self.wr_posted;
            self.chunk_wr[(k % self.slots) as usize] = if inline { FREE_AT_POST } else { wr };
            out.push_back(Wire::Data {
                k,
                imm: immediate(k, self.consumed),
                wr,
            });
            self.wr_posted += 1;
            self.returned = self.consumed;
            self.sent += 1;
            self.send_done = retired(self.send_done, self.sent, &self.chunk_wr, self.wr_done);
            true
        }

        fn try_take(&mut self, out: &mut VecDeque<Wire>) -> bool {
            let slot = (self.consumed % self.slots) as usize;
            let Some(k) = self.held[slot] else {
                return false;
            };
            assert_eq!(k, self.consumed, "chunks are taken in order");
            self.held[slot] = None;
            self.consumed += 1;
            if return_due(self.consumed, self.returned, self.slots) {
                self.returned = self.consumed;
                out.push_back(Wire::Credit {
                    value: self.consumed,
                    wr: self.wr_posted,
                });
                self.wr_posted += 1;
            }
            true
        }

        /// A write from the peer lands here.
        fn land(&mut self, w: &Wire) {
            match *w {
                Wire::Data { k: real, imm, .. } => {
                    let k = chunk_number(self.consumed, (imm & 0xffff) as u16);
                    assert_eq!(k, real, "the 16-bit number names the chunk");
                    assert!(arrival_ok(k, self.next, self.consumed, self.slots));
                    let slot = (k % self.slots) as usize;
                    assert!(
                        self.held[slot].is_none(),
                        "chunk {k} overwrote an unread one"
                    );
                    self.held[slot] = Some(k);
                    self.next = k + 1;
                    let low = (imm >> 16) as u16;
                    self.peer_consumed = self.peer_consumed.max(below(self.sent, low));
                }
                Wire::Credit { value, .. } => {
                    assert!(value <= self.sent, "credits for chunks never sent");
                    self.credit_word = value;
                }
            }
        }

        /// A write of ours completed (in order; `wr` is its number).
        fn complete(&mut self, wr: u64) {
            self.wr_done = self.wr_done.max(wr + 1);
            self.send_done = retired(self.send_done, self.sent, &self.chunk_wr, self.wr_done);
        }
    }

    fn wr_of(w: &Wire) -> u64 {
        match *w {
            Wire::Data { wr, .. } | Wire::Credit { wr, .. } => wr,
        }
    }

    /// Two ranks exchanging `total` chunks each way in random interleavings: nothing lands in
    /// an unread slot, every chunk is named right past the 16-bit wrap, and the exchange always
    /// finishes (no credit deadlock), with credits from immediates or credit writes alike.
    fn exchange(slots: u64, total: u64, seed: u64, one_way: bool) {
        let mut rng = seed | 1;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut ends = [End::new(slots), End::new(slots)];
        // wires[d]: writes from end d to end 1 - d, landed in order; done[d]: landed, not yet
        // completed at the writer.
        let mut wires: [VecDeque<Wire>; 2] = [VecDeque::new(), VecDeque::new()];
        let mut done: [VecDeque<u64>; 2] = [VecDeque::new(), VecDeque::new()];
        let goal = |d: usize| if one_way && d == 1 { 0 } else { total };
        let mut idle = 0;
        while !(0..2).all(|d| ends[1 - d].consumed == goal(d) && wires[d].is_empty()) {
            let d = (next() % 2) as usize;
            let moved = match next() % 4 {
                0 if ends[d].sent < goal(d) => {
                    let inline = next() % 3 == 0;
                    let (a, b) = wires.split_at_mut(1);
                    ends[d].try_post(inline, if d == 0 { &mut a[0] } else { &mut b[0] })
                }
                1 => match wires[d].pop_front() {
                    Some(w) => {
                        ends[1 - d].land(&w);
                        done[d].push_back(wr_of(&w));
                        true
                    }
                    None => false,
                },
                2 => {
                    let (a, b) = wires.split_at_mut(1);
                    ends[d].try_take(if d == 0 { &mut a[0] } else { &mut b[0] })
                }
                _ => match done[d].pop_front() {
                    Some(wr) => {
                        ends[d].complete(wr);
                        true
                    }
                    None => false,
                },
            };
            idle = if moved { 0 } else { idle + 1 };
            assert!(idle < 10_000, "stuck: no step can move (credit deadlock)");
        }
    }

    #[test]
    fn two_ranks_past_the_16_bit_wrap() {
        for (slots, seed) in [(2, 1), (4, 7), (8, 99), (16, 12345)] {
            exchange(slots, 70_000, seed, false);
        }
    }

    #[test]
    fn one_way_lives_on_credit_writes_alone() {
        for (slots, seed) in [(2, 3), (4, 5), (256, 11)] {
            exchange(slots, 70_000, seed, true);
        }
    }

    #[test]
    fn counts_from_16_bits() {
        // The consumed count we learn lies at most 0xffff below what we sent.
        assert_eq!(below(70_000, (70_000u64 & 0xffff) as u16), 70_000);
        assert_eq!(below(70_000, ((70_000u64 - 3) & 0xffff) as u16), 69_997);
        assert_eq!(below(2, 0xffff), 0, "never below zero");
        assert_eq!(chunk_number(65_535, 0), 65_536);
        assert_eq!(chunk_number(65_536, 3), 65_539);
        assert_eq!(immediate(65_537, 0x1_0002), 1 | 2 << 16);
        assert!(has_credit(7, 4, 4) && !has_credit(8, 4, 4));
        assert!(
            !may_post(5, 4, 1, 4),
            "staging slot of chunk 1 not free yet"
        );
        assert!(return_due(3, 1, 4) && !return_due(2, 1, 4));
        assert!(return_due(1, 0, 1), "one slot: every take returns");
        let wr = [FREE_AT_POST, 5, 9, FREE_AT_POST];
        assert_eq!(retired(0, 4, &wr, 6), 2, "the write of chunk 2 is not done");
        assert_eq!(retired(0, 4, &wr, 10), 4);
    }
}
