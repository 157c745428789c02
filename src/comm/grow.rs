//! `grow` and `rejoin`: the members of a running group admit newcomers at a step boundary
//! (their rank 0's lobby, `bootstrap/elastic/lobby.rs`) and meet with them as a new communicator; the
//! old one ends here alone, as after a shrink.

use super::*;
use crate::bootstrap::elastic::lobby::{knock, Lobby, Welcome};
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
    /// not meet the grown group: the members commit over this communicator) leaves this
    /// communicator as it was, on every member, all returning within about the timeout; one
    /// that succeeds ends it: drop it.
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
        // The commit: the members learn, over this communicator, whether every one of them met
        // the grown group; if one did not, all keep this one and the grown group is dropped.
        let mut met = [u8::from(link.is_ok())];
        // The test hook: the last member fails after the others met (lost at the barrier).
        if crate::diag::test_fault("grow-unmet") && r == n - 1 {
            met[0] = 0;
        }
        let mut all = vec![0u8; n];
        self.all_gather(&met, &mut all)?;
        let link = link?;
        if let Some(q) = all.iter().position(|&m| m != 1) {
            return Err(Error::Bootstrap(format!(
                "grow: rank {q} did not meet the grown group of {size}: the grow is undone on                  every member (this communicator goes on)"
            )));
        }
        // The group is whole: later calls are refused, but the teardown meets the others at the
        // close barrier (a member that went first must not fail one still in the commit).
        self.poison_with(format!(
            "rank {r} left this communicator (epoch {}) for its grown successor of {size} ranks",
            self.core.epoch
        ));
        Ok(self.successor(cfg, Some(link), epoch))
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
