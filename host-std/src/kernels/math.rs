//! Vector arithmetic of the attention inner loops: dot products, scaled accumulation
//! and a branch-free `exp`, written over fixed-width lane arrays so that the compiler
//! vectorizes them (SSE2 in the portable build, AVX2 + FMA in the x86 build of the same
//! code, see [`super::online`]).
//!
//! `FUSED` selects `mul_add` (one rounding, one instruction with FMA) or a separate
//! multiply and add; the portable build must not use `mul_add`, which becomes a library
//! call on CPUs without FMA.

/// Lanes of the accumulators: 16 `f32`, two AVX2 registers or one AVX-512 register.
const LANES: usize = 16;

/// Width of the register-blocked accumulation in [`accumulate`].
const ACC_BLOCK: usize = 32;

/// `a * b + c`, fused when `FUSED`. O(1).
#[inline(always)]
pub(crate) fn fma<const FUSED: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FUSED {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// Dot product of two equally long slices, accumulated in `LANES` partial sums. O(n).
#[inline(always)]
pub(crate) fn dot<const FUSED: bool>(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; LANES];
    let mut ac = a.chunks_exact(LANES);
    let mut bc = b.chunks_exact(LANES);
    for (x, y) in (&mut ac).zip(&mut bc) {
        for l in 0..LANES {
            acc[l] = fma::<FUSED>(x[l], y[l], acc[l]);
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in ac.remainder().iter().zip(bc.remainder()) {
        tail = fma::<FUSED>(*x, *y, tail);
    }
    // Pairwise reduction of the lanes.
    let mut w = LANES / 2;
    while w > 0 {
        for l in 0..w {
            acc[l] += acc[l + w];
        }
        w /= 2;
    }
    acc[0] + tail
}

/// `acc[d] += Σ_t p[t] * v[t * dim + d]` for `t < p.len()`, `d < dim = acc.len()`.
/// Register-blocked: a block of `ACC_BLOCK` outputs stays in registers over all tokens.
/// O(p.len() * dim).
#[inline(always)]
pub(crate) fn accumulate<const FUSED: bool>(acc: &mut [f32], p: &[f32], v: &[f32]) {
    let dim = acc.len();
    if dim == 0 {
        return;
    }
    let n = p.len().min(v.len() / dim);
    let (p, v) = (&p[..n], &v[..n * dim]);
    let whole = dim / ACC_BLOCK * ACC_BLOCK;
    let mut d0 = 0;
    while d0 < whole {
        let mut a = [0.0f32; ACC_BLOCK];
        a.copy_from_slice(&acc[d0..d0 + ACC_BLOCK]);
        for (vt, &pt) in v.chunks_exact(dim).zip(p) {
            let vt = &vt[d0..d0 + ACC_BLOCK];
            for l in 0..ACC_BLOCK {
                a[l] = fma::<FUSED>(pt, vt[l], a[l]);
            }
        }
        acc[d0..d0 + ACC_BLOCK].copy_from_slice(&a);
        d0 += ACC_BLOCK;
    }
    if whole < dim {
        for (vt, &pt) in v.chunks_exact(dim).zip(p) {
            for (a, &x) in acc[whole..].iter_mut().zip(&vt[whole..]) {
                *a = fma::<FUSED>(pt, x, *a);
            }
        }
    }
}

/// `x[i] *= c`. O(n).
#[inline(always)]
pub(crate) fn scale(x: &mut [f32], c: f32) {
    for v in x {
        *v *= c;
    }
}

/// Maximum of a slice (`-inf` when empty). O(n).
#[inline(always)]
pub(crate) fn max(x: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; LANES];
    let mut c = x.chunks_exact(LANES);
    for ch in &mut c {
        for l in 0..LANES {
            m[l] = m[l].max(ch[l]);
        }
    }
    let mut r = f32::NEG_INFINITY;
    for &v in m.iter().chain(c.remainder()) {
        r = r.max(v);
    }
    r
}

/// `x[i] = exp(x[i] - shift)` and returns `Σ x[i]` (after the update). For arguments
/// `<= 0` (every softmax term after the running max is subtracted). O(n).
#[inline(always)]
pub(crate) fn exp_shifted_sum(x: &mut [f32], shift: f32) -> f32 {
    let mut sum = [0.0f32; LANES];
    let mut c = x.chunks_exact_mut(LANES);
    for ch in &mut c {
        for l in 0..LANES {
            let e = exp(ch[l] - shift);
            ch[l] = e;
            sum[l] += e;
        }
    }
    let mut r = 0.0f32;
    for v in c.into_remainder() {
        let e = exp(*v - shift);
        *v = e;
        r += e;
    }
    r + sum.iter().sum::<f32>()
}

/// `e^x` for `x <= 0` (larger arguments are clamped to 0), relative error below
/// 2e-7; `0` for `x < -87` (including `-inf`). Branch-free so that it vectorizes:
/// `x = k ln2 + r` with `|r| <= ln2 / 2`, `e^r` by a degree-6 Taylor polynomial
/// (truncation error `r^7 / 7! < 1.3e-7`), `2^k` built in the exponent bits. O(1).
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = core::f32::consts::LOG2_E;
    // ln 2 split into a part with few mantissa bits (exact products) and a remainder.
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // 1.5 * 2^23: adding it rounds to an integer held in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    let xc = x.clamp(-87.0, 0.0);
    let t = xc * LOG2E + MAGIC;
    let k = t.to_bits() as i32 - MAGIC.to_bits() as i32;
    let kf = t - MAGIC;
    let r = xc - kf * LN2_HI - kf * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    let pow2 = f32::from_bits(((k + 127) as u32) << 23);
    // NaN-free select: below the clamp the result is 0 (also for x = -inf).
    if x < -87.0 {
        0.0
    } else {
        p * pow2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_std_on_the_softmax_range() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x <= 0.0 {
            let got = f64::from(exp(x));
            let want = f64::from(x).exp();
            worst = worst.max(((got - want) / want).abs());
            x += 0.001_37;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn dot_and_accumulate_match_scalar_loops() {
        let a: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..37).map(|i| (i as f32 * 0.11).cos()).collect();
        let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot::<false>(&a, &b) - want).abs() < 1e-5);
        assert!((dot::<true>(&a, &b) - want).abs() < 1e-5);

        for dim in [1usize, 31, 32, 45, 64] {
            let n = 5;
            let v: Vec<f32> = (0..n * dim).map(|i| (i as f32 * 0.7).sin()).collect();
            let p: Vec<f32> = (0..n).map(|i| 0.1 + i as f32 * 0.2).collect();
            let mut acc: Vec<f32> = (0..dim).map(|i| i as f32 * 0.01).collect();
            let mut want = acc.clone();
            for t in 0..n {
                for d in 0..dim {
                    want[d] += p[t] * v[t * dim + d];
                }
            }
            accumulate::<false>(&mut acc, &p, &v);
            for (g, w) in acc.iter().zip(&want) {
                assert!((g - w).abs() < 1e-5);
            }
        }
    }
}
