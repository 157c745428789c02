//! 16-bit integers through rdmacomm's 32-bit kernels (nuvec's and fuel's u16/i16 have no
//! rdmacomm dtype): widened, reduced, narrowed. Sums wrap modulo 2^16; Max and Min are exact.

/// Two-byte elements of `src` into four-byte ones in `dst`.
pub(crate) fn widen(src: &[u8], signed: bool, dst: &mut Vec<u8>) {
    dst.clear();
    dst.reserve(src.len() * 2);
    for e in src.chunks_exact(2) {
        let v = [e[0], e[1]];
        let w = if signed {
            i16::from_le_bytes(v) as i32 as u32
        } else {
            u16::from_le_bytes(v) as u32
        };
        dst.extend_from_slice(&w.to_le_bytes());
    }
}

/// Four-byte elements of `src` back to their low two bytes in `dst`.
pub(crate) fn narrow(src: &[u8], dst: &mut [u8]) {
    for (d, s) in dst.chunks_exact_mut(2).zip(src.chunks_exact(4)) {
        d.copy_from_slice(&s[..2]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sixteen_bit_values_survive_widening_and_wrap_when_summed() {
        for signed in [false, true] {
            let vals: Vec<u16> = vec![0, 1, 0x7fff, 0x8000, 0xffff, 1234];
            let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
            let mut wide = Vec::new();
            widen(&bytes, signed, &mut wide);
            // The widened values are the numbers themselves (sign-extended when signed).
            for (i, v) in vals.iter().enumerate() {
                let w = u32::from_le_bytes(wide[4 * i..4 * i + 4].try_into().unwrap());
                let want = if signed {
                    *v as i16 as i32 as u32
                } else {
                    *v as u32
                };
                assert_eq!(w, want);
            }
            // A sum of three ranks' values, done wide and narrowed, wraps as 16-bit addition.
            let summed: Vec<u8> = wide
                .chunks_exact(4)
                .flat_map(|c| {
                    let w = u32::from_le_bytes(c.try_into().unwrap());
                    w.wrapping_mul(3).to_le_bytes()
                })
                .collect();
            let mut back = vec![0u8; bytes.len()];
            narrow(&summed, &mut back);
            for (i, v) in vals.iter().enumerate() {
                let got = u16::from_le_bytes([back[2 * i], back[2 * i + 1]]);
                assert_eq!(got, v.wrapping_mul(3), "{signed} {v}");
            }
        }
    }
}
