//! `ParallelMlp` adds fc1's bias and applies the activation as one op (on a GPU one pass each
//! way, the sum not stored). This runs the same MLP both ways in a world: as `ParallelMlp`, and
//! as its layers one by one (`ColumnParallelLinear` with its bias, the activation, then
//! `RowParallelLinear`; the backward pass through each in turn), and reports every output and
//! gradient whose bits differ. The two ways round the same sums in the same order, so the bits
//! must match; the f64 references of the MLP itself are other tests' (nn_layers, cuda_nn).

use dist_tensor::nn::{Activation, ColumnParallelLinear, Module, ParallelMlp, RowParallelLinear};
use dist_tensor::{DistTensor, Element, Placement, Result, Split, Tensor, World};

const ACTS: [Activation; 4] =
    [Activation::Gelu, Activation::GeluTanh, Activation::Silu, Activation::Relu];

/// Bits of a tensor, wherever it lives.
fn bits<T: Element>(t: &Tensor<T>) -> Result<Vec<f64>> {
    Ok(t.to_host()?.as_slice().iter().map(|v| v.to_f64()).collect())
}

/// The MLP `[tokens, hidden] -> ffn -> hidden` of `T` in `world` both ways, for every activation;
/// a line per output or gradient that differs (`what` names the world).
pub fn fused_matches_layers<T: Element>(
    world: &World,
    what: &str,
    (tokens, hidden, ffn): (usize, usize, usize),
) -> Result<Vec<String>> {
    let x = Tensor::<T>::random(&[tokens, hidden], 1) * T::from_f64(2.0);
    let dy = Tensor::<T>::random(&[tokens, hidden], 2);
    let w1 = Tensor::<T>::random(&[hidden, ffn], 3);
    let b1 = Tensor::<T>::random(&[ffn], 4);
    let w2 = Tensor::<T>::random(&[ffn, hidden], 5);
    let b2 = Tensor::<T>::random(&[hidden], 6);
    let mut fails = Vec::new();
    for act in ACTS {
        let lines = world.run(|rank| {
            let layers = || -> Result<_> {
                Ok((
                    ColumnParallelLinear::from_global(rank, &w1, Some(&b1), Split::Even)?,
                    RowParallelLinear::from_global(rank, &w2, Some(&b2), Split::Even)?,
                ))
            };
            let xs = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
            let dys = DistTensor::from_global(rank, &dy, Placement::Shard(0))?;
            // One by one.
            let (mut fc1, mut fc2) = layers()?;
            let (h, s1) = fc1.forward(&xs)?;
            let a = h.map_local(|t| act.forward(t))?;
            let (y, s2) = fc2.forward(&a)?;
            let da = fc2.backward(s2, &dys)?;
            let pre = h.local().clone();
            let dh = da.try_map_local(|g| act.backward(&pre, g))?;
            let dx = fc1.backward(s1, &dh)?;
            let mut want = vec![bits(y.local())?, bits(dx.local())?];
            for p in fc1.parameters().into_iter().chain(fc2.parameters()) {
                want.push(bits(&p.grad().expect("a gradient"))?);
            }
            // As ParallelMlp, forward (and inference) and backward.
            let (fc1, fc2) = layers()?;
            let mut mlp = ParallelMlp::from_layers(fc1, act, fc2);
            let inferred = mlp.infer(&xs)?;
            let (y2, saved) = mlp.forward(&xs)?;
            let dx2 = mlp.backward(saved, &dys)?;
            let mut got = vec![bits(y2.local())?, bits(dx2.local())?];
            for p in mlp.parameters() {
                got.push(bits(&p.grad().expect("a gradient"))?);
            }
            let names =
                ["y", "dx", "fc1.weight grad", "fc1.bias grad", "fc2.weight grad", "fc2.bias grad"];
            let mut lines = Vec::new();
            for ((name, g), w) in names.iter().zip(&got).zip(&want) {
                let differ = g.iter().zip(w).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                if differ > 0 || g.len() != w.len() {
                    lines.push(format!(
                        "{what} {act:?} {} rank {}: {name}: {differ} of {} elements differ",
                        T::DTYPE,
                        rank.rank(),
                        w.len()
                    ));
                }
            }
            let same =
                |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            if !same(&bits(inferred.local())?, &got[0]) {
                lines.push(format!("{what} {act:?} {}: infer differs from forward", T::DTYPE));
            }
            Ok(lines)
        })?;
        fails.extend(lines.into_iter().flatten());
    }
    Ok(fails)
}
