//! The FP8 E4M3 format of the OCP 8-bit floating point specification (the `e4m3fn`
//! variant that accelerators and checkpoints use): 1 sign bit, 4 exponent bits (bias 7),
//! 3 mantissa bits; no infinities; `S.1111.111` is NaN; the largest finite magnitude is
//! 448 and the smallest subnormal 2^-9.

/// Largest finite magnitude (`S.1111.110`); larger inputs saturate to it in [`encode`].
/// Crate-private: cbindgen would export a public constant as a bare `MAX` macro into
/// `kvpage.h`; callers read it as [`super::Code::max`].
pub(crate) const MAX: f32 = 448.0;

/// The code of NaN (sign clear).
const NAN: u8 = 0x7F;

/// Every code's value, built at compile time.
const DECODED: [f32; 256] = {
    let mut table = [0.0f32; 256];
    let mut code = 0;
    while code < 256 {
        table[code] = decode_slow(code as u8);
        code += 1;
    }
    table
};

/// The value of `code`, computed from its fields.
const fn decode_slow(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((code >> 3) & 0x0F) as i32;
    let man = (code & 0x07) as f32;
    if exp == 15 && code & 0x07 == 7 {
        return f32::NAN;
    }
    // value = (exp == 0 ? man / 8 * 2^-6 : (1 + man / 8) * 2^(exp - 7))
    let (frac, e) = if exp == 0 {
        (man / 8.0, -6)
    } else {
        (1.0 + man / 8.0, exp - 7)
    };
    let mut scale = 1.0f32;
    let mut i = 0;
    while i < e.abs() {
        scale *= 2.0;
        i += 1;
    }
    if e < 0 {
        sign * frac / scale
    } else {
        sign * frac * scale
    }
}

/// The value of `code`. O(1) (one table read).
#[inline]
pub fn decode(code: u8) -> f32 {
    DECODED[code as usize]
}

/// The value of `code` as [`decode`] gives it (NaN for NaN, with the code's sign), by
/// integer and float operations alone: no table read, no branch, so that a loop over
/// codes vectorizes on any CPU. A normal code's exponent and mantissa bits go to the
/// top of an f32's with the exponent's bias added as an integer; a subnormal code is
/// its mantissa, converted, times `2^-9`. Neither touches a subnormal f32, so the
/// result does not change where a program has told the CPU to flush those to zero (as
/// games do). O(1).
#[inline(always)]
pub(crate) fn decode_by_bits(code: u8) -> f32 {
    const TWO_POW_MINUS_9: f32 = 1.0 / 512.0;
    // E4M3's exponent bias is 7, f32's 127.
    const REBIAS: u32 = (127 - 7) << 23;
    let c = u32::from(code);
    let magnitude = c & 0x7F;
    let normal = (magnitude << 20) + REBIAS;
    let subnormal = (magnitude as f32 * TWO_POW_MINUS_9).to_bits();
    let bits = if magnitude == u32::from(NAN) {
        f32::NAN.to_bits()
    } else if magnitude < 8 {
        subnormal
    } else {
        normal
    };
    f32::from_bits(bits | (c & 0x80) << 24)
}

/// The code nearest to `x` (ties to the even mantissa); magnitudes past 448 (`Code::max`)
/// saturate to ±448 (so a scale chosen a little small clips instead of failing); NaN
/// gives NaN. O(1).
pub fn encode(x: f32) -> u8 {
    if x.is_nan() {
        return NAN;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a >= MAX {
        return sign | 0x7E;
    }
    // Smallest normal is 2^-6; below it the step is 2^-9 (subnormals).
    let bits = a.to_bits();
    let exp = (bits >> 23) as i32 - 127;
    if exp < -6 {
        // Subnormal range: value = m * 2^-9, m in 0..=8 (8 rounds up to the smallest
        // normal, whose code is 0x08, so the sum below carries correctly).
        let m = round_half_even(a * 512.0) as u8;
        return sign | m;
    }
    // Normal: keep 3 mantissa bits, rounding the 20 dropped ones to nearest even; a
    // carry out of the mantissa bumps the exponent, which the addition does for us.
    let man = bits & 0x007F_FFFF;
    let keep = man >> 20;
    let rest = man & 0x000F_FFFF;
    let half = 0x0008_0000;
    let up = rest > half || (rest == half && keep & 1 == 1);
    let code = (((exp + 7) as u32) << 3) + keep + u32::from(up);
    // The largest normal below MAX can round up to 0x7F (NaN): clamp to 448.
    sign | (code.min(0x7E) as u8)
}

/// `x` rounded to the nearest integer, ties to even. O(1).
fn round_half_even(x: f32) -> f32 {
    let r = x.round();
    if (r - x).abs() == 0.5 && r % 2.0 != 0.0 {
        r - x.signum()
    } else {
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_codes() {
        assert_eq!(decode(0x00), 0.0);
        assert_eq!(decode(0x38), 1.0);
        assert_eq!(decode(0x7E), 448.0);
        assert_eq!(decode(0xFE), -448.0);
        // Exact powers of two as bits (`powi` may round differently per platform, and
        // does under Miri).
        let pow2 = |e: i32| f32::from_bits(((127 + e) as u32) << 23);
        assert_eq!(decode(0x01), pow2(-9));
        assert_eq!(decode(0x08), pow2(-6));
        assert!(decode(0x7F).is_nan() && decode(0xFF).is_nan());
    }

    #[test]
    fn decode_by_bits_is_the_table_bit_for_bit() {
        for code in 0..=255u8 {
            let (table, bits) = (decode(code), decode_by_bits(code));
            if table.is_nan() {
                assert!(bits.is_nan(), "code {code:#04x}: {bits}");
            } else {
                assert_eq!(
                    bits.to_bits(),
                    table.to_bits(),
                    "code {code:#04x}: {bits} vs {table}"
                );
            }
        }
    }

    #[test]
    fn every_code_round_trips() {
        for code in 0..=255u8 {
            let x = decode(code);
            if x.is_nan() {
                assert!(decode(encode(x)).is_nan());
            } else if code == 0x80 {
                assert_eq!(encode(x), 0x80, "negative zero keeps its sign");
            } else {
                assert_eq!(encode(x), code, "code {code:#04x} = {x}");
            }
        }
    }

    /// Against a brute-force nearest code (ties to the even code) on many values.
    #[test]
    #[cfg_attr(
        miri,
        ignore = "200k values against a search of 256 codes: pure arithmetic, no unsafe code, minutes under Miri"
    )]
    fn encode_is_nearest_ties_to_even() {
        let finite: Vec<(u8, f64)> = (0..=255u8)
            .filter(|&c| !decode(c).is_nan())
            .map(|c| (c, f64::from(decode(c))))
            .collect();
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        for i in 0..200_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            // Magnitudes from 2^-12 to 2^10, both signs; every 97th value a midpoint.
            let e = (state % 22) as i32 - 12;
            let frac = 1.0 + ((state >> 8) % 1024) as f64 / 1024.0;
            let mut x = frac * 2f64.powi(e) * if state & 1 == 1 { -1.0 } else { 1.0 };
            if i % 97 == 0 {
                let (c, v) = finite[(state >> 20) as usize % (finite.len() - 1)];
                let next = f64::from(decode(c.wrapping_add(1)));
                if !next.is_nan() && v.signum() == next.signum() {
                    x = (v + next) / 2.0;
                }
            }
            let x = x as f32;
            let clamped = f64::from(x).clamp(-448.0, 448.0);
            let best = finite.iter().map(|&(c, v)| (c, (v - clamped).abs())).fold(
                (0u8, f64::INFINITY),
                |(bc, bd), (c, d)| {
                    let better = d < bd || (d == bd && (c & 1) == 0 && (bc & 1) == 1);
                    if better {
                        (c, d)
                    } else {
                        (bc, bd)
                    }
                },
            );
            let got = encode(x);
            assert_eq!(
                (f64::from(decode(got)) - clamped).abs(),
                best.1,
                "x = {x}: got {got:#04x} ({}), nearest {:#04x} ({})",
                decode(got),
                best.0,
                decode(best.0)
            );
        }
    }

    #[test]
    fn saturates_and_keeps_nan() {
        assert_eq!(encode(1e6), 0x7E);
        assert_eq!(encode(-1e6), 0xFE);
        assert_eq!(encode(f32::INFINITY), 0x7E);
        assert_eq!(encode(464.0), 0x7E, "would round to the NaN code");
        assert!(decode(encode(f32::NAN)).is_nan());
    }
}
