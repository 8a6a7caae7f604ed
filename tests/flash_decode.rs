//! `fused::flash_decode` and its unfused baseline against attention computed in f64 from the
//! same inputs (already rounded to the element type), over every rank's keys.
//!
//! Worlds of 1 to 8 ranks; every element type; keys per rank that are 0, 1, primes, fewer in
//! all than there are ranks, and several chunks of the host kernel (256 keys) on one rank;
//! grouped-query heads (several query heads per kv head) and one head; d != dv. Every rank must
//! return the same bits.
//!
//! # Tolerance
//! An output is `sum_j p_j v_j` with `sum_j p_j = 1` and `|v_j| <= 1`: the error of the scores
//! (`d` products in the accumulator type) moves `p_j` relatively by about `d eps_acc`, the exp
//! approximation by 2 ulp, and the sums over keys and over chunks add `eps_acc` per term in the
//! worst case; f16 and bf16 round the result once (`u_T`), and the unfused baseline rounds each
//! rank's partial once more. So `|got - want| <= u_T * roundings + 4 (d + log2(keys) + 8)
//! eps_acc`. A kernel that drops one rank's keys, or one chunk, is off by far more: each case
//! checks that its bound catches dropping the largest rank's keys (`catches`).

use dist_tensor::fused::{self, FlashDecodeOutput};
use dist_tensor::{DType, Element, Error, Rank, Result, Tensor, World};
use half::{bf16, f16};

/// Everything of one case: the shapes and each rank's key count.
#[derive(Debug, Clone)]
struct Case {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    d: usize,
    dv: usize,
    keys: Vec<usize>,
}

impl Case {
    fn q<T: Element>(&self) -> Tensor<T> {
        Tensor::random(&[self.batch, self.heads, self.d], 7)
    }

    fn kv<T: Element>(&self, r: usize) -> (Tensor<T>, Tensor<T>) {
        let s = self.keys[r];
        let seed = 100 + 2 * r as u64;
        (
            Tensor::random(&[self.batch, s, self.kv_heads, self.d], seed),
            Tensor::random(&[self.batch, s, self.kv_heads, self.dv], seed + 1),
        )
    }

    fn scale(&self) -> f64 {
        1.0 / (self.d as f64).sqrt()
    }

    /// The attention of every query over the keys of the ranks in `ranks`, in f64, and beside
    /// each output the same sum of absolute values (`sum_j p_j |v_j|`), which errors scale with.
    fn reference<T: Element>(&self, ranks: &[usize]) -> Vec<(f64, f64)> {
        let (g, d, dv) = (self.heads / self.kv_heads, self.d, self.dv);
        let q = self.q::<T>();
        let kvs: Vec<_> = ranks.iter().map(|&r| (r, self.kv::<T>(r))).collect();
        let mut out = vec![(0.0, 0.0); self.batch * self.heads * dv];
        for b in 0..self.batch {
            for h in 0..self.heads {
                let qh = &q.as_slice()[(b * self.heads + h) * d..][..d];
                let (mut scores, mut rows) = (Vec::new(), Vec::new());
                for (r, (k, v)) in &kvs {
                    for j in 0..self.keys[*r] {
                        let at = (b * self.keys[*r] + j) * self.kv_heads + h / g;
                        let key = &k.as_slice()[at * d..][..d];
                        let dot: f64 =
                            qh.iter().zip(key).map(|(a, c)| a.to_f64() * c.to_f64()).sum();
                        scores.push(dot * self.scale());
                        rows.push(&v.as_slice()[at * dv..][..dv]);
                    }
                }
                let top = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|s| (s - top).exp()).collect();
                let sum: f64 = w.iter().sum();
                let o = &mut out[(b * self.heads + h) * dv..][..dv];
                for (w, row) in w.iter().zip(rows) {
                    for (o, x) in o.iter_mut().zip(row) {
                        o.0 += w / sum * x.to_f64();
                        o.1 += w / sum * x.to_f64().abs();
                    }
                }
            }
        }
        out
    }

    /// The bound on one output `(o, a)` of the reference, for a result rounded to `T` once and
    /// `roundings - 1` more times in parts (weights summing to one, so the parts' errors add up
    /// to at most `u_T a`).
    fn bound<T: Element>(&self, (o, a): (f64, f64), roundings: f64) -> f64 {
        let eps_acc = if T::DTYPE == DType::F64 { f64::EPSILON } else { f32::EPSILON as f64 };
        let u_t = match T::DTYPE {
            DType::F16 | DType::BF16 => T::EPSILON / 2.0,
            _ => 0.0,
        };
        let keys: usize = self.keys.iter().sum();
        let depth = self.d as f64 + (keys.max(2) as f64).log2() + 8.0;
        u_t * (o.abs() + (roundings - 1.0) * a) + 4.0 * depth * eps_acc * a
    }

    /// Runs the case on a world of threads; every rank's output, fused then unfused.
    fn run<T: Element>(&self) -> Vec<(FlashDecodeOutput<T>, FlashDecodeOutput<T>)> {
        self.run_in::<T>(World::threads(self.keys.len()).unwrap())
    }

    /// Runs the case in `world` (of as many ranks as the case has); the outputs on the host.
    fn run_in<T: Element>(
        &self,
        world: World,
    ) -> Vec<(FlashDecodeOutput<T>, FlashDecodeOutput<T>)> {
        let q = self.q::<T>();
        let host = |o: FlashDecodeOutput<T>| -> Result<FlashDecodeOutput<T>> {
            Ok(FlashDecodeOutput { output: o.output.to_host()?, lse: o.lse.to_host()? })
        };
        world
            .run(|rank| {
                let (k, v) = self.kv::<T>(rank.rank());
                let fused = fused::flash_decode(rank, &q, &k, &v, self.scale())?;
                let unfused = fused::flash_decode_unfused(rank, &q, &k, &v, self.scale())?;
                Ok((host(fused)?, host(unfused)?))
            })
            .unwrap_or_else(|e| panic!("{self:?} {}: {e}", T::DTYPE))
    }

    /// Checks every rank's output against f64, and that they are the same bits.
    fn check<T: Element>(&self) {
        self.check_in::<T>(World::threads(self.keys.len()).unwrap());
    }

    /// [`Case::check`] in `world`.
    fn check_in<T: Element>(&self, world: World) {
        let n = self.keys.len();
        let want = self.reference::<T>(&(0..n).collect::<Vec<_>>());
        let outs = self.run_in::<T>(world);
        // The largest error as a fraction of its bound.
        let worst = |got: &Tensor<T>, roundings: f64| {
            let ratio = |(g, &w): (&T, &(f64, f64))| {
                (g.to_f64() - w.0).abs() / self.bound::<T>(w, roundings)
            };
            got.as_slice().iter().zip(&want).map(ratio).fold(0.0f64, f64::max)
        };
        for (r, (fused, unfused)) in outs.iter().enumerate() {
            assert_eq!(fused.output.shape(), &[self.batch, self.heads, self.dv]);
            assert_eq!(fused.lse.shape(), &[self.batch, self.heads]);
            let what = format!("{self:?} {} rank {r}", T::DTYPE);
            let err = worst(&fused.output, 1.0);
            assert!(err <= 1.0, "{what}: fused off by {err} times the bound");
            let err = worst(&unfused.output, 2.0);
            assert!(err <= 1.0, "{what}: unfused off by {err} times the bound");
            let bits = |t: &Tensor<T>| {
                t.as_slice().iter().map(|x| x.to_f64().to_bits()).collect::<Vec<_>>()
            };
            assert_eq!(bits(&fused.output), bits(&outs[0].0.output), "{what}: not rank 0's bits");
            for (a, b) in fused.lse.as_slice().iter().zip(unfused.lse.as_slice()) {
                let (a, b) = (a.to_f64(), b.to_f64());
                assert!(
                    a == b || (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                    "{what}: lse {a} vs {b}"
                );
            }
        }
        self.catches::<T>(&want);
    }

    /// The bound catches a kernel that drops the keys of the rank with the most.
    fn catches<T: Element>(&self, want: &[(f64, f64)]) {
        let n = self.keys.len();
        let most = (0..n).max_by_key(|&r| self.keys[r]).unwrap();
        if n == 1 || self.keys.iter().filter(|&&s| s > 0).count() < 2 {
            return; // dropping the only rank with keys leaves nothing to compare
        }
        let others: Vec<usize> = (0..n).filter(|&r| r != most).collect();
        let without = self.reference::<T>(&others);
        let ratio =
            |(w, d): (&(f64, f64), &(f64, f64))| (w.0 - d.0).abs() / self.bound::<T>(*w, 2.0);
        let off = want.iter().zip(&without).map(ratio).fold(0.0f64, f64::max);
        assert!(off > 4.0, "{self:?}: the bound would miss a dropped rank ({off} times)");
    }
}

fn every_dtype(case: &Case) {
    case.check::<f64>();
    case.check::<f32>();
    case.check::<f16>();
    case.check::<bf16>();
}

#[test]
fn matches_f64_on_worlds_of_1_to_8_with_uneven_and_empty_key_shards() {
    for n in 1..=8usize {
        // Primes and empties: rank r holds (7 r + 3) mod 11 keys, rank 1 none.
        let keys: Vec<usize> = (0..n).map(|r| if r == 1 { 0 } else { (7 * r + 3) % 11 }).collect();
        every_dtype(&Case { batch: 2, heads: 6, kv_heads: 2, d: 16, dv: 8, keys });
    }
}

#[test]
fn fewer_keys_than_ranks_one_key_and_one_head() {
    // 3 keys over 8 ranks; a single key in all; one head of width 1.
    every_dtype(&Case {
        batch: 1,
        heads: 4,
        kv_heads: 4,
        d: 5,
        dv: 3,
        keys: vec![0, 1, 0, 0, 1, 0, 1, 0],
    });
    every_dtype(&Case { batch: 3, heads: 2, kv_heads: 1, d: 7, dv: 7, keys: vec![0, 0, 1] });
    every_dtype(&Case { batch: 1, heads: 1, kv_heads: 1, d: 1, dv: 1, keys: vec![2, 3] });
}

#[test]
fn keys_beyond_one_chunk_on_some_ranks() {
    // 1031 keys (a prime, four chunks of 256 and 7 more) on one rank, 512 (two exactly) on another.
    every_dtype(&Case {
        batch: 1,
        heads: 8,
        kv_heads: 2,
        d: 64,
        dv: 64,
        keys: vec![1031, 512, 17],
    });
}

#[test]
fn no_keys_anywhere_gives_zeros_and_minus_infinity() {
    let case = Case { batch: 2, heads: 2, kv_heads: 1, d: 3, dv: 2, keys: vec![0, 0, 0] };
    for (fused, unfused) in case.run::<f32>() {
        for out in [fused, unfused] {
            assert!(out.output.as_slice().iter().all(|&x| x == 0.0));
            assert!(out.lse.as_slice().iter().all(|&x| x == f32::NEG_INFINITY));
        }
    }
}

/// The log-sum-exp is that of every rank's scaled scores (f64 reference).
#[test]
fn the_log_sum_exp_is_over_every_rank() {
    let case = Case { batch: 1, heads: 2, kv_heads: 1, d: 4, dv: 2, keys: vec![3, 0, 5] };
    let q = case.q::<f64>();
    let mut want = Vec::new();
    for h in 0..2 {
        let mut scores = Vec::new();
        for r in 0..3 {
            let (k, _) = case.kv::<f64>(r);
            for j in 0..case.keys[r] {
                let key = &k.as_slice()[j * 4..][..4];
                let qh = &q.as_slice()[h * 4..][..4];
                scores.push(qh.iter().zip(key).map(|(a, b)| a * b).sum::<f64>() * case.scale());
            }
        }
        let top = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        want.push(top + scores.iter().map(|s| (s - top).exp()).sum::<f64>().ln());
    }
    for (fused, unfused) in case.run::<f64>() {
        for got in [fused.lse, unfused.lse] {
            for (g, w) in got.as_slice().iter().zip(&want) {
                assert!((g - w).abs() < 1e-12, "{g} vs {w}");
            }
        }
    }
}

fn on_every_rank(n: usize, body: impl Fn(&Rank<'_>) -> Result<()> + Sync) -> Vec<Error> {
    let errs = World::threads(n)
        .unwrap()
        .run(|rank| Ok(body(rank).expect_err("a bad call must fail")))
        .unwrap();
    assert_eq!(errs.len(), n);
    errs
}

#[test]
fn bad_shapes_fail_on_every_rank_naming_the_rank() {
    // Rank 1's keys are wider than the queries.
    let errs = on_every_rank(3, |rank| {
        let q = Tensor::<f32>::random(&[1, 4, 8], 1);
        let d = if rank.rank() == 1 { 9 } else { 8 };
        let k = Tensor::<f32>::random(&[1, 5, 2, d], 2);
        let v = Tensor::<f32>::random(&[1, 5, 2, 8], 3);
        fused::flash_decode(rank, &q, &k, &v, 0.3).map(drop)
    });
    for e in errs {
        assert!(
            matches!(&e, Error::InvalidArgument { rank: 1, reason, .. } if reason.contains("different widths d")),
            "{e}"
        );
    }
    // Heads not a multiple of the kv heads, on every rank.
    let errs = on_every_rank(2, |rank| {
        let q = Tensor::<f32>::random(&[1, 5, 4], 1);
        let kv = Tensor::<f32>::random(&[1, 3, 2, 4], 2);
        fused::flash_decode_unfused(rank, &q, &kv, &kv, 0.5).map(drop)
    });
    for e in errs {
        assert!(e.to_string().contains("not a multiple of kv_heads"), "{e}");
    }
}

#[test]
fn ranks_that_disagree_on_heads_or_scale_fail_together() {
    let errs = on_every_rank(2, |rank| {
        let heads = 2 + 2 * rank.rank();
        let q = Tensor::<f64>::random(&[1, heads, 4], 1);
        let kv = Tensor::<f64>::random(&[1, 3, 2, 4], 2);
        fused::flash_decode(rank, &q, &kv, &kv, 0.5).map(drop)
    });
    for e in errs {
        assert!(matches!(&e, Error::RanksDisagree { rank_b: 1, .. }), "{e}");
        assert!(e.to_string().contains("heads"), "{e}");
    }
    let errs = on_every_rank(3, |rank| {
        let q = Tensor::<f64>::random(&[1, 2, 4], 1);
        let kv = Tensor::<f64>::random(&[1, 3, 2, 4], 2);
        let scale = if rank.rank() == 2 { 0.25 } else { 0.5 };
        fused::flash_decode(rank, &q, &kv, &kv, scale).map(drop)
    });
    for e in errs {
        assert!(matches!(&e, Error::RanksDisagree { rank_b: 2, .. }), "{e}");
        assert!(e.to_string().contains("scale"), "{e}");
    }
}

/// Calls in a row reuse the receive buffer and signals (their counts keep growing): a smaller
/// call after a larger one, and the world still agrees afterwards.
#[test]
fn calls_in_a_row_reuse_the_workspace() {
    let q = Tensor::<f32>::random(&[1, 4, 8], 1);
    World::threads(3)
        .unwrap()
        .run(|rank| {
            for (step, keys) in [700usize, 3, 0, 1500, 9].into_iter().enumerate() {
                let k = Tensor::<f32>::random(&[1, keys + rank.rank(), 2, 8], step as u64);
                let v = Tensor::<f32>::random(&[1, keys + rank.rank(), 2, 8], step as u64 + 50);
                let a = fused::flash_decode(rank, &q, &k, &v, 0.35)?;
                let b = fused::flash_decode_unfused(rank, &q, &k, &v, 0.35)?;
                for (x, y) in a.output.as_slice().iter().zip(b.output.as_slice()) {
                    assert!((x - y).abs() < 1e-5, "step {step}: {x} vs {y}");
                }
            }
            Ok(())
        })
        .unwrap();
}

/// The GPU kernel (feature `cuda`, on a machine with a GPU; skipped, saying why, elsewhere):
/// worlds of 1 to 4 ranks sharing GPU 0, keys across several of its chunks (128), every dtype.
#[test]
fn on_a_gpu_with_ranks_sharing_it() {
    match dist_tensor::device::cuda::device_count() {
        Ok(count) if count > 0 => {}
        Ok(_) => return println!("SKIPPED: no GPU on this machine"),
        Err(e) => return println!("SKIPPED: {e}"),
    }
    let world = |n: usize| World::builder(n).cuda(&vec![0; n]).build().unwrap();
    let cases = [
        Case { batch: 2, heads: 6, kv_heads: 2, d: 16, dv: 8, keys: vec![3] },
        Case { batch: 1, heads: 8, kv_heads: 2, d: 128, dv: 128, keys: vec![300, 0] },
        Case { batch: 3, heads: 4, kv_heads: 4, d: 5, dv: 7, keys: vec![0, 1, 0] },
        Case { batch: 2, heads: 4, kv_heads: 1, d: 64, dv: 64, keys: vec![257, 13, 128, 1] },
    ];
    for case in &cases {
        let n = case.keys.len();
        case.check_in::<f64>(world(n));
        case.check_in::<f32>(world(n));
        case.check_in::<f16>(world(n));
        case.check_in::<bf16>(world(n));
    }
    // Calls in a row reuse the records buffer and the signals (their epochs grow).
    let case = Case { batch: 1, heads: 2, kv_heads: 1, d: 8, dv: 8, keys: vec![200, 3, 0] };
    let q = case.q::<f32>();
    world(3)
        .run(|rank| {
            let (k, v) = case.kv::<f32>(rank.rank());
            let first = fused::flash_decode(rank, &q, &k, &v, case.scale())?.output.to_host()?;
            for _ in 0..5 {
                let again =
                    fused::flash_decode(rank, &q, &k, &v, case.scale())?.output.to_host()?;
                assert_eq!(again, first);
            }
            Ok(())
        })
        .unwrap();
}

/// Every agreed field on its own: the last rank changes only that field (its shapes kept
/// consistent on their own), and every rank gets the typed mismatch naming the field and that
/// rank. The fields are listed once; a new one gets its test by joining the list.
#[test]
fn each_agreed_field_differing_on_the_last_rank_alone_is_named_on_every_rank() {
    // (field, (batch, heads, kv_heads, d, dv, scale) of the odd rank); the others take the base.
    type Shapes = (usize, usize, usize, usize, usize, f64);
    let base: Shapes = (2, 4, 2, 6, 5, 0.5);
    let fields: [(&str, Shapes); 6] = [
        ("batch", (3, 4, 2, 6, 5, 0.5)),
        ("heads", (2, 6, 2, 6, 5, 0.5)),
        ("kv_heads", (2, 4, 4, 6, 5, 0.5)),
        ("d", (2, 4, 2, 7, 5, 0.5)),
        ("dv", (2, 4, 2, 6, 4, 0.5)),
        ("scale", (2, 4, 2, 6, 5, 0.25)),
    ];
    for (field, odd) in fields {
        for fused in [true, false] {
            let errs = on_every_rank(3, |rank| {
                let (b, h, kvh, d, dv, scale) = if rank.rank() == 2 { odd } else { base };
                let q = Tensor::<f32>::random(&[b, h, d], 1);
                let k = Tensor::<f32>::random(&[b, 3, kvh, d], 2);
                let v = Tensor::<f32>::random(&[b, 3, kvh, dv], 3);
                let call = if fused { fused::flash_decode } else { fused::flash_decode_unfused };
                call(rank, &q, &k, &v, scale).map(drop)
            });
            for e in errs {
                assert!(
                    matches!(&e, Error::RanksDisagree { rank_b: 2, value_b, .. }
                        if value_b.starts_with(&format!("{field} ="))),
                    "{field} (fused {fused}): {e}"
                );
            }
        }
    }
}
