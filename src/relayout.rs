//! Moving a row-major tensor's bytes between "split along dim d" and "split along dim 0", for
//! collectives along any dim over byte collectives that work on contiguous blocks.
//!
//! A tensor along `dim` is `outer` rows (the product of the dims before `dim`) of one `slab`
//! each (the bytes of `dim` and everything after it).

/// `data` ([outer][n parts of slab/n]) as its `n` parts along the dim, each made contiguous:
/// [part][outer][slab/n].
pub(crate) fn parts_along(data: &[u8], outer: usize, slab: usize, n: usize) -> Vec<u8> {
    let part = slab / n;
    let mut out = vec![0u8; data.len()];
    for p in 0..n {
        for o in 0..outer {
            let src = o * slab + p * part;
            let dst = (p * outer + o) * part;
            out[dst..dst + part].copy_from_slice(&data[src..src + part]);
        }
    }
    out
}

/// The inverse: `n` parts ([part][outer][piece]) joined along the dim: [outer][n pieces].
pub(crate) fn join_along(parts: &[u8], outer: usize, piece: usize, n: usize) -> Vec<u8> {
    let mut out = vec![0u8; parts.len()];
    for p in 0..n {
        for o in 0..outer {
            let src = (p * outer + o) * piece;
            let dst = (o * n + p) * piece;
            out[dst..dst + piece].copy_from_slice(&parts[src..src + piece]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 3-D tensor [2, 6, 3] of u8 whose value is its own row-major index.
    #[test]
    fn parts_and_joins_match_index_arithmetic() {
        let dims = [2usize, 6, 3];
        let data: Vec<u8> = (0..36).collect();
        for dim in 0..3 {
            let outer: usize = dims[..dim].iter().product();
            let slab: usize = dims[dim..].iter().product();
            let n = if dims[dim] % 3 == 0 { 3 } else { 2 };
            let parts = parts_along(&data, outer, slab, n);
            // Part p holds the entries whose index along dim is in p's range.
            let k = dims[dim] / n;
            let inner: usize = dims[dim + 1..].iter().product();
            let mut want = Vec::new();
            for p in 0..n {
                for o in 0..outer {
                    for j in p * k..(p + 1) * k {
                        for i in 0..inner {
                            want.push(((o * dims[dim] + j) * inner + i) as u8);
                        }
                    }
                }
            }
            assert_eq!(parts, want, "dim {dim}");
            assert_eq!(join_along(&parts, outer, slab / n, n), data, "dim {dim}");
        }
    }
}
