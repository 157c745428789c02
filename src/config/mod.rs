//! How a rank learns who it is: explicit [`Config`] or the environment of common launchers.
//!
//! Rank and world size, first match wins:
//! `RDMACOMM_RANK`/`RDMACOMM_WORLD_SIZE`, MLX's `MLX_RANK` with `MLX_HOSTFILE` (a nuvec ring
//! launch: rank 0's first address is the coordinator), torchrun's `RANK`/`WORLD_SIZE`, Open MPI's
//! `OMPI_COMM_WORLD_RANK`/`OMPI_COMM_WORLD_SIZE`, PMI's `PMI_RANK`/`PMI_SIZE`, Slurm's
//! `SLURM_PROCID`/`SLURM_NTASKS`. Coordinator (rank 0's rendezvous address): `RDMACOMM_COORDINATOR`
//! (`host:port`), else `MASTER_ADDR`:`MASTER_PORT` (port 29500 if unset), else what the launcher
//! knows ([`Discovery`]): under PMIx (`mpirun`, `srun --mpi=pmix`) rank 0 publishes its address
//! in the launcher's key-value store; under Slurm without PMIx it listens on the step's first
//! node at a port derived from the job and step ids. `RDMACOMM_TIMEOUT`
//! (seconds, default 30) bounds every wait. `RDMACOMM_BIND_ADDR` is this rank's own IP (the source
//! of its bootstrap connection). `RDMACOMM_TRANSPORT` (`auto`, `rdma`, `tcp`, `shm`) picks the transport.
//! World size 1 needs none of these.

use crate::error::{Error, Result};
use std::time::Duration;

mod hostfile;
mod launcher;
mod settings;
mod table;

#[doc(hidden)]
pub use launcher::device_from_env as launcher_device_from_env;
pub(crate) use launcher::*;
pub use settings::*;

pub use crate::copy::CopyKernel;
pub use crate::pin::Pin;
pub use crate::verbs::{DeviceChoice, HcaList};

/// Every variable the library reads (the names in `config/table.rs`); any other `RDMACOMM_*`
/// variable is taken for a typo.
pub const VARIABLES: [&str; table::SETTINGS.len()] = {
    let mut names = [""; table::SETTINGS.len()];
    let mut i = 0;
    while i < names.len() {
        names[i] = table::SETTINGS[i].name;
        i += 1;
    }
    names
};

/// Variables of this project's tools and tests, which the library ignores.
pub const TOOL_VARIABLES: [&str; 6] = [
    "RDMACOMM_TEST_CHILD",
    "RDMACOMM_TEST_FAULT",
    "RDMACOMM_REQUIRE_RDMA",
    "RDMACOMM_SKIP_VM",
    "RDMACOMM_PERF_BIN",
    "RDMACOMM_BUILD",
];

/// Reads the shared secret, if one is set (a file's trailing newline is not part of it).
fn secret_from_env() -> Result<Option<Secret>> {
    if let Some(v) = env("RDMACOMM_SECRET") {
        return Ok(Some(Secret(v.into_bytes())));
    }
    let Some(path) = env("RDMACOMM_SECRET_FILE") else {
        return Ok(None);
    };
    let text = std::fs::read(&path)
        .map_err(|e| Error::Config(format!("RDMACOMM_SECRET_FILE={path:?}: {e}")))?;
    let end = text
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map_or(0, |i| i + 1);
    if end == 0 {
        return Err(Error::Config(format!(
            "RDMACOMM_SECRET_FILE={path:?} is empty"
        )));
    }
    Ok(Some(Secret(text[..end].to_vec())))
}

/// Everything a rank needs to join a communicator.
#[derive(Debug, Clone)]
pub struct Config {
    /// This rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Rank 0's rendezvous address, `host:port`.
    pub coordinator: String,
    /// This rank's own IP address for the bootstrap connection (optional).
    pub bind_addr: Option<String>,
    /// Longest wait on any peer without progress.
    pub timeout: Duration,
    /// Which RDMA device, port and GID to use.
    pub device: DeviceChoice,
    /// The copy kernel asked for (`RDMACOMM_COPY`; `None`: the faster one here).
    pub copy: Option<crate::copy::CopyKernel>,
    /// Portable reduction kernels only (`RDMACOMM_SIMD=baseline`).
    pub simd_baseline: bool,
    /// Threads that share a large copy or reduction (`RDMACOMM_REDUCE_THREADS`, 1-64; `None`:
    /// the cores this rank owns, up to 4). Chosen once per process, by its first communicator.
    pub reduce_threads: Option<usize>,
    /// Bytes per staging slot (one RDMA write at most).
    pub slot_bytes: usize,
    /// Slots per peer and direction (writes in flight per peer).
    pub slots: usize,
    /// Largest chunk on a TCP connection (`RDMACOMM_TCP_CHUNK`, default 64 KiB - 128 =
    /// [`DEFAULT_TCP_CHUNK`]). Received chunks are staged in a buffer of four; small, it stays
    /// in the cache.
    pub tcp_chunk: usize,
    /// RDMA, TCP, shared memory, or the best of them here (`RDMACOMM_TRANSPORT`).
    pub transport: TransportKind,
    /// `RDMACOMM_SHM`: `Some(false)` (0) never uses shared memory; `Some(true)` (1) uses it for
    /// same-host peers whatever the transport; unset (`None`), only `auto` does.
    pub shm: Option<bool>,
    /// How many ranks the launcher started on this host (torchrun's `LOCAL_WORLD_SIZE`, Open
    /// MPI's `OMPI_COMM_WORLD_LOCAL_SIZE`, MPICH's `MPI_LOCALNRANKS`; Slurm's whole world when
    /// `SLURM_JOB_NUM_NODES` is 1), if it says.
    pub local_world: Option<usize>,
    /// Which host this rank is on, for shared memory (`RDMACOMM_HOST_ID`, else the kernel's boot
    /// id, the host name, the PID namespace and the user).
    pub host_id: String,
    /// Whether and where to pin the thread that creates the communicator (`RDMACOMM_PIN`).
    pub pin: crate::pin::Pin,
    /// The core for the progress thread of `Comm::overlap` (`RDMACOMM_PROGRESS_CPU`; unset: not
    /// pinned).
    pub progress_cpu: Option<usize>,
    /// Who moves non-blocking operations (`RDMACOMM_PROGRESS`, default thread).
    pub progress: Progress,
    /// The all_reduce algorithm (`RDMACOMM_ALGO`, default auto).
    pub algo: Algo,
    /// The broadcast algorithm (`RDMACOMM_BCAST`, default auto).
    pub bcast: Bcast,
    /// How waits poll (`RDMACOMM_POLL`, default auto).
    pub poll: Poll,
    /// When TCP connections are made (`RDMACOMM_CONNECT`, default on demand).
    pub connect: Connect,
    /// The most peers an all_to_all, gather or scatter connects at once
    /// (`RDMACOMM_PEERS_MAX`; unset: as many as 64 MiB of the transport's per-peer buffers
    /// hold). Wider worlds run those as trees of log2(n) peers.
    pub peers_max: Option<usize>,
    /// Smallest buffer an operation registers for zero-copy RDMA sends (`RDMACOMM_ZERO_COPY_MIN`;
    /// 0, the default, never: on soft-RoCE it ties with staging, and on an HCA registering per
    /// call costs about what the copy it saves does; see docs/DESIGN.md).
    pub zero_copy_min: usize,
    /// The queue pairs' ACK timeout exponent (`RDMACOMM_IB_TIMEOUT`, 1..=31; default: derived
    /// from `timeout`).
    pub ib_timeout: Option<u8>,
    /// The queue pairs' retry count (`RDMACOMM_IB_RETRY`, 0..=6; default 6).
    pub ib_retry: Option<u8>,
    /// The job's identity (`RDMACOMM_JOB_ID`, else the launcher's job id); alike on every rank.
    pub job_id: String,
    /// The job's shared secret, if any (alike on every rank).
    pub secret: Option<Secret>,
    /// How the ranks find rank 0 when no address is given.
    pub discovery: Discovery,
    /// The minimal log writer's level (`RDMACOMM_DEBUG`; unset: none is installed).
    pub debug: Option<crate::diag::Level>,
    /// Where the minimal writer writes (`RDMACOMM_DEBUG_FILE`; unset: stderr).
    pub debug_file: Option<String>,
    /// Where the group's rank 0 writes the address newcomers join at when it grows, and where a
    /// newcomer reads it (`RDMACOMM_COORDINATOR_FILE`, on a filesystem both see; unset: the
    /// world's coordinator address).
    pub coordinator_file: Option<String>,
    /// This process replaces a lost rank of a running group (`RDMACOMM_REPLACEMENT=1`, set by an
    /// elastic launcher): [`crate::Comm::from_env`] joins that group as a newcomer
    /// ([`crate::Comm::rejoin`]).
    pub replacement: bool,
}

pub(crate) fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

pub(crate) fn parse_num<T: std::str::FromStr>(name: &str, v: &str) -> Result<T> {
    v.trim()
        .parse::<T>()
        .map_err(|_| Error::Config(format!("{name}={v:?}: not a valid number")))
}

/// A timeout in seconds: from a millisecond to 10^9 s (beyond, deadlines would overflow).
pub(crate) fn timeout_of(name: &str, v: &str) -> Result<Duration> {
    let secs: f64 = parse_num(name, v)?;
    if !(1e-3..=1e9).contains(&secs) {
        return Err(Error::Config(format!(
            "{name}={v:?}: must be from 0.001 to 1e9 seconds"
        )));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// A variable's value as a lookup gives it (the environment, or a table in tests).
pub(crate) type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

pub(crate) fn pair(get: Lookup, r: &str, s: &str) -> Result<Option<(usize, usize)>> {
    match (get(r), get(s)) {
        (Some(a), Some(b)) => Ok(Some((parse_num(r, &a)?, parse_num(s, &b)?))),
        (Some(_), None) => Err(Error::Config(format!("{r} is set but {s} is not"))),
        (None, Some(_)) => Err(Error::Config(format!("{s} is set but {r} is not"))),
        (None, None) => Ok(None),
    }
}

impl Config {
    /// A config for `rank` of `world_size` meeting at `coordinator`, other fields from defaults
    /// and the environment (`RDMACOMM_TIMEOUT`, device overrides, slot geometry).
    pub fn new(rank: usize, world_size: usize, coordinator: impl Into<String>) -> Result<Self> {
        check_names()?;
        let mut cfg = Config::defaults(rank, world_size, coordinator);
        // A nuvec job's own setting serves where rdmacomm's is not given.
        if let Some(v) = env("NUVEC_DISTRIBUTED_TIMEOUT") {
            cfg.timeout = timeout_of("NUVEC_DISTRIBUTED_TIMEOUT", &v).map_err(|_| {
                table::bad(
                    "NUVEC_DISTRIBUTED_TIMEOUT",
                    &v,
                    "must be from 0.001 to 1e9 seconds",
                )
            })?;
        }
        table::apply(&mut cfg, &env)?;
        cfg.device = device_from_env()?;
        cfg.local_world = local_world_from_env(world_size)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads rank, world size and coordinator from the environment (see the module docs), and
    /// every setting.
    pub fn from_env() -> Result<Self> {
        let (rank, size, coordinator) = Config::identity_from_env()?;
        Config::new(rank, size, coordinator)
    }

    /// A config with this identity and every setting at its default, reading of the environment
    /// only the job's identity, secret and launcher (for a rank whose settings are bad to tell
    /// the group, and for tests).
    pub fn defaults(rank: usize, world_size: usize, coordinator: impl Into<String>) -> Self {
        Config {
            rank,
            world_size,
            coordinator: coordinator.into(),
            bind_addr: None,
            timeout: DEFAULT_TIMEOUT,
            device: DeviceChoice::default(),
            copy: None,
            simd_baseline: false,
            reduce_threads: None,
            slot_bytes: default_slot_bytes(world_size, DEFAULT_SLOTS),
            slots: DEFAULT_SLOTS,
            tcp_chunk: DEFAULT_TCP_CHUNK,
            transport: TransportKind::Auto,
            shm: None,
            local_world: None,
            host_id: host_id(),
            pin: crate::pin::Pin::Off,
            progress_cpu: None,
            progress: Progress::Thread,
            algo: Algo::Auto,
            bcast: Bcast::Auto,
            poll: Poll::Auto,
            connect: Connect::OnDemand,
            peers_max: None,
            zero_copy_min: 0,
            ib_timeout: None,
            ib_retry: None,
            job_id: job_id_from_env(),
            secret: secret_from_env().ok().flatten(),
            discovery: Discovery::Given,
            debug: None,
            debug_file: None,
            coordinator_file: None,
            replacement: false,
        }
        .discovered()
    }

    /// This config, finding rank 0 as the launcher allows where `coordinator` is empty.
    fn discovered(self) -> Config {
        Config {
            discovery: discovery_from(&env, &self.coordinator, self.world_size),
            ..self
        }
    }

    /// Whether `RDMACOMM_TRANSPORT=auto` picks shared memory: allowed, and the launcher says
    /// every rank of a world of two or more is on this host.
    pub fn all_local(&self) -> bool {
        self.shm != Some(false) && self.world_size > 1 && self.local_world == Some(self.world_size)
    }

    /// Whether a network transport reaches the peers on this host through shared memory:
    /// under `RDMACOMM_TRANSPORT=auto` unless `RDMACOMM_SHM=0`, else only with `RDMACOMM_SHM=1`.
    pub fn shm_for_peers(&self) -> bool {
        match self.shm {
            Some(yes) => yes,
            None => self.transport == TransportKind::Auto,
        }
    }

    /// The settings every rank must share, as `NAME=value` words (compared at the rendezvous,
    /// so that a difference is named before any operation runs).
    pub fn shared_settings(&self) -> String {
        format!(
            "RDMACOMM_ALGO={} RDMACOMM_BCAST={} RDMACOMM_SLOTS={} RDMACOMM_SLOT_BYTES={} \
             RDMACOMM_TCP_CHUNK={}",
            ALL_REDUCE_ALGOS[self.algo.code() as usize],
            BROADCAST_ALGOS[self.bcast.code() as usize],
            self.slots,
            self.slot_bytes,
            self.tcp_chunk
        )
    }

    /// This rank's identity from the environment: rank, world size and coordinator.
    pub fn identity_from_env() -> Result<(usize, usize, String)> {
        identity_from(&env)
    }

    /// Whether a launcher's variables name this process's rank (else it runs alone).
    pub fn launched() -> bool {
        RANK_VARIABLES.iter().any(|v| env(v).is_some())
    }
}

impl Config {
    /// These settings for another group this rank belongs to (a split, a shrunk or grown
    /// group, a rejoin): its rank and size there, where that group meets, and how many of its
    /// ranks share this host, if known.
    pub(crate) fn for_group(
        &self,
        rank: usize,
        size: usize,
        meet: String,
        local_world: Option<usize>,
    ) -> Config {
        Config {
            rank,
            world_size: size,
            coordinator: meet,
            local_world,
            ..self.clone()
        }
    }

    /// Checks ranges and geometry.
    pub fn validate(&self) -> Result<()> {
        if self.world_size == 0 {
            return Err(Error::Config("world size must be at least 1".into()));
        }
        if self.world_size > MAX_WORLD {
            return Err(Error::Config(format!(
                "world size {} is more than rdmacomm supports ({MAX_WORLD}: a work request names \
                 its peer in 14 bits)",
                self.world_size
            )));
        }
        if self.world_size > 1 && self.coordinator.is_empty() && self.discovery != Discovery::Pmix {
            return Err(Error::Config(format!(
                "rank {} of {}: no coordinator address; set RDMACOMM_COORDINATOR=host:port or \
                 MASTER_ADDR (and MASTER_PORT)",
                self.rank, self.world_size
            )));
        }
        if self.rank >= self.world_size {
            return Err(Error::Config(format!(
                "rank {} is out of range for world size {} (ranks are 0..{})",
                self.rank, self.world_size, self.world_size
            )));
        }
        if self.slot_bytes < 4096 || self.slot_bytes % 64 != 0 || self.slot_bytes > (1 << 30) {
            return Err(Error::Config(format!(
                "RDMACOMM_SLOT_BYTES={}: must be a multiple of 64 between 4096 and 1 GiB",
                self.slot_bytes
            )));
        }
        if self.tcp_chunk < 4096 || self.tcp_chunk % 64 != 0 || self.tcp_chunk > (16 << 20) {
            return Err(Error::Config(format!(
                "RDMACOMM_TCP_CHUNK={}: must be a multiple of 64 between 4096 and 16 MiB",
                self.tcp_chunk
            )));
        }
        if !(2..=256).contains(&self.slots) {
            return Err(Error::Config(format!(
                "RDMACOMM_SLOTS={}: must be 2..=256",
                self.slots
            )));
        }
        if !(MIN_TIMEOUT..=MAX_TIMEOUT).contains(&self.timeout) {
            return Err(Error::Config(format!(
                "timeout {:?} (RDMACOMM_TIMEOUT): must be from 1 ms to 1e9 s (beyond, deadlines \
                 overflow)",
                self.timeout
            )));
        }
        self.check_cores()?;
        // Both ride in a rank's hello, which rank 0 bounds before authentication.
        for (what, v) in [
            ("job id (RDMACOMM_JOB_ID)", &self.job_id),
            ("host id (RDMACOMM_HOST_ID)", &self.host_id),
        ] {
            if v.len() > MAX_ID {
                return Err(Error::Config(format!(
                    "the {what} has {} bytes: at most {MAX_ID}",
                    v.len()
                )));
            }
        }
        if let Some(t) = self.ib_timeout.filter(|t| !(1..=31).contains(t)) {
            return Err(Error::Config(format!(
                "RDMACOMM_IB_TIMEOUT={t}: must be 1..=31"
            )));
        }
        if let Some(r) = self.ib_retry.filter(|r| *r > 6) {
            return Err(Error::Config(format!(
                "RDMACOMM_IB_RETRY={r}: must be 0..=6"
            )));
        }
        if self.local_world == Some(0) {
            return Err(Error::Config(
                "local world size 0: a launcher that says how many ranks it started here says at \
                 least 1"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Every core named (`pin`, `progress_cpu`) is one this process may run on: a core past
    /// the affinity set's size would abort the process inside libc.
    fn check_cores(&self) -> Result<()> {
        let named: Vec<(usize, &str)> = match &self.pin {
            crate::pin::Pin::Cores(c) => c.iter().map(|&c| (c, "RDMACOMM_PIN")).collect(),
            _ => Vec::new(),
        };
        let cpu = self.progress_cpu.map(|c| (c, "RDMACOMM_PROGRESS_CPU"));
        if named.is_empty() && cpu.is_none() {
            return Ok(());
        }
        let allowed = crate::pin::allowed_cores();
        for (core, name) in named.into_iter().chain(cpu) {
            if !allowed.contains(&core) {
                return Err(Error::Config(format!(
                    "{name}: core {core} is not one this process may run on ({})",
                    allowed
                        .iter()
                        .map(|c| c.to_string())
                        .collect::<Vec<_>>()
                        .join(",")
                )));
            }
        }
        Ok(())
    }
}

/// The longest job or host identity.
const MAX_ID: usize = 1024;

/// The shortest and longest timeouts a configuration may set.
const MIN_TIMEOUT: Duration = Duration::from_millis(1);
const MAX_TIMEOUT: Duration = Duration::from_secs(1_000_000_000);

/// Fails on an `RDMACOMM_*` variable that nothing reads (a typo), naming the closest known one.
fn check_names() -> Result<()> {
    for (k, _) in std::env::vars_os() {
        let Some(k) = k.to_str() else { continue };
        if !k.starts_with("RDMACOMM_") || VARIABLES.contains(&k) || TOOL_VARIABLES.contains(&k) {
            continue;
        }
        let near = VARIABLES
            .iter()
            .min_by_key(|v| distance(k, v))
            .expect("listed");
        return Err(Error::Config(format!(
            "{k} is not a setting of rdmacomm (did you mean {near}?)"
        )));
    }
    Ok(())
}

/// Edit distance between two names, for suggestions.
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for j in 0..b.len() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != b[j]))
                .min(row[j] + 1)
                .min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests;
