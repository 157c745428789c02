//! The rendezvous: how the ranks of a job find each other through rank 0, and how strangers are
//! kept out of it.
//!
//! Rank 0 listens at the coordinator address and greets every connection with a challenge (a
//! random nonce). A rank answers with its HELLO: protocol version, job identity, rank, world size,
//! its card, the settings every rank must share, a configuration error if it has one, its own
//! nonce, and (with a shared secret) an HMAC-SHA256 over the challenge and all of that. With a
//! secret the card waits: rank 0 first proves the secret (a MAC over the joiner's nonce), so a
//! process that took rank 0's port learns nothing of a rank's memory or queue pairs. Each
//! connection has its own deadline and is served as its bytes arrive, so idle or slow strangers
//! starve nobody; anything that is not a well-formed HELLO of this job is closed and reported once
//! in the log, and the rendezvous goes on. Only conflicts inside the job end it: a rank twice with
//! both connections alive, world sizes or shared settings that disagree, a rank whose
//! configuration is bad. Once every rank is in, every rank gets the table (`table.rs`): a fresh
//! session key (which the data path's connections prove) and every rank's address and card,
//! front-coded (a few bytes a rank), built once. Rank 0 writes it to its first eight ranks and
//! they pass it on along a tree (`fanout.rs`); each rank's route from rank 0 carries the table's
//! digest, with an HMAC over the joiner's nonce when there is a secret, so a joiner cannot be
//! fooled by a fake coordinator nor by a stranger at its table listener.

mod admission;
mod coordinate;
pub mod discover;
mod fanout;
mod hand_out;
pub(crate) mod hello;
mod join;
pub(crate) mod outcome;
pub mod pmix;
mod table;

pub use crate::bootstrap::wire::auth::{mac, mac_ok, random, KEY};
use crate::config::Config;
use crate::error::Result;
use coordinate::coordinate;
pub(crate) use coordinate::Stop;
use discover::meeting_point;
pub use hello::Card;
use join::join;
pub use outcome::Rendezvous;
use std::net::TcpListener;
use std::time::Instant;

/// Joins the group: exchanges `card` with every rank through rank 0 (found as
/// [`crate::config::Discovery`] says).
#[cfg_attr(not(feature = "unstable"), allow(dead_code))]
pub fn rendezvous(cfg: &Config, card: &Card) -> Result<Rendezvous> {
    let mut meet = meeting_point(cfg)?;
    let listener = meet.listener.take();
    rendezvous_on(&meet.cfg, card, listener)
}

/// [`rendezvous`], with rank 0 accepting on `listener` when given (already bound, so its
/// address could be shared beforehand).
pub fn rendezvous_on(
    cfg: &Config,
    card: &Card,
    listener: Option<TcpListener>,
) -> Result<Rendezvous> {
    rendezvous_by(cfg, card, listener, Instant::now() + cfg.timeout, None)
}

/// [`rendezvous_on`] by `deadline`; rank 0 refusing the group where `stop` says why.
pub(crate) fn rendezvous_by(
    cfg: &Config,
    card: &Card,
    listener: Option<TcpListener>,
    deadline: Instant,
    stop: Option<Stop>,
) -> Result<Rendezvous> {
    if !proven(cfg) {
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            log::info!(
                "this job has no identity (RDMACOMM_JOB_ID, or a launcher's job id) and no \
                 secret (RDMACOMM_SECRET): a rank of another job that reaches {} is refused only \
                 where its call differs, and one that claims a free rank first takes its place; \
                 set either for a shared cluster (rdmacomm-run sets both)",
                cfg.coordinator
            )
        });
    }
    if cfg.rank == 0 {
        coordinate(cfg, card, deadline, listener, stop)
    } else {
        join(cfg, card, deadline, None)
    }
}

/// Whether a joiner that passes rank 0's checks is known to be of this job: the job has an
/// identity, or a secret the joiner proved. Only such a joiner's conflict (another world size,
/// a rank taken twice, other settings) ends the rendezvous; otherwise it may be another job's
/// rank, which is refused and noted, never fatal.
fn proven(cfg: &Config) -> bool {
    !cfg.job_id.is_empty() || cfg.secret.is_some()
}

/// Joins the rendezvous only to tell the group that this rank's configuration is bad (`why`),
/// so that every rank fails at once naming it instead of waiting for a rank that never comes.
pub fn refuse(cfg: &Config, why: &str) {
    let deadline = Instant::now() + cfg.timeout;
    let card = Card::default();
    let Ok(mut meet) = meeting_point(cfg) else {
        return;
    };
    let _ = if cfg.rank == 0 {
        let stop = Some(Stop::Config(why));
        coordinate(&meet.cfg, &card, deadline, meet.listener.take(), stop).map(|_| ())
    } else {
        join(&meet.cfg, &card, deadline, Some(why)).map(|_| ())
    };
}
