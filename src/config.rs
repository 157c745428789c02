//! How a rank learns who it is: explicit [`Config`] or the environment of common launchers.
//!
//! Rank and world size, first match wins:
//! `RDMACOMM_RANK`/`RDMACOMM_WORLD_SIZE`, torchrun's `RANK`/`WORLD_SIZE`, Open MPI's
//! `OMPI_COMM_WORLD_RANK`/`OMPI_COMM_WORLD_SIZE`, PMI's `PMI_RANK`/`PMI_SIZE`, Slurm's
//! `SLURM_PROCID`/`SLURM_NTASKS`. Coordinator (rank 0's rendezvous address): `RDMACOMM_COORDINATOR`
//! (`host:port`), else `MASTER_ADDR`:`MASTER_PORT` (port 29500 if unset). `RDMACOMM_TIMEOUT`
//! (seconds, default 30) bounds every wait. `RDMACOMM_BIND_ADDR` is this rank's own IP (the source
//! of its bootstrap connection). `RDMACOMM_TRANSPORT` (`auto`, `rdma`, `tcp`) picks the transport.
//! World size 1 needs none of these.

use crate::error::{Error, Result};
use crate::verbs::DeviceChoice;
use std::time::Duration;

/// The default timeout for every wait on a peer.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// The default TCP chunk: a chunk and its 64-byte header fill one 64 KiB loopback segment (lo's
/// MTU is 65536: 65483 bytes of payload per segment), where 64 KiB chunks took two (the second
/// small, with its own wakeup). Measured on loopback, 2 ranks, minima of 9 alternating runs,
/// 65472 vs 65536 bytes with the 4-byte header then used: 256 KiB all_reduce 89 vs 105 us,
/// 1 MiB 266 vs 330, 2 MiB 539 vs 610; 128 KiB - 64 was within the noise of it, larger chunks
/// slower (less overlap of reduction and transfer).
pub const DEFAULT_TCP_CHUNK: usize = (64 << 10) - 128;

/// Slots per peer and direction unless `RDMACOMM_SLOTS` says otherwise.
pub const DEFAULT_SLOTS: usize = 4;

/// Registered memory per rank the default slot size aims at: every peer's receive and send slots.
pub const SLOT_BUDGET: usize = 32 << 20;

/// The default slot size: the largest power of two from 64 KiB to 1 MiB (2 MiB for two ranks)
/// whose slots (receive and send, `slots` each, for every rank) fit [`SLOT_BUDGET`]: 2 MiB for 2
/// ranks, 1 MiB up to 4, 512 KiB at 8, 64 KiB from 64. Measured on lo-rxe, all_reduce busbw
/// MB/s: 2 ranks, 1 MiB slots vs 256 KiB x 8: 1 MiB 48-52 vs 38-43, 4 MiB 44-51 vs 33-40; 2 ranks,
/// 4 x 2 MiB vs 4 x 1 MiB (two alternating rounds): 16 MiB 52 vs 37-39, 64 KiB-8 MiB alike, and
/// on 2 veth hosts alike (16 MiB 30-32 both). (8 x 1 MiB also fixed 16 MiB but made 128 KiB, two
/// 64 KiB chunks per operation, 3x slower, 10-13 ms against 3.3; 3 and 4 ranks gain nothing from
/// 8 slots: 16 MiB 27-28 vs 30 and 21-22 vs 23.5.)
pub fn default_slot_bytes(world_size: usize, slots: usize) -> usize {
    let fit = SLOT_BUDGET / (2 * world_size.max(1) * slots.max(1));
    let pow2 = if fit == 0 {
        0
    } else {
        1usize << (usize::BITS - 1 - fit.leading_zeros())
    };
    let cap = if world_size == 2 { 2 << 20 } else { 1 << 20 };
    pow2.clamp(64 << 10, cap)
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
    /// Bytes per staging slot (one RDMA write at most).
    pub slot_bytes: usize,
    /// Slots per peer and direction (writes in flight per peer).
    pub slots: usize,
    /// Largest chunk on a TCP connection (`RDMACOMM_TCP_CHUNK`, default 64 KiB - 128 =
    /// [`DEFAULT_TCP_CHUNK`]). Received chunks are staged in a buffer of four; small, it stays
    /// in the cache.
    pub tcp_chunk: usize,
    /// RDMA, TCP, or RDMA where usable (`RDMACOMM_TRANSPORT`).
    pub transport: crate::transport::Kind,
    /// Whether and where to pin the thread that creates the communicator (`RDMACOMM_PIN`).
    pub pin: crate::pin::Pin,
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

fn parse_num<T: std::str::FromStr>(name: &str, v: &str) -> Result<T> {
    v.trim()
        .parse::<T>()
        .map_err(|_| Error::Config(format!("{name}={v:?} is not a valid number")))
}

fn pair(r: &str, s: &str) -> Result<Option<(usize, usize)>> {
    match (env(r), env(s)) {
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
        let timeout = match env("RDMACOMM_TIMEOUT") {
            Some(v) => {
                let secs: f64 = parse_num("RDMACOMM_TIMEOUT", &v)?;
                if !(secs > 0.0 && secs.is_finite()) {
                    return Err(Error::Config(format!(
                        "RDMACOMM_TIMEOUT={v}: must be > 0 seconds"
                    )));
                }
                Duration::from_secs_f64(secs)
            }
            None => DEFAULT_TIMEOUT,
        };
        let slots = match env("RDMACOMM_SLOTS") {
            Some(v) => parse_num("RDMACOMM_SLOTS", &v)?,
            None => DEFAULT_SLOTS,
        };
        let slot_bytes = match env("RDMACOMM_SLOT_BYTES") {
            Some(v) => parse_num("RDMACOMM_SLOT_BYTES", &v)?,
            None => default_slot_bytes(world_size, slots),
        };
        let tcp_chunk = match env("RDMACOMM_TCP_CHUNK") {
            Some(v) => parse_num("RDMACOMM_TCP_CHUNK", &v)?,
            None => DEFAULT_TCP_CHUNK,
        };
        let cfg = Config {
            rank,
            world_size,
            coordinator: coordinator.into(),
            bind_addr: env("RDMACOMM_BIND_ADDR"),
            timeout,
            device: DeviceChoice::from_env()?,
            slot_bytes,
            slots,
            tcp_chunk,
            transport: crate::transport::Kind::from_env()?,
            pin: crate::pin::Pin::parse(&env("RDMACOMM_PIN").unwrap_or_default())?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads rank, world size and coordinator from the environment (see the module docs).
    pub fn from_env() -> Result<Self> {
        let (rank, size) = if let Some(p) = pair("RDMACOMM_RANK", "RDMACOMM_WORLD_SIZE")? {
            p
        } else if let Some(p) = pair("RANK", "WORLD_SIZE")? {
            p
        } else if let Some(p) = pair("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")? {
            p
        } else if let Some(p) = pair("PMI_RANK", "PMI_SIZE")? {
            p
        } else {
            pair("SLURM_PROCID", "SLURM_NTASKS")?.unwrap_or((0, 1))
        };
        let coordinator = match env("RDMACOMM_COORDINATOR") {
            Some(c) => c,
            None => match env("MASTER_ADDR") {
                Some(a) => format!("{a}:{}", env("MASTER_PORT").unwrap_or_else(|| "29500".into())),
                None if size == 1 => String::new(),
                None => {
                    return Err(Error::Config(format!(
                        "rank {rank} of {size}: no coordinator address; set RDMACOMM_COORDINATOR=host:port \
                         or MASTER_ADDR (and MASTER_PORT)"
                    )))
                }
            },
        };
        Config::new(rank, size, coordinator)
    }

    /// Checks ranges and geometry.
    pub fn validate(&self) -> Result<()> {
        if self.world_size == 0 {
            return Err(Error::Config("world size must be at least 1".into()));
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
        if self.world_size > 1 && self.coordinator.is_empty() {
            return Err(Error::Config("no coordinator address (host:port)".into()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_slot_sizes_fit_the_budget() {
        for (n, want) in [(1, 1 << 20), (2, 2 << 20), (4, 1 << 20), (8, 512 << 10)] {
            assert_eq!(default_slot_bytes(n, DEFAULT_SLOTS), want, "{n} ranks");
        }
        assert_eq!(
            default_slot_bytes(6, DEFAULT_SLOTS),
            512 << 10,
            "rounds down"
        );
        assert_eq!(default_slot_bytes(64, DEFAULT_SLOTS), 64 << 10);
        assert_eq!(default_slot_bytes(4096, DEFAULT_SLOTS), 64 << 10, "floor");
        assert_eq!(default_slot_bytes(3, DEFAULT_SLOTS), 1 << 20);
        for n in 1..300 {
            let b = default_slot_bytes(n, DEFAULT_SLOTS);
            let cap = if n == 2 { 2 << 20 } else { 1 << 20 };
            assert!(b.is_power_of_two() && (64 << 10..=cap).contains(&b));
            assert!(
                b == 64 << 10 || 2 * n * DEFAULT_SLOTS * b <= SLOT_BUDGET,
                "{n}"
            );
        }
    }
}
