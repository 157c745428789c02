//! [`Comm`]: the byte-level [`Communicator`] over a transport (RDMA, or TCP where there is none).

use crate::api::{
    check_all_gather, check_all_reduce, check_peer, check_root, check_sum_scatter, Communicator,
};
use crate::collectives::{bcast, halving, p2p, ring};
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

/// all_reduce buffers up to this many bytes use recursive doubling under [`Algo::Auto`], unless
/// the link says otherwise ([`Link::doubling_max`]).
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

    /// The algorithm [`Algo::Auto`] runs for `bytes` on `n` ranks over a link whose
    /// recursive doubling wins up to `doubling_max` bytes ([`Link::doubling_max`]): doubling up
    /// to there, then halving-doubling, and the ring for non-powers of two (whose fold doubles
    /// the traffic of two ranks).
    pub fn choose(self, n: usize, bytes: usize, doubling_max: usize) -> Algo {
        match self {
            Algo::Auto if bytes <= doubling_max => Algo::Doubling,
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
    cfg: Config,
}

impl Comm {
    /// Joins the group described by `cfg` (every rank must call this). A world of one needs no
    /// device.
    pub fn new(cfg: &Config) -> Result<Self> {
        cfg.validate()?;
        crate::copy::requested()?;
        // Choose the copy kernel (its one timing, where it is measured) here, not inside the
        // first operation.
        crate::copy::kernel();
        let link = if cfg.world_size > 1 {
            Some(transport::connect(cfg, cfg.transport)?)
        } else {
            None
        };
        let (local, nlocal) = link.as_ref().map_or((0, 1), |l| l.local_rank());
        cfg.pin.apply(local, nlocal)?;
        Ok(Comm {
            rank: cfg.rank,
            size: cfg.world_size,
            inner: Mutex::new(Inner {
                link,
                scratch: Vec::new(),
            }),
            poisoned: Mutex::new(None),
            algo: Mutex::new(Algo::from_env()?),
            cfg: cfg.clone(),
        })
    }

    /// Joins the group described by the environment (see [`Config::from_env`]).
    pub fn from_env() -> Result<Self> {
        Comm::new(&Config::from_env()?)
    }

    /// Splits into subgroups (MPI_Comm_split / MLX's split), collectively over every rank of
    /// this communicator: ranks with the same `color` form one, ordered by `key` (ties by rank
    /// here). A negative color means "in no subgroup": that rank gets a world of one. Queue pair
    /// endpoints are exchanged over this communicator; each subgroup gets its own side channel
    /// (for abort and health) at its first rank, whose address also goes over this
    /// communicator. The result is independent of this one: either can be used or dropped first.
    pub fn split_comm(&self, color: i32, key: i32) -> Result<Comm> {
        let (n, r) = (self.size, self.rank);
        let mut mine = [0u8; 8];
        mine[..4].copy_from_slice(&color.to_le_bytes());
        mine[4..].copy_from_slice(&key.to_le_bytes());
        let mut all = vec![0u8; 8 * n];
        crate::Communicator::all_gather(self, &mine, &mut all)?;
        let entry = |q: usize| {
            let e = &all[8 * q..8 * q + 8];
            (
                i32::from_le_bytes(e[..4].try_into().unwrap()),
                i32::from_le_bytes(e[4..].try_into().unwrap()),
            )
        };
        let mut members: Vec<usize> = if color < 0 {
            vec![r]
        } else {
            (0..n).filter(|&q| entry(q).0 == color).collect()
        };
        members.sort_by_key(|&q| (entry(q).1, q));
        let sub_rank = members
            .iter()
            .position(|&q| q == r)
            .expect("a member of its own group");
        let grouped = members.len() > 1;
        // The subgroup's first rank listens for its side channel; everyone learns the address.
        let my_ip = match &self.cfg.bind_addr {
            Some(ip) => ip.clone(),
            None => {
                let a = self
                    .lock()
                    .link
                    .as_ref()
                    .map(|l| l.peer(r).addr)
                    .unwrap_or_default();
                if a.is_empty() {
                    "127.0.0.1".into()
                } else {
                    a
                }
            }
        };
        let mut listener = None;
        let mut field = [0u8; 64];
        if grouped && sub_rank == 0 {
            let l = std::net::TcpListener::bind((my_ip.as_str(), 0))
                .map_err(|e| Error::Bootstrap(format!("split: cannot listen on {my_ip}: {e}")))?;
            let text = l.local_addr()?.to_string();
            field[..text.len()].copy_from_slice(text.as_bytes());
            listener = Some(l);
        }
        let mut fields = vec![0u8; 64 * n];
        crate::Communicator::all_gather(self, &field, &mut fields)?;
        let lead = members[0];
        let lead_addr = String::from_utf8_lossy(&fields[64 * lead..64 * lead + 64])
            .trim_end_matches('\0')
            .to_string();
        let mut sub_cfg = self.cfg.clone();
        sub_cfg.rank = sub_rank;
        sub_cfg.world_size = members.len();
        sub_cfg.coordinator = lead_addr;
        // Cards over this communicator: every rank takes part, even one that joins no subgroup.
        let exchange = |card: &[u8]| -> Result<Vec<Vec<u8>>> {
            let mut lens = vec![0u8; 4 * n];
            crate::Communicator::all_gather(self, &(card.len() as u32).to_le_bytes(), &mut lens)?;
            let len_of =
                |q: usize| u32::from_le_bytes(lens[4 * q..4 * q + 4].try_into().unwrap()) as usize;
            let max = (0..n).map(len_of).max().unwrap_or(0);
            let mut padded = card.to_vec();
            padded.resize(max, 0);
            let mut cards = vec![0u8; max * n];
            crate::Communicator::all_gather(self, &padded, &mut cards)?;
            Ok(members
                .iter()
                .map(|&q| cards[q * max..q * max + len_of(q)].to_vec())
                .collect())
        };
        if !grouped {
            exchange(&[])?;
            let cfg = Config {
                rank: 0,
                world_size: 1,
                ..sub_cfg
            };
            return Comm::new(&cfg);
        }
        let kind = self.cfg.transport;
        let meet_cfg = sub_cfg.clone();
        let link = transport::connect_with(&sub_cfg, kind, &mut |card| {
            let cards = exchange(card)?;
            let mut rv =
                crate::transport::bootstrap::rendezvous_on(&meet_cfg, &[], listener.take())?;
            rv.cards = cards;
            Ok(rv)
        })?;
        Ok(Comm {
            rank: sub_rank,
            size: members.len(),
            inner: Mutex::new(Inner {
                link: Some(link),
                scratch: Vec::new(),
            }),
            poisoned: Mutex::new(None),
            algo: Mutex::new(self.algorithm()),
            cfg: sub_cfg,
        })
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
        let r = f(link, &mut inner.scratch).and_then(|v| link.finish().map(|_| v));
        link.release();
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
        let algo = self.algorithm();
        self.with_link(|l, scratch| {
            l.lend(data);
            // Whole elements per slice; each slice is an all_reduce of its own, its algorithm
            // chosen by its size, so every rank still gets the same bits, run to run.
            let es = dtype.size();
            let slice = (l.slice_bytes() / es).max(1) * es;
            let mut rest = data;
            loop {
                let (part, tail) = rest.split_at_mut(rest.len().min(slice));
                match algo.choose(l.size(), part.len(), l.doubling_max()) {
                    Algo::Doubling => halving::all_reduce_doubling(l, op, dtype, part, scratch)?,
                    Algo::Halving => halving::all_reduce_halving(l, op, dtype, part, scratch)?,
                    _ => ring::all_reduce(l, op, dtype, part)?,
                }
                if tail.is_empty() {
                    return Ok(());
                }
                rest = tail;
            }
        })
    }

    fn all_gather(&self, input: &[u8], output: &mut [u8]) -> Result<()> {
        check_all_gather(self.size, input, output)?;
        let n = input.len();
        if self.size == 1 {
            self.check_usable()?;
            crate::copy::copy(output, input);
            return Ok(());
        }
        self.with_link(|l, _| {
            crate::copy::copy(&mut output[l.rank() * n..(l.rank() + 1) * n], input);
            l.lend(output);
            ring::all_gather(l, output)
        })
    }

    fn send(&self, dst: usize, data: &[u8]) -> Result<()> {
        check_peer("send", self.rank, self.size, dst)?;
        self.with_link(|l, _| {
            l.lend(data);
            p2p::send(l, dst, data)
        })
    }

    fn recv(&self, src: usize, data: &mut [u8]) -> Result<()> {
        check_peer("recv", self.rank, self.size, src)?;
        self.with_link(|l, _| p2p::recv(l, src, data))
    }

    fn sum_scatter(&self, dtype: DType, input: &[u8], output: &mut [u8]) -> Result<()> {
        check_sum_scatter(self.size, dtype, input, output)?;
        if self.size == 1 {
            self.check_usable()?;
            crate::copy::copy(output, input);
            return Ok(());
        }
        self.with_link(|l, scratch| {
            scratch.clear();
            scratch.extend_from_slice(input);
            l.lend(scratch);
            if l.size().is_power_of_two() {
                halving::reduce_scatter_halving(l, AllReduce::Sum, dtype, scratch)?;
            } else {
                ring::reduce_scatter(l, AllReduce::Sum, dtype, scratch)?;
            }
            let (r, m) = (l.rank(), output.len());
            crate::copy::copy(output, &scratch[r * m..(r + 1) * m]);
            Ok(())
        })
    }

    /// Registers `buf` with the transport (fails, without running `f`, when registering fails,
    /// e.g. at the locked-memory limit, whose error says how to raise it, or when
    /// [`crate::transport::rdma::MAX_REGISTERED`] buffers are registered already); the
    /// registration ends however `f` exits, a panic included.
    fn with_registered(
        &self,
        buf: &mut [u8],
        f: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<()> {
        self.check_usable()?;
        let id = match self.lock().link.as_deref_mut() {
            Some(l) => l.register(buf)?,
            None => None,
        };
        /// Ends the registration however `f` exits.
        struct Unregister<'a>(&'a Comm, Option<u64>);
        impl Drop for Unregister<'_> {
            fn drop(&mut self) {
                if let (Some(id), Some(l)) = (self.1, self.0.lock().link.as_deref_mut()) {
                    l.unregister(id);
                }
            }
        }
        let _end = Unregister(self, id);
        f(buf)
    }

    fn split(&self, color: i32, key: i32) -> Result<std::sync::Arc<dyn Communicator>> {
        Ok(std::sync::Arc::new(self.split_comm(color, key)?))
    }

    fn broadcast(&self, root: usize, data: &mut [u8]) -> Result<()> {
        check_root(root, self.size)?;
        if self.size == 1 {
            return self.check_usable();
        }
        // RDMACOMM_BCAST=chain|tree|auto. Auto (measured, 4 ranks on lo-rxe): the binomial tree up
        // to 8 KiB on more than 2 ranks (fewer hops), the pipelined chain above (1.7 vs 3.2 ms
        // at 32 KiB, 105 vs 139 ms at 2 MiB).
        let tree = match std::env::var("RDMACOMM_BCAST").as_deref() {
            Ok("tree") => true,
            Ok("chain") => false,
            _ => self.size > 2 && data.len() <= 8 << 10,
        };
        self.with_link(|l, _| {
            l.lend(data);
            if tree {
                bcast::broadcast_tree(l, root, data)
            } else {
                bcast::broadcast(l, root, data)
            }
        })
    }

    fn barrier(&self) -> Result<()> {
        if self.size == 1 {
            return self.check_usable();
        }
        self.with_link(|l, _| bcast::barrier(l))
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
