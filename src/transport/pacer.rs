//! How a transport waits: spin, then yield the core, then back off (a nap, or blocking in
//! `poll(2)`), and when a wait has gone on for the timeout without progress.
//!
//! The clock is read sparingly: not at all in the first [`CLOCK_EVERY`] idle polls of a wait,
//! then once every [`CLOCK_EVERY`] polls (every poll once backing off). Where the clocksource
//! traps (HPET under an emulated CPU, as in the soft-RoCE VM), one clock read costs microseconds,
//! and reading it on every poll took a visible share of a small operation's time.

use std::time::{Duration, Instant};

/// Idle polls between clock reads while spinning or yielding.
pub const CLOCK_EVERY: u32 = 32;

/// Whether more ranks share this rank's host than it has cores: then a waiting rank should
/// yield at once rather than spin on a core another rank needs. The ranks on this host are those
/// with its address in `addrs`, or as many as the launcher says it started here (`launched`,
/// [`crate::Config::local_world`]) where that is more.
pub fn oversubscribed(addrs: &[String], rank: usize, launched: Option<usize>) -> bool {
    let same_addr = addrs.iter().filter(|a| **a == addrs[rank]).count();
    let local = same_addr.max(launched.unwrap_or(0));
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    local > cores
}

/// The pacer a `poll` setting asks for: with `auto`, spin for `spin` (not at all when more local
/// ranks than cores share the host: `crowded`), then yield until `yield_until` of idleness, then
/// back off; `spin` never stops spinning; `yield` never spins.
pub fn for_setting(
    poll: crate::config::Poll,
    timeout: Duration,
    crowded: bool,
    spin: Duration,
    yield_until: Duration,
) -> Pacer {
    use crate::config::Poll;
    match poll {
        Poll::Spin => Pacer::new(timeout, Duration::MAX, Duration::MAX),
        Poll::Yield => Pacer::new(timeout, Duration::ZERO, yield_until),
        Poll::Auto if crowded => Pacer::new(timeout, Duration::ZERO, yield_until),
        Poll::Auto => Pacer::new(timeout, spin, yield_until),
    }
}

/// What a waiting transport should do after a poll that found nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Poll again at once.
    Spin,
    /// Give the core to another runnable thread, then poll again.
    Yield,
    /// Sleep or block briefly (the transport's own way), then poll again.
    BackOff,
    /// Nothing has happened for the timeout.
    Expired,
}

/// The waiting policy and the no-progress deadline of one transport.
#[derive(Debug)]
pub struct Pacer {
    timeout: Duration,
    spin: Duration,
    yield_until: Duration,
    /// Idle polls since the last progress (saturating).
    idle_polls: u32,
    /// Idle polls since the clock was last read (wraps every [`CLOCK_EVERY`]).
    since_read: u32,
    /// Progress happened since the clock was last read.
    progressed: bool,
    /// When progress was last seen (at a clock read).
    last_progress: Instant,
    /// When the current idle stretch was first seen on the clock.
    idle_since: Instant,
    /// The phase chosen at the last clock read.
    phase: Wait,
    /// The last clock read.
    last_read: Instant,
    /// Whether the last [`Pacer::idle`] read the clock.
    read: bool,
}

impl Pacer {
    /// Spin for `spin` (zero: yield from the first idle poll), then yield until `yield_until`
    /// of idleness, then back off; `Duration::MAX` as `spin` never stops spinning. Expires after `timeout` without progress.
    pub fn new(timeout: Duration, spin: Duration, yield_until: Duration) -> Pacer {
        let now = Instant::now();
        Pacer {
            timeout,
            spin,
            yield_until,
            idle_polls: 0,
            since_read: 0,
            progressed: true,
            last_progress: now,
            idle_since: now,
            phase: Wait::Spin,
            last_read: now,
            read: false,
        }
    }

    /// Something moved (no clock read).
    #[inline]
    pub fn progress(&mut self) {
        self.idle_polls = 0;
        self.since_read = 0;
        self.progressed = true;
    }

    /// An operation starts: its wait is measured from here (at the next clock read).
    #[inline]
    pub fn begin(&mut self) {
        self.progress();
    }

    /// How long the wait had gone without progress at the last clock read.
    pub fn stalled_for(&self) -> Duration {
        if self.progressed {
            return Duration::ZERO;
        }
        self.last_read.saturating_duration_since(self.last_progress)
    }

    /// Whether the last [`Pacer::idle`] read the clock (every [`CLOCK_EVERY`] polls at most
    /// while spinning or yielding, on every poll while backing off).
    pub fn just_read(&self) -> bool {
        self.read
    }

    /// Changes the timeout (e.g. shorter at teardown).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// A poll found nothing: what to do now.
    pub fn idle(&mut self) -> Wait {
        self.read = false;
        self.idle_polls = self.idle_polls.saturating_add(1);
        if self.idle_polls < CLOCK_EVERY {
            // Not timed yet: spin, or yield at once when told not to spin at all.
            return if self.spin.is_zero() {
                Wait::Yield
            } else {
                Wait::Spin
            };
        }
        // Counted apart from idle_polls, which stops at u32::MAX: the clock is read every
        // CLOCK_EVERY polls however long the wait, so a spinning wait still times out.
        self.since_read += 1;
        let first = self.idle_polls == CLOCK_EVERY;
        let read = first || self.phase == Wait::BackOff || self.since_read >= CLOCK_EVERY;
        if !read {
            return self.phase;
        }
        self.since_read = 0;
        self.read = true;
        let now = Instant::now();
        self.last_read = now;
        if self.progressed {
            self.progressed = false;
            self.last_progress = now;
        }
        if first {
            self.idle_since = now;
        }
        if now.duration_since(self.last_progress) > self.timeout {
            return Wait::Expired;
        }
        let idle = now.duration_since(self.idle_since);
        self.phase = if idle < self.spin {
            Wait::Spin
        } else if idle < self.yield_until {
            Wait::Yield
        } else {
            Wait::BackOff
        };
        self.phase
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crowded_by_addresses_or_by_the_launchers_count() {
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        let two: Vec<String> = vec!["a".into(), "b".into()];
        assert!(!oversubscribed(&two, 0, None));
        assert!(!oversubscribed(&two, 0, Some(cores)));
        // Ranks the test gave addresses of their own that all run on this machine.
        assert!(oversubscribed(&two, 0, Some(cores + 1)));
        let same: Vec<String> = vec!["a".into(); cores + 1];
        assert!(oversubscribed(&same, 0, None));
    }

    #[test]
    fn phases_follow_idle_time_and_progress_resets_them() {
        let ms = Duration::from_millis;
        let mut p = Pacer::new(ms(400), ms(20), ms(60));
        assert_eq!(p.idle(), Wait::Spin);
        let mut seen = Vec::new();
        let t0 = Instant::now();
        while t0.elapsed() < ms(150) {
            let w = p.idle();
            if seen.last() != Some(&w) {
                seen.push(w);
            }
            if w == Wait::BackOff {
                std::thread::sleep(ms(1));
            }
        }
        assert_eq!(seen, [Wait::Spin, Wait::Yield, Wait::BackOff]);
        p.progress();
        assert_eq!(p.idle(), Wait::Spin, "progress starts a new idle stretch");
    }

    #[test]
    fn a_spinning_wait_past_u32_max_polls_still_expires() {
        let ms = Duration::from_millis;
        // RDMACOMM_POLL=spin: never stops spinning.
        let mut p = Pacer::new(ms(50), Duration::MAX, Duration::MAX);
        for _ in 0..CLOCK_EVERY {
            p.idle();
        }
        // As after about 4.3 billion idle polls (minutes of spinning on a fast NIC).
        p.idle_polls = u32::MAX - 3;
        let t0 = Instant::now();
        loop {
            match p.idle() {
                Wait::Expired => break,
                w => assert_eq!(w, Wait::Spin),
            }
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "the clock is never read again once the poll count saturates"
            );
        }
        assert!(t0.elapsed() >= ms(40), "expired early: {:?}", t0.elapsed());
    }

    #[test]
    fn expires_after_the_timeout_without_progress_only() {
        let ms = Duration::from_millis;
        let mut p = Pacer::new(ms(50), ms(1), ms(2));
        let t0 = Instant::now();
        let mut last_progress = Instant::now();
        // Progress every 10 ms for 120 ms: never expires.
        while t0.elapsed() < ms(120) {
            if last_progress.elapsed() > ms(10) {
                p.progress();
                last_progress = Instant::now();
            }
            assert_ne!(p.idle(), Wait::Expired, "expired despite progress");
        }
        // No progress: expires after 50 ms, not much later, not before.
        p.progress();
        let t1 = Instant::now();
        while p.idle() != Wait::Expired {
            assert!(t1.elapsed() < ms(500), "never expired");
        }
        assert!(t1.elapsed() >= ms(50), "expired early: {:?}", t1.elapsed());
    }
}
