//! The tensor-level API (the tensor spec's): a [`Tensor`] of the crate's own, which belongs to
//! a graph ([`GraphId`]), the tensor-level [`Communicator`] trait, and [`IdentityComm`]. Results
//! are materialised on the caller's graph; tensors of different graphs do not combine.
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

/// The graph a tensor belongs to (the spec's `graph_id`): tensors combine only within one graph,
/// and a collective's result is materialised on its input's graph, never on a fresh one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GraphId(u64);

impl GraphId {
    /// The graph of tensors made without one ([`Tensor::from_slice`], [`Tensor::zeros`], ...).
    pub const DEFAULT: GraphId = GraphId(0);

    /// A new graph, distinct from every other made in this process.
    #[allow(clippy::new_without_default)]
    pub fn new() -> GraphId {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        GraphId(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }

    /// The graph's number.
    pub fn id(self) -> u64 {
        self.0
    }
}

/// A dense, row-major tensor of one graph: shape, dtype and contiguous bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    dtype: DType,
    data: Vec<u8>,
    graph: GraphId,
}

impl Tensor {
    /// A tensor of `shape` from typed values (`values.len()` must be the shape's product), on
    /// the default graph.
    pub fn from_slice<T: Element>(values: &[T], shape: &[usize]) -> Result<Tensor> {
        Tensor::from_slice_on(GraphId::DEFAULT, values, shape)
    }

    /// [`Tensor::from_slice`] on `graph`.
    pub fn from_slice_on<T: Element>(
        graph: GraphId,
        values: &[T],
        shape: &[usize],
    ) -> Result<Tensor> {
        Tensor::from_bytes_on(
            graph,
            T::DTYPE,
            shape,
            bytemuck::cast_slice(values).to_vec(),
        )
    }

    /// An f32 tensor of `shape` on `graph` (the spec's `from_f32_on`).
    pub fn from_f32_on(graph: GraphId, values: &[f32], shape: &[usize]) -> Result<Tensor> {
        Tensor::from_slice_on(graph, values, shape)
    }

    /// An f32 tensor of this one's shape and graph holding `values` (the spec's
    /// `const_f32_like`).
    pub fn const_f32_like(&self, values: &[f32]) -> Result<Tensor> {
        Tensor::from_f32_on(self.graph, values, &self.shape)
    }

    /// A tensor of `shape` and `dtype` over row-major bytes, on the default graph.
    pub fn from_bytes(dtype: DType, shape: &[usize], data: Vec<u8>) -> Result<Tensor> {
        Tensor::from_bytes_on(GraphId::DEFAULT, dtype, shape, data)
    }

    /// [`Tensor::from_bytes`] on `graph`.
    pub fn from_bytes_on(
        graph: GraphId,
        dtype: DType,
        shape: &[usize],
        data: Vec<u8>,
    ) -> Result<Tensor> {
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
            graph,
        })
    }

    /// Zeros of `shape` and `dtype`, on the default graph.
    pub fn zeros(dtype: DType, shape: &[usize]) -> Tensor {
        let numel: usize = shape.iter().product();
        Tensor {
            shape: shape.to_vec(),
            dtype,
            data: vec![0; numel * dtype.size()],
            graph: GraphId::DEFAULT,
        }
    }

    /// The graph this tensor belongs to.
    pub fn graph(&self) -> GraphId {
        self.graph
    }

    /// Concatenation of `tensors` along `dim` (torch's `cat`): all of one graph, dtype and
    /// shape but along `dim`; the result is on their graph.
    ///
    /// # Errors
    /// `InvalidArgument` naming what differs: the graphs, dtypes or shapes, or an empty list.
    pub fn cat(tensors: &[&Tensor], dim: usize) -> Result<Tensor> {
        let Some(first) = tensors.first() else {
            return Err(Error::InvalidArgument("cat of no tensors".into()));
        };
        first.check_dim(dim, "cat")?;
        for (i, t) in tensors.iter().enumerate().skip(1) {
            first.same_graph(t, "cat")?;
            let mut a = first.shape.clone();
            let mut b = t.shape.clone();
            if a.len() == b.len() {
                a[dim] = 0;
                b[dim] = 0;
            }
            if t.dtype != first.dtype || a != b {
                return Err(Error::InvalidArgument(format!(
                    "cat along dim {dim}: tensor {i} is {} {:?}, tensor 0 {} {:?}",
                    t.dtype.name(),
                    t.shape,
                    first.dtype.name(),
                    first.shape
                )));
            }
        }
        let outer: usize = first.shape[..dim].iter().product();
        let mut data = Vec::with_capacity(tensors.iter().map(|t| t.data.len()).sum());
        for o in 0..outer {
            for t in tensors {
                let (_, slab) = t.split_at(dim);
                data.extend_from_slice(&t.data[o * slab..(o + 1) * slab]);
            }
        }
        let mut shape = first.shape.clone();
        shape[dim] = tensors.iter().map(|t| t.shape[dim]).sum();
        Tensor::from_bytes_on(first.graph, first.dtype, &shape, data)
    }

    /// An error unless `other` is on this tensor's graph.
    fn same_graph(&self, other: &Tensor, what: &str) -> Result<()> {
        if self.graph != other.graph {
            return Err(Error::InvalidArgument(format!(
                "{what}: tensors of graphs {} and {} cannot be combined",
                self.graph.0, other.graph.0
            )));
        }
        Ok(())
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
    /// Beyond the spec: part q of `tensor` along `dim` (of `world_size` equal parts) goes to
    /// rank q; the result concatenates, along `dim`, the part each rank sent this one.
    fn all_to_all(&self, tensor: &Tensor, dim: usize) -> Result<Tensor>;
    /// Beyond the spec: the reduction across ranks on `root`; other ranks get their own tensor
    /// back.
    fn reduce(&self, tensor: &Tensor, op: ReduceOp, root: usize) -> Result<Tensor>;
}

/// `tensor`'s `n` equal parts along `dim` made contiguous, in part order: [part][outer][slab/n].
fn parts_along(tensor: &Tensor, dim: usize, n: usize, what: &str) -> Result<Vec<u8>> {
    tensor.check_dim(dim, what)?;
    if tensor.shape[dim] % n != 0 {
        return Err(Error::InvalidArgument(format!(
            "{what}: dim {dim} of shape {:?} has {} entries, not divisible by the world size {n}",
            tensor.shape, tensor.shape[dim]
        )));
    }
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
    Ok(parts)
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
        Tensor::from_bytes_on(tensor.graph, tensor.dtype, &shape, data)
    }

    fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp, dim: usize) -> Result<Tensor> {
        let base = op.base(tensor.dtype)?;
        let n = self.size();
        // Part p (entries p*k..(p+1)*k along dim) contiguous: [part][outer][k-slab].
        let parts = parts_along(tensor, dim, n, "reduce_scatter")?;
        let mut shape = tensor.shape.clone();
        shape[dim] /= n;
        let mine = tensor.data.len() / n;
        let mut data = vec![0u8; mine];
        if base == AllReduce::Sum {
            crate::Communicator::sum_scatter(self, tensor.dtype, &parts, &mut data)?;
        } else {
            let lens = vec![mine; n];
            crate::Communicator::reduce_scatter_v(
                self,
                base,
                tensor.dtype,
                &parts,
                &mut data,
                &lens,
            )?;
        }
        let mut out = Tensor::from_bytes_on(tensor.graph, tensor.dtype, &shape, data)?;
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

    fn all_to_all(&self, tensor: &Tensor, dim: usize) -> Result<Tensor> {
        let n = self.size();
        let parts = parts_along(tensor, dim, n, "all_to_all")?;
        let mut got = vec![0u8; parts.len()];
        crate::Communicator::all_to_all(self, &parts, &mut got)?;
        // got is [rank][outer][slab/n]; the result is [outer][rank][slab/n]: the same shape.
        let (outer, slab) = tensor.split_at(dim);
        let part_slab = slab / n;
        let mut data = vec![0u8; got.len()];
        for q in 0..n {
            for o in 0..outer {
                let src = (q * outer + o) * part_slab;
                let dst = o * slab + q * part_slab;
                data[dst..dst + part_slab].copy_from_slice(&got[src..src + part_slab]);
            }
        }
        Tensor::from_bytes_on(tensor.graph, tensor.dtype, &tensor.shape, data)
    }

    fn reduce(&self, tensor: &Tensor, op: ReduceOp, root: usize) -> Result<Tensor> {
        let base = op.base(tensor.dtype)?;
        let mut out = tensor.clone();
        crate::Communicator::reduce(self, root, base, out.dtype, &mut out.data)?;
        if op == ReduceOp::Avg && self.rank() == root {
            divide(&mut out, self.size());
        }
        Ok(out)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_combine_within_a_graph_only() {
        let g = GraphId::new();
        assert_ne!(g, GraphId::DEFAULT);
        assert_ne!(g, GraphId::new());
        let a = Tensor::from_f32_on(g, &[1.0, 2.0, 3.0, 4.0], &[2, 2]).unwrap();
        let b = a.const_f32_like(&[5.0, 6.0, 7.0, 8.0]).unwrap();
        assert_eq!((b.graph(), b.shape()), (g, &[2usize, 2][..]));
        let c = Tensor::cat(&[&a, &b], 1).unwrap();
        assert_eq!(c.graph(), g);
        assert_eq!(c.shape(), &[2, 4]);
        assert_eq!(
            c.to_vec::<f32>().unwrap(),
            vec![1.0, 2.0, 5.0, 6.0, 3.0, 4.0, 7.0, 8.0]
        );
        let r0 = Tensor::cat(&[&a, &b], 0).unwrap();
        assert_eq!(r0.to_vec::<f32>().unwrap()[4..], [5.0, 6.0, 7.0, 8.0]);
        let other = Tensor::from_slice(&[9.0f32, 9.0, 9.0, 9.0], &[2, 2]).unwrap();
        let e = Tensor::cat(&[&a, &other], 0).unwrap_err().to_string();
        assert!(
            e.contains(&format!("graphs {} and 0", g.id())) && e.contains("cannot be combined"),
            "{e}"
        );
        let wrong = Tensor::from_slice_on(g, &[1i32, 2], &[1, 2]).unwrap();
        assert!(Tensor::cat(&[&a, &wrong], 0).is_err(), "another dtype");
        assert!(a.const_f32_like(&[1.0]).is_err(), "too few values");
    }

    #[test]
    fn collectives_materialise_on_the_callers_graph() {
        use crate::tensor::Communicator as _;
        let g = GraphId::new();
        let x = Tensor::from_slice_on(g, &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).unwrap();
        let c = IdentityComm;
        for t in [
            c.all_reduce(&x, ReduceOp::Sum).unwrap(),
            c.all_gather(&x, 1).unwrap(),
            c.reduce_scatter(&x, ReduceOp::Max, 0).unwrap(),
            c.broadcast(&x, 0).unwrap(),
        ] {
            assert_eq!(t.graph(), g);
        }
    }
}
