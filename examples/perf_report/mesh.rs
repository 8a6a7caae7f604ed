//! `perf_report --mesh`: a training step of the MLP of example 08 (forward, backward, gradients
//! averaged over `dp`, plain SGD) on a 2 x 2 mesh of threads beside the same step with tensor
//! parallelism over all 4 ranks (1 x 4) and data parallelism over all 4 (4 x 1); and, on the
//! 2 x 2 mesh, the part of the dp averaging that the backward pass does not hide: the step with
//! the averaging overlapped, minus the step without any averaging, beside the averaging alone
//! (after the backward pass). Medians over the repetitions; the ranks are threads of this host.

use std::time::Instant;

use dist_tensor::mesh::{DeviceMesh, data_parallel};
use dist_tensor::nn::{Activation, ColumnParallelLinear, Parameters, RowParallelLinear, mse_loss};
use dist_tensor::{DistTensor, Placement, Result, Split, Tensor, World};

/// How a step averages the gradients over dp.
#[derive(Clone, Copy, PartialEq)]
enum Averaging {
    /// In buckets during the backward pass.
    Overlapped,
    /// In the same buckets after it.
    After,
    /// Not at all (what the step costs without data parallelism's communication).
    Skipped,
}

/// Median seconds of a training step on a `dp x tp` mesh of 4 threads.
fn step_seconds(dp: usize, tp: usize, averaging: Averaging, reps: usize) -> Result<f64> {
    let (tokens, hidden, ffn) = (256, 256, 1024);
    let x = Tensor::<f32>::random(&[tokens, hidden], 1);
    let target = Tensor::<f32>::random(&[tokens, hidden], 2);
    let w1 = Tensor::<f32>::random(&[hidden, ffn], 3) * 0.06;
    let b1 = Tensor::<f32>::random(&[ffn], 4) * 0.1;
    let w2 = Tensor::<f32>::random(&[ffn, hidden], 5) * 0.03;
    let b2 = Tensor::<f32>::random(&[hidden], 6) * 0.1;
    let bucket = 256 << 10;
    let times = World::threads(dp * tp)?.run(|rank| {
        let mesh = DeviceMesh::new(rank, &[("dp", dp), ("tp", tp)])?;
        let (tpr, dpr) = (mesh.rank_of("tp")?, mesh.averager("dp")?);
        let mut fc1 = ColumnParallelLinear::from_global(&tpr, &w1, Some(&b1), Split::Even)?;
        let mut fc2 = RowParallelLinear::from_global(&tpr, &w2, Some(&b2), Split::Even)?;
        let share = tokens / dp;
        let rows = |t: &Tensor<f32>| {
            let at = mesh.coord("dp")? * share * hidden;
            Tensor::from_shape_vec(&[share, hidden], t.as_slice()[at..at + share * hidden].to_vec())
        };
        let xs = DistTensor::from_global(&tpr, &rows(&x)?, Placement::Shard(0))?;
        let ts = DistTensor::from_global(&tpr, &rows(&target)?, Placement::Shard(0))?;
        let mut times = Vec::with_capacity(reps);
        for _ in 0..reps + 1 {
            let _ = rank.barrier_all()?;
            let start = Instant::now();
            let (h, s1) = fc1.forward(&xs)?;
            let a = h.map_local(|t| Activation::Gelu.forward(t))?;
            let (y, s2) = fc2.forward(&a)?;
            let (_, dy) = mse_loss(&y, &ts)?;
            fc1.zero_grad();
            fc2.zero_grad();
            let pre = h.into_local();
            let backward = |buckets: &mut data_parallel::GradBuckets<f32>| {
                let da = fc2.backward(s2, &dy)?;
                fc2.parameters().into_iter().for_each(|p| buckets.ready(&p.grad().expect("grad")));
                let dh = da.try_map_local(|g| Activation::Gelu.backward(&pre, g))?;
                fc1.backward(s1, &dh)?;
                fc1.parameters().into_iter().for_each(|p| buckets.ready(&p.grad().expect("grad")));
                Ok(())
            };
            let grads = match averaging {
                Averaging::Overlapped => data_parallel::overlapped(&dpr, bucket, backward)?.1,
                _ => {
                    let mut local = data_parallel::GradBuckets::collect();
                    backward(&mut local)?;
                    let local = local.into_grads();
                    match averaging {
                        Averaging::After => data_parallel::all_reduce_mean(&dpr, bucket, &local)?,
                        _ => local,
                    }
                }
            };
            let mut params = fc2.parameters_mut();
            params.extend(fc1.parameters_mut());
            for (p, g) in params.into_iter().zip(&grads) {
                let stepped = p.value() - &(g * 1e-3);
                *p.value_mut() = stepped;
            }
            let _ = rank.barrier_all()?;
            times.push(start.elapsed().as_secs_f64());
        }
        times.remove(0); // the first step sizes the workspaces
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
    })?;
    Ok(times[0])
}

/// Prints the mesh rows.
pub fn main(quick: bool) -> Result<()> {
    let reps = if quick { 3 } else { 15 };
    println!(
        "training step of the MLP (256 tokens, 256 -> 1024 -> 256, f32) on 4 threads, median of \
         {reps} steps; load {}",
        super::measure::load_1min()
    );
    let mesh = step_seconds(2, 2, Averaging::Overlapped, reps)?;
    let tp = step_seconds(1, 4, Averaging::Overlapped, reps)?;
    let dp = step_seconds(4, 1, Averaging::Overlapped, reps)?;
    println!("mesh 2x2 (dp averaged during backward): {:8.3} ms", mesh * 1e3);
    println!("tp over 4 (1x4):                        {:8.3} ms", tp * 1e3);
    println!("dp over 4 (4x1, averaged during bwd):   {:8.3} ms", dp * 1e3);
    let after = step_seconds(2, 2, Averaging::After, reps)?;
    let none = step_seconds(2, 2, Averaging::Skipped, reps)?;
    let alone = after - none;
    let unhidden = mesh - none;
    println!(
        "2x2: dp averaging after the backward pass {:.3} ms; overlapped, the part not hidden \
         {:.3} ms ({:.0}% of it alone)",
        alone * 1e3,
        unhidden * 1e3,
        100.0 * unhidden / alone
    );
    Ok(())
}
