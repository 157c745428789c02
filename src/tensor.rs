//! The tensor-level API (`../shared/spec/communicator-tensor.txt`): a [`Tensor`] of the crate's
//! own, the tensor-level [`Communicator`] trait, and [`IdentityComm`].
//!
//! Every byte-level [`crate::Communicator`] (RDMA, TCP, identity) serves this trait through one
//! blanket adapter (below), not a second implementation: dims other than 0 are handled by a
//! local re-layout around the byte-level dim-0 collective, as torch's functional collectives do.

use crate::dtype::{AllReduce, DType};
use crate::error::{Error, Result};

/// An element type with a [`DType`].
pub trait Element: bytemuck::Pod {
    /// Its dtype.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),*) => {$( impl Element for $t { const DTYPE: DType = DType::$d; } )*};
}
element!(f32 => f32, f64 => f64, half::f16 => f16, half::bf16 => bf16, i8 => i8, u8 => u8, i32 => i32,
    u32 => u32, i64 => i64, u64 => u64);

/// A dense, row-major tensor: shape, dtype and contiguous bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    dtype: DType,
    data: Vec<u8>,
}

impl Tensor {
    /// A tensor of `shape` from typed values (`values.len()` must be the shape's product).
    pub fn from_slice<T: Element>(values: &[T], shape: &[usize]) -> Result<Tensor> {
        Tensor::from_bytes(T::DTYPE, shape, bytemuck::cast_slice(values).to_vec())
    }

    /// A tensor of `shape` and `dtype` over row-major bytes.
    pub fn from_bytes(dtype: DType, shape: &[usize], data: Vec<u8>) -> Result<Tensor> {
        let numel: usize = shape.iter().product();
        if data.len() != numel * dtype.size() {
            return Err(Error::InvalidArgument(format!(
                "tensor of shape {shape:?} and dtype {} needs {} bytes, got {}",
                dtype.name(),
                numel * dtype.size(),
                data.len()
            )));
        }
        Ok(Tensor {
            shape: shape.to_vec(),
            dtype,
            data,
        })
    }

    /// Zeros of `shape` and `dtype`.
    pub fn zeros(dtype: DType, shape: &[usize]) -> Tensor {
        let numel: usize = shape.iter().product();
        Tensor {
            shape: shape.to_vec(),
            dtype,
            data: vec![0; numel * dtype.size()],
        }
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The row-major bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.data
    }

    /// The values, if `T` is this tensor's dtype.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype {
            return Err(Error::InvalidArgument(format!(
                "tensor holds {}, not {}",
                self.dtype.name(),
                T::DTYPE.name()
            )));
        }
        Ok(bytemuck::pod_collect_to_vec(&self.data))
    }

    fn check_dim(&self, dim: usize, what: &str) -> Result<()> {
        if dim >= self.shape.len() {
            return Err(Error::InvalidArgument(format!(
                "{what}: dim {dim} out of range for a tensor of shape {:?}",
                self.shape
            )));
        }
        Ok(())
    }

    /// (outer, slab): elements before `dim` multiply to `outer`; one slab is the bytes of the
    /// sub-tensor from `dim` on.
    fn split_at(&self, dim: usize) -> (usize, usize) {
        let outer: usize = self.shape[..dim].iter().product();
        let slab: usize = self.shape[dim..].iter().product::<usize>() * self.dtype.size();
        (outer, slab)
    }
}

/// The reduction of a tensor collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Product.
    Prod,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
    /// Mean over ranks: the sum, divided by the world size (floating-point dtypes only).
    Avg,
}

impl ReduceOp {
    fn base(self, dtype: DType) -> Result<AllReduce> {
        Ok(match self {
            ReduceOp::Sum => AllReduce::Sum,
            ReduceOp::Prod => AllReduce::Prod,
            ReduceOp::Min => AllReduce::Min,
            ReduceOp::Max => AllReduce::Max,
            ReduceOp::Avg if dtype.is_float() => AllReduce::Sum,
            ReduceOp::Avg => {
                return Err(Error::InvalidArgument(format!(
                    "Avg needs a floating-point tensor, not {}",
                    dtype.name()
                )))
            }
        })
    }
}

/// Communicator info.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommInfo {
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
}

/// Abstraction over collective communication backends, on tensors. All operations are
/// synchronous and collective: every rank calls the same ones in the same order.
pub trait Communicator: Send {
    /// Communicator info (rank, world size).
    fn info(&self) -> CommInfo;
    /// Element-wise reduction across all ranks; every rank gets the result.
    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor>;
    /// Concatenation of every rank's tensor along `dim`, in rank order.
    fn all_gather(&self, tensor: &Tensor, dim: usize) -> Result<Tensor>;
    /// Reduction across ranks, then rank r keeps the r-th of `world_size` equal parts along `dim`.
    fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp, dim: usize) -> Result<Tensor>;
    /// The tensor of rank `root`, on every rank.
    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Tensor>;
    /// Blocks until every rank has reached it.
    fn barrier(&self) -> Result<()>;
}

/// Divides every element by `n` (Avg).
fn divide(t: &mut Tensor, n: usize) {
    use half::{bf16, f16};
    let d = n as f64;
    match t.dtype {
        DType::f32 => bytemuck::cast_slice_mut::<u8, f32>(&mut t.data)
            .iter_mut()
            .for_each(|x| *x = (*x as f64 / d) as f32),
        DType::f64 => bytemuck::cast_slice_mut::<u8, f64>(&mut t.data)
            .iter_mut()
            .for_each(|x| *x /= d),
        DType::f16 => bytemuck::cast_slice_mut::<u8, f16>(&mut t.data)
            .iter_mut()
            .for_each(|x| *x = f16::from_f64(x.to_f64() / d)),
        DType::bf16 => bytemuck::cast_slice_mut::<u8, bf16>(&mut t.data)
            .iter_mut()
            .for_each(|x| *x = bf16::from_f64(x.to_f64() / d)),
        _ => {}
    }
}

/// Every byte-level communicator is a tensor-level one (the one adapter).
impl<C: crate::Communicator + ?Sized> Communicator for C {
    fn info(&self) -> CommInfo {
        CommInfo {
            rank: self.rank(),
            world_size: self.size(),
        }
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let base = op.base(tensor.dtype)?;
        let mut out = tensor.clone();
        crate::Communicator::all_reduce(self, base, out.dtype, &mut out.data)?;
        if op == ReduceOp::Avg {
            divide(&mut out, self.size());
        }
        Ok(out)
    }

    fn all_gather(&self, tensor: &Tensor, dim: usize) -> Result<Tensor> {
        tensor.check_dim(dim, "all_gather")?;
        let n = self.size();
        let mut gathered = vec![0u8; tensor.data.len() * n];
        crate::Communicator::all_gather(self, &tensor.data, &mut gathered)?;
        // gathered is [rank][outer][slab]; the result is [outer][rank][slab].
        let (outer, slab) = tensor.split_at(dim);
        let mut data = vec![0u8; gathered.len()];
        for o in 0..outer {
            for r in 0..n {
                let src = r * tensor.data.len() + o * slab;
                let dst = (o * n + r) * slab;
                data[dst..dst + slab].copy_from_slice(&gathered[src..src + slab]);
            }
        }
        let mut shape = tensor.shape.clone();
        shape[dim] *= n;
        Tensor::from_bytes(tensor.dtype, &shape, data)
    }

    fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp, dim: usize) -> Result<Tensor> {
        tensor.check_dim(dim, "reduce_scatter")?;
        let base = op.base(tensor.dtype)?;
        let (n, r) = (self.size(), self.rank());
        if tensor.shape[dim] % n != 0 {
            return Err(Error::InvalidArgument(format!(
                "reduce_scatter: dim {dim} of shape {:?} has {} entries, not divisible by the world size {n}",
                tensor.shape, tensor.shape[dim]
            )));
        }
        // Re-layout so part p (entries p*k..(p+1)*k along dim) is contiguous: [part][outer][k-slab].
        let (outer, slab) = tensor.split_at(dim);
        let part_slab = slab / n;
        let mut parts = vec![0u8; tensor.data.len()];
        for p in 0..n {
            for o in 0..outer {
                let src = o * slab + p * part_slab;
                let dst = (p * outer + o) * part_slab;
                parts[dst..dst + part_slab].copy_from_slice(&tensor.data[src..src + part_slab]);
            }
        }
        let mut shape = tensor.shape.clone();
        shape[dim] /= n;
        let mine = outer * part_slab;
        let mut data = vec![0u8; mine];
        if base == AllReduce::Sum {
            crate::Communicator::sum_scatter(self, tensor.dtype, &parts, &mut data)?;
        } else {
            crate::Communicator::all_reduce(self, base, tensor.dtype, &mut parts)?;
            data.copy_from_slice(&parts[r * mine..(r + 1) * mine]);
        }
        let mut out = Tensor::from_bytes(tensor.dtype, &shape, data)?;
        if op == ReduceOp::Avg {
            divide(&mut out, n);
        }
        Ok(out)
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Tensor> {
        let mut out = tensor.clone();
        crate::Communicator::broadcast(self, root, &mut out.data)?;
        Ok(out)
    }

    fn barrier(&self) -> Result<()> {
        crate::Communicator::barrier(self)
    }
}

/// A world of one: every collective returns its input (reduce_scatter and all_gather too, as
/// with one rank), with no transport at all.
#[derive(Debug, Clone, Copy, Default)]
pub struct IdentityComm;

impl crate::Communicator for IdentityComm {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn all_reduce(&self, _op: AllReduce, dtype: DType, data: &mut [u8]) -> Result<()> {
        crate::api::check_all_reduce(dtype, data)
    }
    fn all_gather(&self, input: &[u8], output: &mut [u8]) -> Result<()> {
        crate::api::check_all_gather(1, input, output)?;
        output.copy_from_slice(input);
        Ok(())
    }
    fn send(&self, dst: usize, _data: &[u8]) -> Result<()> {
        crate::api::check_peer("send", 0, 1, dst)
    }
    fn recv(&self, src: usize, _data: &mut [u8]) -> Result<()> {
        crate::api::check_peer("recv", 0, 1, src)
    }
    fn split(&self, _color: i32, _key: i32) -> Result<std::sync::Arc<dyn crate::Communicator>> {
        Ok(std::sync::Arc::new(IdentityComm))
    }
}
