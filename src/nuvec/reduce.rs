//! nuvec's dtypes and reductions on rdmacomm's: direct where rdmacomm has the type, widened
//! (u16, i16), reinterpreted (complex64 as f32 pairs) or as a byte reduction (bool) where not.

use crate::api::Communicator;
use crate::comm::Comm;
use crate::dtype::{AllReduce, DType};
use crate::error::{Error, Result};
use crate::wide16::{narrow, widen};
use nuvec_core::distributed::AllReduce as NOp;
use nuvec_core::DType as N;

/// How a nuvec dtype travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Plan {
    /// As rdmacomm's own dtype.
    Direct(DType),
    /// One byte, 0 or 1 (normalised first): Sum and Max are or, Min is and.
    Bool,
    /// Two bytes widened to four (i16 sign-extended to i32, u16 zero-extended to u32) and
    /// narrowed back: sums wrap modulo 2^16, Max and Min are exact.
    Wide16 { signed: bool },
    /// Pairs of f32 (re, im): Sum only.
    Complex,
}

/// The plan for `dtype`, or an error naming it.
pub(crate) fn plan(dtype: N) -> Result<Plan> {
    Ok(match dtype {
        N::Bool => Plan::Bool,
        N::U8 => Plan::Direct(DType::u8),
        N::I8 => Plan::Direct(DType::i8),
        N::U16 => Plan::Wide16 { signed: false },
        N::I16 => Plan::Wide16 { signed: true },
        N::U32 => Plan::Direct(DType::u32),
        N::I32 => Plan::Direct(DType::i32),
        N::U64 => Plan::Direct(DType::u64),
        N::I64 => Plan::Direct(DType::i64),
        N::F16 => Plan::Direct(DType::f16),
        N::BF16 => Plan::Direct(DType::bf16),
        N::F32 => Plan::Direct(DType::f32),
        N::F64 => Plan::Direct(DType::f64),
        N::Complex64 => Plan::Complex,
        other => {
            return Err(Error::InvalidArgument(format!(
                "no reduction for nuvec dtype {other:?}"
            )))
        }
    })
}

/// rdmacomm's reduction for nuvec's `op` under `plan`.
pub(crate) fn op(op: NOp, plan: Plan, dtype: N) -> Result<AllReduce> {
    Ok(match (plan, op) {
        (Plan::Complex, NOp::Sum) => AllReduce::Sum,
        (Plan::Complex, other) => {
            return Err(Error::InvalidArgument(format!(
                "no {other:?} reduction for {dtype:?} (complex numbers have no order)"
            )))
        }
        (Plan::Bool, NOp::Sum | NOp::Max) => AllReduce::Max,
        (Plan::Bool, NOp::Min) => AllReduce::Min,
        (_, NOp::Sum) => AllReduce::Sum,
        (_, NOp::Max) => AllReduce::Max,
        (_, NOp::Min) => AllReduce::Min,
        (_, other) => {
            return Err(Error::InvalidArgument(format!(
                "no reduction {other:?} in rdmacomm"
            )))
        }
    })
}

/// Checks that `len` bytes are whole elements of `dtype`.
fn check_len(dtype: N, len: usize, what: &str) -> Result<()> {
    let size = dtype.size();
    if size == 0 || len % size != 0 {
        return Err(Error::InvalidArgument(format!(
            "{what} has {len} bytes, not a multiple of the {dtype:?} element size {size}"
        )));
    }
    Ok(())
}

/// Reduces `data` (elements of `dtype`) across the ranks with nuvec's `op`, every rank getting
/// the same bits; `wide` is scratch for the widened types.
pub(crate) fn all_reduce(
    comm: &Comm,
    op_: NOp,
    dtype: N,
    data: &mut [u8],
    wide: &mut Vec<u8>,
) -> Result<()> {
    let plan = plan(dtype)?;
    let rop = op(op_, plan, dtype)?;
    check_len(dtype, data.len(), "all_reduce's buffer")?;
    match plan {
        Plan::Direct(dt) => comm.all_reduce(rop, dt, data),
        Plan::Complex => comm.all_reduce(rop, DType::f32, data),
        Plan::Bool => {
            normalise_bools(data);
            comm.all_reduce(rop, DType::u8, data)
        }
        Plan::Wide16 { signed } => {
            widen(data, signed, wide);
            comm.all_reduce(rop, wide_dtype(signed), wide)?;
            narrow(wide, data);
            Ok(())
        }
    }
}

/// Rank r's `output` is the sum (nuvec's: or for bool) of every rank's block r of `input`
/// (nuvec 0.6's `sum_scatter`); `wide` and `wide_out` are scratch.
pub(crate) fn sum_scatter(
    comm: &Comm,
    dtype: N,
    input: &[u8],
    output: &mut [u8],
    scratch: &mut Vec<u8>,
    wide_out: &mut Vec<u8>,
) -> Result<()> {
    let plan = plan(dtype)?;
    check_len(dtype, output.len(), "sum_scatter's output")?;
    let size = comm.size();
    if output.len().checked_mul(size) != Some(input.len()) {
        return Err(Error::InvalidArgument(format!(
            "sum_scatter's input has {} bytes, not {size} ranks x the output's {}",
            input.len(),
            output.len()
        )));
    }
    match plan {
        Plan::Direct(dt) => comm.sum_scatter(dt, input, output),
        Plan::Complex => comm.sum_scatter(DType::f32, input, output),
        Plan::Bool => {
            scratch.clear();
            scratch.extend_from_slice(input);
            normalise_bools(scratch);
            let lens = vec![output.len(); size];
            comm.reduce_scatter_v(AllReduce::Max, DType::u8, scratch, output, &lens)
        }
        Plan::Wide16 { signed } => {
            widen(input, signed, scratch);
            wide_out.clear();
            wide_out.resize(output.len() * 2, 0);
            comm.sum_scatter(wide_dtype(signed), scratch, wide_out)?;
            narrow(wide_out, output);
            Ok(())
        }
    }
}

fn wide_dtype(signed: bool) -> DType {
    if signed {
        DType::i32
    } else {
        DType::u32
    }
}

/// Any non-zero byte becomes 1, as a bool reads.
fn normalise_bools(data: &mut [u8]) {
    for b in data {
        *b = (*b != 0) as u8;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_nuvec_dtype_has_a_plan_and_only_complex_refuses_an_order() {
        let all = [
            N::Bool,
            N::U8,
            N::U16,
            N::U32,
            N::U64,
            N::I8,
            N::I16,
            N::I32,
            N::I64,
            N::F16,
            N::BF16,
            N::F32,
            N::F64,
            N::Complex64,
        ];
        for d in all {
            let p = plan(d).unwrap();
            assert!(op(NOp::Sum, p, d).is_ok());
            assert_eq!(op(NOp::Max, p, d).is_ok(), d != N::Complex64, "{d:?}");
            if let Plan::Direct(dt) = p {
                assert_eq!(dt.size(), d.size(), "{d:?}");
            }
        }
        assert_eq!(op(NOp::Sum, Plan::Bool, N::Bool).unwrap(), AllReduce::Max);
        assert_eq!(op(NOp::Min, Plan::Bool, N::Bool).unwrap(), AllReduce::Min);
    }
}
