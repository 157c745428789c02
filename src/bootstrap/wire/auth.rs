//! Authentication at the rendezvous: nonces, HMAC-SHA256 tags and their check.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of a nonce, a session key and a MAC.
pub const KEY: usize = 32;
/// HMAC-SHA256 of `parts` under `key`.
pub fn mac(key: &[u8], parts: &[&[u8]]) -> [u8; KEY] {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes any key length");
    for p in parts {
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

/// Whether `tag` is the HMAC of `parts` under `key` (in constant time).
pub fn mac_ok(key: &[u8], parts: &[&[u8]], tag: &[u8]) -> bool {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes any key length");
    for p in parts {
        m.update(p);
    }
    m.verify_slice(tag).is_ok()
}

/// SHA-256 of `bytes` (what a MAC covers in place of a long message).
pub fn digest(bytes: &[u8]) -> [u8; KEY] {
    use sha2::Digest;
    Sha256::digest(bytes).into()
}

/// `N` random bytes from the kernel.
pub fn random<const N: usize>() -> [u8; N] {
    crate::sys::random()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_bind_key_and_every_byte() {
        let t = mac(b"k", &[b"ab", b"c"]);
        assert!(mac_ok(b"k", &[b"abc"], &t));
        assert!(!mac_ok(b"K", &[b"abc"], &t));
        assert!(!mac_ok(b"k", &[b"abd"], &t));
        assert_ne!(random::<KEY>(), random::<KEY>());
    }
}
