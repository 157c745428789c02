//! `split` and `dup`: a subgroup's members, its transports chosen from where they are, its
//! cards exchanged over the parent, and a set-up failure told to the parent's other ranks.

use super::*;

impl Comm {
    /// All-gathers `input` as step `step` of a split.
    pub(super) fn split_step(&self, step: u8, input: &[u8], output: &mut [u8]) -> Result<()> {
        check_all_gather(self.size, input, output)?;
        let n = input.len();
        let desc = OpDesc {
            algo: step,
            ..OpDesc::new(OpKind::Split, n)
        };
        self.with_link(desc, Partners::All, |l, _| {
            crate::copy::copy(&mut output[l.rank() * n..(l.rank() + 1) * n], input);
            ring::all_gather(l, output)
        })
    }

    /// Splits into subgroups (MPI_Comm_split / MLX's split), collectively over every rank of
    /// this communicator: ranks with the same `color` form one, ordered by `key` (ties by rank
    /// here). A negative color means "in no subgroup": that rank gets a world of one. The ranks'
    /// cards are exchanged over this communicator; each subgroup gets its own side channel
    /// (for abort and health) at its first rank, whose address also goes over this
    /// communicator. The result is independent of this one: either can be used or dropped first.
    pub fn split_comm(&self, color: i32, key: i32) -> Result<Comm> {
        if self.size == 1 {
            // A world of one splits (and dups) into a world of one.
            self.alone("split")?;
            return Ok(Comm::with_link_of(self.cfg.clone(), None, self.algorithm()));
        }
        self.check_thread(&"split")?;
        self.split_setup(color, key)
            .map_err(|e| self.set_up_failed(e))
    }

    /// A rank that failed setting up its subgroup (not in this communicator's operations, whose
    /// failures are told already) tells the others, who may wait on it in the split's steps.
    #[cold]
    fn set_up_failed(&self, e: Error) -> Error {
        if self.check_usable().is_ok() {
            let why = format!(
                "rank {} could not set up its subgroup in split: {e}",
                self.me.rank
            );
            self.end_and_tell(Poison(Error::Poisoned(why.clone())), &why);
        }
        e
    }

    /// [`Comm::split_comm`] beyond a world of one, from the owning thread.
    fn split_setup(&self, color: i32, key: i32) -> Result<Comm> {
        let (n, r) = (self.size, self.rank);
        let mut mine = [0u8; 8];
        mine[..4].copy_from_slice(&color.to_le_bytes());
        mine[4..].copy_from_slice(&key.to_le_bytes());
        let mut all = vec![0u8; 8 * n];
        self.split_step(1, &mine, &mut all)?;
        let entry = |q: usize| {
            let e = &all[8 * q..8 * q + 8];
            (
                i32::from_le_bytes(e[..4].try_into().unwrap()),
                i32::from_le_bytes(e[4..].try_into().unwrap()),
            )
        };
        let mut members: Vec<usize> = if color < 0 {
            vec![r]
        } else {
            (0..n).filter(|&q| entry(q).0 == color).collect()
        };
        members.sort_by_key(|&q| (entry(q).1, q));
        let sub_rank = members
            .iter()
            .position(|&q| q == r)
            .expect("a member of its own group");
        let grouped = members.len() > 1;
        // The subgroup's first rank listens for its side channel; everyone learns the address.
        let my_ip = self.my_ip();
        let mut listener = None;
        let mut field = [0u8; 64];
        if grouped && sub_rank == 0 {
            let l = crate::bootstrap::listen((my_ip.as_str(), 0))
                .map_err(|e| Error::Bootstrap(format!("split: cannot listen on {my_ip}: {e}")))?;
            let text = l.local_addr()?.to_string();
            field[..text.len()].copy_from_slice(text.as_bytes());
            listener = Some(l);
        }
        let mut fields = vec![0u8; 64 * n];
        self.split_step(2, &field, &mut fields)?;
        let lead = members[0];
        let lead_addr = String::from_utf8_lossy(&fields[64 * lead..64 * lead + 64])
            .trim_end_matches('\0')
            .to_string();
        // The subgroup's own count of members on this host, not the launcher's count for the
        // world: one rank per host of a 2 x 2 job is no group for shared memory alone.
        let sub_cfg = self.cfg.for_group(
            sub_rank,
            members.len(),
            lead_addr,
            self.members_here(&members),
        );
        // Cards over this communicator: every rank takes part, even one that joins no subgroup.
        let exchange = |card: &[u8]| -> Result<Vec<Vec<u8>>> {
            let mut lens = vec![0u8; 4 * n];
            self.split_step(3, &(card.len() as u32).to_le_bytes(), &mut lens)?;
            let len_of =
                |q: usize| u32::from_le_bytes(lens[4 * q..4 * q + 4].try_into().unwrap()) as usize;
            let max = (0..n).map(len_of).max().unwrap_or(0);
            let mut padded = card.to_vec();
            padded.resize(max, 0);
            let mut cards = vec![0u8; max * n];
            self.split_step(4, &padded, &mut cards)?;
            Ok(members
                .iter()
                .map(|&q| cards[q * max..q * max + len_of(q)].to_vec())
                .collect::<Vec<_>>())
        };
        // A card as bytes: its common part's length and bytes, its entry size, its entries.
        let flatten = |c: &Card| {
            let mut v = (c.common.len() as u32).to_le_bytes().to_vec();
            v.extend_from_slice(&c.common);
            v.extend_from_slice(&(c.entry as u32).to_le_bytes());
            v.extend_from_slice(&c.each);
            v
        };

        if !grouped {
            exchange(&flatten(&Card::default()))?;
            let cfg = Config {
                rank: 0,
                world_size: 1,
                ..sub_cfg
            };
            return Comm::new(&cfg);
        }
        let kind = self.cfg.transport;
        let meet_cfg = sub_cfg.clone();
        let link = transport::connect_with(&sub_cfg, kind, &mut |card| {
            let cards = exchange(&flatten(card))?
                .iter()
                .zip(&members)
                .map(|(b, &q)| entry_of(b, members.len(), sub_rank, q))
                .collect::<Result<Vec<_>>>()?;
            let mut rv = crate::bootstrap::rendezvous::rendezvous_on(
                &meet_cfg,
                &Card::default(),
                listener.take(),
            )?;
            rv.cards = cards;
            Ok(rv)
        })?;
        Ok(Comm::with_link_of(sub_cfg, Some(link), self.algorithm()))
    }

    /// How many of `members` (ranks of this communicator) share this rank's host, where the
    /// link knows: every one over shared memory alone, else as its hosts say; `None` where it
    /// cannot tell (a subgroup then finds out at its own rendezvous).
    pub(super) fn members_here(&self, members: &[usize]) -> Option<usize> {
        let g = self.lock();
        let props = g.link.as_ref()?.props();
        if props.shares_memory {
            return Some(members.len());
        }
        let hosts = props.hosts.as_deref()?;
        let mine = *hosts.get(self.link_rank(self.rank))?;
        Some(
            members
                .iter()
                .filter(|&&q| hosts.get(self.link_rank(q)) == Some(&mine))
                .count(),
        )
    }
}

/// What member `sub_rank` of a subgroup of `n` takes of the flattened card `b` that parent rank
/// `from` sent: its common part and its entry, once the card's geometry checks out (an error
/// naming the sender otherwise, never a panic).
fn entry_of(b: &[u8], n: usize, sub_rank: usize, from: usize) -> Result<Vec<u8>> {
    let bad = |why: &str| Error::PeerFailed {
        peer: crate::Peer {
            rank: from,
            addr: String::new(),
        },
        reason: format!("rank {from} sent a malformed card for the split: {why}"),
    };
    let mut r = crate::bootstrap::Reader(b);
    let common = r.bytes().map_err(|_| bad("truncated"))?.to_vec();
    let entry = r.u32().map_err(|_| bad("truncated"))? as usize;
    if entry.checked_mul(n) != Some(r.0.len()) {
        return Err(bad(&format!(
            "{} bytes of entries, not {n} of {entry}",
            r.0.len()
        )));
    }
    let card = Card {
        common,
        entry,
        each: r.0.to_vec(),
    };
    card.for_rank(sub_rank)
        .ok_or_else(|| bad("no entry for this rank"))
}

#[cfg(test)]
mod card_tests {
    use super::*;

    #[test]
    fn a_malformed_card_is_an_error_naming_its_sender() {
        let mut b = 2u32.to_le_bytes().to_vec();
        b.extend_from_slice(&[7, 7]);
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&[1, 2, 3, 4, 5, 6]);
        assert_eq!(entry_of(&b, 2, 1, 5).unwrap(), vec![7, 7, 4, 5, 6]);
        for (n, sub) in [(3, 0), (1, 0), (2, 2)] {
            let e = entry_of(&b, n, sub, 5).unwrap_err().to_string();
            assert!(e.contains("rank 5 sent a malformed card"), "{n} {sub}: {e}");
        }
        let mut huge = 0u32.to_le_bytes().to_vec();
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(entry_of(&huge, usize::MAX, 0, 1).is_err());
        assert!(entry_of(&[1], 2, 0, 1).is_err());
    }
}
