//! What a joiner says at the rendezvous: its card (what its transport brings) and its HELLO,
//! and their codecs.

use crate::bootstrap::wire::auth::KEY;
use crate::bootstrap::wire::{put_bytes, Reader, MAGIC, VERSION};
use crate::config::Config;

/// What a transport brings to the rendezvous: bytes for every peer (`common`) and, for each peer
/// in rank order, `entry` bytes meant for it alone (`each`, `n * entry` bytes).
#[derive(Debug, Clone, Default)]
pub struct Card {
    /// Bytes every rank receives.
    pub common: Vec<u8>,
    /// Bytes per peer in `each`.
    pub entry: usize,
    /// `entry` bytes for each rank, in rank order.
    pub each: Vec<u8>,
}

impl Card {
    /// What rank `to` receives of this card: the common bytes, then its entry.
    /// `None` where the card has no entry for `to` (a malformed card from a peer).
    pub fn for_rank(&self, to: usize) -> Option<Vec<u8>> {
        let start = to.checked_mul(self.entry)?;
        let entry = self.each.get(start..start.checked_add(self.entry)?)?;
        let mut v = self.common.clone();
        v.extend_from_slice(entry);
        Some(v)
    }
}

/// A HELLO, as read.
pub(super) struct Hello {
    pub version: u16,
    pub job: String,
    pub rank: usize,
    pub size: usize,
    pub card: Card,
    pub addr: String,
    /// Where it takes its table from the rank that passes it on (`fanout.rs`); 0: from rank 0.
    pub port: u16,
    pub settings: String,
    pub error: String,
    pub nonce: [u8; KEY],
}

pub(super) fn encode_hello(
    cfg: &Config,
    card: &Card,
    error: &str,
    nonce: &[u8; KEY],
    port: u16,
) -> Vec<u8> {
    let mut h = Vec::new();
    h.extend_from_slice(&(MAGIC ^ VERSION as u32).to_le_bytes());
    put_bytes(&mut h, cfg.job_id.as_bytes());
    h.extend_from_slice(&(cfg.rank as u32).to_le_bytes());
    h.extend_from_slice(&(cfg.world_size as u32).to_le_bytes());
    put_bytes(&mut h, &card.common);
    h.extend_from_slice(&(card.entry as u32).to_le_bytes());
    put_bytes(&mut h, &card.each);
    put_bytes(&mut h, cfg.bind_addr.as_deref().unwrap_or("").as_bytes());
    h.extend_from_slice(&port.to_le_bytes());
    put_bytes(&mut h, cfg.shared_settings().as_bytes());
    put_bytes(&mut h, error.as_bytes());
    h.extend_from_slice(nonce);
    h
}

/// Reads a HELLO body (without its MAC); `None` for bytes that are not one (of any version:
/// `Some` with another `version` when only the version differs).
pub(super) fn decode_hello(b: &[u8]) -> Option<Hello> {
    let mut r = Reader(b);
    let magic = r.u32().ok()?;
    if magic & 0xffff_0000 != MAGIC & 0xffff_0000 {
        return None;
    }
    let version = (magic ^ MAGIC) as u16;
    let blank = || Hello {
        version,
        job: String::new(),
        rank: 0,
        size: 0,
        card: Card::default(),
        addr: String::new(),
        port: 0,
        settings: String::new(),
        error: String::new(),
        nonce: [0; KEY],
    };
    if version != VERSION {
        return Some(blank());
    }
    let job = String::from_utf8_lossy(r.bytes().ok()?).into_owned();
    let (rank, size) = (r.u32().ok()? as usize, r.u32().ok()? as usize);
    let common = r.bytes().ok()?.to_vec();
    let entry = r.u32().ok()? as usize;
    let each = r.bytes().ok()?.to_vec();
    if entry.checked_mul(size)? != each.len() {
        return None;
    }
    let addr = String::from_utf8_lossy(r.bytes().ok()?).into_owned();
    let port = u16::from_le_bytes(r.take(2).ok()?.try_into().ok()?);
    let settings = String::from_utf8_lossy(r.bytes().ok()?).into_owned();
    let error = String::from_utf8_lossy(r.bytes().ok()?).into_owned();
    let nonce = r.take(KEY).ok()?.try_into().ok()?;
    if !r.0.is_empty() {
        return None;
    }
    Some(Hello {
        job,
        rank,
        size,
        card: Card {
            common,
            entry,
            each,
        },
        addr,
        port,
        settings,
        error,
        nonce,
        ..blank()
    })
}

/// The first `NAME=value` word of `theirs` that differs from `ours`, with ours.
pub(super) fn first_difference(theirs: &str, ours: &str) -> Option<(String, String)> {
    let mine: Vec<&str> = ours.split_whitespace().collect();
    for w in theirs.split_whitespace() {
        let name = w.split('=').next().unwrap_or(w);
        let our = mine
            .iter()
            .find(|m| m.split('=').next() == Some(name))
            .copied()
            .unwrap_or("(unset)");
        if our != w {
            return Some((w.to_string(), our.to_string()));
        }
    }
    (theirs.split_whitespace().count() != mine.len())
        .then(|| (theirs.to_string(), ours.to_string()))
}

pub(super) fn encode_card(card: &Card) -> Vec<u8> {
    let mut v = Vec::new();
    put_bytes(&mut v, &card.common);
    v.extend_from_slice(&(card.entry as u32).to_le_bytes());
    put_bytes(&mut v, &card.each);
    v
}

pub(super) fn decode_card(b: &[u8], n: usize) -> Option<Card> {
    let mut r = Reader(b);
    let common = r.bytes().ok()?.to_vec();
    let entry = r.u32().ok()? as usize;
    let each = r.bytes().ok()?.to_vec();
    (r.0.is_empty() && entry.checked_mul(n)? == each.len()).then_some(Card {
        common,
        entry,
        each,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hello_round_trips_and_garbage_is_no_hello() {
        let mut cfg = Config::defaults(3, 5, "127.0.0.1:1");
        cfg.job_id = "job-7".into();
        let card = Card {
            common: vec![1, 2, 3],
            entry: 2,
            each: (0..10).collect(),
        };
        let b = encode_hello(&cfg, &card, "", &[9; KEY], 4321);
        let h = decode_hello(&b).expect("a hello");
        assert_eq!((h.version, h.rank, h.size, h.port), (VERSION, 3, 5, 4321));
        assert_eq!(h.job, "job-7");
        assert_eq!(h.card.for_rank(4), Some(vec![1, 2, 3, 8, 9]));
        assert_eq!(h.card.for_rank(5), None, "past the entries");
        assert_eq!(h.nonce, [9; KEY]);
        for cut in [0, 3, 4, 10, b.len() - 1] {
            assert!(decode_hello(&b[..cut]).is_none(), "cut at {cut}");
        }
        assert!(
            decode_hello(&[2, 0, 0, 0, 1, 0]).is_none(),
            "six stray bytes"
        );
        let mut other = b.clone();
        other[0] ^= 1; // another version
        assert_eq!(decode_hello(&other).map(|h| h.version), Some(VERSION ^ 1));
        let c = decode_card(&encode_card(&card), 5).expect("a card");
        assert_eq!(
            (&c.common, c.entry, &c.each),
            (&card.common, card.entry, &card.each)
        );
        assert!(
            decode_card(&encode_card(&card), 4).is_none(),
            "entries for 5, not 4"
        );
    }
}
