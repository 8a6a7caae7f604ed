//! What tracking costs: the forward pass of a transformer block's local math (a QKV product,
//! fused causal attention, the output product, RMS norm, a GELU MLP, a residual add) on
//! `Var`s, with the weights untracked (`Var::constant`: no tape) and tracked (`Var::param`:
//! every op records its backward function), against the same ops on plain `Tensor`s. One
//! thread, f32, 256 tokens, 256 features, 4 heads; median of 15 runs after a warm-up, the three
//! forms interleaved so that a slow moment of the machine hits all three alike.
//!
//! `cargo bench --bench autograd` prints the times and ratios.

use std::time::Instant;

use dist_tensor::autograd::Var;
use dist_tensor::tensor::scaled_dot_product_attention;
use dist_tensor::{Result, Tensor};

const S: usize = 256;
const E: usize = 256;
const H: usize = 4;

fn heads(x: &Tensor<f32>) -> Tensor<f32> {
    x.reshape(&[S, H, E / H]).unwrap().permute(&[1, 0, 2]).unwrap()
}

fn plain(x: &Tensor<f32>, w: &[Tensor<f32>]) -> Tensor<f32> {
    let h = x.rms_norm(Some(&w[4]), 1e-5).unwrap();
    let (q, k, v) = (h.matmul(&w[0]).unwrap(), h.matmul(&w[1]).unwrap(), h.matmul(&w[2]).unwrap());
    let o = scaled_dot_product_attention(&heads(&q), &heads(&k), &heads(&v), true).unwrap();
    let o = o.permute(&[1, 0, 2]).unwrap().reshape(&[S, E]).unwrap().matmul(&w[3]).unwrap();
    let x = x + &o;
    let m =
        x.rms_norm(Some(&w[4]), 1e-5).unwrap().matmul(&w[5]).unwrap().gelu().matmul(&w[6]).unwrap();
    x + &m
}

fn with_vars<'a>(x: &Var<'a, f32>, w: &[Var<'a, f32>]) -> Result<Var<'a, f32>> {
    let heads = |t: &Var<'a, f32>| t.reshape(&[S, H, E / H])?.permute(&[1, 0, 2]);
    let h = x.rms_norm(Some(&w[4]), 1e-5)?;
    let (q, k, v) = (h.matmul(&w[0])?, h.matmul(&w[1])?, h.matmul(&w[2])?);
    let o = heads(&q)?.scaled_dot_product_attention(&heads(&k)?, &heads(&v)?, true)?;
    let o = o.permute(&[1, 0, 2])?.reshape(&[S, E])?.matmul(&w[3])?;
    let x = x + &o;
    let m = x.rms_norm(Some(&w[4]), 1e-5)?.matmul(&w[5])?.gelu().matmul(&w[6])?;
    Ok(&x + &m)
}

fn main() {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    pool.install(|| {
        let x = Tensor::<f32>::random(&[S, E], 1);
        let shapes = [[E, E], [E, E], [E, E], [E, E], [1, E], [E, 4 * E], [4 * E, E]];
        let w: Vec<Tensor<f32>> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let t = Tensor::random(s, 2 + i as u64) * 0.05;
                if s[0] == 1 { t.reshape(&[E]).unwrap() } else { t }
            })
            .collect();
        let constants: Vec<Var<f32>> = w.iter().map(|t| Var::constant(t.clone())).collect();
        let params: Vec<Var<f32>> = w.iter().map(|t| Var::param(t.clone())).collect();
        let xv = Var::constant(x.clone());
        let mut times = [Vec::new(), Vec::new(), Vec::new()];
        for run in 0..16 {
            let t = Instant::now();
            drop(plain(&x, &w));
            let a = t.elapsed().as_secs_f64();
            let t = Instant::now();
            drop(with_vars(&xv, &constants).unwrap());
            let b = t.elapsed().as_secs_f64();
            let t = Instant::now();
            let y = with_vars(&xv, &params).unwrap();
            let c = t.elapsed().as_secs_f64();
            assert!(y.is_tracked());
            drop(y);
            if run > 0 {
                for (v, s) in times.iter_mut().zip([a, b, c]) {
                    v.push(s);
                }
            }
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let [a, b, c] = times.each_mut().map(median);
        println!("block forward, S={S} E={E} H={H} f32, one thread (median of 15):");
        println!("  Tensor ops:                 {:8.3} ms", a * 1e3);
        println!("  Var ops, nothing tracked:   {:8.3} ms  ({:.3} of Tensor)", b * 1e3, b / a);
        println!("  Var ops, weights tracked:   {:8.3} ms  ({:.3} of Tensor)", c * 1e3, c / a);
    });
}
