//! [`gradcheck`]: the gradients a backward pass records, against central finite differences in
//! f64 (as `torch.autograd.gradcheck`).

use rand::{Rng, SeedableRng, rngs::StdRng};

use super::Var;
use crate::{Error, Result, Tensor};

/// Step and tolerances of [`gradcheck`].
#[derive(Debug, Clone, Copy)]
pub struct GradcheckOptions {
    /// The finite-difference step.
    pub eps: f64,
    /// Absolute tolerance.
    pub atol: f64,
    /// Relative tolerance (of the finite difference).
    pub rtol: f64,
    /// Seed of the random projection of the output.
    pub seed: u64,
}

impl Default for GradcheckOptions {
    /// `eps` 1e-6, `atol` 1e-5, `rtol` 1e-3, as PyTorch's defaults for f64.
    fn default() -> Self {
        GradcheckOptions { eps: 1e-6, atol: 1e-5, rtol: 1e-3, seed: 0x9e37 }
    }
}

/// What [`gradcheck`] compared.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradcheckReport {
    /// How many input elements were checked.
    pub elements: usize,
    /// The largest `|analytic - numeric|`.
    pub max_abs_error: f64,
}

/// Checks the backward pass of `f` at `inputs`: `f` maps tracked variables (one per input, in
/// order) to an output; the check projects the output on a fixed random tensor `r` (so every
/// output element counts), differentiates `sum(f(x) * r)` by the recorded backward pass, and
/// compares each input element's gradient with the central difference
/// `(L(x + eps) - L(x - eps)) / 2 eps`, which it computes with untracked variables.
///
/// `f` runs `2 n + 1` times for `n` input elements: keep the inputs small.
///
/// # Errors
/// [`Error::GradientMismatch`] for the first element out of tolerance
/// (`|analytic - numeric| > atol + rtol |numeric|`); any error of `f`.
///
/// # Examples
/// ```
/// use dist_tensor::autograd::{GradcheckOptions, gradcheck};
/// use dist_tensor::Tensor;
/// let (a, b) = (Tensor::<f64>::random(&[3, 4], 1), Tensor::<f64>::random(&[4, 2], 2));
/// let report = gradcheck(|x| Ok(x[0].matmul(&x[1])?.gelu()), &[a, b], GradcheckOptions::default())?;
/// assert_eq!(report.elements, 20);
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn gradcheck<'a>(
    f: impl Fn(&[Var<'a, f64>]) -> Result<Var<'a, f64>>,
    inputs: &[Tensor<f64>],
    opts: GradcheckOptions,
) -> Result<GradcheckReport> {
    let vars: Vec<Var<'a, f64>> = inputs.iter().map(|t| Var::param(t.clone())).collect();
    let out = f(&vars)?;
    let mut rng = StdRng::seed_from_u64(opts.seed);
    let r = out.value().map(|_| rng.random_range(-1.0..1.0));
    out.backward_with(r.clone())?;
    let project = |xs: &[Tensor<f64>]| -> Result<f64> {
        let consts: Vec<Var<'a, f64>> = xs.iter().map(|t| Var::constant(t.clone())).collect();
        let y = f(&consts)?;
        Ok(y.value().as_slice().iter().zip(r.as_slice()).map(|(y, r)| y * r).sum())
    };
    let mut report = GradcheckReport { elements: 0, max_abs_error: 0.0 };
    let mut xs = inputs.to_vec();
    for (input, var) in vars.iter().enumerate() {
        let analytic = var.grad().unwrap_or_else(|| Tensor::zeros(inputs[input].shape()));
        for index in 0..inputs[input].len() {
            let x0 = inputs[input].as_slice()[index];
            xs[input].as_mut_slice()[index] = x0 + opts.eps;
            let plus = project(&xs)?;
            xs[input].as_mut_slice()[index] = x0 - opts.eps;
            let minus = project(&xs)?;
            xs[input].as_mut_slice()[index] = x0;
            let numeric = (plus - minus) / (2.0 * opts.eps);
            let analytic = analytic.as_slice()[index];
            let tolerance = opts.atol + opts.rtol * numeric.abs();
            let err = (analytic - numeric).abs();
            if err.is_nan() || err > tolerance {
                return Err(Error::GradientMismatch { input, index, analytic, numeric, tolerance });
            }
            report.max_abs_error = report.max_abs_error.max(err);
            report.elements += 1;
        }
    }
    Ok(report)
}
