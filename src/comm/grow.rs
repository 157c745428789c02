//! `grow` and `rejoin`: the members of a running group admit newcomers at a step boundary
//! (their rank 0's lobby, `bootstrap/elastic/lobby.rs`) and meet with them as a new communicator; the
//! old one ends here alone, as after a shrink.

use super::shrink::{agreement_tag, GROW_COMMIT};
use super::*;
use crate::bootstrap::elastic::driver::{agree, Attempt, Step};
use crate::bootstrap::elastic::lobby::{knock, Lobby, Welcome};
use crate::bootstrap::elastic::retired::Answerer;
use crate::bootstrap::rendezvous::rendezvous_by;
use crate::bootstrap::Stop;

/// Bytes of each member's word in a grow: the newcomers it asks for, then rank 0's meeting
/// address (or why it has none).
const WORD: usize = 8 + 1 + 128;

impl Comm {
    /// A new communicator over this one's ranks (keeping their ranks) and `k` newcomers (ranks
    /// `size..size + k`, in the order they came), each started with [`Comm::rejoin`]. Every
    /// rank calls it with the same `k`, at a step boundary of its choosing; the newcomers are
    /// awaited for the timeout (`RDMACOMM_TIMEOUT`). Rank 0 admits them where they look for it:
    /// at the address it writes to `RDMACOMM_COORDINATOR_FILE`, else at the world's coordinator
    /// address. A grow that fails (a newcomer did not come within the timeout, or a member did
    /// not meet the grown group: the members agree on it, as a shrink does) leaves this
    /// communicator as it was, on every member, all returning within about the timeout; one
    /// that succeeds ends it: drop it. A member lost during that agreement fails this
    /// communicator on every other member, naming it: shrink it then.
    pub fn grow(&self, k: usize) -> Result<Comm> {
        if self.view.is_some() {
            return Err(Error::InvalidArgument(
                "grow: a shared view grows with the communicator it was split from".into(),
            ));
        }
        if k == 0 || k > crate::bootstrap::elastic::lobby::MAX_SIZE.saturating_sub(self.size) {
            return Err(Error::InvalidArgument(format!(
                "grow({k}): a number of newcomers from 1, to a group of at most {} ranks",
                crate::bootstrap::elastic::lobby::MAX_SIZE
            )));
        }
        self.check_thread(&"grow")?;
        self.check_usable()?;
        let (n, r) = (self.size, self.rank);
        // Rank 0 opens the lobby and the grown group's meeting point first; every rank learns
        // where (or why not) and checks that all asked for the same k.
        let mut opened = None;
        let mut word = [0u8; WORD];
        word[..8].copy_from_slice(&(k as u64).to_le_bytes());
        if r == 0 {
            let ip = self.my_ip();
            let (ok, text) = match self.open_lobby(&ip) {
                Ok((lobby, meet)) => {
                    let at = meet.local_addr()?.to_string();
                    opened = Some((lobby, meet));
                    (1, at)
                }
                Err(e) => (0, e.to_string()),
            };
            word[8] = ok;
            let t = &text.as_bytes()[..text.len().min(WORD - 9)];
            word[9..9 + t.len()].copy_from_slice(t);
        }
        let mut words = vec![0u8; WORD * n];
        self.all_gather(&word, &mut words)?;
        let asked =
            |q: usize| u64::from_le_bytes(words[WORD * q..WORD * q + 8].try_into().unwrap());
        if let Some(q) = (0..n).find(|&q| asked(q) != k as u64) {
            return Err(Error::InvalidArgument(format!(
                "grow: rank {q} asked for {} newcomer(s), rank {r} for {k}",
                asked(q)
            )));
        }
        let text = String::from_utf8_lossy(&words[9..WORD])
            .trim_end_matches('\0')
            .to_string();
        if words[8] != 1 {
            return Err(Error::Bootstrap(format!(
                "grow: rank 0 has no lobby: {text}"
            )));
        }
        let size = n + k;
        let epoch = self.core.epoch + 1;
        let cfg = self.cfg.for_group(self.cfg.rank, size, text, None);
        let t = self.cfg.timeout;
        // Rank 0 waits up to the timeout for the newcomers before the group meets.
        let deadline = Instant::now() + 2 * t;
        let meet_cfg = cfg.clone();
        let link = transport::connect_with(&cfg, cfg.transport, &mut |card| match opened.take() {
            Some((lobby, listener)) => {
                let came = lobby.admit(&meet_cfg, k, Instant::now() + t, |i| Welcome {
                    rank: n + i,
                    size,
                    epoch,
                    meet: meet_cfg.coordinator.clone(),
                });
                let why = came.err().map(|e| match e {
                    Error::Bootstrap(m) => format!("grow: {m}"),
                    e => format!("grow: {e}"),
                });
                rendezvous_by(
                    &meet_cfg,
                    card,
                    Some(listener),
                    deadline,
                    why.as_deref().map(|w| Stop::Group(w, n)),
                )
            }
            None => rendezvous_by(&meet_cfg, card, None, deadline, None),
        });
        // The commit: the members agree over their control ports (the model-checked agreement
        // of `shrink`), each bringing whether it met the grown group, and go on grown only if
        // the decision holds every member and every one met it.
        let mut met = link.is_ok();
        // The test hook: the last member fails after the others met (lost at the barrier).
        if crate::diag::test_fault("grow-unmet") && r == n - 1 {
            met = false;
        }
        match self.commit(met, size) {
            Ok(answerer) => {
                let link = link.expect("a member that met holds the grown group's link");
                // The old communicator's later calls are refused, but its teardown meets the
                // others at the close barrier (a member that went first must not fail one still
                // in the commit).
                self.poison_with(format!(
                    "rank {r} left this communicator (epoch {}) for its grown successor of {size} \
                     ranks",
                    self.core.epoch
                ));
                let c = self.successor(cfg, Some(link), epoch);
                c.keep_answerer(answerer);
                Ok(c)
            }
            Err(e) => Err(match link {
                Err(why) if met => Error::Bootstrap(format!("{e}; this rank: {why}")),
                _ => e,
            }),
        }
    }

    /// Grow's commit: whether every member met the grown group (this one: `met`), agreed by
    /// all. On success the old control port's answerer, for members that ask late; an error
    /// says which member did not meet (this communicator goes on), or which were lost or
    /// silent during the commit (this communicator is failed, naming them: shrink it).
    fn commit(&self, met: bool, size: usize) -> Result<Option<Answerer>> {
        let (n, r) = (self.size, self.rank);
        let mut control = self.core.control.lock().unwrap_or_else(|e| e.into_inner());
        let ctl = control.as_ref().ok_or_else(|| {
            Error::Bootstrap(format!(
                "grow: rank {r} has no control port to commit through (this communicator was \
                 shrunk already, or its rendezvous gave it none)"
            ))
        })?;
        let tag = agreement_tag(self.core.epoch, GROW_COMMIT);
        // A member enters the commit when its meeting ends: up to its deadline (twice the
        // timeout) after the others, who wait for it that long and a timeout more.
        let wait = 3 * self.cfg.timeout;
        // A member's value: all ones if it met, else its rank (the least names who did not).
        let value = if met { u64::MAX } else { r as u64 };
        let attempt = Attempt {
            tag,
            next: None,
            carried: Vec::new(),
        };
        let agreed = agree(ctl, attempt, &[], value, wait, "a grow's commit");
        let (d, ended) = match agreed.inspect_err(|e| self.poison(e))? {
            Step::Decided(d, ended) => (d, ended),
            // Only an attempt with a next one ends so.
            Step::Moved(_) => {
                let e = Error::Bootstrap(format!("grow: rank {r}'s commit ended unsettled"));
                self.poison(&e);
                return Err(e);
            }
        };
        if d.members.len() < n {
            let gone: Vec<usize> = (0..n).filter(|q| !d.members.contains(q)).collect();
            let e = Error::PeerFailed {
                peer: crate::error::Peer {
                    rank: gone[0],
                    addr: ctl.addrs.get(gone[0]).cloned().unwrap_or_default(),
                },
                reason: format!(
                    "grow: rank(s) {gone:?} were lost or silent during the grow's commit: the \
                     grow is undone on every member, and ranks {:?} go on (shrink this \
                     communicator)",
                    d.members
                ),
            };
            self.poison(&e);
            return Err(e);
        }
        if d.all != u64::MAX {
            return Err(Error::Bootstrap(format!(
                "grow: rank {} did not meet the grown group of {size}: the grow is undone on \
                 every member (this communicator goes on)",
                d.least
            )));
        }
        // The old port is the answerer's now (its own descriptor): a member that missed the
        // GO learns it there.
        let answerer = ctl
            .try_clone()
            .ok()
            .map(|p| Answerer::start(p, tag, *ended));
        drop(control.take());
        Ok(answerer)
    }

    /// Joins a running group as a newcomer, admitted when its members call [`Comm::grow`]:
    /// `cfg` gives the job's identity, secret, coordinator address or file and settings (its
    /// rank and world size are the group's to give). Waits for the timeout at most.
    pub fn rejoin(cfg: &Config) -> Result<Comm> {
        cfg.validate()?;
        crate::diag::install(cfg.debug, cfg.debug_file.as_deref())?;
        let start = Instant::now();
        let w = knock(cfg, start + cfg.timeout)?;
        let origin = cfg.coordinator.clone();
        let mut cfg = cfg.for_group(w.rank, w.size, w.meet, None);
        let meet_cfg = cfg.clone();
        let link = transport::connect_with(&cfg, cfg.transport, &mut |card| {
            rendezvous_by(
                &meet_cfg,
                card,
                None,
                Instant::now() + 2 * meet_cfg.timeout,
                None,
            )
        })?;
        cfg.coordinator = origin;
        let algo = cfg.algo;
        let mut c = Comm::with_link_of(cfg, Some(link), algo);
        Arc::get_mut(&mut c.core)
            .expect("a new communicator's core is its own")
            .epoch = w.epoch;
        c.rejoined = true;
        log::info!(
            "a newcomer joined as rank {} of {} (epoch {})",
            w.rank,
            w.size,
            w.epoch
        );
        Ok(c)
    }

    /// [`Comm::rejoin`] with the settings of the environment (as [`Comm::from_env`]; a
    /// replacement started with a lost rank's launcher environment has them).
    pub fn rejoin_from_env() -> Result<Comm> {
        let (rank, size, coordinator) = Config::identity_from_env()?;
        Comm::rejoin(&Config::new(rank, size, coordinator)?)
    }

    /// Whether this communicator was made by [`Comm::rejoin`] (a newcomer, which takes the
    /// group's state, such as the weights, from the members).
    pub fn rejoined(&self) -> bool {
        self.rejoined
    }

    /// Rank 0's lobby for newcomers and the grown group's meeting point, beside it.
    fn open_lobby(&self, ip: &str) -> Result<(Lobby, std::net::TcpListener)> {
        let ip: std::net::IpAddr = ip
            .parse()
            .map_err(|_| Error::Config(format!("grow: {ip:?} is not an IP address")))?;
        let lobby = Lobby::open(&self.cfg, ip)?;
        let meet = crate::bootstrap::listen((ip, 0))
            .map_err(|e| Error::Bootstrap(format!("grow: cannot listen on {ip}: {e}")))?;
        Ok((lobby, meet))
    }

    /// The address this rank's peers reach it at.
    pub(super) fn my_ip(&self) -> String {
        match &self.cfg.bind_addr {
            Some(ip) => ip.clone(),
            None => {
                let a = self
                    .lock()
                    .link
                    .as_ref()
                    .map(|l| l.peer(self.link_rank(self.rank)).addr)
                    .unwrap_or_default();
                if a.is_empty() {
                    // No link (a world of one): the address that reaches the coordinator's.
                    crate::transport::reach::data_ip(&self.cfg)
                        .map_or_else(|_| "127.0.0.1".into(), |ip| ip.to_string())
                } else {
                    a
                }
            }
        }
    }
}
