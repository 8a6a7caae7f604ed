//! The distributed duals of `DVar` (all_gather_matmul <-> matmul_reduce_scatter, all_to_all both
//! ways, every redistribute pair) at worlds 1, 2, 3, 4 and 8, with uneven and empty shards,
//! against the same computation on one rank in f64.

use dist_tensor::autograd::{DVar, Var};
use dist_tensor::{DistTensor, Placement, Tensor, World};

const WORLDS: [usize; 5] = [1, 2, 3, 4, 8];

/// `len` rows over `world` ranks, unevenly: rank 1 (when there is one) gets none, rank 0 more
/// than its share.
fn uneven(len: usize, world: usize) -> Vec<usize> {
    if world == 1 {
        return vec![len];
    }
    let mut sizes = vec![0; world];
    let others: Vec<usize> = (0..world).filter(|&r| r != 1).collect();
    let mut left = len;
    for (i, &r) in others.iter().enumerate() {
        let share = if i + 1 == others.len() {
            left
        } else if i == 0 {
            left.div_ceil(2)
        } else {
            left.div_ceil(others.len() - i)
        };
        sizes[r] = share.min(left);
        left -= sizes[r];
    }
    sizes
}

fn close(got: &Tensor<f64>, want: &Tensor<f64>, what: &str) {
    assert_eq!(got.shape(), want.shape(), "{what}");
    let err =
        got.as_slice().iter().zip(want.as_slice()).fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
    assert!(err < 1e-10, "{what}: off by {err:e}");
}

/// `got` on `rank` of a world of `world` ranks against its piece of the global `want`, cut along
/// dim 1 in `sizes`.
fn close_to_piece(
    rank: &dist_tensor::Rank<'_>,
    got: &Tensor<f64>,
    want: &Tensor<f64>,
    sizes: &[usize],
    world: usize,
) -> dist_tensor::Result<()> {
    let want = DistTensor::from_global_split(rank, want, 1, sizes.to_vec())?;
    close(got, want.local(), &format!("world {world} rank {}", rank.rank()));
    Ok(())
}

#[test]
fn tensor_parallel_mlp_gradients_match_one_rank() {
    let (m, e, f) = (7, 5, 10);
    let x = Tensor::<f64>::random(&[m, e], 1);
    let w1 = Tensor::<f64>::random(&[e, f], 2);
    let w2 = Tensor::<f64>::random(&[f, e], 3);
    // One rank, f64: loss = sum((gelu(x w1) w2)^2).
    let (rx, r1, r2) = (Var::param(x.clone()), Var::param(w1.clone()), Var::param(w2.clone()));
    let y = rx.matmul(&r1).unwrap().gelu().matmul(&r2).unwrap();
    (&y * &y).sum().backward().unwrap();
    let (gx, g1, g2) = (rx.grad().unwrap(), r1.grad().unwrap(), r2.grad().unwrap());
    for world in WORLDS {
        let sizes = uneven(m, world);
        World::threads(world)
            .unwrap()
            .run(|rank| {
                let xs = DVar::param(DistTensor::from_global_split(rank, &x, 0, sizes.clone())?);
                let w1r = Var::param(
                    DistTensor::from_global(rank, &w1, Placement::Shard(1))?.into_local(),
                );
                let w2r = Var::param(
                    DistTensor::from_global(rank, &w2, Placement::Shard(0))?.into_local(),
                );
                let h = xs.all_gather_matmul(&w1r)?.map(|h| Ok(h.gelu()))?;
                let y = h.matmul_reduce_scatter(&w2r)?;
                assert_eq!(y.value().shard_sizes(), sizes.as_slice(), "rows come back as x's");
                let yl = y.local();
                (yl * yl).sum().backward()?;
                let want_x = DistTensor::from_global_split(rank, &gx, 0, sizes.clone())?;
                let want_1 = DistTensor::from_global(rank, &g1, Placement::Shard(1))?;
                let want_2 = DistTensor::from_global(rank, &g2, Placement::Shard(0))?;
                let tag = format!("world {world} rank {}", rank.rank());
                close(&xs.grad().unwrap(), want_x.local(), &format!("{tag} dx"));
                close(&w1r.grad().unwrap(), want_1.local(), &format!("{tag} dw1"));
                close(&w2r.grad().unwrap(), want_2.local(), &format!("{tag} dw2"));
                Ok(())
            })
            .unwrap();
    }
}

#[test]
fn all_to_all_gradients_go_back_to_their_positions() {
    let shape = [1, 7, 3, 2]; // [B, S, H, D]
    let x = Tensor::<f64>::random(&shape, 4);
    let c = Tensor::<f64>::random(&shape, 5);
    // d sum(gelu(x) * c) / dx = gelu'(x) c.
    let rx = Var::param(x.clone());
    (&rx.gelu() * &Var::constant(c.clone())).sum().backward().unwrap();
    let want = rx.grad().unwrap();
    for world in WORLDS {
        let sizes = uneven(7, world);
        World::threads(world)
            .unwrap()
            .run(|rank| {
                let xs = DVar::param(DistTensor::from_global_split(rank, &x, 1, sizes.clone())?);
                let heads = xs.all_to_all(2, 1)?;
                let cr = Var::constant(
                    DistTensor::from_global(rank, &c, Placement::Shard(2))?.into_local(),
                );
                (&heads.local().gelu() * &cr).sum().backward()?;
                close_to_piece(rank, &xs.grad().unwrap(), &want, &sizes, world)
            })
            .unwrap();
    }
}

/// `x` of global value `g` under `p`: `Shard(i)` cut unevenly.
fn place<'r>(
    rank: &'r dist_tensor::Rank<'r>,
    g: &Tensor<f64>,
    p: Placement,
) -> dist_tensor::Result<DistTensor<'r, f64>> {
    match p {
        Placement::Shard(i) => {
            DistTensor::from_global_split(rank, g, i, uneven(g.shape()[i], rank.num_ranks()))
        }
        p => DistTensor::from_global(rank, g, p),
    }
}

#[test]
fn every_redistribute_pair_has_its_dual() {
    use Placement::{Partial, Replicate, Shard};
    let g = Tensor::<f64>::random(&[7, 5], 6);
    let c = Tensor::<f64>::random(&[7, 5], 7);
    let placements = [Shard(0), Shard(1), Replicate, Partial];
    for world in WORLDS {
        for from in placements {
            for to in placements {
                World::threads(world)
                    .unwrap()
                    .run(|rank| {
                        let x = DVar::param(place(rank, &g, from)?);
                        let y = x.redistribute(to)?;
                        // L = sum(Y * c) over the global Y, whatever its placement: each rank
                        // adds its part (a replicated Y is counted once, on rank 0).
                        let (cr, weight) = match to {
                            Shard(i) => (
                                DistTensor::from_global_split(
                                    rank,
                                    &c,
                                    i,
                                    y.value().shard_sizes().to_vec(),
                                )?
                                .into_local(),
                                1.0,
                            ),
                            Replicate => (c.clone(), if rank.rank() == 0 { 1.0 } else { 0.0 }),
                            Partial => (c.clone(), 1.0),
                        };
                        (&y.local().scale(weight) * &Var::constant(cr)).sum().backward()?;
                        // dL/dX = c, placed as X: sharded for Shard, whole for Partial and
                        // (summed over ranks) for Replicate.
                        let want = match from {
                            Shard(i) => DistTensor::from_global_split(
                                rank,
                                &c,
                                i,
                                x.value().shard_sizes().to_vec(),
                            )?
                            .into_local(),
                            _ => c.clone(),
                        };
                        let got = x.grad_reduced()?;
                        close(
                            &got,
                            &want,
                            &format!("world {world} rank {} {from:?} -> {to:?}", rank.rank()),
                        );
                        Ok(())
                    })
                    .unwrap();
            }
        }
    }
}

#[test]
fn vocab_parallel_cross_entropy_matches_one_rank_log_softmax_on_huge_logits() {
    use dist_tensor::autograd::vocab_parallel_cross_entropy;
    let (n, v) = (5, 11);
    // Logits near 1000: exp overflows f64 without the maximum subtracted.
    let logits = Tensor::<f64>::random(&[n, v], 8).map(|x| 1000.0 + 20.0 * x);
    // Row 2 is ignored: no loss, no gradient; the mean is over the other four.
    let ids = [Some(0), Some(10), None, Some(3), Some(7)];
    let counted = 4.0;
    // One rank: log-softmax row by row with the maximum subtracted, and (softmax - onehot) / n.
    let mut want_loss = 0.0;
    let mut want_grad = vec![0.0; n * v];
    for (i, row) in logits.as_slice().chunks(v).enumerate() {
        let Some(target) = ids[i] else { continue };
        let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = row.iter().map(|x| (x - max).exp()).sum();
        want_loss += (sum.ln() + max - row[target]) / counted;
        for j in 0..v {
            let hot = if j == target { 1.0 } else { 0.0 };
            want_grad[i * v + j] = ((row[j] - max).exp() / sum - hot) / counted;
        }
    }
    assert!(want_loss.is_finite() && want_loss > 0.1);
    let want_grad = Tensor::from_shape_vec(&[n, v], want_grad).unwrap();
    for world in WORLDS {
        let sizes = uneven(v, world);
        World::threads(world)
            .unwrap()
            .run(|rank| {
                let l =
                    DVar::param(DistTensor::from_global_split(rank, &logits, 1, sizes.clone())?);
                let loss = vocab_parallel_cross_entropy(&l, &ids)?;
                assert_eq!(loss.placement(), Placement::Replicate);
                let got = loss.local().value().as_slice()[0];
                assert!((got - want_loss).abs() < 1e-12, "world {world}: {got} vs {want_loss}");
                loss.backward()?;
                close_to_piece(rank, &l.grad().unwrap(), &want_grad, &sizes, world)
            })
            .unwrap();
    }
}

#[test]
fn cross_entropy_rejects_bad_targets_on_every_rank() {
    use dist_tensor::autograd::vocab_parallel_cross_entropy;
    let logits = Tensor::<f32>::random(&[2, 4], 1);
    let err = World::threads(2)
        .unwrap()
        .run(|rank| {
            let l = DVar::constant(DistTensor::from_global(rank, &logits, Placement::Shard(1))?);
            vocab_parallel_cross_entropy(&l, &[Some(0), Some(4)]).map(|_| ())
        })
        .unwrap_err();
    assert!(err.to_string().contains("below the vocabulary size 4"), "{err}");
}
