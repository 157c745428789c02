//! Rank 0's judgement of stalled waits: follow who waits on whom from the first rank that ran
//! out of time to the rank that waits on nobody (or around a cycle), and name it.

use std::time::Duration;

/// How long rank 0 gathers stall reports before it names the rank the waits lead to (the ranks
/// waiting on a stopped one run out of time within milliseconds of each other).
pub const STALL_WINDOW: Duration = Duration::from_millis(400);

/// How a stall verdict begins.
pub const STALL_VERDICT: &str = "stopped making progress";

/// The verdict on the reported waits (`reported[r]`: whom rank r said it waited on after its
/// wait ran out), with `waiting[r]` whom each rank waits on now where known (rank 0's own
/// thread): the rank to blame and why. `None` without a report.
pub fn verdict(reported: &[Option<usize>], waiting: &[Option<usize>]) -> Option<(usize, String)> {
    let n = reported.len();
    let first = (0..n).find(|&r| reported[r].is_some())?;
    let wait = |r: usize| -> Option<usize> {
        reported[r]
            .or_else(|| waiting.get(r).copied().flatten())
            .filter(|&q| q < n)
    };
    let mut chain = vec![first];
    let mut cycle = false;
    while let Some(next) = wait(*chain.last()?) {
        if chain.contains(&next) {
            cycle = true;
            break;
        }
        chain.push(next);
    }
    let path = chain
        .iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(" -> ");
    Some(if cycle {
        (
            wait(first)?,
            format!(
                "{STALL_VERDICT}: ranks {path} wait on each other (do their sends and receives \
                 match?)"
            ),
        )
    } else {
        (
            *chain.last()?,
            format!(
                "{STALL_VERDICT}: ranks waited on it for the timeout (waits: {path}) while it \
                 waits on nobody: stopped (SIGSTOP, a debugger), hung, or busy outside rdmacomm"
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_waits_lead_to_the_rank_that_waits_on_nobody() {
        // Rank 1 waits on 2, which waits on nobody; rank 0 is busy elsewhere.
        let (r, why) = verdict(&[None, Some(2), None], &[None, None, None]).unwrap();
        assert_eq!(r, 2, "{why}");
        assert!(why.contains("waits: 1 -> 2"), "{why}");
        // Through rank 0's own wait, not yet out of time: 3 -> 0 -> 1.
        let (r, why) = verdict(&[None, None, None, Some(0)], &[Some(1), None, None, None]).unwrap();
        assert_eq!(r, 1, "{why}");
        assert!(why.contains("3 -> 0 -> 1"), "{why}");
        // A cycle names the rank the first reporter waits on.
        let (r, why) = verdict(&[None, Some(2), Some(1)], &[None; 3]).unwrap();
        assert_eq!(r, 2);
        assert!(why.contains("wait on each other"), "{why}");
        // No report, no verdict; a report naming a rank out of range leads nowhere further.
        assert!(verdict(&[None, None], &[Some(1), None]).is_none());
        assert_eq!(verdict(&[None, Some(9)], &[None; 2]).unwrap().0, 1);
    }
}
