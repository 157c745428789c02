//! Rank 0's admission policy: what a joiner's HELLO earns it, decided without sockets (the
//! rendezvous acts on the verdict). Strangers are refused and noted; a rank of this job joins;
//! a conflict inside the job ends the rendezvous, but only where the joiner is known to be of
//! this job (the job has an identity, or a secret the joiner proved): otherwise it may be another
//! job's rank that reached the same port, and is refused like a stranger.

use super::hello::{first_difference, Hello};
use crate::bootstrap::wire::VERSION;

/// What rank 0 does with a joiner.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Not a rank of this job: refused with `reply`, noted (and logged) as `note`.
    Stray {
        /// What the joiner is told.
        reply: String,
        /// What rank 0 notes.
        note: String,
    },
    /// The rendezvous had already failed: the joiner is told why.
    Told(String),
    /// A conflict inside the job: the rendezvous fails, and every rank is told why.
    Fatal(String),
    /// Joins as the rank it claims.
    Join,
}

/// Rank 0's judge of one rendezvous.
pub(super) struct Admission<'a> {
    n: usize,
    job: &'a str,
    secret: bool,
    /// The settings every rank must share, as rank 0 has them.
    ours: &'a str,
    /// Once set, the group cannot form: every later joiner is told this.
    pub fatal: Option<String>,
}

impl<'a> Admission<'a> {
    /// The judge of a world of `n` for job `job` (empty: none), with or without a secret.
    pub fn new(n: usize, job: &'a str, secret: bool, ours: &'a str) -> Self {
        Admission {
            n,
            job,
            secret,
            ours,
            fatal: None,
        }
    }

    /// Whether a joiner that passes the checks is known to be of this job.
    pub fn proven(&self) -> bool {
        !self.job.is_empty() || self.secret
    }

    /// Whether `h` passes the checks that make a joiner a rank of this job (its version, its
    /// job, and the secret where there is one): a restarted rank's new connection may then
    /// replace its dead one.
    pub fn of_this_job(&self, h: &Hello, authentic: bool) -> bool {
        h.version == VERSION && h.job == self.job && (!self.secret || authentic)
    }

    /// The verdict on `h`, whose MAC checked out (`authentic`, where there is a secret), from
    /// `addr`; `taken_by` is the address of a live connection that already holds its rank.
    pub fn judge(
        &mut self,
        h: &Hello,
        authentic: bool,
        addr: &str,
        taken_by: Option<&str>,
    ) -> Verdict {
        let (n, rank) = (self.n, h.rank);
        let stray = |reply: String, note: String| Verdict::Stray { reply, note };
        if h.version != VERSION {
            return stray(
                "another rdmacomm protocol version".into(),
                format!(
                    "rdmacomm protocol version {} (this is {VERSION})",
                    h.version
                ),
            );
        }
        if h.job != self.job {
            return stray(
                format!("this coordinator runs another job ({:?})", self.job),
                format!("a rank of another job ({:?})", h.job),
            );
        }
        if self.secret && !authentic {
            return stray(
                "authentication failed (RDMACOMM_SECRET differs?)".into(),
                "failed authentication".into(),
            );
        }
        if let Some(f) = &self.fatal {
            return Verdict::Told(f.clone());
        }
        if rank == 0 || rank >= n && h.size == n {
            return stray(
                format!("rank {rank} is not in 1..{n}"),
                format!("claims rank {rank}, not in 1..{n}"),
            );
        }
        let problem = if h.size != n {
            format!(
                "world size mismatch: rank {rank} at {addr} has world size {} but rank 0 has \
                 {n}; every rank must be started with the same WORLD_SIZE",
                h.size
            )
        } else if let Some(first) = taken_by {
            format!(
                "rank {rank} joined twice (from {first} and from {addr}, both alive); each rank \
                 must be unique"
            )
        } else if !h.error.is_empty() {
            format!("rank {rank}'s configuration is invalid: {}", h.error)
        } else if let Some((theirs, mine)) = first_difference(&h.settings, self.ours) {
            format!(
                "rank {rank} ({addr}) has {theirs} but rank 0 has {mine}: set it alike everywhere"
            )
        } else {
            return Verdict::Join;
        };
        if !self.proven() {
            // Perhaps not this job's rank at all: it is told why, and the job waits on.
            return stray(
                problem.clone(),
                format!("{problem} (this job has no identity: ignored)"),
            );
        }
        self.fatal = Some(problem.clone());
        Verdict::Fatal(problem)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::rendezvous::hello::Card;
    use crate::bootstrap::wire::auth::KEY;

    fn hello(rank: usize, size: usize, job: &str) -> Hello {
        Hello {
            version: VERSION,
            job: job.into(),
            rank,
            size,
            card: Card::default(),
            addr: "10.0.0.2".into(),
            port: 0,
            settings: "RDMACOMM_SLOTS=8".into(),
            error: String::new(),
            nonce: [0; KEY],
        }
    }

    fn is_stray(v: &Verdict, note: &str) -> bool {
        matches!(v, Verdict::Stray { note: n, .. } if n.contains(note))
    }

    #[test]
    fn strangers_are_refused_and_a_rank_of_the_job_joins() {
        let mut a = Admission::new(3, "job", false, "RDMACOMM_SLOTS=8");
        let h = hello(1, 3, "job");
        assert_eq!(a.judge(&h, true, "x", None), Verdict::Join);
        let old = Hello {
            version: VERSION - 1,
            ..hello(1, 3, "job")
        };
        assert!(is_stray(
            &a.judge(&old, true, "x", None),
            "protocol version"
        ));
        assert!(is_stray(
            &a.judge(&hello(1, 3, "other"), true, "x", None),
            "another job"
        ));
        for r in [0, 3, 7] {
            assert!(is_stray(
                &a.judge(&hello(r, 3, "job"), true, "x", None),
                "not in 1..3"
            ));
        }
        let mut s = Admission::new(3, "", true, "RDMACOMM_SLOTS=8");
        assert!(is_stray(
            &s.judge(&hello(1, 3, ""), false, "x", None),
            "authentication"
        ));
        assert_eq!(s.judge(&hello(1, 3, ""), true, "x", None), Verdict::Join);
        assert!(
            a.fatal.is_none() && s.fatal.is_none(),
            "no stranger ends the rendezvous"
        );
    }

    #[test]
    fn a_conflict_ends_a_job_with_an_identity_and_is_told_after() {
        let mut a = Admission::new(3, "job", false, "RDMACOMM_SLOTS=8");
        let v = a.judge(&hello(1, 4, "job"), true, "10.0.0.2", None);
        assert!(
            matches!(&v, Verdict::Fatal(w) if w.contains("world size mismatch")),
            "{v:?}"
        );
        let later = a.judge(&hello(2, 3, "job"), true, "x", None);
        assert!(matches!(&later, Verdict::Told(w) if w.contains("world size mismatch")));
        for (h, taken, want) in [
            (hello(1, 3, "job"), Some("10.0.0.9"), "joined twice"),
            (
                Hello {
                    error: "RDMACOMM_PIN=x".into(),
                    ..hello(1, 3, "job")
                },
                None,
                "configuration is invalid",
            ),
            (
                Hello {
                    settings: "RDMACOMM_SLOTS=4".into(),
                    ..hello(1, 3, "job")
                },
                None,
                "has RDMACOMM_SLOTS=4 but rank 0 has RDMACOMM_SLOTS=8",
            ),
        ] {
            let mut a = Admission::new(3, "job", false, "RDMACOMM_SLOTS=8");
            let v = a.judge(&h, true, "x", taken);
            assert!(
                matches!(&v, Verdict::Fatal(w) if w.contains(want)),
                "{want}: {v:?}"
            );
        }
    }

    #[test]
    fn without_an_identity_a_conflict_is_a_strangers() {
        let mut a = Admission::new(3, "", false, "RDMACOMM_SLOTS=8");
        assert!(!a.proven());
        assert!(is_stray(
            &a.judge(&hello(1, 5, ""), true, "x", None),
            "no identity"
        ));
        assert!(is_stray(
            &a.judge(&hello(1, 3, ""), true, "x", Some("y")),
            "joined twice"
        ));
        assert!(a.fatal.is_none());
        assert_eq!(a.judge(&hello(2, 3, ""), true, "x", None), Verdict::Join);
    }
}
