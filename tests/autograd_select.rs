//! The indexing, joining, scan and top-k ops of `Var` (`cat`, `stack`, `index_select`,
//! `gather`, `topk`, `argmax`, `masked_fill`, `select_where`, `cumsum`) and its scalar
//! operators: each forward pass against a plain reference computed with hand loops over
//! positions (f64, and f32 within a tolerance of the f64 reference), each backward pass against
//! central finite differences in f64 (`gradcheck`) on seeded random inputs of odd shapes, and
//! each typed error on bad input.

use dist_tensor::autograd::{GradcheckOptions, Var, gradcheck};
use dist_tensor::{Element, Error, Result, Tensor};
use ndarray::{ArrayD, IxDyn, array};

mod common;

// ---- the hand-loop references -------------------------------------------------------------

/// The position of row-major offset `flat` in `shape`.
fn unravel(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut pos = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        pos[d] = flat % shape[d];
        flat /= shape[d];
    }
    pos
}

/// The element of `t` at `pos`.
fn at(t: &Tensor<f64>, pos: &[usize]) -> f64 {
    let flat = pos.iter().zip(t.shape()).fold(0, |acc, (&p, &n)| acc * n + p);
    t.as_slice()[flat]
}

/// A tensor of `shape` whose element at each position `p` is `f(p)`.
fn build(shape: &[usize], f: impl Fn(&[usize]) -> f64) -> Tensor<f64> {
    let n = shape.iter().product();
    Tensor::from_shape_vec(shape, (0..n).map(|i| f(&unravel(i, shape))).collect()).unwrap()
}

/// `pos`, a position in a broadcast result, as a position in an operand of `shape` (trailing
/// axes aligned; an axis of length 1 reads its only element).
fn broadcast_pos(pos: &[usize], shape: &[usize]) -> Vec<usize> {
    let lead = pos.len() - shape.len();
    shape.iter().enumerate().map(|(d, &n)| if n == 1 { 0 } else { pos[lead + d] }).collect()
}

/// `pos` with coordinate `axis` set to `v`.
fn with(pos: &[usize], axis: usize, v: usize) -> Vec<usize> {
    let mut q = pos.to_vec();
    q[axis] = v;
    q
}

fn cat_ref(xs: &[Tensor<f64>], axis: usize) -> Tensor<f64> {
    let mut shape = xs[0].shape().to_vec();
    shape[axis] = xs.iter().map(|x| x.shape()[axis]).sum();
    build(&shape, |p| {
        let mut c = p[axis];
        for x in xs {
            if c < x.shape()[axis] {
                return at(x, &with(p, axis, c));
            }
            c -= x.shape()[axis];
        }
        unreachable!("the position is inside the joined shape")
    })
}

fn stack_ref(xs: &[Tensor<f64>], axis: usize) -> Tensor<f64> {
    let mut shape = xs[0].shape().to_vec();
    shape.insert(axis, xs.len());
    build(&shape, |p| {
        let mut q = p.to_vec();
        let i = q.remove(axis);
        at(&xs[i], &q)
    })
}

fn index_select_ref(x: &Tensor<f64>, axis: usize, indices: &[usize]) -> Tensor<f64> {
    let shape = with(x.shape(), axis, indices.len());
    build(&shape, |p| at(x, &with(p, axis, indices[p[axis]])))
}

fn gather_ref(x: &Tensor<f64>, axis: usize, index: &ArrayD<usize>) -> Tensor<f64> {
    build(index.shape(), |p| at(x, &with(p, axis, index[IxDyn(p)])))
}

fn masked_fill_ref(x: &Tensor<f64>, mask: &ArrayD<bool>, value: f64) -> Tensor<f64> {
    build(
        x.shape(),
        |p| if mask[IxDyn(&broadcast_pos(p, mask.shape()))] { value } else { at(x, p) },
    )
}

fn where_ref(
    cond: &ArrayD<bool>,
    a: &Tensor<f64>,
    b: &Tensor<f64>,
    shape: &[usize],
) -> Tensor<f64> {
    build(shape, |p| {
        if cond[IxDyn(&broadcast_pos(p, cond.shape()))] {
            at(a, &broadcast_pos(p, a.shape()))
        } else {
            at(b, &broadcast_pos(p, b.shape()))
        }
    })
}

fn cumsum_ref(x: &Tensor<f64>, axis: usize) -> Tensor<f64> {
    build(x.shape(), |p| (0..=p[axis]).map(|i| at(x, &with(p, axis, i))).sum())
}

/// The lane of `x` along `axis` through `p`, as (index, value), sorted as topk documents:
/// larger first, ties by lower index (a stable sort of the lane in index order).
fn sorted_lane(x: &Tensor<f64>, axis: usize, p: &[usize]) -> Vec<(usize, f64)> {
    let mut lane: Vec<(usize, f64)> =
        (0..x.shape()[axis]).map(|i| (i, at(x, &with(p, axis, i)))).collect();
    lane.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap());
    lane
}

fn topk_ref(x: &Tensor<f64>, k: usize, axis: usize) -> (Tensor<f64>, Vec<usize>) {
    let shape = with(x.shape(), axis, k);
    let values = build(&shape, |p| sorted_lane(x, axis, p)[p[axis]].1);
    let n: usize = shape.iter().product();
    let indices = (0..n).map(|i| {
        let p = unravel(i, &shape);
        sorted_lane(x, axis, &p)[p[axis]].0
    });
    (values, indices.collect())
}

/// An index array of `shape` with values below `bound`, repeating (a fixed scramble).
fn index(shape: &[usize], bound: usize) -> ArrayD<usize> {
    let n: usize = shape.iter().product();
    ArrayD::from_shape_vec(IxDyn(shape), (0..n).map(|i| (i * 5 + 3) % bound).collect()).unwrap()
}

/// A boolean array of `shape`, neither all true nor all false (a fixed pattern).
fn pattern(shape: &[usize]) -> ArrayD<bool> {
    let n: usize = shape.iter().product();
    ArrayD::from_shape_vec(IxDyn(shape), (0..n).map(|i| (i * 7) % 3 == 1).collect()).unwrap()
}

/// That `got` has `want`'s shape and every element within `tol * max(1, |want|)`.
#[track_caller]
fn assert_close(got: &Tensor<f64>, want: &Tensor<f64>, tol: f64) {
    assert_eq!(got.shape(), want.shape());
    for (i, (g, w)) in got.as_slice().iter().zip(want.as_slice()).enumerate() {
        assert!((g - w).abs() <= tol * w.abs().max(1.0), "element {i}: got {g}, want {w}");
    }
}

// ---- every op: gradcheck, and the forward pass against the reference ---------------------

/// A module of three tests for `body` on random inputs of the given shapes: its gradient in f64
/// against central differences, its f64 forward pass against the hand-loop `reference` (to
/// 1e-12: the references sum in the same order), and its f32 forward pass against that
/// reference on the same (f32-rounded) inputs.
macro_rules! select_test {
    (
        $name:ident, [$($shape:expr),*], |$x:ident| $body:expr, reference |$r:ident| $reference:expr
    ) => {
        mod $name {
            use super::*;
            fn f<T: Element>($x: &[Var<'static, T>]) -> Result<Var<'static, T>> {
                Ok($body)
            }
            fn reference($r: &[Tensor<f64>]) -> Tensor<f64> {
                $reference
            }
            fn inputs() -> Vec<Tensor<f64>> {
                let shapes: Vec<Vec<usize>> = vec![$($shape.to_vec()),*];
                shapes.iter().enumerate().map(|(i, s)| Tensor::random(s, 11 + i as u64)).collect()
            }
            #[test]
            fn gradcheck_f64() {
                let report = gradcheck(f::<f64>, &inputs(), GradcheckOptions::default()).unwrap();
                assert!(report.elements > 0);
            }
            #[test]
            fn forward_f64_against_the_hand_loops() {
                let x = inputs();
                let vars: Vec<Var<'static, f64>> = x.iter().cloned().map(Var::param).collect();
                let got = f(&vars).unwrap();
                assert!(got.is_tracked());
                assert_close(got.value(), &reference(&x), 1e-12);
            }
            #[test]
            fn forward_f32_against_the_f64_reference() {
                let x: Vec<Tensor<f32>> = inputs().iter().map(|t| t.cast::<f32>()).collect();
                let vars: Vec<Var<'static, f32>> = x.iter().cloned().map(Var::constant).collect();
                let got = f(&vars).unwrap().into_value().cast::<f64>();
                let widened: Vec<Tensor<f64>> = x.iter().map(|t| t.cast::<f64>()).collect();
                assert_close(&got, &reference(&widened), 1e-6);
            }
        }
    };
}

select_test!(
    cat_middle_axis_three_inputs,
    [[2, 1, 3], [2, 4, 3], [2, 2, 3]],
    |x| Var::cat(&[&x[0], &x[1], &x[2]], 1)?.gelu(),
    reference | x | cat_ref(x, 1).map(gelu)
);
select_test!(
    cat_first_axis,
    [[1, 5], [3, 5]],
    |x| Var::cat(&[&x[0], &x[1]], 0)?,
    reference | x | cat_ref(x, 0)
);
select_test!(
    cat_last_axis_input_used_twice,
    [[3, 2], [3, 1]],
    |x| Var::cat(&[&x[0], &x[1], &x[0]], 1)?,
    reference | x | cat_ref(&[x[0].clone(), x[1].clone(), x[0].clone()], 1)
);
select_test!(cat_one_input, [[7]], |x| Var::cat(&[&x[0]], 0)?, reference | x | x[0].clone());
select_test!(
    stack_first_axis,
    [[3, 5], [3, 5], [3, 5]],
    |x| Var::stack(&[&x[0], &x[1], &x[2]], 0)?,
    reference | x | stack_ref(x, 0)
);
select_test!(
    stack_middle_axis,
    [[3, 5], [3, 5]],
    |x| Var::stack(&[&x[0], &x[1]], 1)?,
    reference | x | stack_ref(x, 1)
);
select_test!(
    stack_after_the_last_axis,
    [[2, 1, 3], [2, 1, 3]],
    |x| Var::stack(&[&x[0], &x[1]], 3)?,
    reference | x | stack_ref(x, 3)
);
select_test!(
    index_select_repeated_middle_axis,
    [[5, 3, 2]],
    |x| x[0].index_select(1, &[2, 0, 2, 2, 1])?.silu(),
    reference | x | index_select_ref(&x[0], 1, &[2, 0, 2, 2, 1]).map(silu)
);
select_test!(
    index_select_repeated_first_axis,
    [[5, 3]],
    |x| x[0].index_select(0, &[4, 4, 0])?,
    reference | x | index_select_ref(&x[0], 0, &[4, 4, 0])
);
select_test!(
    index_select_last_axis_fewer,
    [[7, 2, 3]],
    |x| x[0].index_select(2, &[1, 1])?,
    reference | x | index_select_ref(&x[0], 2, &[1, 1])
);
select_test!(
    gather_3d_middle_axis_repeated,
    [[3, 4, 5]],
    |x| x[0].gather(1, &index(&[2, 6, 3], 4))?.gelu(),
    reference | x | gather_ref(&x[0], 1, &index(&[2, 6, 3], 4)).map(gelu)
);
select_test!(
    gather_3d_first_axis_longer_index,
    [[3, 2, 2]],
    |x| x[0].gather(0, &index(&[5, 2, 2], 3))?,
    reference | x | gather_ref(&x[0], 0, &index(&[5, 2, 2], 3))
);
select_test!(
    gather_last_axis_2d,
    [[3, 7]],
    |x| x[0].gather(1, &index(&[2, 4], 7))?,
    reference | x | gather_ref(&x[0], 1, &index(&[2, 4], 7))
);
select_test!(
    gather_1d,
    [[7]],
    |x| x[0].gather(0, &index(&[11], 7))?,
    reference | x | gather_ref(&x[0], 0, &index(&[11], 7))
);
// Random inputs have no ties (ties are tested by hand below: topk is not differentiable there).
select_test!(
    topk_middle_axis,
    [[3, 7, 2]],
    |x| x[0].topk(3, 1)?.0.silu(),
    reference | x | topk_ref(&x[0], 3, 1).0.map(silu)
);
select_test!(
    topk_one_last_axis,
    [[3, 7, 2]],
    |x| x[0].topk(1, 2)?.0,
    reference | x | topk_ref(&x[0], 1, 2).0
);
select_test!(
    topk_all_first_axis,
    [[5, 3]],
    |x| x[0].topk(5, 0)?.0,
    reference | x | topk_ref(&x[0], 5, 0).0
);
select_test!(topk_1d, [[11]], |x| x[0].topk(4, 0)?.0, reference | x | topk_ref(&x[0], 4, 0).0);
// A fill value where gelu's slope is not ~0, so that a gradient leaking through the filled
// places would show.
select_test!(
    masked_fill_broadcast_mask,
    [[3, 5, 2]],
    |x| x[0].masked_fill(&pattern(&[5, 1]), T::from_f64(0.75))?.gelu(),
    reference | x | masked_fill_ref(&x[0], &pattern(&[5, 1]), 0.75).map(gelu)
);
select_test!(
    masked_fill_same_shape_mask,
    [[7, 3]],
    |x| x[0].masked_fill(&pattern(&[7, 3]), T::from_f64(0.25))?,
    reference | x | masked_fill_ref(&x[0], &pattern(&[7, 3]), 0.25)
);
select_test!(
    select_where_same_shapes,
    [[3, 5], [3, 5]],
    |x| Var::select_where(&pattern(&[3, 5]), &x[0], &x[1])?,
    reference | x | where_ref(&pattern(&[3, 5]), &x[0], &x[1], &[3, 5])
);
select_test!(
    select_where_all_broadcast,
    [[2, 1, 3], [1, 5, 1]],
    |x| Var::select_where(&pattern(&[5, 3]), &x[0], &x[1])?.silu(),
    reference | x | where_ref(&pattern(&[5, 3]), &x[0], &x[1], &[2, 5, 3]).map(silu)
);
select_test!(
    select_where_input_on_both_sides,
    [[4, 3]],
    |x| Var::select_where(&pattern(&[3]), &x[0], &(&x[0] * &x[0]))?,
    reference | x | where_ref(&pattern(&[3]), &x[0], &x[0].map(|v| v * v), &[4, 3])
);
select_test!(
    cumsum_first_axis,
    [[3, 5, 2]],
    |x| x[0].cumsum(0)?,
    reference | x | cumsum_ref(&x[0], 0)
);
select_test!(
    cumsum_middle_axis,
    [[3, 5, 2]],
    |x| x[0].cumsum(1)?.gelu(),
    reference | x | cumsum_ref(&x[0], 1).map(gelu)
);
select_test!(
    cumsum_last_axis,
    [[3, 5, 2]],
    |x| x[0].cumsum(2)?,
    reference | x | cumsum_ref(&x[0], 2)
);
select_test!(cumsum_one_element, [[1]], |x| x[0].cumsum(0)?, reference | x | x[0].clone());
select_test!(
    cumsum_prime_length,
    [[13]],
    |x| x[0].cumsum(0)?,
    reference | x | cumsum_ref(&x[0], 0)
);
select_test!(
    scalar_rhs_by_reference,
    [[3, 5]],
    |x| &(&(&(&x[0] * T::from_f64(2.5)) - T::from_f64(1.0)) / T::from_f64(0.75)) + T::from_f64(3.0),
    reference | x | x[0].map(|v| (v * 2.5 - 1.0) / 0.75 + 3.0)
);
select_test!(
    scalar_rhs_by_value,
    [[7]],
    |x| ((x[0].clone() + T::from_f64(0.5)) * T::from_f64(-3.0)) / T::from_f64(2.0)
        - T::from_f64(1.0),
    reference | x | x[0].map(|v| (v + 0.5) * -3.0 / 2.0 - 1.0)
);

/// The activations some tests compose with, for their references (`erf` written out in
/// tests/common, not the library's).
fn gelu(x: f64) -> f64 {
    x * common::reference::phi(x)
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

// ---- scalars on the left (one impl per element type, so not in the generic tests) ----------

#[test]
fn scalar_lhs_gradients_against_central_differences() {
    let x = [Tensor::<f64>::random(&[3, 5], 21)];
    let opts = GradcheckOptions::default();
    // Away from 0, so that 2 / x is smooth at the step.
    let shifted = |v: &Var<'static, f64>| v + 2.0;
    gradcheck(|v| Ok(2.5 + &v[0]), &x, opts).unwrap();
    gradcheck(|v| Ok(2.5 - &v[0]), &x, opts).unwrap();
    gradcheck(|v| Ok(2.5 * &v[0]), &x, opts).unwrap();
    gradcheck(|v| Ok(2.5 / &shifted(&v[0])), &x, opts).unwrap();
    gradcheck(|v| Ok(-1.5 / shifted(&v[0]) + 1.0), &x, opts).unwrap();
    gradcheck(|v| Ok((0.5 - v[0].clone()) * 3.0), &x, opts).unwrap();
}

#[test]
fn scalar_lhs_forward_in_every_element_type() {
    let x = Tensor::<f64>::random(&[2, 3], 22).map(|v| v + 2.0);
    let want = x.map(|v| 3.0 / v - (2.0 * v + 1.0));
    let f64_got = &(3.0 / &Var::constant(x.clone())) - &(2.0 * Var::constant(x.clone()) + 1.0);
    assert_close(f64_got.value(), &want, 1e-15);
    let f32_got = &(3.0f32 / &Var::constant(x.cast())) - &(2.0f32 * Var::constant(x.cast()) + 1.0);
    assert_close(&f32_got.into_value().cast(), &want, 1e-6);
    let (three, two) = (half::f16::from_f64(3.0), half::f16::from_f64(2.0));
    let one = half::f16::from_f64(1.0);
    let f16_got = &(three / &Var::constant(x.cast())) - &(two * Var::constant(x.cast()) + one);
    assert_close(&f16_got.into_value().cast(), &want, 4e-3);
    let (three, two) = (half::bf16::from_f64(3.0), half::bf16::from_f64(2.0));
    let one = half::bf16::from_f64(1.0);
    let bf16_got = &(three / &Var::constant(x.cast())) - &(two * Var::constant(x.cast()) + one);
    assert_close(&bf16_got.into_value().cast(), &want, 3e-2);
}

#[test]
fn scalar_lhs_gradient_of_a_quotient_by_hand() {
    let x = Var::param(Tensor::<f32>::from(vec![2.0, -4.0]));
    (3.0f32 / &x).sum().backward().unwrap(); // d(3 / x)/dx = -3 / x^2
    assert_eq!(x.grad().unwrap().as_slice(), &[-0.75, -0.1875]);
}

// ---- gradients by hand: repeated indices accumulate, ties are documented -------------------

#[test]
fn repeated_indices_accumulate_their_gradients() {
    let x = Var::param(Tensor::<f64>::random(&[4, 2], 31));
    x.index_select(0, &[1, 3, 1, 1]).unwrap().sum().backward().unwrap();
    assert_eq!(x.grad().unwrap().as_slice(), &[0., 0., 3., 3., 0., 0., 1., 1.]);
    x.zero_grad();
    x.gather(1, &array![[0, 0, 0], [1, 0, 1], [1, 1, 1], [0, 1, 0]])
        .unwrap()
        .sum()
        .backward()
        .unwrap();
    assert_eq!(x.grad().unwrap().as_slice(), &[3., 0., 1., 2., 0., 3., 2., 1.]);
}

#[test]
fn an_empty_selection_gives_a_zero_gradient() {
    let x = Var::param(Tensor::<f64>::random(&[3, 2], 32));
    let y = x.index_select(0, &[]).unwrap();
    assert_eq!(y.shape(), &[0, 2]);
    y.sum().backward().unwrap();
    assert_eq!(x.grad().unwrap().as_slice(), &[0.; 6]);
}

#[test]
fn topk_and_argmax_break_ties_by_the_lowest_index_and_the_gradient_follows() {
    // Two 3s tie for the first place, three 2s for the third: k = 4 takes the 2s at 0 and 3.
    let x = Var::param(Tensor::<f64>::from(vec![2., 3., 1., 2., 3., 2.]));
    let (values, indices) = x.topk(4, 0).unwrap();
    assert_eq!(values.value().as_slice(), &[3., 3., 2., 2.]);
    assert_eq!(indices.as_slice().unwrap(), &[1, 4, 0, 3]);
    assert_eq!(x.argmax(0).unwrap().as_slice().unwrap(), &[1]);
    let w = Var::constant(Tensor::from(vec![1., 10., 100., 1000.]));
    (&values * &w).sum().backward().unwrap();
    assert_eq!(x.grad().unwrap().as_slice(), &[100., 1., 0., 1000., 10., 0.]);
}

#[test]
fn nan_counts_as_the_largest_and_signed_zeros_tie() {
    let x = Tensor::<f32>::from(vec![1., f32::NAN, 5., -0.0, 0.0, f32::NAN]);
    assert_eq!(x.argmax(0).unwrap().as_slice().unwrap(), &[1]);
    let (values, indices) = x.topk(6, 0).unwrap();
    assert_eq!(indices.as_slice().unwrap(), &[1, 5, 2, 0, 3, 4]);
    assert!(values.as_slice()[0].is_nan() && values.as_slice()[2] == 5.0);
}

#[test]
fn argmax_against_the_hand_loops_on_every_axis() {
    let x = Tensor::<f64>::random(&[3, 7, 2], 33);
    for axis in 0..3 {
        let got = Var::param(x.clone()).argmax(axis).unwrap();
        let mut shape = x.shape().to_vec();
        shape.remove(axis);
        let want = build(&shape, |p| {
            let mut q = p.to_vec();
            q.insert(axis, 0);
            sorted_lane(&x, axis, &q)[0].0 as f64
        });
        assert_eq!(got.shape(), &shape[..]);
        let got: Vec<f64> = got.iter().map(|&i| i as f64).collect();
        assert_eq!(got, want.as_slice(), "axis {axis}");
        // f32 picks the same elements.
        assert_eq!(
            x.cast::<f32>().argmax(axis).unwrap().mapv(|i| i as f64).into_raw_vec_and_offset().0,
            got
        );
    }
}

#[test]
fn topk_indices_against_the_hand_loops() {
    let x = Tensor::<f64>::random(&[3, 7, 2], 34);
    let (_, indices) = Var::param(x.clone()).topk(3, 1).unwrap();
    assert_eq!(indices.into_raw_vec_and_offset().0, topk_ref(&x, 3, 1).1);
}

#[test]
fn masked_fill_gradient_is_zero_where_filled() {
    let x = Var::param(Tensor::<f64>::random(&[2, 3], 35));
    let y = x.masked_fill(&array![true, false, true], 9.0).unwrap();
    assert_eq!(y.value().as_slice()[0], 9.0);
    (&y * 2.0).sum().backward().unwrap();
    assert_eq!(x.grad().unwrap().as_slice(), &[0., 2., 0., 0., 2., 0.]);
}

#[test]
fn untracked_inputs_record_nothing() {
    let c = Var::<f64>::constant(Tensor::random(&[3, 4], 36));
    assert!(!Var::cat(&[&c, &c], 0).unwrap().is_tracked());
    assert!(!Var::stack(&[&c], 0).unwrap().is_tracked());
    assert!(!c.index_select(0, &[0]).unwrap().is_tracked());
    assert!(!c.gather(0, &array![[0]]).unwrap().is_tracked());
    assert!(!c.topk(1, 1).unwrap().0.is_tracked());
    assert!(!c.masked_fill(&array![true], 0.0).unwrap().is_tracked());
    assert!(!Var::select_where(&array![true], &c, &c).unwrap().is_tracked());
    assert!(!c.cumsum(1).unwrap().is_tracked());
    assert!(!(&c * 2.0).is_tracked() && !(2.0 - &c).is_tracked());
    // One tracked input of several: only it gets a gradient.
    let p = Var::param(Tensor::<f64>::random(&[1, 4], 37));
    Var::cat(&[&c, &p], 0).unwrap().sum().backward().unwrap();
    assert_eq!(p.grad().unwrap().as_slice(), &[1.; 4]);
}

// ---- bad input: the typed errors -----------------------------------------------------------

/// That `got` failed with the variant `matches` accepts, for `op`.
#[track_caller]
fn refused<R: std::fmt::Debug>(got: Result<R>, op: &str, matches: fn(&Error) -> bool) {
    match got {
        Err(e) if matches(&e) => assert!(e.to_string().starts_with(op), "{e}"),
        other => panic!("{op}: got {other:?}"),
    }
}

fn invalid_shape(e: &Error) -> bool {
    matches!(e, Error::InvalidShape { .. })
}

fn invalid_argument(e: &Error) -> bool {
    matches!(e, Error::InvalidArgument { .. })
}

fn dim_out_of_range(e: &Error) -> bool {
    matches!(e, Error::DimOutOfRange { .. })
}

#[test]
fn cat_and_stack_refuse_bad_input() {
    let a = Var::param(Tensor::<f64>::random(&[2, 3], 41));
    let b = Var::param(Tensor::<f64>::random(&[2, 4], 42));
    let s = Var::param(Tensor::<f64>::from_shape_vec(&[], vec![1.0]).unwrap());
    refused(Var::<f64>::cat(&[], 0), "Tensor::cat", invalid_argument);
    refused(Var::cat(&[&a, &b], 0), "Tensor::cat", invalid_shape);
    refused(Var::cat(&[&a, &b.reshape(&[2, 2, 2]).unwrap()], 1), "Tensor::cat", invalid_shape);
    refused(Var::cat(&[&a, &a], 2), "Tensor::cat", dim_out_of_range);
    refused(Var::cat(&[&s, &s], 0), "Tensor::cat", dim_out_of_range);
    assert_eq!(Var::cat(&[&a, &b], 1).unwrap().shape(), &[2, 7]);
    refused(Var::<f64>::stack(&[], 0), "Tensor::stack", invalid_argument);
    refused(Var::stack(&[&a, &b], 0), "Tensor::stack", invalid_shape);
    refused(Var::stack(&[&a, &a], 3), "Tensor::stack", dim_out_of_range);
    assert_eq!(Var::stack(&[&s, &s], 0).unwrap().shape(), &[2]);
}

#[test]
fn index_select_and_gather_refuse_bad_input() {
    let x = Var::param(Tensor::<f64>::random(&[2, 3], 43));
    refused(x.index_select(1, &[0, 3]), "Tensor::index_select", invalid_argument);
    refused(x.index_select(2, &[0]), "Tensor::index_select", dim_out_of_range);
    refused(x.gather(1, &array![[0, 3]]), "Tensor::gather", invalid_argument);
    refused(x.gather(1, &array![0, 1]), "Tensor::gather", invalid_shape); // 1-D index
    refused(x.gather(1, &array![[0], [1], [2]]), "Tensor::gather", invalid_shape); // 3 rows
    refused(x.gather(2, &array![[0]]), "Tensor::gather", dim_out_of_range);
}

#[test]
fn topk_and_argmax_refuse_bad_input() {
    let x = Var::param(Tensor::<f64>::random(&[2, 3], 44));
    refused(x.topk(4, 1), "Tensor::topk", invalid_argument);
    refused(x.topk(1, 2), "Tensor::topk", dim_out_of_range);
    refused(x.argmax(2), "Tensor::argmax", dim_out_of_range);
    let empty = Var::param(Tensor::<f64>::zeros(&[2, 0]));
    refused(empty.argmax(1), "Tensor::argmax", invalid_shape);
    assert_eq!(empty.topk(0, 1).unwrap().0.shape(), &[2, 0]);
    assert_eq!(x.topk(0, 1).unwrap().0.shape(), &[2, 0]);
}

#[test]
fn masked_fill_select_where_and_cumsum_refuse_bad_input() {
    let x = Var::param(Tensor::<f64>::random(&[2, 3], 45));
    let y = Var::param(Tensor::<f64>::random(&[4], 46));
    refused(x.masked_fill(&array![true, false], 0.0), "Tensor::masked_fill", invalid_shape);
    // A mask may not widen the tensor.
    refused(x.masked_fill(&pattern(&[4, 2, 3]), 0.0), "Tensor::masked_fill", invalid_shape);
    refused(Var::select_where(&array![true], &x, &y), "Tensor::select_where", invalid_shape);
    refused(Var::select_where(&array![true, false], &x, &x), "Tensor::select_where", invalid_shape);
    refused(x.cumsum(2), "Tensor::cumsum", dim_out_of_range);
}
