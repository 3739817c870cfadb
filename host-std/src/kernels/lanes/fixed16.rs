//! 16-bit fixed point of the f32 side of the integer dot products over int8 codes
//! ([`super::int8_vnni`], [`super::int8_avx2`]): a query row, or a block of softmax
//! weights, becomes codes `round(x / s)` with `s = max |x| / 32767`, so each element
//! is off by at most `2^-16 max |x|`.

/// The largest 16-bit code of the queries and weights.
pub(super) const ONE: f32 = 32767.0;

/// The scale that makes `max` code 32767, and its inverse: `(max / 32767, 32767 /
/// max)`; `(0, 0)` for `max == 0`, and a NaN scale (inverse 0) when `finite` is false
/// or `max` is not finite, so that the call's output is NaN, as the f32 arithmetic's
/// would be. O(1).
#[inline(always)]
pub(super) fn fixed_point(max: f32, finite: bool) -> (f32, f32) {
    fixed_point_to(max, finite, ONE)
}

/// [`fixed_point`] with `max` coded `one` instead of 32767 (AMX's query codes, whose
/// two bytes must each be signed: [`crate::kernels::amx`]). O(1).
#[inline(always)]
pub(in crate::kernels) fn fixed_point_to(max: f32, finite: bool, one: f32) -> (f32, f32) {
    if !finite || !max.is_finite() {
        (f32::NAN, 0.0)
    } else if max > 0.0 {
        (max / one, one / max)
    } else {
        (0.0, 0.0)
    }
}

/// Stores 16-bit codes two to a float, as bits (`codes[2 i]` in the low half of
/// `slots[i]`, `codes[2 i + 1]` in the high half): how an encoded query row keeps its
/// codes among its floats. Fills `min(slots.len(), codes.len() / 2)` slots. O(codes).
#[inline(always)]
pub(super) fn pack_pairs(slots: &mut [f32], codes: &[i16]) {
    for (slot, pair) in slots.iter_mut().zip(codes.chunks_exact(2)) {
        *slot = f32::from_bits(u32::from(pair[0] as u16) | u32::from(pair[1] as u16) << 16);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_maps_the_largest_magnitude_to_the_largest_code() {
        let (s, inv) = fixed_point(2.5, true);
        assert_eq!(s, 2.5 / ONE);
        assert_eq!((2.5 * inv).round(), ONE);
        assert_eq!(fixed_point(0.0, true), (0.0, 0.0));
        assert!(fixed_point(1.0, false).0.is_nan());
        assert!(fixed_point(f32::INFINITY, true).0.is_nan());
        assert_eq!(fixed_point(f32::NAN, true).1, 0.0);
    }

    #[test]
    fn pairs_pack_low_code_first() {
        let mut slots = [0.0f32; 2];
        pack_pairs(&mut slots, &[1, -1, -32767, 32767]);
        assert_eq!(slots[0].to_bits(), 0xFFFF_0001);
        assert_eq!(slots[1].to_bits(), 0x7FFF_8001);
    }
}
