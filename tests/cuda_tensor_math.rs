//! Local math on a `Tensor` that lives on a GPU, computed there, against references computed in
//! f64 from the same inputs (already rounded to the element type), for every element type:
//! operators with broadcasting and scalars (every by-reference / by-value form), activations,
//! casts, softmax, sums and means, norms, permutations and batched products. NaN and infinities
//! propagate as on the host (checked against the host's own result). Shapes on purpose: length 1,
//! primes, empty dimensions, lengths that are not a multiple of a 16-byte vector, broadcasts of
//! every kind.
//!
//! Tolerances as in tests/tensor_math.rs: one final rounding to a half type plus `c` roundings
//! in the accumulator type, times the size of what was computed; a wrong broadcast, axis or
//! missing term is off by about a whole element.
//!
//! Without a GPU (or a build without `--features cuda`) each test prints that it was skipped and
//! why, and passes: `cargo test --release --features cuda --test cuda_tensor_math`.

use dist_tensor::nn::Activation;
use dist_tensor::{DType, Device, Element, Error, Tensor};
use half::{bf16, f16};
use ndarray::{ArrayD, Axis, IxDyn};

mod common;

use common::checks::{off, widen};
use common::{assert_none, f64s, reference, within};

const GPU: Device = Device::Cuda(0);

/// Whether a GPU is here; prints why not.
fn have_gpu(test: &str) -> bool {
    match dist_tensor::device::cuda::device_count() {
        Ok(n) if n > 0 => match Tensor::<f32>::zeros(&[1]).to_device(GPU) {
            Ok(_) => true,
            Err(e) => {
                println!("SKIPPED {test}: {e}");
                false
            }
        },
        Ok(_) => {
            println!("SKIPPED {test}: no GPU on this machine");
            false
        }
        Err(e) => {
            println!("SKIPPED {test}: {e}");
            false
        }
    }
}

fn gpu<T: Element>(t: &Tensor<T>) -> Tensor<T> {
    t.to_device(GPU).expect("upload")
}

/// `got` (on the GPU) is on the GPU and within `tol * scale` of `want`, entry by entry.
fn check<T: Element>(
    fails: &mut Vec<String>,
    what: &str,
    got: &Tensor<T>,
    want: &ArrayD<f64>,
    scale: &ArrayD<f64>,
    tol: f64,
) {
    let what = format!("{what} ({})", T::DTYPE);
    if got.device() != GPU {
        fails.push(format!("{what}: computed on {}, not the GPU", got.device()));
        return;
    }
    let host = got.to_host().expect("download");
    if host.shape() != want.shape() {
        fails.push(format!("{what}: shape {:?}, want {:?}", host.shape(), want.shape()));
        return;
    }
    // Below T's smallest normal a rounding is off by up to half the subnormal spacing, however
    // small the value (2.28882e-5 is the f16 nearest 2.29096e-5: 2.1e-8 from it, under half
    // the spacing 2^-24): that much is allowed on top of the relative bound.
    let floor = if tol > 0.0 { smallest_subnormal::<T>() / 2.0 / tol } else { 0.0 };
    let scale: Vec<f64> = scale.iter().map(|s| s.max(f64::MIN_POSITIVE) + floor).collect();
    let want: Vec<f64> = want.iter().copied().collect();
    fails.extend(off(&what, &widen(host.as_slice()), &want, &scale, tol));
}

/// The spacing of `T`'s values next to zero (its smallest positive subnormal).
fn smallest_subnormal<T: Element>() -> f64 {
    match T::DTYPE {
        DType::F64 => f64::from_bits(1),
        DType::F32 => f64::from(f32::from_bits(1)),
        DType::F16 => f16::from_bits(1).to_f64(),
        DType::BF16 => bf16::from_bits(1).to_f64(),
    }
}

/// The final rounding to `T` (half types only) plus `c` roundings in the accumulator type.
fn tol<T: Element>(c: f64) -> f64 {
    let acc = <T::Acc as Element>::EPSILON;
    let last = if T::DTYPE == <T::Acc as Element>::DTYPE { 0.0 } else { T::EPSILON / 2.0 };
    last + c * acc
}

fn abs(a: &ArrayD<f64>) -> ArrayD<f64> {
    a.mapv(f64::abs)
}

/// Every dtype through `f`, failures prefixed.
fn every_dtype(
    f: fn(&mut Vec<String>, usize),
    g: fn(&mut Vec<String>, usize),
    h: fn(&mut Vec<String>, usize),
    i: fn(&mut Vec<String>, usize),
) -> Vec<String> {
    let mut fails = Vec::new();
    for (k, run) in [f, g, h, i].into_iter().enumerate() {
        run(&mut fails, k);
    }
    fails
}

macro_rules! all_types {
    ($check:ident) => {
        every_dtype(
            |f, s| $check::<f32>(f, s as u64),
            |f, s| $check::<f64>(f, s as u64),
            |f, s| $check::<f16>(f, s as u64),
            |f, s| $check::<bf16>(f, s as u64),
        )
    };
}

// ---- operators ------------------------------------------------------------------------------

fn reference_op(a: &ArrayD<f64>, b: &ArrayD<f64>, op: char) -> ArrayD<f64> {
    match op {
        '+' => a + b,
        '-' => a - b,
        '*' => a * b,
        _ => a / b,
    }
}

fn apply<T: Element>(a: &Tensor<T>, b: &Tensor<T>, op: char, form: usize) -> Tensor<T> {
    let (x, y) = (a.clone(), b.clone());
    macro_rules! forms {
        ($sym:tt, $assign:tt) => {
            match form {
                0 => a $sym b,
                1 => x $sym b,
                2 => a $sym y,
                3 => x $sym y,
                _ => {
                    let mut x = x;
                    x $assign b;
                    x
                }
            }
        };
    }
    match op {
        '+' => forms!(+, +=),
        '-' => forms!(-, -=),
        '*' => forms!(*, *=),
        _ => forms!(/, /=),
    }
}

fn check_operators<T: Element>(fails: &mut Vec<String>, seed: u64) {
    // [4099]: several 16-byte vectors a thread, and a tail. The last three walk 16-byte vectors
    // of the output (a row-broadcast bias, a broadcast column, a broadcast leading dimension);
    // the other broadcasts element by element.
    let pairs: [(&[usize], &[usize]); 11] = [
        (&[1], &[1]),
        (&[13, 17], &[13, 17]),
        (&[4099], &[4099]),
        (&[2, 3], &[3]),
        (&[3, 1, 5], &[4, 1]),
        (&[7, 1], &[1, 11]),
        (&[0, 3], &[3]),
        (&[5, 2, 3], &[5, 1, 3]),
        (&[7, 48], &[48]),
        (&[3, 5, 16], &[5, 1]),
        (&[1, 3, 8], &[4, 3, 8]),
    ];
    for (i, (sa, sb)) in pairs.into_iter().enumerate() {
        let a = Tensor::<T>::random(sa, seed * 100 + i as u64);
        let b = Tensor::<T>::random(sb, seed * 100 + 50 + i as u64);
        let (da, db) = (gpu(&a), gpu(&b));
        for op in ['+', '-', '*', '/'] {
            let want = reference_op(&f64s(&a), &f64s(&b), op);
            // One rounding of the exact result: relative to the result itself.
            let scale = abs(&want);
            // Assigning forms only where the result has the left side's shape.
            let forms = if want.shape() == sa { 5 } else { 4 };
            for form in 0..forms {
                let got = apply(&da, &db, op, form);
                check(
                    fails,
                    &format!("{sa:?} {op} {sb:?} form {form}"),
                    &got,
                    &want,
                    &scale,
                    tol::<T>(1.0),
                );
            }
        }
    }
    // Scalars on either side.
    let a = Tensor::<T>::random(&[6, 35], seed + 7);
    let da = gpu(&a);
    let s = T::from_f64(0.375);
    let x = f64s(&a);
    let cases: [(&str, Tensor<T>, ArrayD<f64>); 6] = [
        ("t + s", &da + s, x.mapv(|v| v + 0.375)),
        ("t - s", da.clone() - s, x.mapv(|v| v - 0.375)),
        ("t * s", &da * s, x.mapv(|v| v * 0.375)),
        (
            "t / s",
            {
                let mut t = da.clone();
                t /= s;
                t
            },
            x.mapv(|v| v / 0.375),
        ),
        ("-t", -&da, x.mapv(|v| -v)),
        ("-(owned t)", -(da.clone()), x.mapv(|v| -v)),
    ];
    for (what, got, want) in cases {
        let scale = abs(&want);
        check(fails, what, &got, &want, &scale, tol::<T>(1.0));
    }
}

macro_rules! scalar_left {
    ($fails:expr, $t:ty) => {{
        let a = Tensor::<$t>::random(&[3, 41], 3);
        let da = gpu(&a);
        let s = <$t as Element>::from_f64(0.625);
        let x = f64s(&a);
        let cases: [(&str, Tensor<$t>, ArrayD<f64>); 4] = [
            ("s + t", s + &da, x.mapv(|v| 0.625 + v)),
            ("s - t", s - &da, x.mapv(|v| 0.625 - v)),
            ("s * t", s * da.clone(), x.mapv(|v| 0.625 * v)),
            ("s / t", s / da.clone(), x.mapv(|v| 0.625 / v)),
        ];
        for (what, got, want) in cases {
            let scale = abs(&want);
            check($fails, what, &got, &want, &scale, tol::<$t>(1.0));
        }
    }};
}

#[test]
fn operators_with_tensors_and_scalars_broadcast_on_the_gpu_in_every_type() {
    if !have_gpu("operators") {
        return;
    }
    let mut fails = all_types!(check_operators);
    scalar_left!(&mut fails, f32);
    scalar_left!(&mut fails, f64);
    scalar_left!(&mut fails, f16);
    scalar_left!(&mut fails, bf16);
    assert_none(fails);
}

// ---- activations ----------------------------------------------------------------------------

fn check_activations<T: Element>(fails: &mut Vec<String>, seed: u64) {
    for shape in [&[1][..], &[13, 17], &[1031], &[70001], &[2, 0]] {
        // Values in [-4, 4): every branch of every activation.
        let a = Tensor::<T>::from_array(
            f64s(&Tensor::<T>::random(shape, seed + 3)).mapv(|v| T::from_f64(4.0 * v)),
        );
        let da = gpu(&a);
        let x = f64s(&a);
        for (act, got) in [
            (Activation::Gelu, da.gelu()),
            (Activation::GeluTanh, da.gelu_tanh()),
            (Activation::Silu, da.silu()),
            (Activation::Relu, da.relu()),
        ] {
            let want = x.mapv(|v| reference::activation(act, v));
            // exp / tanh / erf within a few ulp of the accumulator type, scaled by |x| (the
            // activations are x times a factor in [0, 1.2]).
            let scale = x.mapv(|v| v.abs() + 1e-30);
            check(fails, &format!("{act:?} {shape:?}"), &got, &want, &scale, tol::<T>(16.0));
        }
    }
}

#[test]
fn activations_on_the_gpu_match_f64_in_every_type() {
    if !have_gpu("activations") {
        return;
    }
    assert_none(all_types!(check_activations));
}

/// NaN and infinities give what the host gives, op by op.
fn check_specials<T: Element>(fails: &mut Vec<String>, _seed: u64) {
    let values = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0, -1.5, 2.0, 1e30, -0.0];
    let a = Tensor::<T>::from_shape_vec(&[2, 4], values.iter().map(|&v| T::from_f64(v)).collect())
        .unwrap();
    let da = gpu(&a);
    let b = Tensor::<T>::from_shape_vec(
        &[4],
        [1.0, f64::NAN, 0.0, f64::INFINITY].map(T::from_f64).to_vec(),
    )
    .unwrap();
    let db = gpu(&b);
    let cases: Vec<(&str, Tensor<T>, Tensor<T>)> = vec![
        ("a + b", &da + &db, &a + &b),
        ("a / b", &da / &db, &a / &b),
        ("a * 0", &da * T::zero(), &a * T::zero()),
        ("gelu", da.gelu(), a.gelu()),
        ("gelu_tanh", da.gelu_tanh(), a.gelu_tanh()),
        ("silu", da.silu(), a.silu()),
        ("relu", da.relu(), a.relu()),
        ("softmax 1", da.softmax(1).unwrap(), a.softmax(1).unwrap()),
        ("sum_axis 0", da.sum_axis(0).unwrap(), a.sum_axis(0).unwrap()),
        ("rms_norm", da.rms_norm(None, 1e-5).unwrap(), a.rms_norm(None, 1e-5).unwrap()),
    ];
    for (what, got, host) in cases {
        let got = got.to_host().unwrap();
        for (i, (g, h)) in got.as_slice().iter().zip(host.as_slice()).enumerate() {
            let (g, h) = (g.to_f64(), h.to_f64());
            let same = (g.is_nan() && h.is_nan())
                || (g.is_infinite() && g == h)
                || (g.is_finite() && h.is_finite());
            if !same {
                fails.push(format!(
                    "{what} ({}): entry {i} is {g} on the GPU, {h} on the host",
                    T::DTYPE
                ));
            }
        }
    }
    // A softmax lane that is all -inf is NaN; a -inf entry among finite ones is 0.
    let masked = Tensor::<T>::from_shape_vec(
        &[2, 3],
        [0.0, 0.0, f64::NEG_INFINITY, f64::NEG_INFINITY, f64::NEG_INFINITY, f64::NEG_INFINITY]
            .map(T::from_f64)
            .to_vec(),
    )
    .unwrap();
    let got = widen(gpu(&masked).softmax(1).unwrap().to_host().unwrap().as_slice());
    if got[..3] != [0.5, 0.5, 0.0] || !got[3..].iter().all(|v| v.is_nan()) {
        fails.push(format!("masked softmax ({}): {got:?}", T::DTYPE));
    }
}

#[test]
fn nan_and_infinities_propagate_on_the_gpu_as_on_the_host() {
    if !have_gpu("specials") {
        return;
    }
    assert_none(all_types!(check_specials));
}

// ---- casts ----------------------------------------------------------------------------------

fn cast_to<T: Element, U: Element>(fails: &mut Vec<String>, a: &Tensor<T>) {
    let got = gpu(a).cast::<U>();
    // Rounded once from the exact value: what U::from_f64 gives, bit for bit.
    let want = f64s(a).mapv(|v| U::from_f64(v).to_f64());
    let zeros = want.mapv(|_| 0.0);
    check(fails, &format!("cast {} -> {}", T::DTYPE, U::DTYPE), &got, &want, &zeros, 0.0);
}

fn check_casts<T: Element>(fails: &mut Vec<String>, seed: u64) {
    // Values of every magnitude an f16 holds, and some it does not.
    let a = Tensor::<T>::from_array(
        f64s(&Tensor::<f64>::random(&[17, 19], seed + 11)).mapv(|v| T::from_f64(v * 1000.0)),
    );
    // Also many blocks of the cast's walk, and a tail of fewer than a step (69077 elements: not
    // a multiple of 8, 4 or 2).
    let long = Tensor::<T>::from_array(
        f64s(&Tensor::<f64>::random(&[1031, 67], seed + 12)).mapv(|v| T::from_f64(v * 1000.0)),
    );
    for t in [&a, &long] {
        cast_to::<T, f32>(fails, t);
        cast_to::<T, f64>(fails, t);
        cast_to::<T, f16>(fails, t);
        cast_to::<T, bf16>(fails, t);
    }
    cast_to::<T, f32>(fails, &Tensor::<T>::zeros(&[0, 5]));
}

#[test]
fn casts_on_the_gpu_round_once_like_the_host_between_every_pair_of_types() {
    if !have_gpu("casts") {
        return;
    }
    assert_none(all_types!(check_casts));
}

// ---- softmax, sums, norms -------------------------------------------------------------------

fn check_softmax<T: Element>(fails: &mut Vec<String>, seed: u64) {
    // Rows kept in registers, read element by element (7, 1031) or in 16-byte vectors (2048),
    // and rows longer than the registers hold (8200: the two-read form).
    for (shape, axes) in [
        (&[3, 5, 7][..], &[0, 1, 2][..]),
        (&[4, 1031], &[1]),
        (&[3, 2048], &[1]),
        (&[2, 8200], &[1]),
        (&[1], &[0]),
        (&[2, 0, 3], &[1, 2]),
    ] {
        let a = Tensor::<T>::random(shape, seed + 21);
        let da = gpu(&a);
        let x = f64s(&a);
        for &axis in axes {
            let mut want = x.clone();
            for mut lane in want.lanes_mut(Axis(axis)) {
                let v: Vec<f64> = lane.iter().copied().collect();
                for (o, s) in lane.iter_mut().zip(reference::softmax(&v)) {
                    *o = s;
                }
            }
            let n = shape[axis] as f64;
            let scale = abs(&want);
            let got = da.softmax(axis).unwrap();
            check(
                fails,
                &format!("softmax {shape:?} axis {axis}"),
                &got,
                &want,
                &scale,
                tol::<T>(n + 16.0),
            );
        }
    }
    if !matches!(gpu(&Tensor::<T>::zeros(&[2])).softmax(1), Err(Error::DimOutOfRange { .. })) {
        fails.push("softmax of a missing axis is not DimOutOfRange".into());
    }
}

#[test]
fn softmax_on_the_gpu_over_every_axis_matches_f64() {
    if !have_gpu("softmax") {
        return;
    }
    assert_none(all_types!(check_softmax));
}

fn check_sums<T: Element>(fails: &mut Vec<String>, seed: u64) {
    // [16385] and [7, 40009] are over 16 Ki elements: whole sums of two passes (a partial per
    // chunk of 16 Ki, the last chunk 1 element long, then 18 chunks, the last one part full).
    // Sums over a leading axis run in two passes too: [1031, 3] and [613, 67] in 17 and 10
    // chunks of rows, 67 columns in 3 tiles of 32 lanes, the last one part full. Where the
    // lanes are whole 16-byte vectors a thread adds a vector of lanes: [1031, 24], [613, 520]
    // (520 lanes: 3 tiles of 256 bf16 lanes, the last part full) and [5, 9, 16] over axes 0 and 1.
    let shapes: [&[usize]; 10] = [
        &[3, 5, 7],
        &[1],
        &[2, 0, 3],
        &[1031, 3],
        &[613, 67],
        &[16385],
        &[7, 40009],
        &[1031, 24],
        &[613, 520],
        &[5, 9, 16],
    ];
    for shape in shapes {
        let a = Tensor::<T>::random(shape, seed + 31);
        let da = gpu(&a);
        let x = f64s(&a);
        for axis in 0..shape.len() {
            let n = shape[axis] as f64;
            let want = x.sum_axis(Axis(axis));
            let scale = abs(&x).sum_axis(Axis(axis));
            check(
                fails,
                &format!("sum_axis {shape:?} {axis}"),
                &da.sum_axis(axis).unwrap(),
                &want,
                &scale,
                tol::<T>(n + 1.0),
            );
            let mean = want.mapv(|v| v / n);
            let mscale = scale.mapv(|v| v / n);
            if n > 0.0 {
                check(
                    fails,
                    &format!("mean_axis {shape:?} {axis}"),
                    &da.mean_axis(axis).unwrap(),
                    &mean,
                    &mscale,
                    tol::<T>(n + 2.0),
                );
            }
        }
        let (sum, total) = (x.sum(), abs(&x).sum());
        let len = x.len() as f64;
        let got = da.sum().to_f64();
        if !within((got - sum).abs(), tol::<T>(len + 1.0) * total.max(f64::MIN_POSITIVE)) {
            fails.push(format!("sum {shape:?} ({}): {got}, want {sum}", T::DTYPE));
        }
        if len > 0.0 {
            let got = da.mean().to_f64();
            if !within(
                (got - sum / len).abs(),
                tol::<T>(len + 2.0) * (total / len).max(f64::MIN_POSITIVE),
            ) {
                fails.push(format!("mean {shape:?} ({}): {got}, want {}", T::DTYPE, sum / len));
            }
        }
    }
}

#[test]
fn sums_and_means_on_the_gpu_match_f64() {
    if !have_gpu("sums") {
        return;
    }
    assert_none(all_types!(check_sums));
}

fn check_norms<T: Element>(fails: &mut Vec<String>, seed: u64) {
    // 2048: rows in registers read in 16-byte vectors; 8200: longer than the registers hold.
    for shape in [&[5, 33][..], &[1, 1], &[2, 3, 1030], &[3, 2048], &[2, 8200], &[0, 4]] {
        let n = *shape.last().unwrap();
        let a = Tensor::<T>::random(shape, seed + 41);
        let w = Tensor::<T>::random(&[n], seed + 42);
        let b = Tensor::<T>::random(&[n], seed + 43);
        let (da, dw, db) = (gpu(&a), gpu(&w), gpu(&b));
        let x = f64s(&a);
        let (wv, bv) = (f64s(&w), f64s(&b));
        let eps = 1e-5;
        let rows = x.len() / n.max(1);
        let flat = x.to_shape((rows, n)).unwrap().to_owned();
        let mut rms = flat.clone();
        let mut layer = flat.clone();
        // Each layer_norm entry's size, what its roundings are relative to (as in
        // tests/tensor_math.rs): |x - mean| / sigma * |w| + |b| bounded by its terms' sizes.
        let mut layer_scale = flat.clone();
        for (r, row) in flat.rows().into_iter().enumerate() {
            let ms = row.iter().map(|v| v * v).sum::<f64>() / n as f64;
            let mean = row.sum() / n as f64;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n as f64;
            let inv = 1.0 / (var + eps).sqrt();
            for j in 0..n {
                rms[[r, j]] = row[j] / (ms + eps).sqrt() * wv[j];
                layer[[r, j]] = (row[j] - mean) * inv * wv[j] + bv[j];
                layer_scale[[r, j]] = (row[j].abs() + mean.abs()) * inv * wv[j].abs() + bv[j].abs();
            }
        }
        let rms = rms.into_shape_with_order(IxDyn(shape)).unwrap();
        let layer = layer.into_shape_with_order(IxDyn(shape)).unwrap();
        // Normalized values are about 1: an absolute bound of n + 16 roundings, relative to
        // the entry itself where it is larger (the final rounding to a half type is relative
        // to the entry: a layer_norm entry of 2.2 in bf16 may be off by half of 2^-6).
        let ones = rms.mapv(|v| v.abs().max(1.0));
        let layer_ones =
            layer_scale.mapv(|v| v.max(1.0)).into_shape_with_order(IxDyn(shape)).unwrap();
        let c = n as f64 + 16.0;
        check(
            fails,
            &format!("rms_norm {shape:?}"),
            &da.rms_norm(Some(&dw), eps).unwrap(),
            &rms,
            &ones,
            tol::<T>(c),
        );
        check(
            fails,
            &format!("layer_norm {shape:?}"),
            &da.layer_norm(Some(&dw), Some(&db), eps).unwrap(),
            &layer,
            &layer_ones,
            tol::<T>(c),
        );
    }
    // A parameter on the host beside a GPU input is an error, not ignored.
    let a = gpu(&Tensor::<T>::random(&[2, 3], 1));
    if !matches!(
        a.rms_norm(Some(&Tensor::<T>::random(&[3], 2)), 1e-5),
        Err(Error::InvalidArgument { .. })
    ) {
        fails.push(format!("rms_norm with a host weight ({}) is not InvalidArgument", T::DTYPE));
    }
}

#[test]
fn rms_and_layer_norms_on_the_gpu_match_f64() {
    if !have_gpu("norms") {
        return;
    }
    assert_none(all_types!(check_norms));
}

// ---- layout and products --------------------------------------------------------------------

fn check_layout<T: Element>(fails: &mut Vec<String>, seed: u64) {
    let a = Tensor::<T>::random(&[2, 3, 4], seed + 51);
    let da = gpu(&a);
    for axes in [[0, 1, 2], [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]] {
        let want = f64s(&a).permuted_axes(IxDyn(&axes)).as_standard_layout().into_owned();
        let zeros = want.mapv(|_| 0.0);
        check(fails, &format!("permute {axes:?}"), &da.permute(&axes).unwrap(), &want, &zeros, 0.0);
    }
    // The tiled transpose: tiles cut at the edges, batches, and a 2-D matrix.
    for (shape, x, y) in [
        (&[3, 37, 45][..], 1, 2),
        (&[33, 65], 0, 1),
        (&[2, 67, 130], 1, 2),
        (&[2, 66, 130], 1, 2),
        (&[1, 1], 0, 1),
        (&[4, 1, 7], 1, 2),
        (&[2, 0, 5], 1, 2),
    ] {
        let a = Tensor::<T>::random(shape, seed + 52);
        let mut want = f64s(&a);
        want.swap_axes(x, y);
        let want = want.as_standard_layout().into_owned();
        let zeros = want.mapv(|_| 0.0);
        check(
            fails,
            &format!("transpose {shape:?} {x} {y}"),
            &gpu(&a).transpose(x, y).unwrap(),
            &want,
            &zeros,
            0.0,
        );
    }
    let r = da.reshape(&[4, 6]).unwrap().insert_axis(1).unwrap();
    let want = f64s(&a).into_shape_with_order(IxDyn(&[4, 1, 6])).unwrap();
    let zeros = want.mapv(|_| 0.0);
    check(fails, "reshape + insert_axis", &r, &want, &zeros, 0.0);
}

#[test]
fn permutes_transposes_and_reshapes_on_the_gpu_move_every_element() {
    if !have_gpu("layout") {
        return;
    }
    assert_none(all_types!(check_layout));
}

/// `a @ b` with the batch dimensions broadcast, each matrix by `reference::product` (f64):
/// the product and its scale `|a| @ |b|`.
fn batched_reference(a: &ArrayD<f64>, b: &ArrayD<f64>) -> (ArrayD<f64>, ArrayD<f64>) {
    let (sa, sb) = (a.shape(), b.shape());
    let (m, k, n) = (sa[sa.len() - 2], sa[sa.len() - 1], sb[sb.len() - 1]);
    let nd = (sa.len().max(sb.len())) - 2;
    let dim = |s: &[usize], i: usize| {
        let lead = s.len() - 2;
        if i + lead < nd { 1 } else { s[i + lead - nd] }
    };
    // numpy's rule: a dimension of 1 takes the other's length (0 included).
    let batch: Vec<usize> =
        (0..nd).map(|i| if dim(sa, i) == 1 { dim(sb, i) } else { dim(sa, i) }).collect();
    let full = |last: [usize; 2]| batch.iter().copied().chain(last).collect::<Vec<_>>();
    let va = a.broadcast(IxDyn(&full([m, k]))).unwrap();
    let vb = b.broadcast(IxDyn(&full([k, n]))).unwrap();
    let count: usize = batch.iter().product();
    let va = va.to_shape((count, m, k)).unwrap();
    let vb = vb.to_shape((count, k, n)).unwrap();
    let (mut out, mut scale) = (Vec::new(), Vec::new());
    for i in 0..count {
        let (p, s) = reference::product(va.index_axis(Axis(0), i), vb.index_axis(Axis(0), i));
        out.extend(p.iter().copied());
        scale.extend(s.iter().copied());
    }
    let shape = full([m, n]);
    (
        ArrayD::from_shape_vec(IxDyn(&shape), out).unwrap(),
        ArrayD::from_shape_vec(IxDyn(&shape), scale).unwrap(),
    )
}

fn check_matmul<T: Element>(fails: &mut Vec<String>, seed: u64) {
    // Batches of one stride per operand (one strided-batched call, a broadcast operand at
    // stride 0), and broadcasts that need one call per outer index ([2, 1] against [3]); odd
    // matrix sizes, so that the products after the first start at odd addresses in f16 / bf16.
    let cases: [(&[usize], &[usize]); 8] = [
        (&[3, 5, 7], &[7, 4]),
        (&[2, 1, 5, 7], &[3, 7, 4]),
        (&[6, 1], &[1, 9]),
        (&[4, 3, 2], &[4, 2, 1]),
        (&[5, 3, 3], &[5, 3, 1]),
        (&[2, 4, 1, 3, 5], &[1, 4, 2, 5, 3]),
        (&[1, 1, 2, 3], &[7, 3, 2]),
        (&[0, 2, 3], &[3, 4]),
    ];
    for (sa, sb) in cases {
        let a = Tensor::<T>::random(sa, seed + 61);
        let b = Tensor::<T>::random(sb, seed + 62);
        let (want, scale) = batched_reference(&f64s(&a), &f64s(&b));
        let k = sa[sa.len() - 1] as f64;
        let got = gpu(&a).matmul(&gpu(&b)).unwrap();
        check(fails, &format!("matmul {sa:?} @ {sb:?}"), &got, &want, &scale, tol::<T>(k + 1.0));
    }
}

#[test]
fn batched_matmul_on_the_gpu_broadcasts_batch_dimensions() {
    if !have_gpu("matmul") {
        return;
    }
    assert_none(all_types!(check_matmul));
}

// ---- closures -------------------------------------------------------------------------------

#[test]
fn closures_on_a_gpu_tensor_are_a_typed_error_naming_the_gpu_methods() {
    if !have_gpu("closures") {
        return;
    }
    let a = gpu(&Tensor::<f32>::random(&[3], 1));
    let mut b = a.clone();
    let in_place = b.try_map_inplace(|x| x * 2.0).err();
    assert_eq!(b.to_host().unwrap(), a.to_host().unwrap(), "a failed map leaves the tensor");
    for err in [a.try_map(|x| x * 2.0).err(), a.zip_map(&a, |x, y| x + y).err(), in_place] {
        match err {
            Some(e @ Error::DeviceUnavailable { .. }) => {
                assert!(e.to_string().contains("gelu") && e.to_string().contains("to_host"), "{e}")
            }
            other => panic!("a closure on a GPU tensor gave {other:?}"),
        }
    }
    let zeros = a.zeros_like(&[2, 5]).unwrap();
    assert_eq!(zeros.device(), GPU);
    assert_eq!(zeros.to_host().unwrap(), Tensor::<f32>::zeros(&[2, 5]));
}

/// `try_sum` / `try_mean` of a GPU tensor: the GPU's total, against f64 sums of the same values
/// (the accumulator type's rounding over `len` terms, then one rounding to `T`).
fn fallible_totals<T: Element>(fails: &mut Vec<String>) {
    for len in [1, 7, 1031] {
        let x = Tensor::<T>::random(&[len], 5);
        let d = gpu(&x);
        let sum: f64 = widen(x.as_slice()).iter().sum();
        let abs: f64 = widen(x.as_slice()).iter().map(|v| v.abs()).sum();
        let acc = if T::DTYPE == DType::F64 { f64::EPSILON } else { f32::EPSILON as f64 };
        let bound = |total: f64| 2.0 * T::EPSILON * total.abs() + len as f64 * acc * abs;
        let (got_sum, got_mean) = (d.try_sum().unwrap().to_f64(), d.try_mean().unwrap().to_f64());
        if !within((got_sum - sum).abs(), bound(sum)) {
            fails.push(format!("try_sum {} [{len}]: {got_sum}, want {sum}", T::DTYPE));
        }
        let mean = sum / len as f64;
        if !within((got_mean - mean).abs(), bound(mean) / len as f64 + T::EPSILON * mean.abs()) {
            fails.push(format!("try_mean {} [{len}]: {got_mean}, want {mean}", T::DTYPE));
        }
        if d.sum().to_f64() != got_sum {
            fails.push(format!("sum and try_sum differ on the GPU in {}", T::DTYPE));
        }
    }
}

#[test]
fn fallible_sums_and_means_of_a_gpu_tensor_return_its_total() {
    if !have_gpu("fallible_sums_and_means_of_a_gpu_tensor_return_its_total") {
        return;
    }
    let mut fails = Vec::new();
    common::in_every_dtype!(fallible_totals(&mut fails));
    assert_none(fails);
}
