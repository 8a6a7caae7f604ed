//! Collectives against plain references: world 1 to 8, every element type, lengths 0, 1, a prime,
//! fewer than the ranks, and uneven splits.

use dist_tensor::collectives::{self, ReduceOp};
use dist_tensor::{Element, Error, Tensor, World};
use half::{bf16, f16};

mod common;

use common::array_split;

/// Rank `r`'s input for case `case`, of `len` elements: seeded, never zeros.
fn input<T: Element>(case: u64, r: usize, len: usize) -> Vec<T> {
    Tensor::<T>::random(&[len], case * 1000 + r as u64).as_slice().to_vec()
}

/// Lengths that stress the edges for a world of `n`.
fn lengths(n: usize) -> Vec<usize> {
    let mut l = vec![0, 1, 13, n.saturating_sub(1), 3 * n + 1, 40_009];
    l.dedup();
    l
}

/// An uneven per-rank length: some ranks empty, the rest different.
fn uneven(r: usize, base: usize) -> usize {
    if r % 3 == 1 { 0 } else { base + 7 * r }
}

/// The reduction as the library promises it: accumulate in `T::Acc` in rank order, divide for a
/// mean, round once.
fn reference_reduce<T: Element>(parts: &[Vec<T>], i: usize, op: ReduceOp) -> T {
    let mut acc = parts[0][i].to_acc();
    for p in &parts[1..] {
        acc += p[i].to_acc();
    }
    if op == ReduceOp::Mean {
        acc = acc / <T::Acc as Element>::from_f64(parts.len() as f64);
    }
    T::from_acc(acc)
}

fn check_world<T: Element>(n: usize) {
    let world = World::threads(n).unwrap();
    let outs = world
        .run(|rank| {
            let r = rank.rank();
            let mut results = Vec::new();
            for (case, &len) in lengths(n).iter().enumerate() {
                let case = case as u64;
                results.push(collectives::all_gather(rank, &input::<T>(case, r, uneven(r, len)))?);
                let x = input::<T>(case + 100, r, len);
                results.push(collectives::reduce_scatter(rank, &x, ReduceOp::Sum)?);
                results.push(collectives::reduce_scatter(rank, &x, ReduceOp::Mean)?);
                results.push(collectives::all_reduce(rank, &x)?);
                let root = (case as usize) % n;
                let data = input::<T>(case + 200, r, len);
                results.push(collectives::broadcast(rank, &data, root)?);
                let counts: Vec<usize> = (0..n).map(|p| uneven((r + p) % n, len % 5)).collect();
                let total = counts.iter().sum();
                results.push(collectives::all_to_all_v(
                    rank,
                    &input::<T>(case + 300, r, total),
                    &counts,
                )?);
                let equal = input::<T>(case + 400, r, n * (len % 4));
                results.push(collectives::all_to_all(rank, &equal)?);
                // The one-copy form, with long uneven pieces (several chunks each).
                let counts: Vec<usize> = (0..n).map(|p| uneven((r + 2 * p) % n, len)).collect();
                let total = counts.iter().sum();
                let sent = input::<T>(case + 500, r, total);
                let got = collectives::all_to_all_v_tensor(rank, &sent, &counts)?;
                results.push(got.as_slice().to_vec());
            }
            Ok(results)
        })
        .unwrap_or_else(|e| panic!("world {n} {}: {e}", T::DTYPE));

    for (case, &len) in lengths(n).iter().enumerate() {
        let case64 = case as u64;
        let at = |r: usize, k: usize| &outs[r][case * 8 + k];
        let what = |op: &str| format!("{op}, world {n}, {}, len {len}", T::DTYPE);

        let gathered: Vec<T> = (0..n).flat_map(|r| input::<T>(case64, r, uneven(r, len))).collect();
        let xs: Vec<Vec<T>> = (0..n).map(|r| input::<T>(case64 + 100, r, len)).collect();
        let split = array_split(len, n);
        let sum: Vec<T> = (0..len).map(|i| reference_reduce(&xs, i, ReduceOp::Sum)).collect();
        let mean: Vec<T> = (0..len).map(|i| reference_reduce(&xs, i, ReduceOp::Mean)).collect();
        let root = case % n;
        for r in 0..n {
            assert_eq!(at(r, 0), &gathered, "{}", what("all_gather"));
            let start: usize = split[..r].iter().sum();
            let mine = start..start + split[r];
            assert_eq!(
                at(r, 1)[..],
                sum[mine.clone()],
                "{} on rank {r}",
                what("reduce_scatter sum")
            );
            assert_eq!(at(r, 2)[..], mean[mine], "{} on rank {r}", what("reduce_scatter mean"));
            assert_eq!(at(r, 3), &sum, "{} on rank {r}", what("all_reduce"));
            assert_eq!(at(r, 4), &input::<T>(case64 + 200, root, len), "{}", what("broadcast"));
            // all_to_all_v: what rank p sent to r.
            let mut want = Vec::new();
            for p in 0..n {
                let counts: Vec<usize> = (0..n).map(|q| uneven((p + q) % n, len % 5)).collect();
                let sent = input::<T>(case64 + 300, p, counts.iter().sum());
                let start: usize = counts[..r].iter().sum();
                want.extend_from_slice(&sent[start..start + counts[r]]);
            }
            assert_eq!(at(r, 5), &want, "{} on rank {r}", what("all_to_all_v"));
            let piece = len % 4;
            let want: Vec<T> = (0..n)
                .flat_map(|p| {
                    input::<T>(case64 + 400, p, n * piece)[r * piece..(r + 1) * piece].to_vec()
                })
                .collect();
            assert_eq!(at(r, 6), &want, "{} on rank {r}", what("all_to_all"));
            let mut want = Vec::new();
            for p in 0..n {
                let counts: Vec<usize> = (0..n).map(|q| uneven((p + 2 * q) % n, len)).collect();
                let sent = input::<T>(case64 + 500, p, counts.iter().sum());
                let start: usize = counts[..r].iter().sum();
                want.extend_from_slice(&sent[start..start + counts[r]]);
            }
            assert_eq!(at(r, 7), &want, "{} on rank {r}", what("all_to_all_v_tensor"));
        }
        // The f64 view: the promised rounding is within a few ulps of the exact sum.
        for (i, s) in sum.iter().enumerate() {
            let exact: f64 = xs.iter().map(|x| x[i].to_f64()).sum();
            let bound: f64 =
                xs.iter().map(|x| x[i].to_f64().abs()).sum::<f64>() * T::EPSILON * n as f64;
            assert!(
                (s.to_f64() - exact).abs() <= bound + 1e-300,
                "{} element {i}",
                what("sum vs f64")
            );
        }
    }
}

#[test]
fn collectives_equal_the_reference_f32() {
    for n in 1..=8 {
        check_world::<f32>(n);
    }
}

#[test]
fn collectives_equal_the_reference_f64() {
    for n in 1..=8 {
        check_world::<f64>(n);
    }
}

#[test]
fn collectives_equal_the_reference_f16() {
    for n in 1..=8 {
        check_world::<f16>(n);
    }
}

#[test]
fn collectives_equal_the_reference_bf16() {
    for n in 1..=8 {
        check_world::<bf16>(n);
    }
}

#[test]
fn half_reductions_accumulate_in_f32_and_round_once() {
    // 8 ranks each add 1/8 of one bf16 ulp at 1.0 to 1.0: rounding after every add would lose
    // every one; accumulating in f32 keeps them and rounds the total up to the next bf16.
    let ulp = bf16::EPSILON.to_f64();
    let out = World::threads(8)
        .unwrap()
        .run(|rank| {
            let x = if rank.rank() == 0 { 1.0 } else { ulp * 0.75 };
            collectives::all_reduce(rank, &[bf16::from_f64(x)])
        })
        .unwrap();
    let exact = 1.0 + 7.0 * bf16::from_f64(ulp * 0.75).to_f64();
    assert_eq!(out[0][0], bf16::from_f64(exact));
    assert!(out[0][0] > bf16::ONE);
}

#[test]
fn reductions_are_bitwise_the_same_over_100_calls() {
    let n = 4;
    let outs = World::threads(n)
        .unwrap()
        .run(|rank| {
            let x = input::<f32>(7, rank.rank(), 10_007);
            let first_rs = collectives::reduce_scatter(rank, &x, ReduceOp::Sum)?;
            let first_ar = collectives::all_reduce(rank, &x)?;
            for call in 0..100 {
                let rs = collectives::reduce_scatter(rank, &x, ReduceOp::Sum)?;
                let ar = collectives::all_reduce(rank, &x)?;
                let same =
                    |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits());
                assert!(same(&rs, &first_rs), "reduce_scatter differs at call {call}");
                assert!(same(&ar, &first_ar), "all_reduce differs at call {call}");
            }
            Ok(first_ar)
        })
        .unwrap();
    // And every rank has the same bits.
    assert!(outs.iter().all(|o| o.iter().zip(&outs[0]).all(|(a, b)| a.to_bits() == b.to_bits())));
}

#[test]
fn lengths_that_disagree_are_an_error_on_every_rank() {
    let world = World::threads(3).unwrap();
    let err = world.run(|rank| {
        let x = vec![1.0f32; 10 + rank.rank()];
        match collectives::reduce_scatter(rank, &x, ReduceOp::Sum) {
            Err(Error::RanksDisagree { op: "reduce_scatter", rank_a: 0, rank_b: 1, .. }) => Ok(()),
            other => panic!("rank {}: {other:?}", rank.rank()),
        }
    });
    assert!(err.is_ok(), "{err:?}");
}

/// all_reduce one-shot or two-shot (see `one_shot_and_two_shot_all_reduce_give_the_same_bits`):
/// either way, inputs of different lengths and an output of the wrong length are
/// the same typed error on every rank.
#[test]
fn all_reduce_rejects_disagreeing_lengths_on_every_rank_at_every_world() {
    for n in [2, 3] {
        let texts = World::threads(n)
            .unwrap()
            .run(|rank| {
                let x = vec![1.0f32; 10 + rank.rank()];
                let disagree = match collectives::all_reduce(rank, &x) {
                    Err(
                        e @ Error::RanksDisagree { op: "all_reduce", rank_a: 0, rank_b: 1, .. },
                    ) => e.to_string(),
                    other => panic!("world {n} rank {}: {other:?}", rank.rank()),
                };
                let x = vec![1.0f32; 10];
                let mut out = vec![0.0f32; if rank.rank() == 1 { 9 } else { 10 }];
                let short = collectives::all_reduce_into(rank, &x, &mut out).unwrap_err();
                assert!(
                    matches!(short, Error::InvalidArgument { op: "all_reduce", rank: 1, .. }),
                    "world {n} rank {}: {short:?}",
                    rank.rank()
                );
                Ok(disagree)
            })
            .unwrap();
        assert!(texts[0].contains("input length = 10"), "{}", texts[0]);
        assert!(texts.iter().all(|t| t == &texts[0]), "{texts:?}");
    }
}

/// One-shot (each rank sums every peer's whole input) and two-shot (reduce_scatter, then
/// all_gather) all_reduce give the reference's bits, both and `all_reduce`'s own choice, on
/// worlds 1 to 8, for lengths on both sides of the one-shot limit.
#[test]
fn one_shot_and_two_shot_all_reduce_give_the_same_bits() {
    fn case<T: Element>(n: usize) {
        let limit = collectives::ONE_SHOT_MAX_READ_BYTES / (n * n * size_of::<T>());
        let lengths = [0, 1, 2 * n + 1, 4099, limit, limit + 1];
        World::threads(n)
            .unwrap()
            .run(|rank| {
                for (case, &len) in lengths.iter().enumerate() {
                    let parts: Vec<Vec<T>> =
                        (0..n).map(|r| input::<T>(300 + case as u64, r, len)).collect();
                    let x = &parts[rank.rank()];
                    let want: Vec<T> =
                        (0..len).map(|i| reference_reduce(&parts, i, ReduceOp::Sum)).collect();
                    let bits = |v: &[T]| v.iter().map(|x| x.to_f64().to_bits()).collect::<Vec<_>>();
                    let what = format!("{} world {n} length {len}", T::DTYPE);
                    assert_eq!(
                        bits(&collectives::all_reduce_one_shot(rank, x)?),
                        bits(&want),
                        "{what}"
                    );
                    assert_eq!(
                        bits(&collectives::all_reduce_two_shot(rank, x)?),
                        bits(&want),
                        "{what}"
                    );
                    assert_eq!(bits(&collectives::all_reduce(rank, x)?), bits(&want), "{what}");
                }
                Ok(())
            })
            .unwrap();
    }
    for n in 1..=8 {
        case::<f32>(n);
        case::<bf16>(n);
    }
    case::<f64>(3);
    case::<f16>(5);
}

/// A rank in a one-shot all_reduce never meets one in a two-shot (the ranks would read
/// different parts of each other's inputs): a typed error on every rank instead.
#[test]
fn one_shot_against_two_shot_is_an_error_on_every_rank() {
    let errs = World::threads(3)
        .unwrap()
        .run(|rank| {
            let x = vec![1.0f32; 10];
            let got = if rank.rank() == 2 {
                collectives::all_reduce_two_shot(rank, &x)
            } else {
                collectives::all_reduce_one_shot(rank, &x)
            };
            Ok(got.unwrap_err())
        })
        .unwrap();
    for e in errs {
        assert!(matches!(e, Error::RanksDisagree { rank_b: 2, .. }), "{e}");
        assert!(e.to_string().contains("one-shot"), "{e}");
    }
}

#[test]
fn a_root_outside_the_world_is_an_error_on_every_rank() {
    let out = World::threads(3)
        .unwrap()
        .run(|rank| {
            let root = if rank.rank() == 2 { 7 } else { 0 };
            let err = collectives::broadcast(rank, &[1.0f64], root).unwrap_err();
            Ok(err.to_string())
        })
        .unwrap();
    for text in &out {
        assert!(text.starts_with("broadcast: invalid argument on rank 2"), "{text}");
    }
    assert!(out[2].contains("root 7 is outside a world of 3 ranks"), "{}", out[2]);
}

#[test]
fn uneven_all_to_all_counts_that_do_not_add_up_are_an_error() {
    let out = World::threads(2)
        .unwrap()
        .run(|rank| {
            let vector = collectives::all_to_all_v(rank, &[1.0f32; 3], &[1, 1]).unwrap_err();
            let tensor = collectives::all_to_all_v_tensor(rank, &[1.0f32; 3], &[1]).unwrap_err();
            Ok((vector.to_string(), tensor.to_string()))
        })
        .unwrap();
    for (vector, tensor) in &out {
        assert!(vector.contains("send counts add up to 2, the input has 3 elements"), "{vector}");
        assert!(tensor.contains("1 send counts for a world of 2 ranks"), "{tensor}");
    }
}

#[test]
fn symmetric_memory_too_small_is_an_error_not_a_hang() {
    let world = World::builder(2).heap_capacity(1 << 20).build().unwrap();
    let err = world
        .run(|rank| collectives::all_gather(rank, &vec![1.0f32; 1 << 20]).map(|_| ()))
        .unwrap_err();
    assert!(err.to_string().contains("symmetric memory exhausted"), "{err}");
}

#[test]
fn workspaces_are_kept_between_calls_and_runs_and_visible() {
    let world = World::threads(2).unwrap();
    let run = || world.run(|rank| collectives::all_gather(rank, &vec![1.0f32; 1000]).map(|_| ()));
    run().unwrap();
    let after_first = world.workspace_bytes();
    assert!(after_first[0] >= 4000, "{after_first:?}");
    run().unwrap();
    assert_eq!(world.workspace_bytes(), after_first);
    world.run(|rank| rank.release_workspaces()).unwrap();
    assert_eq!(world.workspace_bytes(), vec![0, 0]);
}

/// Column blocks, as a tensor sharded on its last dimension: rows > 1, ragged widths, and rows
/// long enough to span several chunks.
#[test]
fn column_block_gather_and_reduce_scatter_equal_the_reference() {
    for n in [1, 2, 3, 5] {
        for (rows, base) in [(1, 5), (3, 1), (7, 13), (2, 20_011)] {
            let widths: Vec<usize> = (0..n).map(|r| uneven(r, base)).collect();
            let total: usize = widths.iter().sum();
            let outs = World::threads(n)
                .unwrap()
                .run(|rank| {
                    let r = rank.rank();
                    let block = input::<f32>(900, r, rows * widths[r]);
                    let gathered = collectives::all_gather_cols(rank, &block, rows)?;
                    let full = input::<f32>(901, r, rows * total);
                    let reduced = collectives::reduce_scatter_cols(
                        rank,
                        &full,
                        rows,
                        &widths,
                        ReduceOp::Sum,
                    )?;
                    Ok((gathered, reduced))
                })
                .unwrap();
            let blocks: Vec<Vec<f32>> =
                (0..n).map(|r| input::<f32>(900, r, rows * widths[r])).collect();
            let fulls: Vec<Vec<f32>> = (0..n).map(|r| input::<f32>(901, r, rows * total)).collect();
            for (r, (gathered, reduced)) in outs.iter().enumerate() {
                let start: usize = widths[..r].iter().sum();
                for i in 0..rows {
                    let mut col = 0;
                    for (p, &w) in widths.iter().enumerate() {
                        assert_eq!(
                            gathered[i * total + col..i * total + col + w],
                            blocks[p][i * w..(i + 1) * w],
                            "world {n}, rows {rows}, row {i}, block of rank {p}"
                        );
                        col += w;
                    }
                    for j in 0..widths[r] {
                        let want = reference_reduce(&fulls, i * total + start + j, ReduceOp::Sum);
                        assert_eq!(
                            reduced[i * widths[r] + j],
                            want,
                            "world {n}, rows {rows}, ({i}, {j})"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn into_forms_write_the_same_result_and_reject_a_wrong_output_length() {
    let outs = World::threads(3)
        .unwrap()
        .run(|rank| {
            let x = input::<f32>(11, rank.rank(), 101);
            let mut gathered = vec![0.0f32; 303];
            collectives::all_gather_into(rank, &x, &mut gathered)?;
            assert_eq!(gathered, collectives::all_gather(rank, &x)?);
            let mut piece = vec![0.0f32; array_split(101, 3)[rank.rank()]];
            collectives::reduce_scatter_into(rank, &x, ReduceOp::Sum, &mut piece)?;
            assert_eq!(piece, collectives::reduce_scatter(rank, &x, ReduceOp::Sum)?);
            let mut summed = vec![0.0f32; 101];
            collectives::all_reduce_into(rank, &x, &mut summed)?;
            assert_eq!(summed, collectives::all_reduce(rank, &x)?);
            // Rank 1 passes a buffer one too short: every rank gets the error.
            let mut wrong = vec![0.0f32; if rank.rank() == 1 { 302 } else { 303 }];
            Ok(collectives::all_gather_into(rank, &x, &mut wrong).unwrap_err().to_string())
        })
        .unwrap();
    for text in &outs {
        assert_eq!(
            text,
            "all_gather: invalid argument on rank 1: the output holds 302 elements, the result has 303"
        );
    }
}

/// Outputs past `STREAM_OUTPUT_BYTES` (8 MiB) are written with streaming stores, contiguous and
/// row by row: the same results as the plain copies of smaller calls.
#[test]
fn large_outputs_written_with_streaming_stores_equal_the_reference() {
    let (rows, width) = (3, 700_001); // odd widths: unaligned rows for the 16-byte stores
    let outs = World::threads(2)
        .unwrap()
        .run(|rank| {
            let block = input::<f32>(950, rank.rank(), rows * (width + rank.rank()));
            let gathered = collectives::all_gather_cols(rank, &block, rows)?;
            let flat = input::<f32>(951, rank.rank(), 2 * 1_500_001);
            let exchanged = collectives::all_to_all(rank, &flat)?;
            // Every rank passes its own data: only rank 0's may come back.
            let mine = input::<f32>(952, rank.rank(), 2_500_003);
            let cast = collectives::broadcast(rank, &mine, 0)?;
            Ok((gathered, exchanged, cast))
        })
        .unwrap();
    let blocks: Vec<Vec<f32>> = (0..2).map(|r| input::<f32>(950, r, rows * (width + r))).collect();
    let total = 2 * width + 1;
    let root_data = input::<f32>(952, 0, 2_500_003);
    for (r, (gathered, exchanged, cast)) in outs.iter().enumerate() {
        for i in 0..rows {
            assert_eq!(
                gathered[i * total..i * total + width],
                blocks[0][i * width..(i + 1) * width]
            );
            let w1 = width + 1;
            assert_eq!(
                gathered[i * total + width..(i + 1) * total],
                blocks[1][i * w1..(i + 1) * w1]
            );
        }
        let want: Vec<f32> = (0..2)
            .flat_map(|p| {
                input::<f32>(951, p, 2 * 1_500_001)[r * 1_500_001..(r + 1) * 1_500_001].to_vec()
            })
            .collect();
        assert_eq!(exchanged, &want);
        assert!(cast == &root_data, "broadcast on rank {r}: not rank 0's data");
    }
}
