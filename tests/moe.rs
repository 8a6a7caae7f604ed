//! Mixture-of-experts routing, dispatch and combine against plain f64 references written here
//! (not the library's own math): every dtype, worlds of 1 to 8, token counts 0, 1 and primes,
//! fewer experts than ranks, top-k above the experts per rank, every token to one expert, and
//! the fused ops bit for bit against their unfused baselines.

use dist_tensor::fused::{
    Dispatched, moe_combine, moe_combine_unfused, moe_dispatch, moe_dispatch_unfused,
};
use dist_tensor::tensor::{DROPPED, Element, Gate, Routed, Router, Tensor, array_split, route};
use dist_tensor::{Error, Rank, Result, World};
use half::{bf16, f16};

// ---------------------------------------------------------------------------------------------
// Routing.

/// The reference router in f64: (experts per slot, weights per slot, aux, z).
fn route_f64(logits: &[f64], experts: usize, r: &Router) -> (Vec<u32>, Vec<f64>, f64, f64) {
    let tokens = logits.len() / experts;
    let (mut chosen, mut weights) = (Vec::new(), Vec::new());
    let (mut assigned, mut probs) = (vec![0.0; experts], vec![0.0; experts]);
    let mut z = 0.0;
    for t in 0..tokens {
        let row = &logits[t * experts..][..experts];
        let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = max + row.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
        z += lse * lse;
        let scores: Vec<f64> = match r.gate {
            Gate::Softmax => row.iter().map(|v| (v - lse).exp()).collect(),
            Gate::Sigmoid => row.iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect(),
        };
        let total: f64 = scores.iter().sum();
        for e in 0..experts {
            probs[e] += scores[e] / if r.gate == Gate::Sigmoid { total } else { 1.0 };
        }
        // Selection by repeated maximum, the first (lowest) index winning ties.
        let mut taken = vec![false; experts];
        let mut picked = Vec::new();
        for _ in 0..r.top_k {
            let mut best = None;
            for e in (0..experts).filter(|&e| !taken[e]) {
                if best.is_none_or(|b: usize| scores[e] > scores[b]) {
                    best = Some(e);
                }
            }
            let b = best.unwrap();
            taken[b] = true;
            picked.push(b);
        }
        let norm: f64 = picked.iter().map(|&e| scores[e]).sum();
        for &e in &picked {
            chosen.push(e as u32);
            weights.push(if r.normalize { scores[e] / norm } else { scores[e] });
            assigned[e] += 1.0;
        }
    }
    let tf = tokens as f64;
    let aux = experts as f64 * (0..experts).map(|e| assigned[e] / tf * probs[e] / tf).sum::<f64>();
    (chosen, weights, aux, z / tf)
}

#[test]
fn routing_matches_the_f64_reference_for_softmax_and_sigmoid_gates() {
    for (tokens, experts, k) in [(1, 1, 1), (7, 4, 2), (13, 8, 8), (31, 64, 8), (5, 3, 1)] {
        for gate in [Gate::Softmax, Gate::Sigmoid] {
            for normalize in [true, false] {
                let router = Router { top_k: k, gate, normalize, capacity_factor: None };
                let logits = Tensor::<f64>::random(&[tokens, experts], tokens as u64 * 31 + 7);
                let logits = &logits * 3.0;
                let got = route(&logits, &router).unwrap();
                let (want, weights, aux, z) = route_f64(logits.as_slice(), experts, &router);
                assert_eq!(got.expert, want, "{tokens}x{experts} top-{k} {gate:?}");
                for (g, w) in got.weight.as_slice().iter().zip(&weights) {
                    assert!((g - w).abs() < 1e-14, "{g} vs {w}");
                }
                assert!((got.aux_loss - aux).abs() < 1e-12, "{} vs {aux}", got.aux_loss);
                assert!((got.z_loss - z).abs() < 1e-12, "{} vs {z}", got.z_loss);
                assert_eq!(got.dropped, 0);
                let mut load = vec![0; experts];
                want.iter().for_each(|&e| load[e as usize] += 1);
                assert_eq!(got.load, load);
                // Each dtype: its weights within its rounding of the f64 ones, the same experts
                // where the scores are apart.
                check_half::<f32>(&logits, &router, &weights, 1e-6);
                check_half::<bf16>(&logits, &router, &weights, 1e-2);
                check_half::<f16>(&logits, &router, &weights, 2e-3);
            }
        }
    }
}

fn check_half<T: Element>(logits: &Tensor<f64>, router: &Router, want: &[f64], tol: f64) {
    let logits: Tensor<T> = logits.cast();
    let got = route(&logits, router).unwrap();
    // Re-derive the f64 reference from the rounded logits, so that only the arithmetic differs.
    let experts = logits.shape()[1];
    let rounded: Vec<f64> = logits.as_slice().iter().map(|v| v.to_f64()).collect();
    let (chosen, weights, _, _) = route_f64(&rounded, experts, router);
    assert_eq!(got.expert, chosen, "{}", std::any::type_name::<T>());
    for (g, w) in got.weight.as_slice().iter().zip(&weights) {
        assert!((g.to_f64() - w).abs() <= tol * w.abs().max(1.0), "{g} vs {w}");
    }
    assert_eq!(want.len(), weights.len());
}

#[test]
fn ties_go_to_the_lower_expert_and_nan_is_never_skipped() {
    let logits =
        Tensor::from_shape_vec(&[2, 4], vec![1.0f64, 2.0, 2.0, 2.0, 0.0, f64::NAN, 5.0, 0.0])
            .unwrap();
    let got = route(&logits, &Router::softmax_top_k(2)).unwrap();
    assert_eq!(&got.expert[..2], &[1, 2]);
    // A NaN logit makes the whole softmax NaN: every score NaN, so the order is by index.
    assert_eq!(&got.expert[2..], &[0, 1]);
    let sig = Router { gate: Gate::Sigmoid, ..Router::softmax_top_k(1) };
    assert_eq!(route(&logits, &sig).unwrap().expert[1], 1, "NaN first under a sigmoid");
}

#[test]
fn capacity_drops_the_lowest_scores_past_it_and_ties_the_later_token() {
    // 6 tokens, 2 experts, top-1: tokens 0..5 all prefer expert 0 with rising margin but tokens
    // 4 and 5 tie. Capacity ceil(1.0 * 6 / 2) = 3: expert 0 keeps the 3 highest scores.
    let mut l = Vec::new();
    for m in [0.1, 0.5, 0.3, 0.9, 0.7, 0.7] {
        l.extend([m, 0.0]);
    }
    let logits = Tensor::from_shape_vec(&[6, 2], l).unwrap();
    let router = Router { capacity_factor: Some(1.0), ..Router::softmax_top_k(1) };
    let got = route(&logits, &router).unwrap();
    assert_eq!(got.expert, vec![DROPPED, DROPPED, DROPPED, 0, 0, 0]);
    assert_eq!((got.dropped, got.load.clone()), (3, vec![3, 0]));
    assert!(got.weight.as_slice()[..3].iter().all(|&w| w == 0.0));
    // Capacity 2 (factor 2/3): of the tie 4 and 5, the later token goes.
    let router = Router { capacity_factor: Some(2.0 / 3.0), ..router };
    let got = route(&logits, &router).unwrap();
    assert_eq!(got.expert, vec![DROPPED, DROPPED, DROPPED, 0, 0, DROPPED]);
    // A roomy factor drops nothing; the aux loss counts assignments before dropping.
    let roomy = route(&logits, &Router { capacity_factor: Some(2.0), ..router }).unwrap();
    assert_eq!((roomy.dropped, roomy.aux_loss), (0, got.aux_loss));
}

#[test]
fn bad_router_settings_are_typed_errors() {
    let logits = Tensor::<f32>::random(&[3, 4], 1);
    for (k, f) in [(0, None), (5, None), (2, Some(0.0)), (2, Some(f64::NAN))] {
        let r = Router { capacity_factor: f, ..Router::softmax_top_k(k) };
        let e = route(&logits, &r).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { op: "route", .. }), "{e}");
    }
    let e = route(&Tensor::<f32>::random(&[3], 1), &Router::softmax_top_k(1)).unwrap_err();
    assert!(e.to_string().contains("not [tokens, experts]"), "{e}");
    let w = Tensor::<f32>::random(&[1, 2], 1);
    assert!(Routed::from_parts(2, vec![0, 2], w.clone()).is_err());
    assert!(Routed::from_parts(2, vec![0], w).is_err());
}

// ---------------------------------------------------------------------------------------------
// Dispatch and combine.

/// One case: every rank's tokens and routing, the expert function `y = x * scale(e) + e`.
struct Case {
    ranks: usize,
    experts: usize,
    top_k: usize,
    hidden: usize,
    tokens: Vec<usize>,
    /// Every token to this expert (its first slot), the rest random.
    all_to: Option<u32>,
    capacity: Option<f64>,
}

impl Case {
    fn new(ranks: usize, experts: usize, top_k: usize, tokens: &[usize]) -> Case {
        let tokens = tokens.to_vec();
        Case { ranks, experts, top_k, hidden: 6, tokens, all_to: None, capacity: None }
    }

    fn x<T: Element>(&self, r: usize) -> Tensor<T> {
        Tensor::<f64>::random(&[self.tokens[r], self.hidden], 100 + r as u64).cast()
    }

    fn routed<T: Element>(&self, r: usize) -> Routed<T> {
        let logits = Tensor::<f64>::random(&[self.tokens[r], self.experts], 200 + r as u64);
        let router = Router { capacity_factor: self.capacity, ..Router::softmax_top_k(self.top_k) };
        let routed = route(&logits.cast::<T>(), &router).unwrap();
        match self.all_to {
            None => routed,
            Some(e) => {
                let mut expert = routed.expert.clone();
                for t in 0..self.tokens[r] {
                    expert[t * self.top_k] = e;
                    // Keep the slots distinct experts: swap e out of the later ones.
                    for s in 1..self.top_k {
                        if expert[t * self.top_k + s] == e {
                            expert[t * self.top_k + s] = routed.expert[t * self.top_k];
                        }
                    }
                }
                Routed::from_parts(self.experts, expert, routed.weight).unwrap()
            }
        }
    }

    fn scale(e: usize) -> f64 {
        1.0 + e as f64 / 8.0
    }

    /// The expert function on this rank's received rows, in `T`.
    fn experts_apply<T: Element>(got: &Dispatched<T>) -> Tensor<T> {
        let mut y = got.rows.as_slice().to_vec();
        let h = got.rows.shape()[1];
        for e in got.experts.clone() {
            for i in got.rows_of(e) {
                for v in &mut y[i * h..(i + 1) * h] {
                    *v = T::from_f64(v.to_f64() * Self::scale(e) + e as f64);
                }
            }
        }
        Tensor::from_shape_vec(got.rows.shape(), y).unwrap()
    }

    /// What owner `d` receives, in f64: (expert, source, token, slot) order.
    fn received<T: Element>(&self, d: usize) -> (Vec<f64>, Vec<usize>) {
        let split = array_split(self.experts, self.ranks);
        let first: usize = split[..d].iter().sum();
        let (mut rows, mut per_expert) = (Vec::new(), Vec::new());
        let xs: Vec<Tensor<T>> = (0..self.ranks).map(|r| self.x(r)).collect();
        let routes: Vec<Routed<T>> = (0..self.ranks).map(|r| self.routed(r)).collect();
        for e in first..first + split[d] {
            let mut count = 0;
            for s in 0..self.ranks {
                for (slot, &x) in routes[s].expert.iter().enumerate() {
                    if x as usize == e {
                        let t = slot / self.top_k;
                        let row = &xs[s].as_slice()[t * self.hidden..][..self.hidden];
                        rows.extend(row.iter().map(|v| v.to_f64()));
                        count += 1;
                    }
                }
            }
            per_expert.push(count);
        }
        (rows, per_expert)
    }

    /// Rank `r`'s combined output in f64 from its rounded inputs.
    fn combined<T: Element>(&self, r: usize) -> Vec<f64> {
        let (x, routed) = (self.x::<T>(r), self.routed::<T>(r));
        let mut out = vec![0.0; self.tokens[r] * self.hidden];
        for (slot, &e) in routed.expert.iter().enumerate().filter(|(_, e)| **e != DROPPED) {
            let t = slot / self.top_k;
            let w = routed.weight.as_slice()[slot].to_f64();
            for j in 0..self.hidden {
                let v = x.as_slice()[t * self.hidden + j].to_f64();
                // The expert's output is rounded to T, as the kernel's input is.
                let y = T::from_f64(v * Self::scale(e as usize) + e as f64).to_f64();
                out[t * self.hidden + j] += w * y;
            }
        }
        out
    }

    /// Runs fused and unfused on a world; each rank's (dispatched, combined) of both.
    #[allow(clippy::type_complexity)]
    fn run<T: Element>(
        &self,
        world: &World,
    ) -> Vec<((Dispatched<T>, Tensor<T>), (Dispatched<T>, Tensor<T>))> {
        world
            .run(|rank| {
                let r = rank.rank();
                let (x, routed) = (self.x::<T>(r), self.routed::<T>(r));
                let fused = moe_dispatch(rank, &x, &routed)?;
                let y = Self::experts_apply(&fused);
                let back = moe_combine(rank, &y, &fused, &routed.weight)?;
                let unfused = moe_dispatch_unfused(rank, &x, &routed)?;
                let y2 = Self::experts_apply(&unfused);
                let back2 = moe_combine_unfused(rank, &y2, &unfused, &routed.weight)?;
                Ok(((fused, back), (unfused, back2)))
            })
            .unwrap()
    }

    fn check<T: Element>(&self, tol: f64) {
        self.check_in::<T>(&World::threads(self.ranks).unwrap(), tol);
    }

    fn check_in<T: Element>(&self, world: &World, tol: f64) {
        let what = |r: usize| {
            format!(
                "{} ranks, {} experts, top-{}, tokens {:?}, rank {r}, {}",
                self.ranks,
                self.experts,
                self.top_k,
                self.tokens,
                std::any::type_name::<T>()
            )
        };
        for (r, ((fused, back), (unfused, back2))) in self.run::<T>(world).into_iter().enumerate() {
            assert_eq!(fused, unfused, "dispatch: fused and unfused differ, {}", what(r));
            assert_eq!(back, back2, "combine: fused and unfused differ, {}", what(r));
            let (rows, per_expert) = self.received::<T>(r);
            assert_eq!(fused.expert_rows, per_expert, "{}", what(r));
            let got: Vec<f64> = fused.rows.as_slice().iter().map(|v| v.to_f64()).collect();
            assert_eq!(got, rows, "dispatched rows, {}", what(r));
            let want = self.combined::<T>(r);
            assert_eq!(back.shape(), [self.tokens[r], self.hidden]);
            for (g, w) in back.as_slice().iter().zip(&want) {
                let err = (g.to_f64() - w).abs();
                assert!(err <= tol * w.abs().max(1.0), "{g} vs {w}: {}", what(r));
            }
        }
    }
}

/// Tolerances of a combine: one rounding of the sum (the expert outputs are rounded in the
/// reference too) plus the weighted sum of up to 8 rows in the accumulator type.
fn every_dtype(case: &Case) {
    case.check::<f64>(1e-13);
    case.check::<f32>(1e-5);
    case.check::<bf16>(8e-3);
    case.check::<f16>(1e-3);
}

#[test]
fn matches_f64_on_worlds_of_1_to_8_every_dtype() {
    for n in 1..=8 {
        let tokens: Vec<usize> = (0..n).map(|r| [5, 1, 0, 13, 2, 7, 3, 11][r]).collect();
        every_dtype(&Case::new(n, 8, 2, &tokens));
    }
}

#[test]
fn fewer_experts_than_ranks_and_top_k_above_the_experts_per_rank() {
    // 3 experts on 5 ranks: ranks 3 and 4 hold none.
    every_dtype(&Case::new(5, 3, 2, &[4, 3, 1, 2, 5]));
    // 8 experts on 3 ranks (3, 3, 2), top-8: every token to every expert.
    every_dtype(&Case::new(3, 8, 8, &[3, 0, 7]));
    // One expert, one rank of tokens.
    every_dtype(&Case::new(2, 1, 1, &[0, 17]));
}

#[test]
fn every_token_to_one_expert_and_dropped_slots() {
    let mut case = Case::new(4, 8, 2, &[17, 3, 11, 1]);
    case.all_to = Some(5);
    every_dtype(&case);
    // Capacity: most of expert 5's rows dropped, tokens with every slot dropped give 0.
    case.capacity = Some(0.5);
    every_dtype(&case);
    let routed = case.routed::<f64>(0);
    assert!(routed.dropped > 0);
}

#[test]
fn more_experts_than_one_exchange_carries() {
    // 130 experts: the counts take three exchanges.
    every_dtype(&Case::new(3, 130, 4, &[19, 23, 2]));
}

#[test]
fn calls_in_a_row_reuse_the_workspaces_and_grow_them() {
    let world = World::threads(3).unwrap();
    for tokens in [[2, 3, 1], [40, 1, 77], [1, 1, 1]] {
        let case = Case::new(3, 6, 2, &tokens);
        case.check_in::<f32>(&world, 1e-5);
        // The same world across calls, its workspaces kept.
        for ((a, x), (b, y)) in case.run::<f32>(&world) {
            assert_eq!((a, x), (b, y));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Errors: on every rank, typed, naming the rank.

fn on_every_rank(n: usize, body: impl Fn(&Rank<'_>) -> Result<()> + Sync) -> Vec<Error> {
    let errs = World::threads(n)
        .unwrap()
        .run(|rank| Ok(body(rank).expect_err("a bad call must fail")))
        .unwrap();
    assert_eq!(errs.len(), n);
    errs
}

fn routed_for(tokens: usize, experts: usize, seed: u64) -> Routed<f32> {
    route(&Tensor::<f32>::random(&[tokens, experts], seed), &Router::softmax_top_k(2)).unwrap()
}

#[test]
fn bad_inputs_fail_on_every_rank_naming_the_rank() {
    // Rank 2's x has a row fewer than its routing.
    for fused in [true, false] {
        let errs = on_every_rank(3, |rank| {
            let rows = if rank.rank() == 2 { 3 } else { 4 };
            let x = Tensor::<f32>::random(&[rows, 5], 1);
            let routed = routed_for(4, 4, 2);
            let d = if fused { moe_dispatch } else { moe_dispatch_unfused };
            d(rank, &x, &routed).map(drop)
        });
        for e in errs {
            assert!(matches!(&e, Error::InvalidArgument { rank: 2, .. }), "{e}");
        }
    }
    // An expert out of range on rank 1 (a routing built by hand).
    let errs = on_every_rank(2, |rank| {
        let x = Tensor::<f32>::random(&[1, 5], 1);
        let mut routed = routed_for(1, 4, 2);
        if rank.rank() == 1 {
            routed.expert[0] = 4;
        }
        moe_dispatch(rank, &x, &routed).map(drop)
    });
    for e in errs {
        assert!(
            matches!(&e, Error::InvalidArgument { rank: 1, reason, .. } if reason.contains("expert 4 of 4")),
            "{e}"
        );
    }
}

#[test]
fn each_agreed_field_differing_on_the_last_rank_alone_is_named_on_every_rank() {
    // (field, hidden, experts, top_k) on the last rank; the others 5, 4, 2.
    for (field, h, e, k) in [("hidden", 6, 4, 2), ("experts", 5, 5, 2), ("top_k", 5, 4, 3)] {
        let errs = on_every_rank(3, |rank| {
            let last = rank.rank() == 2;
            let (h, e, k) = if last { (h, e, k) } else { (5, 4, 2) };
            let x = Tensor::<f32>::random(&[3, h], 1);
            let logits = Tensor::<f32>::random(&[3, e], 2);
            let routed = route(&logits, &Router::softmax_top_k(k))?;
            moe_dispatch(rank, &x, &routed).map(drop)
        });
        for err in errs {
            assert!(
                matches!(&err, Error::RanksDisagree { rank_b: 2, value_b, .. } if value_b.starts_with(field)),
                "{field}: {err}"
            );
        }
    }
}

#[test]
fn a_combine_given_another_dispatch_or_width_fails_on_every_rank() {
    // Rank 1 passes the plan of the first of two dispatches.
    let errs = on_every_rank(3, |rank| {
        let x = Tensor::<f32>::random(&[4, 5], rank.rank() as u64);
        let (a, b) = (routed_for(4, 6, 1 + rank.rank() as u64), routed_for(4, 6, 9));
        let first = moe_dispatch(rank, &x, &a)?;
        let second = moe_dispatch(rank, &x, &b)?;
        let (plan, routed) = if rank.rank() == 1 { (&first, &a) } else { (&second, &b) };
        moe_combine(rank, &plan.rows, plan, &routed.weight).map(drop)
    });
    for e in errs {
        assert!(matches!(&e, Error::RanksDisagree { rank_b: 1, .. }), "{e}");
    }
    // The last rank's outputs are wider.
    let errs = on_every_rank(2, |rank| {
        let x = Tensor::<f32>::random(&[4, 5], 1);
        let routed = routed_for(4, 4, 2);
        let got = moe_dispatch(rank, &x, &routed)?;
        let w = if rank.rank() == 1 { 6 } else { 5 };
        let y = Tensor::<f32>::random(&[got.rows.shape()[0], w], 3);
        moe_combine_unfused(rank, &y, &got, &routed.weight).map(drop)
    });
    for e in errs {
        assert!(
            matches!(&e, Error::RanksDisagree { rank_b: 1, value_b, .. } if value_b.starts_with("width")),
            "{e}"
        );
    }
    // A y with a row too few on rank 1.
    let errs = on_every_rank(2, |rank| {
        let x = Tensor::<f32>::random(&[4, 5], 1);
        let routed = routed_for(4, 4, 2);
        let got = moe_dispatch(rank, &x, &routed)?;
        let rows = got.rows.shape()[0] - usize::from(rank.rank() == 1);
        let y = got.rows.index_select(0, &(0..rows).collect::<Vec<_>>())?;
        moe_combine(rank, &y, &got, &routed.weight).map(drop)
    });
    for e in errs {
        assert!(matches!(&e, Error::InvalidArgument { rank: 1, .. }), "{e}");
    }
}

#[test]
fn a_heap_too_small_for_the_rows_is_a_typed_error_on_every_rank() {
    let world = World::builder(2).heap_capacity(1 << 20).build().unwrap();
    let got = world.run(|rank| {
        // Every one of 2 x 300 tokens of 1024 f64 to expert 0: 4.9 MB for rank 0.
        let x = Tensor::<f64>::random(&[300, 1024], 1);
        let w = Tensor::from_shape_vec(&[300, 1], vec![1.0; 300])?;
        let routed = Routed::from_parts(2, vec![0; 300], w)?;
        Ok(moe_dispatch(rank, &x, &routed).map(drop).expect_err("too big").to_string())
    });
    let messages = match got {
        Ok(each) => each,
        Err(e) => vec![e.to_string()],
    };
    for m in messages {
        assert!(m.contains("symmetric memory exhausted"), "{m}");
    }
}

// ---------------------------------------------------------------------------------------------
// The grouped product.

fn grouped_case<T: Element>(groups: &[usize], k: usize, n: usize, tol: f64) {
    let rows: usize = groups.iter().sum();
    let x: Tensor<T> = Tensor::<f64>::random(&[rows, k], 7).cast();
    let ws: Vec<Tensor<T>> =
        (0..groups.len()).map(|g| Tensor::<f64>::random(&[k, n], 50 + g as u64).cast()).collect();
    let got =
        dist_tensor::tensor::grouped_matmul(&x, groups, &ws.iter().collect::<Vec<_>>(), 2).unwrap();
    assert_eq!(got.shape(), [rows, n]);
    let (mut g, mut end) = (0, groups.first().copied().unwrap_or(0));
    for r in 0..rows {
        while r >= end {
            g += 1;
            end += groups[g];
        }
        for j in 0..n {
            let want: f64 = (0..k)
                .map(|i| x.as_slice()[r * k + i].to_f64() * ws[g].as_slice()[i * n + j].to_f64())
                .sum();
            let v = got.as_slice()[r * n + j].to_f64();
            assert!((v - want).abs() <= tol * (k as f64).sqrt(), "row {r} col {j}: {v} vs {want}");
        }
    }
}

#[test]
fn grouped_matmul_matches_f64_with_empty_and_uneven_groups() {
    for groups in [&[3, 0, 1, 17][..], &[0, 0], &[1], &[31, 2, 0, 5, 64]] {
        grouped_case::<f64>(groups, 13, 7, 1e-14);
        grouped_case::<f32>(groups, 13, 7, 1e-6);
        grouped_case::<bf16>(groups, 13, 7, 1e-2);
        grouped_case::<f16>(groups, 13, 7, 2e-3);
    }
    let x = Tensor::<f32>::random(&[4, 3], 1);
    let w = Tensor::<f32>::random(&[3, 2], 2);
    let bad = Tensor::<f32>::random(&[2, 2], 3);
    for (groups, ws) in
        [(&[4, 1][..], vec![&w, &w]), (&[2, 2], vec![&w]), (&[2, 2], vec![&w, &bad])]
    {
        let e = dist_tensor::tensor::grouped_matmul(&x, groups, &ws, 1).unwrap_err();
        assert!(matches!(e, Error::InvalidShape { op: "grouped_matmul", .. }), "{e}");
    }
}

// ---------------------------------------------------------------------------------------------
// Autograd: dispatch and combine differentiated, against gradients derived by hand in f64.

#[test]
fn gradients_of_x_weights_and_experts_match_the_f64_reference() {
    use dist_tensor::autograd::Var;
    let (experts, k, h) = (5, 2, 3);
    for n in [1, 2, 3, 5] {
        let tokens: Vec<usize> = (0..n).map(|r| [4, 1, 0, 7, 3][r]).collect();
        let case = Case { capacity: Some(0.75), ..Case::new(n, experts, k, &tokens) };
        let case = Case { hidden: h, ..case };
        let w_e = |e: usize| Tensor::<f64>::random(&[h, h], 300 + e as u64);
        let r_of = |r: usize| Tensor::<f64>::random(&[tokens[r], h], 400 + r as u64);
        for fused in [true, false] {
            let out = World::threads(n)
                .unwrap()
                .run(|rank| {
                    let me = rank.rank();
                    let (x, routed) = (Var::param(case.x::<f64>(me)), case.routed::<f64>(me));
                    let weight = Var::param(routed.weight.clone());
                    let (rows, got) = x.moe_dispatch(rank, &routed, fused)?;
                    let params: Vec<Var<'_, f64>> =
                        got.experts.clone().map(|e| Var::param(w_e(e))).collect();
                    let mut parts = Vec::new();
                    for (i, e) in got.experts.clone().enumerate() {
                        let range = got.rows_of(e);
                        parts.push(rows.narrow(0, range.start, range.len())?.matmul(&params[i])?);
                    }
                    let y = if parts.is_empty() {
                        rows.narrow(0, 0, 0)?
                    } else {
                        Var::cat(&parts.iter().collect::<Vec<_>>(), 0)?
                    };
                    let out = y.moe_combine(rank, &got, &weight, fused)?;
                    (&out * &Var::constant(r_of(me))).sum().backward()?;
                    let grads: Vec<Tensor<f64>> = params
                        .iter()
                        .map(|p| p.grad().unwrap_or_else(|| Tensor::zeros(&[h, h])))
                        .collect();
                    Ok((x.grad(), weight.grad(), got.experts.clone(), grads, routed.dropped))
                })
                .unwrap();
            // The reference.
            let mut d_we = vec![vec![0.0; h * h]; experts];
            for (r, (dx, dw, _, _, _)) in out.iter().enumerate() {
                let (x, routed, rr) = (case.x::<f64>(r), case.routed::<f64>(r), r_of(r));
                let (x, rr) = (x.as_slice(), rr.as_slice());
                let mut want_dx = vec![0.0; tokens[r] * h];
                let mut want_dw = vec![0.0; tokens[r] * k];
                for (slot, &e) in routed.expert.iter().enumerate() {
                    if e == DROPPED {
                        continue;
                    }
                    let (t, w, we) = (slot / k, routed.weight.as_slice()[slot], w_e(e as usize));
                    let we = we.as_slice();
                    for i in 0..h {
                        for j in 0..h {
                            want_dx[t * h + i] += w * rr[t * h + j] * we[i * h + j];
                            want_dw[slot] += rr[t * h + j] * x[t * h + i] * we[i * h + j];
                            d_we[e as usize][i * h + j] += w * x[t * h + i] * rr[t * h + j];
                        }
                    }
                }
                let near = |got: &[f64], want: &[f64], what: &str| {
                    assert_eq!(got.len(), want.len(), "{what}");
                    for (g, w) in got.iter().zip(want) {
                        assert!(
                            (g - w).abs() < 1e-12,
                            "{what} on rank {r} of {n} (fused {fused}): {g} vs {w}"
                        );
                    }
                };
                let zeros = |len: usize| vec![0.0; len];
                near(dx.as_ref().map_or(&zeros(0)[..], |g| g.as_slice()), &want_dx, "dx");
                near(dw.as_ref().map_or(&zeros(0)[..], |g| g.as_slice()), &want_dw, "dweight");
            }
            for (_, _, owned, grads, _) in &out {
                for (e, g) in owned.clone().zip(grads) {
                    for (a, b) in g.as_slice().iter().zip(&d_we[e]) {
                        assert!(
                            (a - b).abs() < 1e-12,
                            "dW of expert {e} (fused {fused}): {a} vs {b}"
                        );
                    }
                }
            }
            assert!(out.iter().any(|o| o.4 > 0) || n == 1, "some slots dropped");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The trainable layer: its gradients against finite differences of the whole world's loss.

/// The world's loss (each rank's `sum(out * R) + 0.3 aux + 0.2 z`, summed) with one weight of
/// the layer moved by `delta` (`which`: 0 the router, 1 gate_up, 2 down; `at` the global flat
/// index, for the experts' `[E, ...]` stacks), and the gradients at that weight.
fn layer_loss(n: usize, which: usize, at: usize, delta: f64) -> (f64, f64) {
    use dist_tensor::autograd::DVar;
    use dist_tensor::nn::{Module, MoeLayer};
    use dist_tensor::{DistTensor, Placement};
    let (hidden, ffn, experts) = (4, 3, 5);
    let x = Tensor::<f64>::random(&[7, hidden], 11);
    let r = Tensor::<f64>::random(&[7, hidden], 12);
    let out = World::threads(n)
        .unwrap()
        .run(|rank| {
            let mut layer =
                MoeLayer::<f64>::new(rank, hidden, ffn, experts, Router::softmax_top_k(2), 3)?;
            let per_expert = [hidden * experts, hidden * 2 * ffn, ffn * hidden][which];
            let mine = match which {
                0 => Some(at),
                _ => {
                    let e = at / per_expert;
                    layer
                        .local_experts()
                        .contains(&e)
                        .then(|| (e - layer.local_experts().start) * per_expert + at % per_expert)
                }
            };
            let param = [&mut layer.router, &mut layer.gate_up, &mut layer.down][which].value_mut();
            if let Some(i) = mine {
                let mut v = param.as_slice().to_vec();
                v[i] += delta;
                *param = Tensor::from_shape_vec(param.shape(), v)?;
            }
            let xs = DVar::constant(DistTensor::from_global(rank, &x, Placement::Shard(0))?);
            let rs = DistTensor::from_global(rank, &r, Placement::Shard(0))?;
            let y = layer.forward(rank, &xs)?;
            let target = dist_tensor::autograd::Var::constant(rs.local().clone());
            let fit = (y.out.local() * &target).sum();
            let loss = &(&fit + &y.aux_loss.scale(0.3)) + &y.z_loss.scale(0.2);
            loss.backward()?;
            let grads: Vec<Tensor<f64>> = layer
                .parameters()
                .iter()
                .map(|p| p.grad().unwrap_or_else(|| Tensor::zeros(p.value().shape())))
                .collect();
            let g = mine.map_or(0.0, |i| grads[which].as_slice()[i]);
            Ok((loss.value().as_slice()[0], g))
        })
        .unwrap();
    (out.iter().map(|o| o.0).sum(), out.iter().map(|o| o.1).sum())
}

#[test]
fn the_layer_gradients_match_finite_differences_on_1_2_and_3_ranks() {
    let eps = 1e-6;
    for n in [1, 2, 3] {
        for (which, at) in [(0, 0), (0, 13), (1, 5), (1, 40), (1, 101), (2, 7), (2, 50)] {
            let (_, grad) = layer_loss(n, which, at, 0.0);
            let (up, _) = layer_loss(n, which, at, eps);
            let (down, _) = layer_loss(n, which, at, -eps);
            let fd = (up - down) / (2.0 * eps);
            assert!(
                (grad - fd).abs() < 1e-6 * fd.abs().max(1.0),
                "{n} ranks, param {which}[{at}]: {grad} vs {fd}"
            );
        }
    }
    // The same output on every world size: the same global layer.
    let outs: Vec<Tensor<f64>> = [1, 2, 3]
        .map(|n| {
            World::threads(n)
                .unwrap()
                .run(|rank| {
                    use dist_tensor::nn::MoeLayer;
                    use dist_tensor::{DistTensor, Placement, autograd::DVar};
                    let layer = MoeLayer::<f64>::new(rank, 4, 3, 5, Router::softmax_top_k(2), 3)?;
                    let x = Tensor::<f64>::random(&[7, 4], 11);
                    let xs =
                        DVar::constant(DistTensor::from_global(rank, &x, Placement::Shard(0))?);
                    layer.forward(rank, &xs)?.out.value().to_global()
                })
                .unwrap()
                .remove(0)
        })
        .into_iter()
        .collect();
    for o in &outs[1..] {
        for (a, b) in o.as_slice().iter().zip(outs[0].as_slice()) {
            assert!((a - b).abs() < 1e-12, "{a} vs {b}");
        }
    }
}

#[test]
fn a_layer_saved_on_2_ranks_loads_on_3_with_its_experts_resplit() {
    use dist_tensor::checkpoint::SafetensorsFile;
    use dist_tensor::nn::{Module, MoeLayer};
    let path =
        std::env::temp_dir().join(format!("dt-moe-layer-{}.safetensors", std::process::id()));
    let router = Router::softmax_top_k(2);
    World::threads(2)
        .unwrap()
        .run(|rank| {
            MoeLayer::<f32>::new(rank, 4, 3, 5, router, 7)?.save_safetensors(rank, &path, "moe")
        })
        .unwrap();
    World::threads(3)
        .unwrap()
        .run(|rank| {
            let mut loaded = MoeLayer::<f32>::new(rank, 4, 3, 5, router, 99)?;
            loaded.load_safetensors(&SafetensorsFile::open(rank, &path)?, "moe")?;
            let fresh = MoeLayer::<f32>::new(rank, 4, 3, 5, router, 7)?;
            assert_eq!(loaded.local_experts(), [0..2, 2..4, 4..5][rank.rank()].clone());
            for (a, b) in loaded.parameters().iter().zip(fresh.parameters()) {
                assert_eq!(a.value(), b.value());
            }
            Ok(())
        })
        .unwrap();
    std::fs::remove_file(&path).ok();
}

// ---------------------------------------------------------------------------------------------
// The whole MoE MLP in one kernel.

/// Rank `r`'s MoE MLP output in f64 from the rounded inputs (no intermediate rounding).
fn experts_reference<T: Element>(case: &Case, r: usize, ffn: usize) -> Vec<f64> {
    let (x, routed, h) = (case.x::<T>(r), case.routed::<T>(r), case.hidden);
    let mut out = vec![0.0; case.tokens[r] * h];
    for (slot, &e) in routed.expert.iter().enumerate().filter(|(_, e)| **e != DROPPED) {
        let (t, w) = (slot / case.top_k, routed.weight.as_slice()[slot].to_f64());
        let (gu, down) =
            (expert_gate_up::<T>(e as usize, h, ffn), expert_down::<T>(e as usize, h, ffn));
        let row: Vec<f64> = x.as_slice()[t * h..(t + 1) * h].iter().map(|v| v.to_f64()).collect();
        let mut act = vec![0.0; ffn];
        for (i, a) in act.iter_mut().enumerate() {
            let dot = |col: usize| {
                (0..h).map(|j| row[j] * gu.as_slice()[j * 2 * ffn + col].to_f64()).sum::<f64>()
            };
            let (g, u) = (dot(i), dot(ffn + i));
            *a = g / (1.0 + (-g).exp()) * u;
        }
        for j in 0..h {
            let y: f64 = (0..ffn).map(|i| act[i] * down.as_slice()[i * h + j].to_f64()).sum();
            out[t * h + j] += w * y;
        }
    }
    out
}

fn expert_gate_up<T: Element>(e: usize, h: usize, ffn: usize) -> Tensor<T> {
    (Tensor::<f64>::random(&[h, 2 * ffn], 500 + e as u64) * 0.5).cast()
}

fn expert_down<T: Element>(e: usize, h: usize, ffn: usize) -> Tensor<T> {
    (Tensor::<f64>::random(&[ffn, h], 600 + e as u64) * 0.5).cast()
}

fn check_experts<T: Element>(case: &Case, ffn: usize, tol: f64) {
    let h = case.hidden;
    let outs = World::threads(case.ranks)
        .unwrap()
        .run(|rank| {
            let me = rank.rank();
            let (x, routed) = (case.x::<T>(me), case.routed::<T>(me));
            let mine = array_split(case.experts, case.ranks);
            let first: usize = mine[..me].iter().sum();
            let stack = |f: &dyn Fn(usize) -> Tensor<T>, shape: [usize; 2]| {
                let data: Vec<T> =
                    (first..first + mine[me]).flat_map(|e| f(e).as_slice().to_vec()).collect();
                Tensor::from_shape_vec(&[mine[me], shape[0], shape[1]], data)
            };
            let gate_up = stack(&|e| expert_gate_up::<T>(e, h, ffn), [h, 2 * ffn])?;
            let down = stack(&|e| expert_down::<T>(e, h, ffn), [ffn, h])?;
            let fused = dist_tensor::fused::moe_experts(rank, &x, &routed, &gate_up, &down)?;
            let unfused =
                dist_tensor::fused::moe_experts_unfused(rank, &x, &routed, &gate_up, &down)?;
            Ok((fused, unfused))
        })
        .unwrap();
    for (r, (fused, unfused)) in outs.iter().enumerate() {
        let want = experts_reference::<T>(case, r, ffn);
        for got in [fused, unfused] {
            assert_eq!(got.shape(), [case.tokens[r], h]);
            for (g, w) in got.as_slice().iter().zip(&want) {
                assert!(
                    (g.to_f64() - w).abs() <= tol * w.abs().max(1.0),
                    "{g} vs {w}: rank {r} of {}, {} experts, {}",
                    case.ranks,
                    case.experts,
                    std::any::type_name::<T>()
                );
            }
        }
    }
}

#[test]
fn the_one_kernel_mlp_matches_f64_on_worlds_of_1_to_6_every_dtype() {
    for n in 1..=6 {
        let tokens: Vec<usize> = (0..n).map(|r| [37, 1, 0, 13, 2, 70][r]).collect();
        let case = Case::new(n, 6, 2, &tokens);
        check_experts::<f64>(&case, 5, 1e-12);
        check_experts::<f32>(&case, 5, 1e-5);
        check_experts::<bf16>(&case, 5, 3e-2);
        check_experts::<f16>(&case, 5, 4e-3);
    }
    // Skewed and dropped: every token's first slot to expert 1, capacity 0.5.
    let mut case = Case::new(3, 4, 2, &[40, 3, 33]);
    case.all_to = Some(1);
    check_experts::<f32>(&case, 7, 1e-5);
    case.capacity = Some(0.5);
    check_experts::<f32>(&case, 7, 1e-5);
}

#[test]
fn expert_weights_of_the_wrong_shape_fail_on_every_rank_naming_it() {
    let errs = on_every_rank(2, |rank| {
        let x = Tensor::<f32>::random(&[3, 4], 1);
        let routed = routed_for(3, 4, 2);
        let ffn = if rank.rank() == 1 { 6 } else { 5 };
        let gate_up = Tensor::<f32>::random(&[2, 4, 10], 3);
        let down = Tensor::<f32>::random(&[2, ffn, 4], 4);
        dist_tensor::fused::moe_experts(rank, &x, &routed, &gate_up, &down).map(drop)
    });
    for e in errs {
        assert!(
            matches!(&e, Error::InvalidArgument { rank: 1, reason, .. } if reason.contains("expert weights")),
            "{e}"
        );
    }
}
