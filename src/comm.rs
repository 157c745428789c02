//! [`Comm`]: the byte-level [`Communicator`] over a transport (RDMA, or TCP where there is none).

use crate::api::{check_all_gather, check_all_reduce, check_peer, check_sum_scatter, Communicator};
use crate::collectives::{halving, p2p, ring};
use crate::config::Config;
use crate::dtype::{AllReduce, DType};
use crate::error::{Error, Result};
use crate::transport::{self, Link, Transport};
use std::sync::{Mutex, MutexGuard};

struct Inner {
    /// None for a world of one.
    link: Option<Box<dyn Transport>>,
    scratch: Vec<u8>,
}

/// The all_reduce algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algo {
    /// Pipelined ring: reduce-scatter then all-gather (bandwidth-optimal, 2(n-1) steps).
    Ring,
    /// Recursive halving-doubling (Rabenseifner): bandwidth-optimal in 2 log2(n) steps.
    Halving,
    /// Recursive doubling of the whole vector: log2(n) steps, for small messages.
    Doubling,
    /// Chosen by size and world size (see [`Algo::choose`]).
    Auto,
}

/// all_reduce buffers up to this many bytes use recursive doubling under [`Algo::Auto`].
pub const DOUBLING_MAX_BYTES: usize = 16 << 10;

impl Algo {
    /// Parses `ring`, `halving`, `doubling` or `auto`.
    pub fn parse(s: &str) -> Result<Algo> {
        Ok(match s {
            "ring" => Algo::Ring,
            "halving" | "rabenseifner" => Algo::Halving,
            "doubling" => Algo::Doubling,
            "auto" => Algo::Auto,
            _ => {
                return Err(Error::Config(format!(
                    "RDMACOMM_ALGO={s:?}: use ring, halving, doubling or auto"
                )))
            }
        })
    }

    /// Reads `RDMACOMM_ALGO` (default `auto`).
    pub fn from_env() -> Result<Algo> {
        match std::env::var("RDMACOMM_ALGO") {
            Ok(v) if !v.is_empty() => Algo::parse(&v),
            _ => Ok(Algo::Auto),
        }
    }

    /// The algorithm [`Algo::Auto`] runs for `bytes` on `n` ranks: recursive doubling up to
    /// [`DOUBLING_MAX_BYTES`], then halving-doubling, and the ring for non-powers of two
    /// (whose fold doubles the traffic of two ranks).
    pub fn choose(self, n: usize, bytes: usize) -> Algo {
        match self {
            Algo::Auto if bytes <= DOUBLING_MAX_BYTES => Algo::Doubling,
            Algo::Auto if n.is_power_of_two() => Algo::Halving,
            Algo::Auto => Algo::Ring,
            a => a,
        }
    }
}

/// A communicator: over RDMA (one reliable-connected queue pair per peer) or, where no RDMA
/// device exists, over TCP (`RDMACOMM_TRANSPORT`). Calls are serialized (the trait is `Sync`;
/// one operation runs at a time).
pub struct Comm {
    rank: usize,
    size: usize,
    inner: Mutex<Inner>,
    /// Set by the first failure; every later call returns it (readable while an op runs).
    poisoned: Mutex<Option<String>>,
    algo: Mutex<Algo>,
}

impl Comm {
    /// Joins the group described by `cfg` (every rank must call this). A world of one needs no
    /// device.
    pub fn new(cfg: &Config) -> Result<Self> {
        cfg.validate()?;
        let link = if cfg.world_size > 1 {
            Some(transport::connect(cfg, cfg.transport)?)
        } else {
            None
        };
        Ok(Comm {
            rank: cfg.rank,
            size: cfg.world_size,
            inner: Mutex::new(Inner {
                link,
                scratch: Vec::new(),
            }),
            poisoned: Mutex::new(None),
            algo: Mutex::new(Algo::from_env()?),
        })
    }

    /// Joins the group described by the environment (see [`Config::from_env`]).
    pub fn from_env() -> Result<Self> {
        Comm::new(&Config::from_env()?)
    }

    /// Chooses the all_reduce algorithm (every rank must choose the same).
    pub fn set_algorithm(&self, algo: Algo) {
        *self.algo.lock().unwrap_or_else(|e| e.into_inner()) = algo;
    }

    /// The all_reduce algorithm setting.
    pub fn algorithm(&self) -> Algo {
        *self.algo.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The transport in use, in words: `RDMA <device> port <n> GID[<i>]` or `TCP` (None for a
    /// world of one).
    pub fn device(&self) -> Option<String> {
        self.lock().link.as_ref().map(|l| l.describe())
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the link unless the communicator failed before; a failure poisons it.
    fn with_link<T>(&self, f: impl FnOnce(&mut dyn Link, &mut Vec<u8>) -> Result<T>) -> Result<T> {
        let mut g = self.lock();
        self.check_usable()?;
        let inner = &mut *g;
        let link = inner
            .link
            .as_deref_mut()
            .expect("world of one handled by the caller");
        let r = f(link, &mut inner.scratch);
        if let Err(e) = &r {
            self.poison(e);
        }
        r
    }

    fn poison(&self, e: &Error) {
        let mut p = self.poisoned.lock().unwrap_or_else(|e| e.into_inner());
        if p.is_none() {
            *p = Some(e.to_string());
        }
    }

    fn check_usable(&self) -> Result<()> {
        match &*self.poisoned.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(why) => Err(Error::Poisoned(why.clone())),
            None => Ok(()),
        }
    }
}

impl Communicator for Comm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce(&self, op: AllReduce, dtype: DType, data: &mut [u8]) -> Result<()> {
        check_all_reduce(dtype, data)?;
        if self.size == 1 {
            return self.check_usable();
        }
        let algo = self.algorithm().choose(self.size, data.len());
        self.with_link(|l, scratch| match algo {
            Algo::Doubling => halving::all_reduce_doubling(l, op, dtype, data, scratch),
            Algo::Halving => halving::all_reduce_halving(l, op, dtype, data, scratch),
            _ => ring::all_reduce(l, op, dtype, data),
        })
    }

    fn all_gather(&self, input: &[u8], output: &mut [u8]) -> Result<()> {
        check_all_gather(self.size, input, output)?;
        let n = input.len();
        if self.size == 1 {
            self.check_usable()?;
            output.copy_from_slice(input);
            return Ok(());
        }
        self.with_link(|l, _| {
            output[l.rank() * n..(l.rank() + 1) * n].copy_from_slice(input);
            ring::all_gather(l, output)
        })
    }

    fn send(&self, dst: usize, data: &[u8]) -> Result<()> {
        check_peer("send", self.rank, self.size, dst)?;
        self.with_link(|l, _| p2p::send(l, dst, data))
    }

    fn recv(&self, src: usize, data: &mut [u8]) -> Result<()> {
        check_peer("recv", self.rank, self.size, src)?;
        self.with_link(|l, _| p2p::recv(l, src, data))
    }

    fn sum_scatter(&self, dtype: DType, input: &[u8], output: &mut [u8]) -> Result<()> {
        check_sum_scatter(self.size, dtype, input, output)?;
        if self.size == 1 {
            self.check_usable()?;
            output.copy_from_slice(input);
            return Ok(());
        }
        self.with_link(|l, scratch| {
            scratch.clear();
            scratch.extend_from_slice(input);
            if l.size().is_power_of_two() {
                halving::reduce_scatter_halving(l, AllReduce::Sum, dtype, scratch)?;
            } else {
                ring::reduce_scatter(l, AllReduce::Sum, dtype, scratch)?;
            }
            let (r, m) = (l.rank(), output.len());
            output.copy_from_slice(&scratch[r * m..(r + 1) * m]);
            Ok(())
        })
    }

    /// Never blocks: while another thread runs an operation, reports what is known (that
    /// operation itself fails within the timeout if a peer is lost).
    fn health(&self) -> Result<()> {
        self.check_usable()?;
        let mut g = match self.inner.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return Ok(()),
        };
        let Some(link) = g.link.as_mut() else {
            return Ok(());
        };
        let r = link.health();
        if let Err(e) = &r {
            self.poison(e);
        }
        r
    }
}
