//! A seeded xorshift for the transports' randomized tests: the same draws on every run, and no
//! dependency.

/// A xorshift64 stream.
pub(crate) struct Rng(u64);

impl Rng {
    /// A stream from `seed` (non-zero).
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// The next draw, below `m`.
    pub(crate) fn below(&mut self, m: u64) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x % m
    }
}
