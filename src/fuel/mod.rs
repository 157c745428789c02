//! rdmacomm as fuel's out-of-process transport (feature `fuel`): [`Transport`] implements
//! `fuel_parallel::comm::Communicator` on fuel's own lazy tensors, so fuel's tensor-parallel
//! layers (`RowParallel<C>`) run across processes over RDMA, shared memory or TCP.
//!
//! ```no_run
//! use fuel_parallel::comm::{Communicator, ReduceOp};
//! // Under rdmacomm-run, torchrun, mpirun or srun.
//! let comm = rdmacomm::fuel::Transport::from_env()?;
//! # let partial: fuel::lazy::Tensor = todo!();
//! let total = comm.all_reduce(&partial, ReduceOp::Sum)?; // on `partial`'s graph
//! # Ok::<(), fuel::Error>(())
//! ```
//!
//! Every result is materialised on its input's graph. Before any data moves, the ranks compare
//! what each passed (operation, dtype, shape, dim or root): a mismatch, an argument every rank
//! refuses, or a rank that could not read its tensor is an error on every rank, after which
//! the communicator refuses further work. Dtypes: F32, F64, F16, BF16, U8, I8, U32, I32, I64
//! directly, I16 widened, F8E4M3 through f32 (fuel's casts; a reduction rounds once), Bool
//! for Max (or), Min (and), gathers and broadcasts; sub-byte and other 8-bit floats are refused.
//! Max and Min propagate NaN, as fuel's `maximum`. Clones share one communicator; calls from
//! two threads at once are refused.

mod bytes;
mod header;

use crate::api::Communicator as _;
use crate::comm::Comm;
use crate::dtype::AllReduce;
use crate::relayout::{join_along, parts_along};
use crate::serial::Serial;
use bytes::Wire;
use fuel::lazy::Tensor;
use fuel::DType as F;
use fuel_parallel::comm::{CommInfo, Communicator, ReduceOp};
use header::Header;
use std::sync::Arc;

/// rdmacomm as a `fuel_parallel::comm::Communicator`: owned and cheap to clone (fuel's
/// `RowParallel::new` takes its communicator by value).
#[derive(Clone)]
pub struct Transport {
    serial: Arc<Serial<Scratch>>,
    rank: usize,
    size: usize,
}

#[derive(Default)]
struct Scratch {
    wide: Vec<u8>,
    wide_out: Vec<u8>,
}

/// The collectives, as headers name them.
const ALL_REDUCE: u8 = 1;
const ALL_GATHER: u8 = 2;
const REDUCE_SCATTER: u8 = 3;
const BROADCAST: u8 = 4;

/// fuel's dtypes, to name one from its discriminant in a header.
const DTYPES: [F; 18] = [
    F::U8,
    F::I8,
    F::U32,
    F::I16,
    F::I32,
    F::I64,
    F::BF16,
    F::F16,
    F::F32,
    F::F64,
    F::F8E4M3,
    F::F8E5M2,
    F::F6E2M3,
    F::F6E3M2,
    F::F4,
    F::F8E8M0,
    F::F8E6M2,
    F::Bool,
];

/// A header in words: "F32 [2, 3]".
fn describe(b: &[u8]) -> String {
    let (_, _, dtype, _, dims) = header::fields(b);
    let name = DTYPES
        .iter()
        .find(|d| **d as u8 == dtype)
        .map_or_else(|| format!("dtype #{dtype}"), |d| format!("{d:?}"));
    format!("{name} {dims:?}")
}

fn reduce_code(op: ReduceOp) -> u8 {
    match op {
        ReduceOp::Sum => 1,
        ReduceOp::Product => 2,
        ReduceOp::Min => 3,
        ReduceOp::Max => 4,
    }
}

/// rdmacomm's reduction for `op` on `w`, or why there is none.
fn reduction(op: ReduceOp, w: Wire) -> Result<AllReduce, String> {
    Ok(match (w, op) {
        (Wire::Bool, ReduceOp::Max) => AllReduce::Max,
        (Wire::Bool, ReduceOp::Min) => AllReduce::Min,
        (Wire::Bool, op) => {
            return Err(format!(
                "no {op:?} of Bool tensors (a mask is not a number; Max is or, Min is and)"
            ))
        }
        (_, ReduceOp::Sum) => AllReduce::Sum,
        (_, ReduceOp::Product) => AllReduce::Prod,
        (_, ReduceOp::Min) => AllReduce::Min,
        (_, ReduceOp::Max) => AllReduce::Max,
    })
}

/// Rows before `dim` and bytes from `dim` on, for elements of `size` bytes.
fn outer_slab(dims: &[usize], dim: usize, size: usize) -> (usize, usize) {
    let outer = dims[..dim].iter().product();
    let slab = dims[dim..].iter().product::<usize>() * size;
    (outer, slab)
}

/// What one rank brings to a collective once it has read its tensor.
struct Local {
    wire: Wire,
    data: Vec<u8>,
    dims: Vec<usize>,
}

impl Transport {
    /// Wraps a communicator (built with [`Comm::from_env`] or [`Comm::new`]); clones share it.
    pub fn new(comm: Comm) -> Transport {
        let (rank, size) = (comm.rank(), comm.size());
        Transport {
            serial: Arc::new(Serial::new(comm, Scratch::default())),
            rank,
            size,
        }
    }

    /// Joins the job the launcher started (rdmacomm-run, torchrun, mpirun, srun), as
    /// [`Comm::from_env`].
    pub fn from_env() -> fuel::Result<Transport> {
        Comm::from_env()
            .map(Transport::new)
            .map_err(|e| fuel::Error::msg(format!("rdmacomm: {e}")))
    }

    /// The communicator underneath (its own thread rule applies: it runs the calls of the
    /// thread that last called this transport).
    pub fn comm(&self) -> &Comm {
        self.serial.comm()
    }

    /// After a rank was lost: the survivors agree and go on over a new transport
    /// ([`Comm::shrink`]), on which the program rebuilds its parallel layers; the agreement
    /// carries the least and the AND of the `value`s. This transport (and its clones) refuse
    /// every call afterwards.
    pub fn shrink(&self, value: u64) -> fuel::Result<(Transport, crate::Agreed)> {
        let (c, agreed) = self
            .serial
            .run("shrink", |c, _| c.shrink(value))
            .map_err(|e| self.error("shrink", e))?;
        Ok((Transport::new(c), agreed))
    }

    /// Admits `k` newcomers (each started with [`Transport::rejoin`]) at a step boundary and
    /// goes on over a new transport with them ([`Comm::grow`]).
    pub fn grow(&self, k: usize) -> fuel::Result<Transport> {
        self.serial
            .run("grow", |c, _| c.grow(k))
            .map(Transport::new)
            .map_err(|e| self.error("grow", e))
    }

    /// Joins a running job as a newcomer ([`Comm::rejoin_from_env`]), admitted when its
    /// members call [`Transport::grow`].
    pub fn rejoin() -> fuel::Result<Transport> {
        Comm::rejoin_from_env()
            .map(Transport::new)
            .map_err(|e| fuel::Error::msg(format!("rdmacomm: {e}")))
    }

    fn error(&self, what: &str, e: crate::Error) -> fuel::Error {
        fuel::Error::msg(format!("rdmacomm {what}: rank {}: {e}", self.rank))
    }

    /// Reads `t` (unless `read` is false: a broadcast's non-root needs only its shape), checks
    /// `ok` locally, agrees with every rank on the call, then runs `f` on the bytes and puts
    /// what it returns (bytes and dims) on `t`'s graph.
    #[allow(clippy::too_many_arguments)]
    fn collective(
        &self,
        what: &str,
        t: &Tensor,
        op: u8,
        reduce: u8,
        arg: u32,
        read: bool,
        ok: impl FnOnce(Wire, &[usize]) -> Result<(), String>,
        f: impl FnOnce(&Comm, &mut Scratch, Local) -> crate::Result<(Vec<u8>, Vec<usize>)>,
    ) -> fuel::Result<Tensor> {
        let dtype = t.dtype();
        let dims = t.shape().dims().to_vec();
        let local = bytes::wire(dtype)
            .and_then(|w| ok(w, &dims).map(|()| w))
            .map_err(|why| fuel::Error::msg(format!("rdmacomm {what}: rank {}: {why}", self.rank)))
            .and_then(|wire| {
                let data = if read {
                    bytes::realise(t, wire)?
                } else {
                    vec![0u8; t.shape().elem_count() * wire.realised_size()]
                };
                Ok(Local {
                    wire,
                    data,
                    dims: dims.clone(),
                })
            });
        let header = Header {
            op,
            reduce,
            dtype: dtype as u8,
            failed: local.is_err(),
            arg,
            dims,
        };
        let (local, refused) = match local {
            Ok(l) => (Some(l), None),
            Err(e) => (None, Some(e)),
        };
        let ran = self.serial.run(what, |c, s| {
            if let Err(e) = header.agree(c, what, &describe) {
                c.refuse_further(&e.to_string());
                return Err(e);
            }
            local.map(|l| f(c, s, l)).transpose()
        });
        // This rank's own refusal first (the group was told of it in the header).
        if let Some(e) = refused {
            return Err(e);
        }
        match ran {
            Ok(Some((out, out_dims))) => bytes::on_graph_of(t, dtype, &out_dims, out),
            Ok(None) => Err(fuel::Error::msg(format!("rdmacomm {what}: nothing to do"))),
            Err(e) => Err(self.error(what, e)),
        }
    }
}

/// Any byte not 0 as 1 (a bool).
fn normalise_bools(data: &mut [u8]) {
    for b in data {
        *b = (*b != 0) as u8;
    }
}

impl Communicator for Transport {
    fn info(&self) -> CommInfo {
        CommInfo {
            rank: self.rank,
            world_size: self.size,
        }
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> fuel::Result<Tensor> {
        let check = |w: Wire, _: &[usize]| reduction(op, w).map(|_| ());
        self.collective(
            "all_reduce",
            tensor,
            ALL_REDUCE,
            reduce_code(op),
            0,
            true,
            check,
            |c, s, l| {
                let rop = reduction(op, l.wire).map_err(crate::Error::InvalidArgument)?;
                let mut data = l.data;
                match l.wire {
                    Wire::Wide16 => {
                        crate::wide16::widen(&data, true, &mut s.wide);
                        c.all_reduce(rop, l.wire.dtype(), &mut s.wide)?;
                        crate::wide16::narrow(&s.wide, &mut data);
                    }
                    Wire::Bool => {
                        normalise_bools(&mut data);
                        c.all_reduce(rop, l.wire.dtype(), &mut data)?;
                    }
                    w => c.all_reduce(rop, w.dtype(), &mut data)?,
                }
                Ok((data, l.dims))
            },
        )
    }

    fn all_gather(&self, tensor: &Tensor, dim: usize) -> fuel::Result<Tensor> {
        let n = self.size;
        let check = |_: Wire, dims: &[usize]| {
            if dim < dims.len() {
                Ok(())
            } else {
                Err(format!("dim {dim} of a tensor of shape {dims:?}"))
            }
        };
        self.collective(
            "all_gather",
            tensor,
            ALL_GATHER,
            0,
            dim as u32,
            true,
            check,
            |c, _, l| {
                let mut gathered = vec![0u8; l.data.len() * n];
                c.all_gather(&l.data, &mut gathered)?;
                let (outer, slab) = outer_slab(&l.dims, dim, l.wire.realised_size());
                // [rank][outer][slab] as [outer][rank][slab]; along dim 0 they are the same.
                let out = if outer == 1 {
                    gathered
                } else {
                    join_along(&gathered, outer, slab, n)
                };
                let mut dims = l.dims;
                dims[dim] *= n;
                Ok((out, dims))
            },
        )
    }

    fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp, dim: usize) -> fuel::Result<Tensor> {
        let n = self.size;
        let check = |w: Wire, dims: &[usize]| {
            reduction(op, w)?;
            match dims.get(dim) {
                None => Err(format!("dim {dim} of a tensor of shape {dims:?}")),
                Some(d) if d % n != 0 => Err(format!(
                    "dim {dim} of shape {dims:?} has {d} entries, not divisible into {n} equal \
                     chunks"
                )),
                Some(_) => Ok(()),
            }
        };
        let code = reduce_code(op);
        self.collective(
            "reduce_scatter",
            tensor,
            REDUCE_SCATTER,
            code,
            dim as u32,
            true,
            check,
            |c, s, l| {
                let rop = reduction(op, l.wire).map_err(crate::Error::InvalidArgument)?;
                let (outer, slab) = outer_slab(&l.dims, dim, l.wire.realised_size());
                // Rank p's chunk (entries p*k..(p+1)*k along dim) made contiguous, in rank order.
                let mut parts = if outer == 1 {
                    l.data
                } else {
                    parts_along(&l.data, outer, slab, n)
                };
                let mine = parts.len() / n;
                let mut out = vec![0u8; mine];
                let dt = l.wire.dtype();
                match l.wire {
                    Wire::Wide16 => {
                        crate::wide16::widen(&parts, true, &mut s.wide);
                        s.wide_out.clear();
                        s.wide_out.resize(mine * 2, 0);
                        c.reduce_scatter_v(rop, dt, &s.wide, &mut s.wide_out, &vec![mine * 2; n])?;
                        crate::wide16::narrow(&s.wide_out, &mut out);
                    }
                    w => {
                        if w == Wire::Bool {
                            normalise_bools(&mut parts);
                        }
                        if rop == AllReduce::Sum {
                            c.sum_scatter(dt, &parts, &mut out)?;
                        } else {
                            c.reduce_scatter_v(rop, dt, &parts, &mut out, &vec![mine; n])?;
                        }
                    }
                }
                let mut dims = l.dims;
                dims[dim] /= n;
                Ok((out, dims))
            },
        )
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> fuel::Result<Tensor> {
        let n = self.size;
        let check = |_: Wire, _: &[usize]| {
            if root < n {
                Ok(())
            } else {
                Err(format!("root {root} in a world of {n}"))
            }
        };
        let read = self.rank == root;
        self.collective(
            "broadcast",
            tensor,
            BROADCAST,
            0,
            root as u32,
            read,
            check,
            |c, _, l| {
                let mut data = l.data;
                c.broadcast(root, &mut data)?;
                Ok((data, l.dims))
            },
        )
    }

    fn barrier(&self) -> fuel::Result<()> {
        self.serial
            .run("barrier", |c, _| c.barrier())
            .map_err(|e| self.error("barrier", e))
    }
}
