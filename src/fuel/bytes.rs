//! A fuel tensor's bytes out (realised row-major, fallibly) and bytes back onto the caller's
//! graph, for every dtype rdmacomm can carry: directly, widened (i16), through f32 (F8E4M3,
//! cast by fuel's own kernels) or as one byte (bool).

use crate::dtype::DType;
use fuel::lazy::Tensor;
use fuel::{DType as F, Device, Shape};

/// How a fuel dtype travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wire {
    /// As rdmacomm's own dtype.
    Direct(DType),
    /// i16, widened to i32 for reductions.
    Wide16,
    /// F8E4M3, as f32 (fuel's cast both ways; reductions round once, at the end).
    ViaF32,
    /// One byte, 0 or 1: Max is or, Min is and; no Sum or Product.
    Bool,
}

impl Wire {
    /// The dtype the bytes have on the wire.
    pub(crate) fn dtype(self) -> DType {
        match self {
            Wire::Direct(d) => d,
            Wire::Wide16 => DType::i32,
            Wire::ViaF32 => DType::f32,
            Wire::Bool => DType::u8,
        }
    }

    /// Bytes per element as realised (before widening).
    pub(crate) fn realised_size(self) -> usize {
        match self {
            Wire::Wide16 => 2,
            w => w.dtype().size(),
        }
    }
}

/// How `dtype` travels, or why it cannot.
pub(crate) fn wire(dtype: F) -> Result<Wire, String> {
    Ok(match dtype {
        F::F32 => Wire::Direct(DType::f32),
        F::F64 => Wire::Direct(DType::f64),
        F::F16 => Wire::Direct(DType::f16),
        F::BF16 => Wire::Direct(DType::bf16),
        F::U8 => Wire::Direct(DType::u8),
        F::I8 => Wire::Direct(DType::i8),
        F::U32 => Wire::Direct(DType::u32),
        F::I32 => Wire::Direct(DType::i32),
        F::I64 => Wire::Direct(DType::i64),
        F::I16 => Wire::Wide16,
        F::F8E4M3 => Wire::ViaF32,
        F::Bool => Wire::Bool,
        other => {
            return Err(format!(
            "fuel dtype {other:?} is not supported (sub-byte, or fuel has no CPU constructor or \
                 cast to rebuild it on the caller's graph)"
        ))
        }
    })
}

/// `t`'s elements as they travel (F8E4M3 cast to f32 by fuel), row-major.
pub(crate) fn realise(t: &Tensor, w: Wire) -> fuel::Result<Vec<u8>> {
    // fuel reads a tensor out through a copy kernel, which its CPU backend lacks for I8:
    // read those as I32 (an exact cast) and keep each element's low byte.
    let i8_as_i32 = t.dtype() == F::I8;
    let src = match w {
        Wire::ViaF32 => t.to_dtype(F::F32)?,
        _ if i8_as_i32 => t.to_dtype(F::I32)?,
        _ => t.clone(),
    };
    let mut bytes =
        fuel::pipelined_bridge::realize_one_bytes(src.graph(), src.node_id(), &Device::cpu())?;
    if i8_as_i32 {
        bytes = bytes.chunks_exact(4).map(|c| c[0]).collect();
    }
    let want = t.shape().elem_count().checked_mul(w.realised_size());
    if want != Some(bytes.len()) {
        return Err(fuel::Error::msg(format!(
            "a {:?} tensor of shape {:?} realised as {} bytes, not {want:?}",
            t.dtype(),
            t.shape().dims(),
            bytes.len()
        )));
    }
    Ok(bytes)
}

/// `bytes` as elements, written once into the shared slice fuel's constructors take.
fn values<T: bytemuck::Pod>(bytes: &[u8]) -> std::sync::Arc<[T]> {
    bytes
        .chunks_exact(std::mem::size_of::<T>())
        .map(bytemuck::pod_read_unaligned::<T>)
        .collect()
}

/// Signed integers of `size` bytes as i64.
fn as_i64(bytes: &[u8], size: usize) -> Vec<i64> {
    bytes
        .chunks_exact(size)
        .map(|c| match size {
            1 => c[0] as i8 as i64,
            2 => i16::from_le_bytes([c[0], c[1]]) as i64,
            _ => i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64,
        })
        .collect()
}

/// A tensor of `dtype` and `dims` holding `bytes` (as realised: f32 for F8E4M3, i16 for I16)
/// on `anchor`'s graph.
pub(crate) fn on_graph_of(
    anchor: &Tensor,
    dtype: F,
    dims: &[usize],
    bytes: Vec<u8>,
) -> fuel::Result<Tensor> {
    let shape = Shape::from_dims(dims);
    let cast = |t: Tensor| t.to_dtype(dtype);
    match dtype {
        F::F32 => anchor.const_f32_like(values::<f32>(&bytes), shape),
        F::F64 => anchor.const_f64_like(values::<f64>(&bytes), shape),
        F::F16 => anchor.const_f16_like(values::<half::f16>(&bytes), shape),
        F::BF16 => anchor.const_bf16_like(values::<half::bf16>(&bytes), shape),
        F::U32 => anchor.const_u32_like(values::<u32>(&bytes), shape),
        F::I64 => anchor.const_i64_like(values::<i64>(&bytes), shape),
        F::U8 => Ok(Tensor::from_graph_tensor(
            anchor.graph_tensor().const_u8_like(bytes, shape)?,
        )),
        F::Bool => cast(Tensor::from_graph_tensor(
            anchor.graph_tensor().const_u8_like(bytes, shape)?,
        )),
        F::I8 => cast(anchor.const_i64_like(as_i64(&bytes, 1), shape)?),
        F::I16 => cast(anchor.const_i64_like(as_i64(&bytes, 2), shape)?),
        F::I32 => cast(anchor.const_i64_like(as_i64(&bytes, 4), shape)?),
        F::F8E4M3 => cast(anchor.const_f32_like(values::<f32>(&bytes), shape)?),
        other => Err(fuel::Error::msg(format!(
            "fuel dtype {other:?} is not supported"
        ))),
    }
}
