//! Sums over a vocabulary, for scoring a language model's next-token distributions:
//! [`log_softmax`], [`exp_all`] and the KL divergence's sum [`kl_sum`], each target's row
//! (tens of thousands of entries) in a few passes on the widest vectors the CPU has.
//!
//! The same bits on every CPU, with or without SIMD: each function is plain Rust written
//! for the compiler's vectors, compiled once a tier (as the kernels' other such
//! functions), with no fused multiply-add written; a sum over a row keeps [`LANES`]
//! running sums (entry `i` in sum `i % LANES`) added in one fixed order at the end; and
//! the exponential is [`exp`], plain multiplies and adds (not the C library's, whose
//! result may depend on the CPU it picks a version for). The sensitivity stage's scoring
//! (`kl_probe` in `benches`: 512 targets of 49,152 against a reference whose
//! probabilities are kept, one thread, alternated on the AVX-512 Xeon of
//! `docs/BENCHMARKS.md`): 0.221-0.226 s a measurement with the C library's exponential
//! and one running sum, 0.115-0.119 s so.

/// Running sums a row's sums keep.
pub const LANES: usize = 8;

/// `e^x`, within 2 ulp of the C library's (checked on a grid of `[-708, 709.7]` in the
/// tests); 0 below -708 (where the result would be subnormal or 0) and for `-inf`; `+inf`
/// past the largest f64; NaN for NaN. Plain multiplies and adds: the same bits on every
/// CPU and in every vector lane.
#[inline(always)]
#[must_use]
pub fn exp(x: f64) -> f64 {
    // x = k ln 2 + r, |r| <= ln 2 / 2: k by adding and taking away 1.5 · 2^52 (rounds to
    // the nearest, ties to even, in any lane), r in two steps (fdlibm's split of ln 2: k ·
    // LN2_HI is exact for |k| < 2^20)
    const LOG2E: f64 = std::f64::consts::LOG2_E;
    const LN2_HI: f64 = f64::from_bits(0x3fe6_2e42_fee0_0000);
    const LN2_LO: f64 = f64::from_bits(0x3dea_39ef_3579_3c76);
    const SHIFT: f64 = 6_755_399_441_055_744.0;
    // e^r by Taylor's series to r^13 (the next term is below 5e-18 for |r| <= 0.3466)
    const C: [f64; 12] = [
        1.0 / 2.0,
        1.0 / 6.0,
        1.0 / 24.0,
        1.0 / 120.0,
        1.0 / 720.0,
        1.0 / 5_040.0,
        1.0 / 40_320.0,
        1.0 / 362_880.0,
        1.0 / 3_628_800.0,
        1.0 / 39_916_800.0,
        1.0 / 479_001_600.0,
        1.0 / 6_227_020_800.0,
    ];
    let xc = x.clamp(-710.0, 710.0);
    let t = xc * LOG2E + SHIFT;
    let k = t - SHIFT;
    let r = (xc - k * LN2_HI) - k * LN2_LO;
    let mut p = C[11];
    for &c in C[..11].iter().rev() {
        p = p * r + c;
    }
    let p = (p * r + 1.0) * r + 1.0;
    // 2^(k - 1) from k's bits in `t` (t is 1.5 · 2^52 + k, one unit a step), then 2: exact,
    // and k = 1024 overflows to infinity only where e^x does
    let ki = t.to_bits().cast_signed() - SHIFT.to_bits().cast_signed();
    let half = f64::from_bits((ki + 1022).cast_unsigned() << 52);
    let y = (p * half) * 2.0;
    if x < -708.0 {
        0.0
    } else if x.is_nan() {
        x
    } else {
        y
    }
}

/// The eight running sums added in their one order.
#[inline(always)]
fn total(s: [f64; LANES]) -> f64 {
    ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]))
}

/// [`log_softmax`]'s arithmetic, written for the compiler's vectors: the maximum, the
/// exponentials into `out`, their sum, then `out` overwritten with the log-probabilities
/// (each pass a plain loop the compiler widens; the sum's loop over exponentials worked
/// out in it was not widened, and took 400 µs a row).
#[inline(always)]
pub(crate) fn log_softmax_lanes(logits: &[f32], out: &mut [f64]) {
    // the maximum in eight running maxima (a NaN is passed over, as `f32::max` does)
    let larger = |m: f32, v: f32| if v > m { v } else { m };
    let max = lanes(logits, f32::NEG_INFINITY, larger)
        .into_iter()
        .fold(f32::NEG_INFINITY, larger);
    for (o, &v) in out.iter_mut().zip(logits) {
        *o = exp(f64::from(v - max));
    }
    let lse = sum(out).ln();
    for (o, &v) in out.iter_mut().zip(logits) {
        *o = f64::from(v - max) - lse;
    }
}

/// `v`'s sum in [`LANES`] running sums.
#[inline(always)]
fn sum(v: &[f64]) -> f64 {
    total(lanes(v, 0.0, |s, x| s + x))
}

/// `f` folded over `v` in [`LANES`] running values from `init`, entry `i` into value
/// `i % LANES`, in order.
#[inline(always)]
fn lanes<T: Copy, A: Copy>(v: &[T], init: A, f: impl Fn(A, T) -> A) -> [A; LANES] {
    let mut acc = [init; LANES];
    let mut chunks = v.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = f(*a, x);
        }
    }
    for (a, &x) in acc.iter_mut().zip(chunks.remainder()) {
        *a = f(*a, x);
    }
    acc
}

/// [`exp_all`]'s arithmetic, written for the compiler's vectors.
#[inline(always)]
pub(crate) fn exp_lanes<P: Copy + Into<f64>>(v: &[P], out: &mut [f64]) {
    for (o, &x) in out.iter_mut().zip(v) {
        *o = exp(x.into());
    }
}

/// [`kl_sum`]'s arithmetic, written for the compiler's vectors, with the exponentials `ep`
/// of `p` given (every term a product of loads: a term that took its exponential in
/// place ran at a third of the speed).
#[inline(always)]
pub(crate) fn kl_lanes<P: Copy + Into<f64>>(p: &[P], ep: &[f64], q: &[f64]) -> f64 {
    let mut s = [0f64; LANES];
    let n = p.len().min(q.len()).min(ep.len());
    let (mut pc, mut ec, mut qc) = (
        p[..n].chunks_exact(LANES),
        ep[..n].chunks_exact(LANES),
        q[..n].chunks_exact(LANES),
    );
    let term = |lp: P, e: f64, lq: f64| {
        let lp: f64 = lp.into();
        e * (lp - lq)
    };
    for ((pc, ec), qc) in (&mut pc).zip(&mut ec).zip(&mut qc) {
        for (((s, &lp), &e), &lq) in s.iter_mut().zip(pc).zip(ec).zip(qc) {
            *s += term(lp, e, lq);
        }
    }
    let rest = pc
        .remainder()
        .iter()
        .zip(ec.remainder())
        .zip(qc.remainder());
    for (s, ((&lp, &e), &lq)) in s.iter_mut().zip(rest) {
        *s += term(lp, e, lq);
    }
    total(s)
}

/// `log_softmax(logits)` in f64 into `out` (made as long as `logits`; a buffer kept
/// from row to row spares a vocabulary-long allocation a row): `(v - max)` (in f32, then
/// widened) less the log of `Σ e^(v - max)`, the sum in [`LANES`] running sums of
/// [`exp`].
pub fn log_softmax(logits: &[f32], out: &mut Vec<f64>) {
    out.resize(logits.len(), 0.0);
    crate::kernels::log_softmax(logits, out);
}

/// [`argmax_lanes`]'s key for a value: `f64::total_cmp`'s order as an integer's.
#[inline(always)]
fn key(x: f64) -> i64 {
    let b = x.to_bits().cast_signed();
    b ^ ((b >> 63).cast_unsigned() >> 1).cast_signed()
}

/// [`argmax`]'s arithmetic, written for the compiler's vectors: the order's keys, their
/// maximum in [`LANES`] running maxima, then the last index of that key.
#[inline(always)]
pub(crate) fn argmax_lanes<T: Copy + Into<f64>>(v: &[T]) -> usize {
    let top = lanes(v, i64::MIN, |m, x| m.max(key(x.into())))
        .into_iter()
        .max()
        .unwrap_or(i64::MIN);
    v.iter().rposition(|&x| key(x.into()) == top).unwrap_or(0)
}

/// The index of the largest of `v` in `f64::total_cmp`'s order, the last of equals (0 for
/// none): what `v.iter().enumerate().max_by(total_cmp)` gives, without a branch a value.
#[must_use]
pub fn argmax(v: &[f32]) -> usize {
    crate::kernels::argmax(v)
}

/// [`argmax`] of f64 values.
#[must_use]
pub fn argmax_f64(v: &[f64]) -> usize {
    crate::kernels::argmax_f64(v)
}

/// [`exp`] of each value, widened to f64 first.
#[must_use]
pub fn exp_all(v: &[f32]) -> Vec<f64> {
    let mut out = vec![0f64; v.len()];
    crate::kernels::exp_all(v, &mut out);
    out
}

/// `Σ e_i (p_i - q_i)` over the shorter of the rows, in [`LANES`] running sums: the KL
/// divergence of `q` from `p` for log-probabilities `p` and `q`, with `e = ep` when given
/// (the [`exp_all`] of `p`, worked out once for a row that many are compared with) or
/// [`exp`] of `p` worked out here first (the same bits).
#[must_use]
pub fn kl_sum(p: &[f32], ep: Option<&[f64]>, q: &[f64]) -> f64 {
    match ep {
        Some(ep) => crate::kernels::kl_sum(p, ep, q),
        None => crate::kernels::kl_sum(p, &exp_all(p), q),
    }
}

/// [`kl_sum`] for f64 log-probabilities `p`.
#[must_use]
pub fn kl_sum_f64(p: &[f64], ep: Option<&[f64]>, q: &[f64]) -> f64 {
    match ep {
        Some(ep) => crate::kernels::kl_sum_f64(p, ep, q),
        None => {
            let mut e = vec![0f64; p.len()];
            crate::kernels::exp_all_f64(p, &mut e);
            crate::kernels::kl_sum_f64(p, &e, q)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ulps between two finite f64 of one sign.
    fn ulps(a: f64, b: f64) -> u64 {
        a.to_bits().abs_diff(b.to_bits())
    }

    #[test]
    fn exp_is_within_two_ulp_of_the_c_library() {
        let mut worst = (0, 0.0);
        let mut x = -708.0;
        while x <= 709.7 {
            let d = ulps(exp(x), x.exp());
            if d > worst.0 {
                worst = (d, x);
            }
            x += 0.000_731_3;
        }
        assert!(worst.0 <= 2, "{} ulp at {}", worst.0, worst.1);
        assert_eq!(exp(0.0).to_bits(), 1f64.to_bits());
        assert_eq!(exp(-0.0).to_bits(), 1f64.to_bits());
        assert_eq!(exp(-708.5), 0.0);
        assert_eq!(exp(f64::NEG_INFINITY), 0.0);
        assert_eq!(exp(709.79), f64::INFINITY);
        assert_eq!(exp(1e9), f64::INFINITY);
        assert!(ulps(exp(709.78), 709.78f64.exp()) <= 2);
        assert!(exp(f64::NAN).is_nan());
    }

    #[test]
    fn every_tier_gives_the_plain_bits() {
        let mut rng = crate::synthetic::Rng::new(0x2545_f491_4f6c_dd1d);
        let mut next = move || rng.uniform() as f32;
        for n in [1usize, 7, 8, 9, 63, 1000, 49_152] {
            let logits: Vec<f32> = (0..n).map(|_| next() * 40.0 - 25.0).collect();
            let mut plain = vec![0f64; n];
            log_softmax_lanes(&logits, &mut plain);
            let mut tiered = Vec::new();
            log_softmax(&logits, &mut tiered);
            assert!(
                plain
                    .iter()
                    .zip(&tiered)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
            );
            // a distribution: its probabilities add up to 1
            let sum: f64 = tiered.iter().map(|&v| v.exp()).sum();
            assert!((sum - 1.0).abs() < 1e-12, "{sum}");
            let lp: Vec<f32> = tiered.iter().map(|&v| v as f32).collect();
            let mut e = vec![0f64; n];
            exp_lanes(&lp, &mut e);
            let ep = exp_all(&lp);
            assert!(e.iter().zip(&ep).all(|(a, b)| a.to_bits() == b.to_bits()));
            let shifted: Vec<f32> = logits.iter().map(|v| v * 1.1 + 0.3).collect();
            let mut q = Vec::new();
            log_softmax(&shifted, &mut q);
            assert_eq!(argmax(&shifted), argmax_lanes(&shifted));
            assert_eq!(argmax_f64(&q), argmax_lanes(&q));
            assert_eq!(argmax_f64(&q), argmax(&shifted));
            let with = kl_sum(&lp, Some(&ep), &q);
            assert_eq!(with.to_bits(), kl_lanes(&lp, &ep, &q).to_bits());
            // the exponentials taken here are the ones given
            assert_eq!(with.to_bits(), kl_sum(&lp, None, &q).to_bits());
            let lp64: Vec<f64> = lp.iter().map(|&v| f64::from(v)).collect();
            assert_eq!(with.to_bits(), kl_sum_f64(&lp64, Some(&ep), &q).to_bits());
            // and the sum is the KL divergence, to rounding
            let direct: f64 = lp
                .iter()
                .zip(&q)
                .map(|(&p, &q)| f64::from(p).exp() * (f64::from(p) - q))
                .sum();
            assert!(
                (with - direct).abs() <= 1e-12 * direct.abs().max(1.0),
                "{with} {direct}"
            );
            if n > 1 {
                assert!(with > 0.0);
            }
        }
    }

    /// The definition `argmax` replaces.
    fn by_max_by<T: Copy + Into<f64>>(v: &[T]) -> usize {
        v.iter()
            .enumerate()
            .max_by(|a, b| (*a.1).into().total_cmp(&(*b.1).into()))
            .map_or(0, |(i, _)| i)
    }

    #[test]
    fn argmax_is_max_by_total_cmp_with_ties_zeros_and_nans() {
        let mut rng = crate::synthetic::Rng::new(0x9e37_79b9_7f4a_7c15);
        let mut next = move || rng.next_u64();
        let specials = [
            0.0f32,
            -0.0,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001),
            f32::INFINITY,
            f32::NEG_INFINITY,
            1e-45,
            -3.5,
            2.0,
        ];
        for case in 0..2000 {
            let len = (next() % 40) as usize + usize::from(case % 7 == 0) * 49_152;
            let v: Vec<f32> = (0..len)
                .map(|_| match next() % 10 {
                    // few distinct values: ties everywhere
                    0..=2 => specials[(next() % 10) as usize],
                    3..=5 => ((next() % 5) as f32) - 2.0,
                    _ => f32::from_bits(next() as u32),
                })
                .collect();
            assert_eq!(argmax(&v), by_max_by(&v), "case {case}: {v:?}");
            let w: Vec<f64> = v.iter().map(|&x| f64::from(x) * 0.5).collect();
            assert_eq!(argmax_f64(&w), by_max_by(&w), "case {case}");
            assert_eq!(argmax_lanes(&v), argmax(&v), "case {case}");
        }
        assert_eq!(argmax(&[]), 0);
        assert_eq!(argmax(&[1.0f32, 3.0, 3.0, -0.0]), 2);
        assert_eq!(argmax(&[0.0f32, -0.0]), 0);
        assert_eq!(argmax(&[-0.0f32, 0.0, -0.0]), 1);
    }
}
