//! Scalar number formats and DeepEP's per-token FP8 quantisation, bit-exact and host-only.
//!
//! - bf16 is carried as its raw bits (`u16`); fp8 is e4m3fn carried as `u8` (bias 7, no
//!   infinities, NaN = `S.1111.111`, largest finite 448).
//! - Conversions to the narrow formats round to nearest, ties to even.
//! - [`f32_to_fp8_e4m3`] matches CUDA's `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)`:
//!   finite values beyond ±448 and ±inf saturate to ±448; NaN becomes the NaN code with the
//!   input's sign (`0x7f` / `0xff`), as cuda_fp8.hpp's host path does.
//! - Per-token quantisation follows DeepEP's low-latency kernels: one fp32 scale per
//!   [`FP8_GROUP`] channels, `amax = max(FP8_AMAX_MIN, max |x|)`, the value multiplied into the
//!   data is `448 / amax` and the scale stored next to it (what a reader multiplies back) is
//!   `amax * (1 / 448)`; with `round_scale` both are powers of two, `2^-e` and `2^e` with
//!   `e = ceil(log2(amax / 448))`.

use crate::{Error, Result};

/// Channels per fp32 scale in the fp8 formats.
pub const FP8_GROUP: usize = 128;
/// Largest finite e4m3fn value.
pub const FP8_E4M3_MAX: f32 = 448.0;
/// Lower clamp on a group's absolute maximum, so all-zero groups get a finite scale
/// (DeepEP's `kFP8Margin`).
pub const FP8_AMAX_MIN: f32 = 1e-4;

/// bf16 bits -> f32 (exact).
#[inline]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// f32 -> bf16 bits, round to nearest even. Overflow rounds to ±inf as IEEE does; NaN stays
/// NaN (sign and top payload bits kept, quiet bit set).
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    let lsb = (bits >> 16) & 1;
    // Adding 0x7fff + lsb carries into bit 16 exactly when the dropped half is > 0x8000,
    // or == 0x8000 with an odd kept part: round to nearest even. A carry out of the
    // mantissa bumps the exponent, which is the correct result (up to +inf).
    (bits.wrapping_add(0x7fff + lsb) >> 16) as u16
}

/// fp8 e4m3fn bits -> f32 (exact). `0x7f` and `0xff` are NaN.
#[inline]
pub fn fp8_e4m3_to_f32(b: u8) -> f32 {
    let neg = b & 0x80 != 0;
    let e = ((b >> 3) & 0x0f) as i32;
    let m = (b & 0x07) as f32;
    let mag = if e == 0x0f && b & 0x07 == 0x07 {
        f32::NAN
    } else if e == 0 {
        m * (1.0 / 512.0) // subnormal: m * 2^-9
    } else {
        (8.0 + m) * pow2(e - 10) // (1 + m/8) * 2^(e-7)
    };
    if neg {
        -mag
    } else {
        mag
    }
}

/// f32 -> fp8 e4m3fn bits: round to nearest even, saturating to ±448 (`__NV_SATFINITE`).
#[inline]
pub fn f32_to_fp8_e4m3(x: f32) -> u8 {
    let sign = ((x.to_bits() >> 24) & 0x80) as u8;
    if x.is_nan() {
        return 0x7f | sign;
    }
    let a = x.abs();
    if a > FP8_E4M3_MAX {
        // Everything in (448, 464] rounds to 448 (even mantissa) and everything above saturates.
        return 0x7e | sign;
    }
    let code = if a < 1.0 / 64.0 {
        // Subnormal range (and the boundary to the smallest normal): the codes 0..=8 are
        // exactly the multiples of 2^-9, so the code is the rounded quotient. Scaling by a
        // power of two is exact.
        (a * 512.0).round_ties_even() as u32
    } else {
        let bits = a.to_bits();
        let exp = (bits >> 23) as i32 - 127; // -6..=8 here
        let man = bits & 0x007f_ffff;
        let kept = man >> 20;
        let rest = man & 0x000f_ffff;
        let up = (rest > 0x0008_0000 || (rest == 0x0008_0000 && kept & 1 == 1)) as u32;
        // A mantissa carry rolls into the exponent field, which is the right answer.
        ((((exp + 7) as u32) << 3) | kept) + up
    };
    code as u8 | sign
}

/// `2^e` for `-126 <= e <= 127`, exact.
#[inline]
fn pow2(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

/// `ceil(log2(x))` for a positive normal f32, read from its bits as DeepEP's
/// `fast_log2_ceil` does.
#[inline]
fn log2_ceil(x: f32) -> i32 {
    let bits = x.to_bits();
    let exp = ((bits >> 23) & 0xff) as i32 - 127;
    exp + ((bits & 0x007f_ffff) != 0) as i32
}

/// The two factors of one fp8 group: `q = fp8(x * mult)`, `x ≈ f32(q) * scale`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fp8Scale {
    /// Multiplied into the data before the cast (`448 / amax`, or `2^-e`).
    pub mult: f32,
    /// Stored next to the data; dequantisation multiplies by it (`amax / 448`, or `2^e`).
    pub scale: f32,
}

/// Scale for a group whose absolute maximum is `amax` (clamped below at [`FP8_AMAX_MIN`]).
/// A NaN `amax` is treated as the minimum (fmaxf semantics); `+inf` gives `mult = 0`.
#[inline]
pub fn fp8_group_scale(amax: f32, round_scale: bool) -> Fp8Scale {
    let amax = amax.max(FP8_AMAX_MIN);
    if round_scale && amax.is_finite() {
        let e = log2_ceil(amax * (1.0 / FP8_E4M3_MAX));
        Fp8Scale { mult: pow2(-e), scale: pow2(e) }
    } else {
        Fp8Scale { mult: FP8_E4M3_MAX / amax, scale: amax * (1.0 / FP8_E4M3_MAX) }
    }
}

fn check_fp8_row(hidden: usize, q_len: usize, scales_len: usize) -> Result<()> {
    if hidden == 0 || hidden % FP8_GROUP != 0 {
        return Err(Error::arg(
            "x",
            format!("row length {hidden} is not a positive multiple of {FP8_GROUP}"),
        ));
    }
    if q_len != hidden {
        return Err(Error::arg("out_q", format!("length {q_len}, expected {hidden}")));
    }
    if scales_len != hidden / FP8_GROUP {
        return Err(Error::arg(
            "out_scales",
            format!("length {scales_len}, expected {}", hidden / FP8_GROUP),
        ));
    }
    Ok(())
}

/// Quantise one bf16 row `x [hidden]` into `out_q [hidden]` e4m3 and
/// `out_scales [hidden / 128]` f32. No allocation.
pub fn quantize_row_bf16(
    x: &[u16],
    round_scale: bool,
    out_q: &mut [u8],
    out_scales: &mut [f32],
) -> Result<()> {
    check_fp8_row(x.len(), out_q.len(), out_scales.len())?;
    for ((xg, qg), s) in
        x.chunks_exact(FP8_GROUP).zip(out_q.chunks_exact_mut(FP8_GROUP)).zip(out_scales.iter_mut())
    {
        let amax = xg.iter().fold(0.0f32, |m, &b| m.max(bf16_to_f32(b).abs()));
        let sc = fp8_group_scale(amax, round_scale);
        for (q, &b) in qg.iter_mut().zip(xg) {
            *q = f32_to_fp8_e4m3(bf16_to_f32(b) * sc.mult);
        }
        *s = sc.scale;
    }
    Ok(())
}

/// Quantise one f32 row (same contract as [`quantize_row_bf16`]).
pub fn quantize_row_f32(
    x: &[f32],
    round_scale: bool,
    out_q: &mut [u8],
    out_scales: &mut [f32],
) -> Result<()> {
    check_fp8_row(x.len(), out_q.len(), out_scales.len())?;
    for ((xg, qg), s) in
        x.chunks_exact(FP8_GROUP).zip(out_q.chunks_exact_mut(FP8_GROUP)).zip(out_scales.iter_mut())
    {
        let amax = xg.iter().fold(0.0f32, |m, &v| m.max(v.abs()));
        let sc = fp8_group_scale(amax, round_scale);
        for (q, &v) in qg.iter_mut().zip(xg) {
            *q = f32_to_fp8_e4m3(v * sc.mult);
        }
        *s = sc.scale;
    }
    Ok(())
}

/// Dequantise one row: `out[i] = f32(q[i]) * scales[i / 128]`.
pub fn dequantize_row(q: &[u8], scales: &[f32], out: &mut [f32]) -> Result<()> {
    check_fp8_row(q.len(), q.len(), scales.len())?;
    if out.len() != q.len() {
        return Err(Error::arg("out", format!("length {}, expected {}", out.len(), q.len())));
    }
    for ((qg, og), &s) in
        q.chunks_exact(FP8_GROUP).zip(out.chunks_exact_mut(FP8_GROUP)).zip(scales.iter())
    {
        for (o, &b) in og.iter_mut().zip(qg) {
            *o = fp8_e4m3_to_f32(b) * s;
        }
    }
    Ok(())
}

/// Quantise `x [num_tokens, hidden]` bf16 into (`q [num_tokens, hidden]` e4m3,
/// `scales [num_tokens, hidden / 128]` f32).
pub fn quantize_bf16(x: &[u16], hidden: usize, round_scale: bool) -> Result<(Vec<u8>, Vec<f32>)> {
    if hidden == 0 || hidden % FP8_GROUP != 0 {
        return Err(Error::arg(
            "hidden",
            format!("{hidden} is not a positive multiple of {FP8_GROUP}"),
        ));
    }
    if x.len() % hidden != 0 {
        return Err(Error::arg(
            "x",
            format!("length {} is not a multiple of hidden {hidden}", x.len()),
        ));
    }
    let groups = hidden / FP8_GROUP;
    let mut q = vec![0u8; x.len()];
    let mut scales = vec![0f32; x.len() / hidden * groups];
    for ((xr, qr), sr) in
        x.chunks_exact(hidden).zip(q.chunks_exact_mut(hidden)).zip(scales.chunks_exact_mut(groups))
    {
        quantize_row_bf16(xr, round_scale, qr, sr)?;
    }
    Ok((q, scales))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::SplitMix64;

    /// Every finite e4m3fn value, as (code, value), codes 0x00..=0x7e.
    fn fp8_finite_positive() -> Vec<(u8, f64)> {
        (0u8..=0x7e)
            .map(|c| {
                let e = (c >> 3) as i32;
                let m = (c & 7) as f64;
                let v = if e == 0 { m * 2f64.powi(-9) } else { (1.0 + m / 8.0) * 2f64.powi(e - 7) };
                (c, v)
            })
            .collect()
    }

    /// Brute force: nearest finite code, ties to the even code; this is SATFINITE rounding.
    fn fp8_brute(x: f32, table: &[(u8, f64)]) -> u8 {
        if x.is_nan() {
            return 0x7f | if x.is_sign_negative() { 0x80 } else { 0 };
        }
        // Clamped: every code is <= 448, so this keeps the nearest and avoids f64 rounding.
        let a = (x as f64).abs().min(1e4);
        let mut best = table[0];
        for &(c, v) in table {
            let (db, dc) = ((a - best.1).abs(), (a - v).abs());
            if dc < db || (dc == db && c & 1 == 0 && best.0 & 1 == 1) {
                best = (c, v);
            }
        }
        best.0 | if x.is_sign_negative() { 0x80 } else { 0 }
    }

    /// Brute force bf16: the two neighbours by truncation, nearest wins, ties to even.
    fn bf16_brute(x: f32) -> u16 {
        let bits = x.to_bits();
        let lo = bits & 0xffff_0000;
        let hi = lo + 0x1_0000;
        let val = |b: u32| -> f64 {
            if b & 0x7fff_ffff == 0x7f80_0000 {
                // The next step after the largest finite value, for rounding purposes.
                let m = 2f64.powi(128);
                if b >> 31 == 1 {
                    -m
                } else {
                    m
                }
            } else {
                f32::from_bits(b) as f64
            }
        };
        let (dl, dh) = (((x as f64) - val(lo)).abs(), ((x as f64) - val(hi)).abs());
        let pick = if dl < dh || (dl == dh && (lo >> 16) & 1 == 0) { lo } else { hi };
        (pick >> 16) as u16
    }

    #[test]
    fn fp8_all_codes_round_trip() {
        for c in 0u8..=255 {
            let v = fp8_e4m3_to_f32(c);
            if c & 0x7f == 0x7f {
                assert!(v.is_nan(), "code {c:#x}");
                assert_eq!(f32_to_fp8_e4m3(v), c, "NaN code {c:#x} keeps its sign");
            } else {
                assert_eq!(f32_to_fp8_e4m3(v), c, "code {c:#x} value {v}");
            }
        }
        assert_eq!(fp8_e4m3_to_f32(0x7e), 448.0);
        assert_eq!(fp8_e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(fp8_e4m3_to_f32(0x08), 2f32.powi(-6));
    }

    #[test]
    fn fp8_matches_brute_force_on_all_bf16_values_and_random_f32() {
        let table = fp8_finite_positive();
        for b in 0u16..=u16::MAX {
            let x = bf16_to_f32(b);
            assert_eq!(f32_to_fp8_e4m3(x), fp8_brute(x, &table), "bf16 {b:#x} = {x}");
        }
        let mut rng = SplitMix64(7);
        for _ in 0..200_000 {
            // Random bits, biased to the interesting exponent range half of the time.
            let r = rng.next_u64();
            let bits = if r & 1 == 0 {
                r as u32
            } else {
                let exp = 127 - 12 + (rng.below(22) as u32);
                ((r >> 32) as u32 & 0x8000_0000) | (exp << 23) | ((r >> 8) as u32 & 0x7f_ffff)
            };
            let x = f32::from_bits(bits);
            assert_eq!(f32_to_fp8_e4m3(x), fp8_brute(x, &table), "f32 {bits:#x} = {x}");
        }
    }

    #[test]
    fn fp8_ties_saturation_and_specials() {
        // Midpoints between neighbours go to the even code.
        let table = fp8_finite_positive();
        for w in table.windows(2) {
            let mid = ((w[0].1 + w[1].1) / 2.0) as f32;
            let even = if w[0].0 & 1 == 0 { w[0].0 } else { w[1].0 };
            assert_eq!(f32_to_fp8_e4m3(mid), even, "midpoint {mid}");
            assert_eq!(f32_to_fp8_e4m3(-mid), even | 0x80, "midpoint {}", -mid);
        }
        assert_eq!(f32_to_fp8_e4m3(464.0), 0x7e);
        assert_eq!(f32_to_fp8_e4m3(465.0), 0x7e);
        assert_eq!(f32_to_fp8_e4m3(1e30), 0x7e);
        assert_eq!(f32_to_fp8_e4m3(f32::INFINITY), 0x7e);
        assert_eq!(f32_to_fp8_e4m3(f32::NEG_INFINITY), 0xfe);
        assert_eq!(f32_to_fp8_e4m3(2f32.powi(-10)), 0x00); // tie between 0 and 2^-9
        assert_eq!(f32_to_fp8_e4m3(2f32.powi(-10) * 1.0001), 0x01);
        assert_eq!(f32_to_fp8_e4m3(-0.0), 0x80);
        assert_eq!(f32_to_fp8_e4m3(-1e-30), 0x80);
        assert_eq!(f32_to_fp8_e4m3(f32::NAN), 0x7f);
        assert_eq!(f32_to_fp8_e4m3(-f32::NAN), 0xff);
    }

    #[test]
    fn bf16_all_codes_round_trip() {
        for b in 0u16..=u16::MAX {
            let x = bf16_to_f32(b);
            let back = f32_to_bf16(x);
            if x.is_nan() {
                assert!(bf16_to_f32(back).is_nan(), "{b:#x}");
                assert_eq!(back & 0x8000, b & 0x8000, "NaN sign {b:#x}");
            } else {
                assert_eq!(back, b, "{b:#x}");
            }
        }
    }

    #[test]
    fn bf16_matches_brute_force_and_ties() {
        let mut rng = SplitMix64(11);
        for _ in 0..500_000 {
            let x = f32::from_bits(rng.next_u64() as u32);
            if x.is_nan() {
                assert!(bf16_to_f32(f32_to_bf16(x)).is_nan());
                continue;
            }
            assert_eq!(f32_to_bf16(x), bf16_brute(x), "{:#x}", x.to_bits());
        }
        // Exact ties: kept part even stays, odd rounds up.
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert_eq!(f32_to_bf16(f32::from_bits(0x7f7f_8000)), 0x7f80); // rounds up to +inf
        assert_eq!(f32_to_bf16(f32::from_bits(0x7f7f_7fff)), 0x7f7f);
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7f80);
        assert_eq!(f32_to_bf16(-0.0), 0x8000);
    }

    #[test]
    fn group_scales() {
        let s = fp8_group_scale(0.0, false);
        assert_eq!(s.scale, FP8_AMAX_MIN * (1.0 / 448.0));
        let s = fp8_group_scale(448.0, false);
        assert_eq!((s.mult, s.scale), (1.0, 1.0));
        let s = fp8_group_scale(448.0, true);
        assert_eq!((s.mult, s.scale), (1.0, 1.0));
        let s = fp8_group_scale(449.0, true);
        assert_eq!((s.mult, s.scale), (0.5, 2.0));
        let s = fp8_group_scale(3.5, true); // 3.5/448 = 2^-7 exactly
        assert_eq!((s.mult, s.scale), (128.0, 2f32.powi(-7)));
        let s = fp8_group_scale(f32::NAN, false);
        assert_eq!(s.scale, FP8_AMAX_MIN * (1.0 / 448.0));
    }

    #[test]
    fn quantize_rows_within_tolerance() {
        let mut rng = SplitMix64(3);
        let hidden = 512;
        for round_scale in [false, true] {
            let x: Vec<u16> = (0..4 * hidden)
                .map(|i| {
                    // Group 1 of every row is zero, to exercise the clamp.
                    if (i % hidden) / 128 == 1 {
                        0
                    } else {
                        f32_to_bf16((rng.unit_f32() - 0.5) * 2f32.powi((i % 7) as i32 - 3))
                    }
                })
                .collect();
            let (q, scales) = quantize_bf16(&x, hidden, round_scale).unwrap();
            assert_eq!(scales.len(), 4 * hidden / 128);
            let mut back = vec![0f32; hidden];
            for t in 0..4 {
                let row = &x[t * hidden..(t + 1) * hidden];
                let sc = &scales[t * 4..(t + 1) * 4];
                dequantize_row(&q[t * hidden..(t + 1) * hidden], sc, &mut back).unwrap();
                for g in 0..4 {
                    let amax = row[g * 128..(g + 1) * 128]
                        .iter()
                        .fold(0f32, |m, &b| m.max(bf16_to_f32(b).abs()));
                    assert!(sc[g] * 448.0 >= amax.max(FP8_AMAX_MIN) * 0.999_999);
                    if round_scale {
                        assert_eq!(sc[g].to_bits() & 0x007f_ffff, 0, "power of two");
                    }
                    for i in g * 128..(g + 1) * 128 {
                        let xv = bf16_to_f32(row[i]);
                        // e4m3 relative step 2^-3 (half: 2^-4) above the subnormals, whose
                        // absolute step is 2^-9 * scale.
                        let tol = xv.abs() / 16.0 * 1.0001 + sc[g] * 2f32.powi(-10) * 1.01;
                        assert!((back[i] - xv).abs() <= tol, "t{t} i{i}: {} vs {xv}", back[i]);
                    }
                }
            }
        }
    }

    #[test]
    fn quantize_rejects_bad_shapes() {
        assert!(matches!(
            quantize_bf16(&[0; 100], 100, false),
            Err(Error::InvalidArgument { arg: "hidden", .. })
        ));
        assert!(matches!(
            quantize_bf16(&[0; 200], 128, false),
            Err(Error::InvalidArgument { arg: "x", .. })
        ));
        let mut q = [0u8; 128];
        let mut s = [0f32; 2];
        assert!(matches!(
            quantize_row_bf16(&[0; 128], false, &mut q, &mut s),
            Err(Error::InvalidArgument { arg: "out_scales", .. })
        ));
    }
}
