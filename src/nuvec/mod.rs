//! rdmacomm as nuvec's distributed backend (feature `nuvec`): [`Transport`] implements
//! `nuvec_core::distributed::Communicator` over a [`Comm`], and [`init`] does what
//! `nuvec_distributed::init` does, over RDMA, shared memory or TCP.
//!
//! ```no_run
//! use nuvec_core::distributed;
//! // Under rdmacomm-run, torchrun, mpirun, srun, or nuvec's own MLX_RANK + MLX_HOSTFILE.
//! let group = rdmacomm::nuvec::init(true)?;
//! # let x: nuvec_core::Array = todo!();
//! let total = distributed::all_sum(&x, None)?; // the default group: rdmacomm
//! # Ok::<(), nuvec_core::Error>(())
//! ```
//!
//! Threads: nuvec calls a group's transport from whichever thread evaluates a collective, one
//! collective at a time per group; so may any caller. Two calls at once on one transport are
//! refused (their order could differ between ranks), never silently crossed. A split gives a
//! transport of its own, which may run beside its parent.
//!
//! Errors: a bad argument is `Error::InvalidArgument`; anything involving a peer is
//! `Error::Backend("distributed: rank R: ...")` naming the peer, after which every call fails
//! at once ("failed earlier").

mod reduce;
mod stream;

use crate::api::Communicator as _;
use crate::comm::Comm;
use crate::config::Config;
use crate::serial::Serial;
use nuvec_core::distributed::{self as nd, AllReduce, Group};
use nuvec_core::{DType, Error, Result};
use std::sync::Arc;

/// rdmacomm as a `nuvec_core::distributed::Communicator`: install it with
/// `Group::new(Arc::new(transport))`, or let [`init`] do it.
pub struct Transport {
    serial: Serial<State>,
    rank: usize,
}

#[derive(Default)]
struct State {
    /// Bytes received from each peer and not read yet.
    streams: Vec<stream::Stream>,
    /// Scratch for the widened dtypes.
    wide: Vec<u8>,
    wide_out: Vec<u8>,
}

impl Transport {
    /// Wraps a communicator (built with [`Comm::from_env`] or [`Comm::new`]); any thread may
    /// then call it.
    pub fn new(comm: Comm) -> Transport {
        let (rank, size) = (comm.rank(), comm.size());
        let state = State {
            streams: (0..size).map(|_| Default::default()).collect(),
            ..Default::default()
        };
        Transport {
            serial: Serial::new(comm, state),
            rank,
        }
    }

    /// Runs `f` as this transport's one call in progress, from the calling thread.
    fn run<T>(
        &self,
        what: &str,
        f: impl FnOnce(&Comm, &mut State) -> crate::Result<T>,
    ) -> Result<T> {
        self.serial.run(what, f).map_err(|e| self.error(e))
    }

    /// rdmacomm's error as nuvec's: arguments are `InvalidArgument`, the rest `Backend`.
    fn error(&self, e: crate::Error) -> Error {
        let r = self.rank;
        match e {
            crate::Error::InvalidArgument(m) | crate::Error::Config(m) => {
                Error::InvalidArgument(format!("distributed: rank {r}: {m}"))
            }
            e @ (crate::Error::BadSetting { .. } | crate::Error::LengthMismatch { .. }) => {
                Error::InvalidArgument(format!("distributed: rank {r}: {e}"))
            }
            crate::Error::Poisoned(why) => Error::Backend(format!(
                "distributed: rank {r}: the communicator failed earlier ({why}); no further \
                 operation runs"
            )),
            e => Error::Backend(format!("distributed: rank {r}: {e}")),
        }
    }

    /// The communicator underneath, for what nuvec's trait lacks (its own thread rule
    /// applies: it runs the calls of the thread that last called this transport).
    pub fn comm(&self) -> &Comm {
        self.serial.comm()
    }

    /// nuvec 0.6's `sum_scatter`: rank r's `output` is the sum of every rank's block r of
    /// `input` (`input.len() == size * output.len()`); bools are or-ed, as nuvec sums them.
    pub fn sum_scatter(&self, dtype: DType, input: &[u8], output: &mut [u8]) -> Result<()> {
        self.run("sum_scatter", |c, s| {
            reduce::sum_scatter(c, dtype, input, output, &mut s.wide, &mut s.wide_out)
        })
    }

    /// nuvec 0.6's `health`: whether every peer is still reachable, without blocking and
    /// without a collective; an error names a lost peer.
    pub fn health(&self) -> Result<()> {
        self.comm().health().map_err(|e| self.error(e))
    }

    /// After a rank was lost: the survivors agree and go on over a new transport
    /// ([`Comm::shrink`]), which the program installs as its group
    /// (`nd::set_default_group(Group::new(Arc::new(t)))`); the agreement carries the least and
    /// the AND of the `value`s. This transport refuses every call afterwards.
    pub fn shrink(&self, value: u64) -> Result<(Transport, crate::Agreed)> {
        let (c, agreed) = self.run("shrink", |c, _| c.shrink(value))?;
        Ok((Transport::new(c), agreed))
    }

    /// Admits `k` newcomers (each started with [`Transport::rejoin`]) at a step boundary and
    /// goes on over a new transport with them ([`Comm::grow`]).
    pub fn grow(&self, k: usize) -> Result<Transport> {
        self.run("grow", |c, _| c.grow(k)).map(Transport::new)
    }

    /// Joins a running job as a newcomer ([`Comm::rejoin_from_env`]), admitted when its
    /// members call [`Transport::grow`].
    pub fn rejoin() -> Result<Transport> {
        Comm::rejoin_from_env()
            .map(Transport::new)
            .map_err(|e| Error::Backend(format!("distributed: {e}")))
    }
}

impl nd::Communicator for Transport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.comm().size()
    }

    fn all_reduce(&self, op: AllReduce, dtype: DType, data: &mut [u8]) -> Result<()> {
        self.run("all_reduce", |c, s| {
            reduce::all_reduce(c, op, dtype, data, &mut s.wide)
        })
    }

    fn all_gather(&self, input: &[u8], output: &mut [u8]) -> Result<()> {
        self.run("all_gather", |c, _| c.all_gather(input, output))
    }

    fn send(&self, dst: usize, data: &[u8]) -> Result<()> {
        self.run("send", |c, _| stream::send(c, dst, data))
    }

    fn recv(&self, src: usize, data: &mut [u8]) -> Result<()> {
        self.run("recv", |c, s| {
            crate::api::check_peer("recv", c.rank(), c.size(), src)?;
            let r = stream::recv(c, &mut s.streams[src], src, data);
            if let Err(e) = &r {
                if e.is_argument() {
                    // The stream from `src` is out of step: nothing after it can be trusted.
                    c.abort(&e.to_string());
                }
            }
            r
        })
    }

    fn split(&self, color: i32, key: i32) -> Result<Arc<dyn nd::Communicator>> {
        let sub = self.run("split", |c, _| c.split_comm(color, key))?;
        Ok(Arc::new(Transport::new(sub)))
    }
}

/// Joins the job the launcher started (as [`Comm::from_env`]: rdmacomm-run, torchrun, mpirun,
/// srun, or nuvec's `MLX_RANK` with `MLX_HOSTFILE`), makes it nuvec's default group and
/// returns it, as `nuvec_distributed::init(strict)` does. Without a launcher's variables: an
/// error if `strict`, else a group of one.
pub fn init(strict: bool) -> Result<Group> {
    let err = |e: crate::Error| match e {
        crate::Error::Config(m) | crate::Error::InvalidArgument(m) => {
            Error::InvalidArgument(format!("distributed: {m}"))
        }
        e @ crate::Error::BadSetting { .. } => Error::InvalidArgument(format!("distributed: {e}")),
        e => Error::Backend(format!("distributed: {e}")),
    };
    let (_, size, _) = Config::identity_from_env().map_err(err)?;
    if size <= 1 && strict && !Config::launched() {
        return Err(Error::InvalidArgument(
            "distributed: no launcher's variables (rdmacomm-run, torchrun, mpirun, srun, or \
             MLX_RANK with MLX_HOSTFILE) say which rank this is"
                .into(),
        ));
    }
    let group = if size <= 1 {
        Group::single()
    } else {
        Group::new(Arc::new(Transport::new(Comm::from_env().map_err(err)?)))
    };
    nd::set_default_group(group.clone());
    Ok(group)
}
