//! Checkpoints: round trips of every element type and placement between worlds of 1 to 8 ranks
//! (threads and processes), uneven and empty shards, the nn state, crash safety (a rank
//! SIGKILLed mid-save), corruption and every typed error, a file written by Python's
//! `safetensors`, and how many bytes a slice load reads.
//!
//! The references are the input tensors themselves (values exact in every type: multiples of
//! 1/8 below 64), never the library's own gather.

mod common;

use common::jobs::{in_rank, printed, run_job};

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dist_tensor::checkpoint::{
    self, Checkpoint, CheckpointErrorKind, Entry, SafetensorsFile, Target,
};
use dist_tensor::nn::{Activation, Module, Optimizer, ParallelMlp, Sgd, mse_loss};
use dist_tensor::shmem::RankExit;
use dist_tensor::{DistTensor, Element, Error, Placement, Split, Tensor, World};
use half::{bf16, f16};

/// A fresh directory for one test (removed by [`Dir`]'s drop).
struct Dir(PathBuf);

impl Dir {
    fn new(what: &str) -> Dir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "dist-tensor-ckpt-test-{what}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        Dir(p)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Seeded values, exact in every type (multiples of 1/8 in [-32, 32)).
fn values<T: Element>(shape: &[usize], seed: u64) -> Tensor<T> {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let v = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            T::from_f64((s % 512) as f64 / 8.0 - 32.0)
        })
        .collect();
    Tensor::from_shape_vec(shape, v).unwrap()
}

/// Element-wise bit equality through f64 (every value here is exact in f64).
fn same<T: Element>(a: &Tensor<T>, b: &Tensor<T>) -> bool {
    a.shape() == b.shape()
        && a.as_slice()
            .iter()
            .zip(b.as_slice())
            .all(|(x, y)| x.to_f64().to_bits() == y.to_f64().to_bits())
}

/// The checkpoint error inside `e`.
fn kind_of(e: &Error) -> &CheckpointErrorKind {
    match e {
        Error::Checkpoint(c) => &c.kind,
        other => panic!("not a checkpoint error: {other}"),
    }
}

// ---- round trips -------------------------------------------------------------------------------

/// The targets loads are checked in: every placement, even and uneven splits.
fn targets(world: usize, rows: usize) -> Vec<Target> {
    let mut sizes = vec![0; world];
    sizes[world - 1] = rows; // every row on the last rank, the others empty
    vec![
        Target::new(Placement::Shard(0)),
        Target::new(Placement::Shard(1)),
        Target::new(Placement::Replicate),
        Target::new(Placement::Partial),
        Target::new(Placement::Shard(0)).split(Split::Sizes(sizes)),
    ]
}

/// Saves `global` on `save_world` ranks in several placements, then loads it on every world in
/// `load_worlds` in every target; each rank's part must be its slice of `global`, bit for bit.
fn round_trip<T: Element>(global: &Tensor<T>, save_world: usize, load_worlds: &[usize]) {
    let dir = Dir::new("rt");
    let rows = global.shape()[0];
    World::threads(save_world)
        .unwrap()
        .run(|rank| {
            let s0 = DistTensor::from_global(rank, global, Placement::Shard(0))?;
            let s1 = DistTensor::from_global_split(rank, global, 1, Split::Even)?;
            let rep = DistTensor::from_global(rank, global, Placement::Replicate)?;
            // Partial: rank r holds global * w_r with the w_r adding up to 1 (exact: 1/2, 1/4...).
            let n = rank.num_ranks();
            let w = if n == 1 {
                1.0
            } else if rank.rank() + 1 < n {
                0.5f64.powi(rank.rank() as i32 + 1)
            } else {
                0.5f64.powi(n as i32 - 1)
            };
            let part = global.map(|v| T::from_f64(v.to_f64() * w));
            let partial = DistTensor::from_local(rank, part, Placement::Partial)?;
            let entries = [
                Entry::new("s0", &s0)?,
                Entry::new("s1", &s1)?,
                Entry::new("rep", &rep)?,
                Entry::new("partial", &partial)?,
            ];
            checkpoint::save(rank, &dir.0, &entries)?;
            Ok(())
        })
        .unwrap();
    for &lw in load_worlds {
        World::threads(lw)
            .unwrap()
            .run(|rank| {
                let ck = Checkpoint::open(rank, &dir.0)?;
                assert_eq!(ck.saved_world(), save_world);
                for name in ["s0", "s1", "rep", "partial"] {
                    for target in targets(lw, rows) {
                        let t = ck.load::<T>(name, target.clone())?;
                        let want = match target.placement() {
                            Placement::Partial if rank.rank() != 0 => Tensor::zeros(global.shape()),
                            Placement::Partial | Placement::Replicate => global.clone(),
                            Placement::Shard(d) => {
                                let sizes = t.shard_sizes().to_vec();
                                DistTensor::from_global_split(rank, global, d, sizes)?.into_local()
                            }
                        };
                        assert!(
                            same(t.local(), &want),
                            "{name} saved on {save_world}, loaded on {lw} as {target:?}: rank {} differs",
                            rank.rank()
                        );
                        assert_eq!(t.global_dims(), global.shape());
                    }
                }
                Ok(())
            })
            .unwrap();
    }
}

#[test]
fn every_dtype_and_placement_round_trips_between_worlds() {
    // Uneven: 7 rows and 5 columns on up to 8 ranks (some empty).
    round_trip(&values::<f32>(&[7, 5], 1), 3, &[1, 2, 5, 8]);
    round_trip(&values::<f64>(&[7, 5], 2), 4, &[1, 3, 8]);
    round_trip(&values::<f16>(&[7, 5], 3), 2, &[3, 7]);
    round_trip(&values::<bf16>(&[7, 5], 4), 5, &[2, 4]);
}

#[test]
fn worlds_one_to_eight_save_and_load_all_pairs() {
    // Every save world 1-8 against every load world 1-8, for two sizes (one smaller than most
    // worlds, one prime), sharded on one dimension and loaded on the other.
    for shape in [[3usize, 11], [13, 4]] {
        let global = values::<f32>(&shape, shape[0] as u64);
        for save_world in 1..=8 {
            let dir = Dir::new("pairs");
            World::threads(save_world)
                .unwrap()
                .run(|rank| {
                    let x = DistTensor::from_global(rank, &global, Placement::Shard(0))?;
                    checkpoint::save(rank, &dir.0, &[Entry::new("x", &x)?])?;
                    Ok(())
                })
                .unwrap();
            for load_world in 1..=8 {
                let parts = World::threads(load_world)
                    .unwrap()
                    .run(|rank| {
                        let ck = Checkpoint::open(rank, &dir.0)?;
                        Ok(ck.load::<f32>("x", Placement::Shard(1))?.into_local())
                    })
                    .unwrap();
                // Columns glued back in rank order: the global tensor.
                let cols: Vec<usize> = parts.iter().map(|p| p.shape()[1]).collect();
                assert_eq!(cols, dist_tensor::Split::Even.sizes(shape[1], load_world).unwrap());
                for row in 0..shape[0] {
                    let got: Vec<f32> = parts
                        .iter()
                        .flat_map(|p| {
                            p.as_slice()[row * p.shape()[1]..(row + 1) * p.shape()[1]].to_vec()
                        })
                        .collect();
                    assert_eq!(
                        got,
                        global.as_slice()[row * shape[1]..(row + 1) * shape[1]],
                        "{save_world} -> {load_world}"
                    );
                }
            }
        }
    }
}

#[test]
fn empty_shards_empty_tensors_and_scalars_round_trip() {
    let dir = Dir::new("empty");
    let empty = values::<f64>(&[0, 3], 1);
    let thin = values::<f64>(&[2, 3], 2); // fewer rows than ranks
    let scalar = Tensor::<f64>::from_shape_vec(&[], vec![2.5]).unwrap();
    World::threads(4)
        .unwrap()
        .run(|rank| {
            let a = DistTensor::from_global(rank, &empty, Placement::Shard(0))?;
            let b = DistTensor::from_global(rank, &thin, Placement::Shard(0))?;
            let c = DistTensor::from_global_split(rank, &thin, 1, vec![0, 3, 0, 0])?;
            let s = DistTensor::from_global(rank, &scalar, Placement::Replicate)?;
            let p = DistTensor::from_local(
                rank,
                Tensor::from_shape_vec(&[], vec![0.5])?,
                Placement::Partial,
            )?;
            let e = [
                Entry::new("a", &a)?,
                Entry::new("b", &b)?,
                Entry::new("c", &c)?,
                Entry::new("s", &s)?,
                Entry::new("p", &p)?,
            ];
            checkpoint::save(rank, &dir.0, &e)?;
            Ok(())
        })
        .unwrap();
    World::threads(3)
        .unwrap()
        .run(|rank| {
            let ck = Checkpoint::open(rank, &dir.0)?;
            assert_eq!(ck.load::<f64>("a", Placement::Shard(1))?.to_global()?.shape(), &[0, 3]);
            assert!(same(&ck.load::<f64>("b", Placement::Shard(1))?.to_global()?, &thin));
            assert!(same(&ck.load::<f64>("c", Placement::Replicate)?.into_local(), &thin));
            assert_eq!(ck.load::<f64>("s", Placement::Replicate)?.local().as_slice(), &[2.5]);
            assert_eq!(ck.load::<f64>("p", Placement::Replicate)?.local().as_slice(), &[2.0]); // 4 * 0.5
            Ok(())
        })
        .unwrap();
}

#[test]
fn dtypes_convert_only_when_asked() {
    let dir = Dir::new("convert");
    let global = values::<f64>(&[5, 6], 9).map(|v| v + 1.0 / 1024.0); // not exact in bf16
    World::threads(2)
        .unwrap()
        .run(|rank| {
            let x = DistTensor::from_global(rank, &global, Placement::Shard(1))?;
            checkpoint::save(rank, &dir.0, &[Entry::new("x", &x)?])?;
            Ok(())
        })
        .unwrap();
    World::threads(3)
        .unwrap()
        .run(|rank| {
            let ck = Checkpoint::open(rank, &dir.0)?;
            let err = ck.load::<bf16>("x", Placement::Replicate).unwrap_err();
            assert!(matches!(kind_of(&err), CheckpointErrorKind::DtypeMismatch { .. }), "{err}");
            let x = ck.load::<bf16>("x", Target::new(Placement::Replicate).convert_dtype())?;
            let want: Vec<bf16> = global.as_slice().iter().map(|&v| bf16::from_f64(v)).collect();
            assert_eq!(x.local().as_slice(), &want[..]);
            Ok(())
        })
        .unwrap();
}

// ---- nn state ----------------------------------------------------------------------------------

/// Trains an MLP (bf16, SGD with momentum: master weights and a buffer) on `world` for `steps`,
/// from a checkpoint if given, saving one at the end if asked; returns the losses.
fn train(world: usize, steps: usize, resume: Option<&Path>, save: Option<&Path>) -> Vec<f64> {
    let x = values::<bf16>(&[9, 8], 1).map(|v| bf16::from_f64(v.to_f64() / 32.0));
    let target = x.map(|v| bf16::from_f64(v.to_f64().sin()));
    World::threads(world)
        .unwrap()
        .run(|rank| {
            let mut mlp = ParallelMlp::<bf16>::new(rank, 8, 12, Activation::Gelu, 5)?;
            let mut sgd = Sgd::<bf16>::new(0.05).momentum(0.9);
            if let Some(dir) = resume {
                let ck = Checkpoint::open(rank, dir)?;
                mlp.load_state_dict(&ck, "model")?;
                sgd.load_state_dict(&ck, &mlp, "optim")?;
            }
            let xs = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
            let ts = DistTensor::from_global(rank, &target, Placement::Shard(0))?;
            let mut losses = Vec::new();
            for _ in 0..steps {
                let (y, saved) = mlp.forward(&xs)?;
                let (loss, dy) = mse_loss(&y, &ts)?;
                mlp.zero_grad();
                mlp.backward(saved, &dy)?;
                sgd.step(mlp.parameters_mut())?;
                losses.push(loss);
            }
            if let Some(dir) = save {
                dist_tensor::nn::save_training(rank, dir, &mlp, &sgd)?;
            }
            Ok(losses)
        })
        .unwrap()
        .swap_remove(0)
}

#[test]
fn a_training_state_resumes_bitwise_on_the_same_world_and_closely_on_another() {
    let dir = Dir::new("nn");
    let straight = train(2, 12, None, None);
    let first = train(2, 6, None, Some(&dir.0));
    assert_eq!(first, straight[..6]);
    // The names are the documented ones.
    World::threads(1)
        .unwrap()
        .run(|rank| {
            let ck = Checkpoint::open(rank, &dir.0)?;
            for name in [
                "model.fc1.weight",
                "model.fc2.bias",
                "optim.fc1.weight.momentum_buffer",
                "optim.fc1.weight.master",
                "optim.fc2.bias.step",
            ] {
                assert!(ck.contains(name), "{name} missing: {:?}", ck.names());
            }
            Ok(())
        })
        .unwrap();
    let same_world = train(2, 6, Some(&dir.0), None);
    assert_eq!(same_world, straight[6..], "resumed on the same world: bit for bit");
    let other = train(3, 6, Some(&dir.0), None);
    let straight3 = train(3, 12, None, None);
    for (a, b) in other.iter().zip(&straight3[6..]) {
        assert!((a - b).abs() <= 2e-2 * straight3[0], "{other:?} vs {straight3:?}");
    }
}

#[test]
fn a_layer_refuses_a_checkpoint_of_another_shape() {
    let dir = Dir::new("nnshape");
    World::threads(2)
        .unwrap()
        .run(|rank| {
            let mlp = ParallelMlp::<f32>::new(rank, 8, 12, Activation::Gelu, 5)?;
            checkpoint::save(rank, &dir.0, &mlp.state_dict("m")?)?;
            Ok(())
        })
        .unwrap();
    let errs = World::threads(2)
        .unwrap()
        .run(|rank| {
            let mut mlp = ParallelMlp::<f32>::new(rank, 8, 16, Activation::Gelu, 5)?;
            Ok(mlp.load_state_dict(&Checkpoint::open(rank, &dir.0)?, "m").unwrap_err())
        })
        .unwrap();
    for e in &errs {
        assert!(
            matches!(kind_of(e), CheckpointErrorKind::ShapeMismatch { expected, found } if expected == &vec![8, 16] && found == &vec![8, 12]),
            "{e}"
        );
        assert!(e.to_string().contains("m.fc1.weight"), "{e}");
    }
}

// ---- errors --------------------------------------------------------------------------------

/// Saves a checkpoint of two sharded tensors (several checksum chunks each) on 3 ranks.
fn three_rank_checkpoint(dir: &Path) -> Tensor<f32> {
    let global = values::<f32>(&[600, 1000], 3); // 2.4 MB
    World::threads(3)
        .unwrap()
        .run(|rank| {
            let x = DistTensor::from_global(rank, &global, Placement::Shard(0))?;
            let y = DistTensor::from_global(rank, &global, Placement::Shard(1))?;
            checkpoint::save(rank, dir, &[Entry::new("x", &x)?, Entry::new("y", &y)?])?;
            Ok(())
        })
        .unwrap();
    global
}

fn rank_file(dir: &Path, r: usize) -> PathBuf {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name().unwrap().to_string_lossy().starts_with(&format!("rank-{r:05}."))
                && p.extension().is_some_and(|e| e == "safetensors")
        })
        .unwrap()
}

/// Loads "x" on 2 ranks as rows (rank 1 needs rank 1's and 2's files); returns every rank's error.
fn load_errors(dir: &Path, name: &str) -> Vec<Error> {
    World::threads(2)
        .unwrap()
        .run(|rank| {
            let ck = Checkpoint::open(rank, dir);
            Ok(match ck {
                Err(e) => e,
                Ok(ck) => ck.load::<f32>(name, Placement::Shard(0)).unwrap_err(),
            })
        })
        .unwrap()
}

/// Where tensor `name`'s data starts in a safetensors file, read from its header.
fn data_offset(file: &Path, name: &str) -> usize {
    let bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    8 + n + header[name]["data_offsets"][0].as_u64().unwrap() as usize
}

#[test]
fn a_corrupted_byte_is_a_checksum_mismatch_on_every_rank_naming_file_and_tensor() {
    let dir = Dir::new("corrupt");
    three_rank_checkpoint(&dir.0);
    // Rank 2's file holds rows 400..600 of x; on 2 ranks, rank 1 (rows 300..600) reads them.
    let file = rank_file(&dir.0, 2);
    let mut bytes = std::fs::read(&file).unwrap();
    let at = data_offset(&file, "x") + 150 * 1000 * 4 + 17; // row 550
    bytes[at] ^= 0x10;
    std::fs::write(&file, &bytes).unwrap();
    for e in load_errors(&dir.0, "x") {
        let Error::Checkpoint(c) = &e else { panic!("{e}") };
        assert!(matches!(c.kind, CheckpointErrorKind::ChecksumMismatch { .. }), "{e}");
        assert_eq!(c.rank, 1, "rank 1 reads rank 2's file: {e}");
        assert_eq!(Path::new(&c.file), file, "{e}");
        assert_eq!(c.tensor.as_deref(), Some("x"), "{e}");
        assert!(e.to_string().contains("checksum mismatch"), "{e}");
    }
    // Tensor y (columns) is intact in every file and still loads.
    World::threads(2)
        .unwrap()
        .run(|rank| {
            Checkpoint::open(rank, &dir.0)?.load::<f32>("y", Placement::Shard(0))?;
            Ok(())
        })
        .unwrap();
}

#[test]
fn missing_truncated_and_malformed_files_are_typed_errors_on_every_rank() {
    let dir = Dir::new("files");
    three_rank_checkpoint(&dir.0);
    // A truncated file.
    let file = rank_file(&dir.0, 1);
    let len = std::fs::metadata(&file).unwrap().len();
    let full = std::fs::read(&file).unwrap();
    std::fs::write(&file, &full[..len as usize - 7]).unwrap();
    for e in load_errors(&dir.0, "x") {
        assert!(
            matches!(kind_of(&e), CheckpointErrorKind::Truncated { expected, found } if *expected == len && *found == len - 7),
            "{e}"
        );
    }
    // A missing file.
    std::fs::remove_file(&file).unwrap();
    for e in load_errors(&dir.0, "x") {
        assert!(matches!(kind_of(&e), CheckpointErrorKind::MissingFile), "{e}");
        assert!(e.to_string().contains("rank-00001"), "{e}");
    }
    std::fs::write(&file, &full).unwrap();
    // A tensor not in the index.
    for e in load_errors(&dir.0, "z") {
        assert!(matches!(kind_of(&e), CheckpointErrorKind::TensorNotFound), "{e}");
        assert!(e.to_string().contains("\"z\""), "{e}");
    }
    // A header replaced by garbage of the same length.
    let mut bad = full.clone();
    bad[8..40].fill(b'#');
    std::fs::write(&file, &bad).unwrap();
    for e in load_errors(&dir.0, "x") {
        assert!(matches!(kind_of(&e), CheckpointErrorKind::Malformed { .. }), "{e}");
    }
    std::fs::write(&file, &full).unwrap();
    // A malformed index, then none.
    let index = dir.0.join(checkpoint::INDEX_FILE);
    std::fs::write(&index, b"{ not json").unwrap();
    for e in load_errors(&dir.0, "x") {
        assert!(matches!(kind_of(&e), CheckpointErrorKind::Malformed { .. }), "{e}");
    }
    std::fs::remove_file(&index).unwrap();
    for e in load_errors(&dir.0, "x") {
        assert!(matches!(kind_of(&e), CheckpointErrorKind::NoIndex), "{e}");
    }
}

#[test]
fn ranks_saving_different_entries_disagree() {
    let dir = Dir::new("disagree");
    let g = values::<f32>(&[4, 4], 1);
    let errs = World::threads(2)
        .unwrap()
        .run(|rank| {
            let x = DistTensor::from_global(rank, &g, Placement::Shard(0))?;
            let name = if rank.rank() == 0 { "x" } else { "y" };
            Ok(checkpoint::save(rank, &dir.0, &[Entry::new(name, &x)?]).unwrap_err())
        })
        .unwrap();
    for e in errs {
        assert!(matches!(e, Error::RanksDisagree { .. }), "{e}");
    }
    // One name twice.
    let errs = World::threads(2)
        .unwrap()
        .run(|rank| {
            let x = DistTensor::from_global(rank, &g, Placement::Shard(0))?;
            let e = [Entry::new("x", &x)?, Entry::new("x", &x)?];
            Ok(checkpoint::save(rank, &dir.0, &e).unwrap_err())
        })
        .unwrap();
    for e in errs {
        assert!(
            matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("twice"),
            "{e}"
        );
    }
}

#[test]
fn replicas_that_differ_between_ranks_are_named_not_saved() {
    let dir = Dir::new("replicas");
    let same = values::<f32>(&[3, 5], 2);
    for world in [2, 3] {
        let errs = World::threads(world)
            .unwrap()
            .run(|rank| {
                // One replica equal everywhere, then one whose last rank's copy drifted by an ulp.
                let mut drifted = values::<f64>(&[7], 3);
                if rank.rank() == rank.num_ranks() - 1 {
                    let v = drifted.as_mut_slice();
                    v[6] = f64::from_bits(v[6].to_bits() + 1);
                }
                let a = DistTensor::from_local(rank, same.clone(), Placement::Replicate)?;
                let b = DistTensor::from_local(rank, drifted, Placement::Replicate)?;
                let e = [Entry::new("same", &a)?, Entry::new("drifted", &b)?];
                Ok(checkpoint::save(rank, &dir.0, &e).unwrap_err())
            })
            .unwrap();
        for e in errs {
            let Error::RanksDisagree { rank_b, value_a, .. } = &e else { panic!("{e}") };
            assert_eq!(*rank_b, world - 1, "{e}");
            assert!(value_a.contains("\"drifted\""), "{e}");
        }
        assert!(!dir.0.join(checkpoint::INDEX_FILE).exists(), "nothing is saved");
    }
}

// ---- bytes read ----------------------------------------------------------------------------

#[test]
fn a_slice_load_reads_about_the_slice() {
    // [512, 4096] f32 = 8 MiB, saved as 4 row slabs of 2 MiB (two checksum chunks each).
    let dir = Dir::new("bytes");
    let global = values::<f32>(&[512, 4096], 5);
    World::threads(4)
        .unwrap()
        .run(|rank| {
            let x = DistTensor::from_global(rank, &global, Placement::Shard(0))?;
            checkpoint::save(rank, &dir.0, &[Entry::new("x", &x)?])?;
            Ok(())
        })
        .unwrap();
    let mib = 1u64 << 20;
    for (world, want) in [(8, mib), (4, 2 * mib), (2, 4 * mib), (5, 2 * mib)] {
        let read = World::threads(world)
            .unwrap()
            .run(|rank| {
                let ck = Checkpoint::open(rank, &dir.0)?;
                let x = ck.load::<f32>("x", Placement::Shard(0))?;
                let part = (x.local().len() * 4) as u64;
                Ok((ck.bytes_read(), part))
            })
            .unwrap();
        for (r, &(got, part)) in read.iter().enumerate() {
            // At most the part rounded out to whole chunks at both ends.
            assert!(
                got >= part && got <= part + 2 * mib,
                "world {world} rank {r}: read {got} for a part of {part}"
            );
            if world != 5 {
                assert_eq!(got, want, "world {world} rank {r}");
            }
        }
    }
    // A plain safetensors file, loaded by columns: each rank copies its columns of every row.
    let file = dir.0.join("plain.safetensors");
    checkpoint::write_safetensors(&file, &[("x", &global)]).unwrap();
    let read = World::threads(4)
        .unwrap()
        .run(|rank| {
            let f = SafetensorsFile::open(rank, &file)?;
            let x = f.load::<f32>("x", Placement::Shard(1))?;
            assert_eq!(x.local().shape(), &[512, 1024]);
            Ok(f.bytes_read())
        })
        .unwrap();
    assert_eq!(read, vec![2 * mib; 4]);
}

// ---- a file written by Python's safetensors ------------------------------------------------

#[test]
fn a_file_written_by_python_safetensors_loads_sharded() {
    let probe =
        std::process::Command::new("python3").args(["-c", "import safetensors, numpy"]).output();
    match probe {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            eprintln!(
                "skipped: python3 cannot import safetensors and numpy ({}); `pip install safetensors numpy` runs it",
                String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("")
            );
            return;
        }
        Err(e) => {
            eprintln!("skipped: no python3 ({e})");
            return;
        }
    }
    let dir = Dir::new("python");
    std::fs::create_dir_all(&dir.0).unwrap();
    let file = dir.0.join("model.safetensors");
    // The values: i * 0.25 - 40 in row-major order, exact in f16, f32 and f64.
    let script = format!(
        "import numpy as np\nfrom safetensors.numpy import save_file\n\
         v = lambda shape, t: (np.arange(np.prod(shape)) * 0.25 - 40).astype(t).reshape(shape)\n\
         save_file({{'embed.weight': v((11, 6), np.float32), 'fc.weight': v((6, 9), np.float16), \
         'fc.bias': v((9,), np.float64)}}, {:?}, metadata={{'format': 'np'}})\n",
        file.to_str().unwrap()
    );
    let out = std::process::Command::new("python3").args(["-c", &script]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let want = |shape: &[usize]| -> Vec<f64> {
        (0..shape.iter().product::<usize>()).map(|i| i as f64 * 0.25 - 40.0).collect()
    };
    for world in [1, 3, 4] {
        World::threads(world)
            .unwrap()
            .run(|rank| {
                let f = SafetensorsFile::open(rank, &file)?;
                assert_eq!(f.names(), ["embed.weight", "fc.bias", "fc.weight"]);
                let e = f.load::<f32>("embed.weight", Placement::Shard(0))?.to_global()?;
                let w = f.load::<f16>(
                    "fc.weight",
                    Target::new(Placement::Shard(1)).split(Split::Units(3)),
                )?;
                let b = DistTensor::<f32>::from_safetensors(
                    rank,
                    &file,
                    "fc.bias",
                    Target::new(Placement::Shard(0)).convert_dtype(),
                )?;
                let as_f64 = |t: &Tensor<f32>| {
                    t.as_slice().iter().map(|&v| f64::from(v)).collect::<Vec<_>>()
                };
                assert_eq!(as_f64(&e), want(&[11, 6]));
                let w = w.to_global()?;
                assert_eq!(
                    w.as_slice().iter().map(|v| v.to_f64()).collect::<Vec<_>>(),
                    want(&[6, 9])
                );
                assert_eq!(as_f64(&b.to_global()?), want(&[9]));
                // f16 asked of an f32 tensor, without conversion: refused, naming the tensor.
                let err = f.load::<f16>("embed.weight", Placement::Replicate).unwrap_err();
                assert!(
                    matches!(kind_of(&err), CheckpointErrorKind::DtypeMismatch { .. }),
                    "{err}"
                );
                assert!(err.to_string().contains("embed.weight"), "{err}");
                Ok(())
            })
            .unwrap();
    }
}

// ---- process worlds, and crash safety ------------------------------------------------------

/// Where a process test's ranks find their directories.
const DIR_ENV: &str = "DIST_TENSOR_CKPT_TEST_DIR";

/// How long (µs) the killed rank waits before killing itself; unset in other jobs.
const KILL_ENV: &str = "DIST_TENSOR_CKPT_TEST_KILL_US";

/// Runs test `name` as `n` ranks with extra `env` (the shared launcher, which bounds every rank
/// by a timeout and checks that no process is left).
fn job(name: &str, n: usize, env: &[(&str, String)]) -> Vec<RankExit> {
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    run_job(name, n, &env)
}

/// The tensors of the process tests: 768 KiB each in f32 (a few checksum chunks per
/// rank), sharded on alternating dimensions.
fn big(i: usize) -> Tensor<f32> {
    values::<f32>(&[256, 768], 100 + i as u64)
}

fn save_big(world: &World, dir: &Path, seed_shift: usize, count: usize) -> dist_tensor::Result<()> {
    world.run(|rank| save_big_on(rank, dir, seed_shift, count)).map(|_| ())
}

/// [`save_big`] inside a run.
fn save_big_on(
    rank: &dist_tensor::Rank<'_>,
    dir: &Path,
    seed_shift: usize,
    count: usize,
) -> dist_tensor::Result<()> {
    let globals: Vec<Tensor<f32>> = (0..count).map(|i| big(i + seed_shift)).collect();
    let parts: Vec<DistTensor<'_, f32>> = globals
        .iter()
        .enumerate()
        .map(|(i, g)| DistTensor::from_global(rank, g, Placement::Shard(i % 2)))
        .collect::<dist_tensor::Result<_>>()?;
    let entries: Vec<Entry<'_>> = parts
        .iter()
        .enumerate()
        .map(|(i, p)| Entry::new(format!("t{i}"), p))
        .collect::<dist_tensor::Result<_>>()?;
    checkpoint::save(rank, dir, &entries)?;
    Ok(())
}

/// Which of the generations `seed_shift` the checkpoint in `dir` holds, loading every tensor on
/// 3 threads and comparing it with the reference; an error if it does not load.
fn which_checkpoint(dir: &Path, count: usize, shifts: &[usize]) -> dist_tensor::Result<usize> {
    let found = World::threads(3)?.run(|rank| {
        let ck = Checkpoint::open(rank, dir)?;
        let mut which = None;
        for i in 0..count {
            let t = ck.load::<f32>(&format!("t{i}"), Placement::Replicate)?.into_local();
            let s = shifts.iter().copied().find(|&s| same(&t, &big(i + s)));
            assert!(s.is_some(), "tensor t{i} of {} is neither checkpoint", dir.display());
            assert!(
                which.is_none() || which == s,
                "tensors of two saves mixed in {}",
                dir.display()
            );
            which = s;
        }
        Ok(which.unwrap())
    })?;
    Ok(found[0])
}

#[test]
fn processes_save_and_threads_and_processes_load() {
    if in_rank(|world| {
        let dir = PathBuf::from(std::env::var(DIR_ENV).unwrap());
        if world.num_ranks() == 4 {
            save_big(&world, &dir, 0, 3)?;
            return Ok("saved".into());
        }
        let sums = world.run(|rank| {
            let ck = Checkpoint::open(rank, &dir)?;
            let t = ck.load::<f32>("t1", Placement::Shard(0))?;
            let want = DistTensor::from_global(rank, &big(1), Placement::Shard(0))?;
            Ok(same(t.local(), want.local()))
        })?;
        Ok(format!("{}", sums[0]))
    }) {
        return;
    }
    let dir = Dir::new("procs");
    let env = [(DIR_ENV, dir.0.display().to_string())];
    for exit in job("processes_save_and_threads_and_processes_load", 4, &env) {
        assert_eq!(printed(&exit, "RESULT").as_deref(), Some("saved"), "{}", exit.stdout_text());
    }
    assert_eq!(which_checkpoint(&dir.0, 3, &[0]).unwrap(), 0);
    for exit in job("processes_save_and_threads_and_processes_load", 3, &env) {
        assert_eq!(printed(&exit, "RESULT").as_deref(), Some("true"), "{}", exit.stdout_text());
    }
}

#[test]
fn a_rank_killed_mid_save_leaves_the_last_good_checkpoint() {
    const COUNT: usize = 4;
    if in_rank(|world| {
        let base = PathBuf::from(std::env::var(DIR_ENV).unwrap());
        let kill_us: Option<u64> = std::env::var(KILL_ENV).ok().and_then(|v| v.parse().ok());
        // One run for everything, so that the timed kill lands inside the saves.
        let took = world.run(|rank| {
            // Every rank waits in a barrier while each other rank sleeps, so that each has
            // looked at (opened a pidfd of) every peer before the kill.
            for r in 0..rank.num_ranks() {
                if r == rank.rank() {
                    std::thread::sleep(Duration::from_millis(30));
                }
                let _ = rank.barrier_all()?;
            }
            if let Some(us) = kill_us
                && rank.rank() == 1
            {
                // SIGKILL to this rank at a point of the saves the test chose.
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_micros(us));
                    let pid = rustix::process::getpid();
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                });
            }
            let start = Instant::now();
            // A new checkpoint into a fresh directory, then over the good one.
            save_big_on(rank, &base.join("fresh"), 1, COUNT)?;
            save_big_on(rank, &base.join("same"), 1, COUNT)?;
            Ok(start.elapsed().as_micros())
        })?;
        Ok(format!("{}", took[0]))
    }) {
        return;
    }
    let name = "a_rank_killed_mid_save_leaves_the_last_good_checkpoint";
    let dir = Dir::new("crash");
    std::fs::create_dir_all(&dir.0).unwrap();
    let (fresh, same_dir) = (dir.0.join("fresh"), dir.0.join("same"));
    let env = |kill: Option<u64>| {
        let mut e = vec![(DIR_ENV, dir.0.display().to_string())];
        if let Some(us) = kill {
            e.push((KILL_ENV, us.to_string()));
        }
        e
    };
    // How long the two saves take undisturbed (the kills are spread over that).
    let reset = || {
        let _ = std::fs::remove_dir_all(&fresh);
        let _ = std::fs::remove_dir_all(&same_dir);
        save_big(&World::threads(3).unwrap(), &same_dir, 0, COUNT).unwrap(); // the good one
    };
    reset();
    let exits = job(name, 3, &env(None));
    let took: u64 =
        exits.iter().filter_map(|e| printed(e, "RESULT")?.parse().ok()).max().expect("a clean run");
    assert_eq!(which_checkpoint(&same_dir, COUNT, &[0, 1]).unwrap(), 1);
    let (mut partial, mut complete) = (0, 0);
    // Kills spread over both saves (the first, into the fresh directory, is the first half),
    // the first save more densely, with a seeded jitter. A save can run faster than the clean
    // run that timed it (warm caches, a quieter machine), so a kill that finds both saves done
    // halves the span the later kills are spread over.
    const AT_PERCENT: [u64; 6] = [2, 6, 10, 16, 40, 75];
    let (mut span, mut trials) = (took, 0);
    while trials < 6 || (partial == 0 && trials < 10) {
        reset();
        let t = trials;
        trials += 1;
        let at = span * AT_PERCENT[t % 6] / 100 + (t as u64 * 7919) % (span / 20 + 1);
        let exits = job(name, 3, &env(Some(at)));
        let killed = !exits[1].success() || printed(&exits[1], "RESULT").is_none();
        // The good checkpoint (or the new one, complete) loads in `same`, never a mixture.
        let in_same =
            which_checkpoint(&same_dir, COUNT, &[0, 1]).expect("the last good checkpoint loads");
        match which_checkpoint(&fresh, COUNT, &[1]) {
            Ok(_) => {
                complete += 1;
                if !killed {
                    span /= 2;
                }
            }
            Err(e) => {
                assert!(killed, "a save that was not killed did not finish: {e}");
                let inner = e_inner(&e);
                assert!(
                    matches!(kind_of(&inner), CheckpointErrorKind::NoIndex),
                    "the partial checkpoint: {e}"
                );
                assert!(inner.to_string().contains("did not finish"), "{inner}");
                assert_eq!(in_same, 0, "the second save cannot have finished before the first");
                partial += 1;
            }
        }
    }
    eprintln!(
        "{trials} kills over saves of {took} us (spread over the last {span} us): {partial} left a \
         partial checkpoint, {complete} a complete one"
    );
    assert!(
        partial > 0,
        "no kill landed inside a save ({complete} complete): the test checked nothing"
    );
}

/// The checkpoint error of a world's failure (a rank's error, or the world's wrapper of it).
fn e_inner(e: &Error) -> Error {
    match e {
        Error::Checkpoint(_) => e.clone(),
        other => other.rank_error().clone(),
    }
}

// ---- GPU worlds --------------------------------------------------------------------------------

/// This rank's part of `global` as `t` (loaded) is laid out, cut on the host.
fn expected_part<T: Element>(global: &Tensor<T>, t: &DistTensor<'_, T>, rank: usize) -> Tensor<T> {
    match t.placement() {
        Placement::Partial if rank != 0 => Tensor::zeros(global.shape()),
        Placement::Partial | Placement::Replicate => global.clone(),
        Placement::Shard(d) => {
            let sizes = t.shard_sizes();
            let start: usize = sizes[..rank].iter().sum();
            let part = global
                .view()
                .slice_axis(ndarray::Axis(d), ndarray::Slice::from(start..start + sizes[rank]))
                .to_owned();
            Tensor::from_shape_vec(part.shape(), part.iter().copied().collect()).unwrap()
        }
    }
}

/// Saves `global` from a GPU world in every placement (the parts on the GPUs), then loads it
/// into the GPU world (onto the GPUs) and into host worlds of 1 and 3 ranks, in every target.
fn cuda_round_trip<T: Element>(world: &World, global: &Tensor<T>) {
    let dir = Dir::new("cuda");
    let gpus = world.num_ranks();
    world
        .run(|rank| {
            let s0 = DistTensor::from_global(rank, global, Placement::Shard(0))?;
            let s1 = DistTensor::from_global_split(rank, global, 1, Split::Even)?;
            let rep = DistTensor::from_global(rank, global, Placement::Replicate)?;
            // Rank 0 holds the whole sum, the others zeros: exact in every type.
            let part =
                if rank.rank() == 0 { global.clone() } else { Tensor::zeros(global.shape()) };
            let partial = DistTensor::from_local(rank, part, Placement::Partial)?;
            for t in [&s0, &s1, &rep, &partial] {
                assert_ne!(t.local().device(), dist_tensor::Device::Host, "a part on the GPU");
            }
            let entries = [
                Entry::new("s0", &s0)?,
                Entry::new("s1", &s1)?,
                Entry::new("rep", &rep)?,
                Entry::new("partial", &partial)?,
            ];
            checkpoint::save(rank, &dir.0, &entries)?;
            Ok(())
        })
        .unwrap();
    let rows = global.shape()[0];
    let host_worlds = [World::threads(1).unwrap(), World::threads(3).unwrap()];
    for load in std::iter::once(world).chain(&host_worlds) {
        let on_gpu = std::ptr::eq(load, world);
        let n = load.num_ranks();
        load.run(|rank| {
            let ck = Checkpoint::open(rank, &dir.0)?;
            assert_eq!(ck.saved_world(), gpus);
            for name in ["s0", "s1", "rep", "partial"] {
                for target in targets(n, rows) {
                    let t = ck.load::<T>(name, target.clone())?;
                    assert_eq!(t.local().device() != dist_tensor::Device::Host, on_gpu);
                    let got = t.local().to_host()?;
                    assert!(
                        same(&got, &expected_part(global, &t, rank.rank())),
                        "{} {name} saved on {gpus} GPUs, loaded on {n} ranks (GPU {on_gpu}) as \
                         {target:?}: rank {} differs",
                        T::DTYPE,
                        rank.rank()
                    );
                    assert_eq!(t.global_dims(), global.shape());
                }
            }
            Ok(())
        })
        .unwrap();
    }
}

/// `cargo test --release --features cuda --test checkpoint -- --nocapture gpu`: skipped, saying
/// why, without a GPU.
#[test]
fn a_gpu_world_saves_and_loads_resharded_on_gpus_and_hosts() {
    let Some(world) =
        common::gpu::cuda_world("a_gpu_world_saves_and_loads_resharded_on_gpus_and_hosts", 2)
    else {
        return;
    };
    // 5 rows: uneven over 2 GPUs and 3 host ranks.
    cuda_round_trip(&world, &values::<f32>(&[5, 3], 11));
    cuda_round_trip(&world, &values::<bf16>(&[5, 3], 12));
    cuda_round_trip(&world, &values::<f64>(&[1, 4], 13));
}
