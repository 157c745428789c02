//! File descriptors: a rank holds a few per peer (a TCP connection, at rank 0 a side-channel
//! connection, shared-memory files), so a large world outgrows the usual soft limit of 1024.
//! The soft limit is raised to the hard one where the world needs more; where even the hard
//! one is too low, the error says so before any connection is made.

use crate::error::{Error, Result};

/// About how many descriptors a rank of a world of `n` holds: three per peer at most (rank 0),
/// and room for the process's own.
pub(crate) fn need(n: usize) -> u64 {
    (n as u64).saturating_mul(3).saturating_add(64)
}

/// What to do with limits `soft` and `hard` when `need` are needed.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Plan {
    Enough,
    RaiseTo(u64),
    TooFew,
}

pub(crate) fn plan(need: u64, soft: u64, hard: u64) -> Plan {
    if soft >= need {
        Plan::Enough
    } else if hard >= need {
        Plan::RaiseTo(hard)
    } else {
        Plan::TooFew
    }
}

/// Makes sure rank `rank` of a world of `n` may open the descriptors it needs.
pub(crate) fn ensure(rank: usize, n: usize) -> Result<()> {
    let Ok((soft, hard)) = crate::sys::nofile() else {
        return Ok(()); // cannot tell: connecting will say if it runs out
    };
    let need = need(n);
    match plan(need, soft, hard) {
        Plan::Enough => Ok(()),
        Plan::RaiseTo(to) => {
            crate::sys::set_nofile(to, hard).map_err(|_| too_few(rank, n, need, soft))
        }
        Plan::TooFew => Err(too_few(rank, n, need, hard)),
    }
}

fn too_few(rank: usize, n: usize, need: u64, limit: u64) -> Error {
    Error::Config(format!(
        "rank {rank}: a world of {n} ranks needs about {need} file descriptors per rank, but \
         RLIMIT_NOFILE allows {limit}: raise it (ulimit -n {need}, LimitNOFILE= under systemd, \
         --ulimit nofile= for containers)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_rises_to_the_hard_one_only_when_needed() {
        assert_eq!(need(510), 1594);
        assert_eq!(plan(1594, 1024, 1_048_576), Plan::RaiseTo(1_048_576));
        assert_eq!(plan(100, 1024, 4096), Plan::Enough);
        assert_eq!(plan(5000, 1024, 4096), Plan::TooFew);
        assert_eq!(need(usize::MAX), u64::MAX);
    }
}
