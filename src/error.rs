//! The crate's error type: every variant that involves a peer names it (rank and address).

use std::fmt;
use std::time::Duration;

/// A peer of this rank: its rank and the host address it was reached at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// The peer's rank in the communicator.
    pub rank: usize,
    /// The peer's host address (as the bootstrap saw it).
    pub addr: String,
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} ({})", self.rank, self.addr)
    }
}

/// Everything that can go wrong in rdmacomm. New kinds may be added: match with a `_` arm.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No usable RDMA device on this host.
    #[error("no usable RDMA device: {0}")]
    NoDevice(String),
    /// A verbs call failed.
    #[error("verbs {op} failed: {detail}")]
    Verbs {
        /// What was being done.
        op: &'static str,
        /// The error, in words.
        detail: String,
        /// The verbs library's error, where it gave one.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
    },
    /// Memory registration failed because the locked-memory limit is too low.
    #[error(
        "could not register {bytes} bytes of memory: {detail}; the locked-memory limit is too low \
         (now {limit}): raise it with `ulimit -l unlimited` (or memlock in /etc/security/limits.conf, \
         or LimitMEMLOCK=infinity for systemd / --ulimit memlock=-1 for containers)"
    )]
    MemLock {
        /// Bytes requested.
        bytes: usize,
        /// The current RLIMIT_MEMLOCK, in words.
        limit: String,
        /// The verbs error.
        detail: String,
    },
    /// The caller passed something that cannot work; the message says what to fix.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The configuration (environment or builder) is wrong or incomplete.
    #[error("configuration: {0}")]
    Config(String),
    /// An environment variable's value cannot be used.
    #[error("configuration: {variable}={value:?}: {reason}")]
    BadSetting {
        /// The variable (`RDMACOMM_TIMEOUT`).
        variable: String,
        /// Its value as set.
        value: String,
        /// Why it cannot be used, and what can.
        reason: String,
    },
    /// Two ranks passed buffers of different lengths: a chunk of `got` bytes came from rank
    /// `from` where this rank's buffer expected `want`.
    #[error(
        "received {got} bytes from rank {from} where {want} were expected: do all ranks pass \
         buffers of the same length?"
    )]
    LengthMismatch {
        /// The peer's rank.
        from: usize,
        /// The bytes its chunk carried.
        got: usize,
        /// The bytes this rank's buffer had room for there.
        want: usize,
    },
    /// Bootstrap (rendezvous over TCP) failed.
    #[error("bootstrap: {0}")]
    Bootstrap(String),
    /// A peer failed: its connection broke or an RDMA operation to it failed.
    #[error("peer {peer} failed: {reason}")]
    PeerFailed {
        /// The lost peer.
        peer: Peer,
        /// What happened.
        reason: String,
    },
    /// This rank and a peer called different operations (or the same one with different
    /// arguments) at the same position; the message names both calls.
    #[error("{reason} (peer {peer})")]
    Mismatch {
        /// The peer whose call differs.
        peer: Peer,
        /// Both calls, in words.
        reason: String,
    },
    /// An operation was called from a thread that does not own the communicator.
    #[error("wrong thread: {0}")]
    WrongThread(String),
    /// Waiting on a peer took longer than the configured timeout.
    #[error("timed out after {after:?} waiting for peer {peer} ({what}); set RDMACOMM_TIMEOUT to wait longer")]
    Timeout {
        /// The peer waited on.
        peer: Peer,
        /// What was awaited.
        what: String,
        /// The timeout in force.
        after: Duration,
    },
    /// A rank's application called `Comm::abort` (this rank's, or a peer's told over the side
    /// channel): every pending and later operation of the communicator ends with this.
    #[error("aborted by {by}: {reason}")]
    Aborted {
        /// The rank that aborted.
        by: Peer,
        /// The reason it gave.
        reason: String,
    },
    /// A shrink went on without this rank (it was stopped, cut off or late): `by` said so, for
    /// the group that went on.
    #[error("left out of the shrink, as {by} said: {reason}")]
    LeftOut {
        /// The rank whose answer said so (the coordinator, or a member's retired port).
        by: Peer,
        /// The group that went on, in words.
        reason: String,
    },
    /// The communicator failed earlier and refuses further work.
    #[error("communicator is unusable after an earlier failure: {0}")]
    Poisoned(String),
    /// An I/O error outside a peer's context.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

/// Result with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// A received chunk of `got` bytes from rank `from` where `want` were expected: the ranks
    /// passed buffers of different lengths.
    pub(crate) fn length_mismatch(got: usize, want: usize, from: usize) -> Error {
        Error::LengthMismatch { from, got, want }
    }

    /// Whether the caller's arguments are at fault (on this rank, or against a peer's).
    pub(crate) fn is_argument(&self) -> bool {
        matches!(
            self,
            Error::InvalidArgument(_) | Error::LengthMismatch { .. }
        )
    }

    /// What a failed communicator returns on a later call: the same kind and peer where this
    /// error names one (its text saying it is an earlier failure), else [`Error::Poisoned`]
    /// with this error's words.
    pub(crate) fn again(&self) -> Error {
        const EARLIER: &str = "; an earlier failure: the communicator refuses further work";
        match self {
            Error::PeerFailed { peer, reason } => Error::PeerFailed {
                peer: peer.clone(),
                reason: with_suffix(reason, EARLIER),
            },
            Error::Timeout { peer, what, after } => Error::Timeout {
                peer: peer.clone(),
                what: with_suffix(what, EARLIER),
                after: *after,
            },
            Error::Mismatch { peer, reason } => Error::Mismatch {
                peer: peer.clone(),
                reason: with_suffix(reason, EARLIER),
            },
            Error::Aborted { by, reason } => Error::Aborted {
                by: by.clone(),
                reason: reason.clone(),
            },
            Error::LengthMismatch { from, got, want } => Error::LengthMismatch {
                from: *from,
                got: *got,
                want: *want,
            },
            Error::Poisoned(why) => Error::Poisoned(why.clone()),
            e => Error::Poisoned(e.to_string()),
        }
    }

    /// The peer this error names, if any.
    pub fn peer(&self) -> Option<&Peer> {
        match self {
            Error::PeerFailed { peer, .. }
            | Error::Timeout { peer, .. }
            | Error::Mismatch { peer, .. }
            | Error::Aborted { by: peer, .. }
            | Error::LeftOut { by: peer, .. } => Some(peer),
            _ => None,
        }
    }
}

/// `text` with `suffix` once (an error replayed twice says it once).
fn with_suffix(text: &str, suffix: &str) -> String {
    if text.ends_with(suffix) {
        text.to_string()
    } else {
        format!("{text}{suffix}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn a_later_error_keeps_the_first_ones_kind_and_peer() {
        let peer = Peer {
            rank: 3,
            addr: "10.0.0.4".into(),
        };
        let first = Error::Timeout {
            peer: peer.clone(),
            what: "stopped making progress".into(),
            after: Duration::from_secs(2),
        };
        let again = first.again();
        assert!(matches!(again, Error::Timeout { .. }), "{again}");
        assert_eq!(again.peer(), Some(&peer));
        assert!(
            again.to_string().contains("refuses further work"),
            "{again}"
        );
        assert_eq!(again.again().to_string(), again.to_string(), "said once");
        let m = Error::Mismatch {
            peer: peer.clone(),
            reason: "mismatched operations".into(),
        };
        assert!(matches!(m.again(), Error::Mismatch { .. }));
        let io = Error::Io(std::io::Error::other("gone"));
        assert!(matches!(io.again(), Error::Poisoned(ref w) if w.contains("gone")));
    }

    #[test]
    fn verbs_errors_keep_their_source() {
        let io = std::io::Error::from_raw_os_error(libc::ENOMEM);
        let e = Error::Verbs {
            op: "post receive",
            detail: io.to_string(),
            source: Some(Box::new(io)),
        };
        let src = e.source().expect("a source");
        assert!(src.downcast_ref::<std::io::Error>().is_some(), "{src:?}");
        assert!(
            e.to_string().starts_with("verbs post receive failed: "),
            "{e}"
        );
    }
}
