//! Local math on `Tensor` beside what a user would write with ndarray alone, and the memory
//! ceiling.
//!
//! Groups are `<op>/<dtype>` on a `[1024, 1024]` tensor (4 MiB of f32), one thread (a rank's own):
//! `tensor` is this crate's method or operator, `ndarray` the same computation written with
//! ndarray (`&a + &b`, `mapv`, lanes), and `copy` a copy of the output's bytes (`to_owned` of the
//! input), the floor for any op that writes a new tensor. Each op should sit near `ndarray`
//! (the same loops) and within a small factor of `copy` for the streaming ops (`add`).

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use dist_tensor::{Element, Tensor};
use half::bf16;
use ndarray::{ArrayD, Axis};

const SHAPE: [usize; 2] = [1024, 1024];

fn inputs<T: Element>() -> (Tensor<T>, Tensor<T>, Tensor<T>) {
    (Tensor::random(&SHAPE, 1), Tensor::random(&SHAPE, 2), Tensor::random(&SHAPE[1..], 3))
}

fn add<T: Element>(c: &mut Criterion)
where
    for<'a> &'a ArrayD<T>: std::ops::Add<&'a ArrayD<T>, Output = ArrayD<T>>,
{
    let (a, b, row) = inputs::<T>();
    let (na, nb, nrow) = (a.to_array(), b.to_array(), row.to_array());
    let mut g = c.benchmark_group(format!("add/{}", T::DTYPE));
    g.throughput(Throughput::Bytes((3 * a.len() * size_of::<T>()) as u64));
    g.bench_function("tensor", |bench| bench.iter(|| black_box(&a + &b)));
    g.bench_function("ndarray", |bench| bench.iter(|| black_box(&na + &nb)));
    g.bench_function("tensor_broadcast_row", |bench| bench.iter(|| black_box(&a + &row)));
    g.bench_function("ndarray_broadcast_row", |bench| bench.iter(|| black_box(&na + &nrow)));
    g.bench_function("copy", |bench| bench.iter(|| black_box(na.to_owned())));
    g.finish();
}

fn activations(c: &mut Criterion) {
    let (a, _, _) = inputs::<f32>();
    let na = a.to_array();
    let mut g = c.benchmark_group("gelu_tanh/f32");
    g.throughput(Throughput::Bytes((2 * a.len() * 4) as u64));
    g.bench_function("tensor", |bench| bench.iter(|| black_box(a.gelu_tanh())));
    g.bench_function("ndarray", |bench| {
        bench.iter(|| {
            black_box(
                na.mapv(|x| 0.5 * x * (1.0 + (0.797_884_6 * (x + 0.044715 * x * x * x)).tanh())),
            )
        })
    });
    g.bench_function("copy", |bench| bench.iter(|| black_box(na.to_owned())));
    g.finish();

    let mut g = c.benchmark_group("softmax/f32");
    g.throughput(Throughput::Bytes((2 * a.len() * 4) as u64));
    g.bench_function("tensor", |bench| bench.iter(|| black_box(a.softmax(1).unwrap())));
    g.bench_function("ndarray", |bench| {
        bench.iter(|| {
            let mut out = na.clone();
            for mut lane in out.lanes_mut(Axis(1)) {
                let max = lane.fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                lane.mapv_inplace(|v| (v - max).exp());
                let sum = lane.sum();
                lane.mapv_inplace(|v| v / sum);
            }
            black_box(out)
        })
    });
    g.finish();

    let w = Tensor::<f32>::random(&SHAPE[1..], 4);
    let mut g = c.benchmark_group("rms_norm/f32");
    g.throughput(Throughput::Bytes((2 * a.len() * 4) as u64));
    g.bench_function("tensor", |bench| {
        bench.iter(|| black_box(a.rms_norm(Some(&w), 1e-5).unwrap()))
    });
    let nw = w.to_array();
    g.bench_function("ndarray", |bench| {
        bench.iter(|| {
            let ms = na.mapv(|v| v * v).mean_axis(Axis(1)).unwrap().insert_axis(Axis(1));
            black_box(&na / &ms.mapv(|m| (m + 1e-5).sqrt()) * &nw)
        })
    });
    g.finish();
}

fn benches(c: &mut Criterion) {
    add::<f32>(c);
    add::<bf16>(c);
    activations(c);
}

criterion_group!(tensor_math, benches);
criterion_main!(tensor_math);
