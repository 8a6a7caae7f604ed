//! Checks of a rank's results against f64 references built from every rank's inputs, for the
//! tests whose ranks are processes (`tests/processes.rs`, `tests/mpi.rs`): each rank regenerates
//! every rank's inputs with [`seeded`] (the same function of the rank everywhere) and computes
//! what its own results must be with ndarray and plain loops, none of it from the library. A
//! world of threads and a world of processes could share a bug; they cannot share these.

use dist_tensor::{Device, DistTensor, Element, Placement, Rank, Tensor};
use ndarray::{Array2, ArrayD, Axis, IxDyn, concatenate, s};

use super::{pieces, reference, seeded, tolerance, within};

/// What is wrong with `got` against the f64 reference `want`: entry by entry within
/// `tol * scale` (exact when `tol` is 0).
pub fn off(what: &str, got: &[f64], want: &[f64], scale: &[f64], tol: f64) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("{what}: {} values, want {}", got.len(), want.len()));
    }
    let bad = (0..got.len()).find(|&i| !within((got[i] - want[i]).abs(), tol * scale[i]))?;
    Some(format!("{what}: entry {bad} is {}, want {}", got[bad], want[bad]))
}

pub fn widen<T: Element>(values: &[T]) -> Vec<f64> {
    values.iter().map(|v| v.to_f64()).collect()
}

/// `seeded` of rank `r` as an f64 matrix of `rows x cols` (values rounded to `T` first).
pub fn seeded_matrix<T: Element>(r: usize, rows: usize, cols: usize, salt: usize) -> Array2<f64> {
    Array2::from_shape_vec((rows, cols), widen(&seeded::<T>(r, rows * cols, salt))).unwrap()
}

/// Rank `me`'s piece of `sum over ranks of seeded(r, len, salt)` (split as numpy.array_split,
/// or whole), with the scale `sum |v|`.
pub fn summed<T: Element>(
    n: usize,
    len: usize,
    salt: usize,
    piece: Option<usize>,
) -> [Vec<f64>; 2] {
    let (mut sum, mut scale) = (vec![0.0; len], vec![0.0; len]);
    for r in 0..n {
        for (i, v) in widen(&seeded::<T>(r, len, salt)).into_iter().enumerate() {
            sum[i] += v;
            scale[i] += v.abs();
        }
    }
    match piece {
        Some(me) => {
            let range = pieces(len, n)[me].clone();
            [sum[range.clone()].to_vec(), scale[range].to_vec()]
        }
        None => [sum, scale],
    }
}

/// Rank `r`'s Ulysses input of `shape` (`[B, s_r, H, D]`) for a case `salt`, as f64.
pub fn ulysses_input(r: usize, shape: [usize; 4], salt: usize) -> ArrayD<f64> {
    let len = shape.iter().product();
    ArrayD::from_shape_vec(IxDyn(&shape), widen(&seeded::<f32>(r, len, salt))).unwrap()
}

fn flat(a: Array2<f64>) -> Vec<f64> {
    a.iter().copied().collect()
}

/// The failures found, as text.
#[derive(Default)]
pub struct Checks {
    pub fails: Vec<String>,
}

impl Checks {
    /// `got` must be `want`, bit for bit (data movement).
    pub fn exact<T: Element>(&mut self, what: &str, got: &[T], want: Vec<f64>) {
        let zeros = vec![0.0; want.len()];
        self.fails.extend(off(what, &widen(got), &want, &zeros, 0.0));
    }

    /// `got` within `tol * scale` of `want`, entry by entry.
    pub fn close<T: Element>(
        &mut self,
        what: &str,
        got: &[T],
        [want, scale]: [Vec<f64>; 2],
        tol: f64,
    ) {
        self.fails.extend(off(what, &widen(got), &want, &scale, tol));
    }

    /// `concat(every rank's x) @ w_me`: rank `me`'s all_gather_matmul, each rank's `x` of
    /// `rows(r) x 64` (salt 9), `w` of `64 x 24` (salt 10).
    pub fn gathered_product<T: Element>(
        &mut self,
        what: &str,
        got: &[T],
        (me, n): (usize, usize),
        rows: impl Fn(usize) -> usize,
    ) {
        let xs: Vec<Array2<f64>> = (0..n).map(|r| seeded_matrix::<T>(r, rows(r), 64, 9)).collect();
        let views: Vec<_> = xs.iter().map(|x| x.view()).collect();
        let x = concatenate(Axis(0), &views).unwrap();
        let (want, scale) = reference::product(x.view(), seeded_matrix::<T>(me, 64, 24, 10).view());
        self.close(what, got, [flat(want), flat(scale)], tolerance::<T>(64));
    }

    /// Rank `me`'s rows (numpy.array_split of `m`) of `sum over ranks of h_r @ w_r`: the
    /// matmul_reduce_scatter of `h` of `m x k` (salt 11) and `w` of `k x nn` (salt 12).
    pub fn reduce_scattered_product<T: Element>(
        &mut self,
        what: &str,
        got: &[T],
        (me, n): (usize, usize),
        (m, k, nn): (usize, usize, usize),
    ) {
        let (mut want, mut scale) = (Array2::<f64>::zeros((m, nn)), Array2::<f64>::zeros((m, nn)));
        for r in 0..n {
            let (p, s) = reference::product(
                seeded_matrix::<T>(r, m, k, 11).view(),
                seeded_matrix::<T>(r, k, nn, 12).view(),
            );
            want += &p;
            scale += &s;
        }
        let rows = pieces(m, n)[me].clone();
        let mine = |a: &Array2<f64>| a.slice(s![rows.clone(), ..]).iter().copied().collect();
        self.close(what, got, [mine(&want), mine(&scale)], tolerance::<T>(k + n));
    }

    /// Rank `me`'s Ulysses all_to_all (`[B, s_r, H, D]` to `[B, S, h_r, D]`) of the inputs of
    /// `shape(r)` (salt `salt`).
    pub fn heads_all_to_all(
        &mut self,
        what: &str,
        got: &[f32],
        (me, n): (usize, usize),
        shape: impl Fn(usize) -> [usize; 4],
        salt: usize,
    ) {
        let inputs: Vec<ArrayD<f64>> = (0..n).map(|r| ulysses_input(r, shape(r), salt)).collect();
        let want = reference::heads_all_to_all(&inputs, me);
        self.exact(what, got, want.iter().copied().collect());
    }

    /// Runs the DistTensor MLP block of the batteries on `rank` and checks it with
    /// [`Checks::mlp_block`]: `x` of 29 x 16 (fewer rows than some worlds have ranks) sharded by
    /// rows, `w1` of 16 x 40 by columns and `w2` of 40 x 16 by rows, through all_gather_matmul
    /// then matmul_reduce_scatter, gathered whole. Returns `y` read on the host, and the device
    /// that held this rank's shard of `x`.
    pub fn run_mlp_block(
        &mut self,
        what: &str,
        rank: &Rank<'_>,
    ) -> dist_tensor::Result<(Tensor<f32>, Device)> {
        let x = Tensor::<f32>::random(&[29, 16], 1);
        let w1 = Tensor::<f32>::random(&[16, 40], 2);
        let w2 = Tensor::<f32>::random(&[40, 16], 3);
        let xs = DistTensor::from_global(rank, &x, Placement::Shard(0))?;
        let w1s = DistTensor::from_global(rank, &w1, Placement::Shard(1))?;
        let w2s = DistTensor::from_global(rank, &w2, Placement::Shard(0))?;
        let y = xs.all_gather_matmul(w1s.local())?.matmul_reduce_scatter(w2s.local())?;
        let y = y.to_global()?.to_host()?;
        self.mlp_block(what, &y, [&x, &w1, &w2], rank.num_ranks());
        Ok((y, xs.local().device()))
    }

    /// `(x @ w1) @ w2` of whole f32 tensors (the product rounds to f32 once in between, within
    /// `tolerance(16)` of `|x| @ |w1|`), as the DistTensor MLP block of the batteries gives it on
    /// `n` ranks.
    pub fn mlp_block(
        &mut self,
        what: &str,
        got: &Tensor<f32>,
        [x, w1, w2]: [&Tensor<f32>; 3],
        n: usize,
    ) {
        let m = |t: &Tensor<f32>| super::f64s(t).into_dimensionality::<ndarray::Ix2>().unwrap();
        let (h_want, h_scale) = reference::product(m(x).view(), m(w1).view());
        let (y_want, _) = reference::product(h_want.view(), m(w2).view());
        let (y_scale, _) = reference::product(h_scale.view(), m(w2).abs().view());
        let k = x.shape()[1];
        let tol = 2.0 * (tolerance::<f32>(k) + tolerance::<f32>(w1.shape()[1] + n));
        self.close(what, got.as_slice(), [flat(y_want), flat(y_scale)], tol);
    }
}
