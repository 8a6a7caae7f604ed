//! Choosing the next token from a position's logits: greedy, or sampled with a temperature,
//! top-k, top-p (nucleus) and a repetition penalty, from a seeded generator. Every rank holds
//! the same logits and the same generator, so every rank picks the same token with no exchange.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::{Error, Result};

/// How [`Model::generate`](super::Model::generate) picks and stops.
///
/// # Examples
/// ```
/// use dist_tensor::models::GenerateOptions;
/// let greedy = GenerateOptions::greedy(20);
/// assert_eq!(greedy.temperature, 0.0);
/// let sampled = GenerateOptions { temperature: 0.8, top_k: Some(40), top_p: Some(0.95), seed: 7, ..greedy };
/// assert!(sampled.check().is_ok());
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOptions {
    /// Tokens to generate at most.
    pub max_new: usize,
    /// 0: greedy (the largest logit, the first on ties); else the logits are divided by it
    /// before sampling.
    pub temperature: f32,
    /// Sample among the `k` most likely tokens only.
    pub top_k: Option<usize>,
    /// Sample among the most likely tokens whose probabilities add up to at least `p`.
    pub top_p: Option<f32>,
    /// Above 1, the logits of tokens already in the sequence are made less likely (a positive
    /// logit divided by it, a negative one multiplied), as `transformers` does.
    pub repetition_penalty: f32,
    /// The sampling generator's seed: the same tokens for the same seed, on any world size.
    pub seed: u64,
    /// Generation ends after any of these (it is included).
    pub stop: Vec<u32>,
    /// Positions per block of the KV cache.
    pub block_size: usize,
}

impl GenerateOptions {
    /// Greedy, `max_new` tokens, no stop token.
    pub fn greedy(max_new: usize) -> Self {
        GenerateOptions {
            max_new,
            temperature: 0.0,
            top_k: None,
            top_p: None,
            repetition_penalty: 1.0,
            seed: 0,
            stop: Vec::new(),
            block_size: 16,
        }
    }

    /// Checks the numbers.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a negative or NaN temperature, a top-k of 0, a top-p
    /// outside `(0, 1]`, a repetition penalty that is not positive, or a block of 0 positions.
    pub fn check(&self) -> Result<()> {
        let bad = |reason: String| Err(Error::InvalidArgument { op: "generate", rank: 0, reason });
        if self.temperature.is_nan() || self.temperature < 0.0 {
            return bad(format!("temperature {}: 0 (greedy) or more", self.temperature));
        }
        if self.top_k == Some(0) {
            return bad("top_k 0 leaves no token".into());
        }
        if let Some(p) = self.top_p
            && !(p > 0.0 && p <= 1.0)
        {
            return bad(format!("top_p {p}: in (0, 1]"));
        }
        if self.repetition_penalty.is_nan() || self.repetition_penalty <= 0.0 {
            return bad(format!("repetition_penalty {}: positive", self.repetition_penalty));
        }
        if self.block_size == 0 {
            return bad("a KV cache block of 0 positions".into());
        }
        Ok(())
    }
}

/// Picks tokens as [`GenerateOptions`] say, from one seeded generator.
pub(crate) struct Sampler {
    options: GenerateOptions,
    rng: StdRng,
}

impl Sampler {
    pub(crate) fn new(options: &GenerateOptions) -> Self {
        Sampler { options: options.clone(), rng: StdRng::seed_from_u64(options.seed) }
    }

    /// The next token after `seen`, from the last position's `logits`.
    pub(crate) fn next(&mut self, logits: &[f32], seen: &[u32]) -> u32 {
        let o = &self.options;
        let mut l: Vec<f32> = logits.to_vec();
        if o.repetition_penalty != 1.0 {
            let mut done = vec![false; l.len()];
            for &t in seen {
                let t = t as usize;
                if t < l.len() && !std::mem::replace(&mut done[t], true) {
                    let x = l[t];
                    l[t] =
                        if x > 0.0 { x / o.repetition_penalty } else { x * o.repetition_penalty };
                }
            }
        }
        if o.temperature == 0.0 {
            return super::blocks::argmax(&l);
        }
        // Candidates, most likely first (ties: the lower id first).
        let mut order: Vec<usize> = (0..l.len()).collect();
        order.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
        if let Some(k) = o.top_k {
            order.truncate(k.min(order.len()));
        }
        let max = l[order[0]] as f64;
        let mut p: Vec<f64> =
            order.iter().map(|&i| ((l[i] as f64 - max) / o.temperature as f64).exp()).collect();
        let total: f64 = p.iter().sum();
        p.iter_mut().for_each(|x| *x /= total);
        if let Some(top_p) = o.top_p {
            let mut sum = 0.0;
            let keep = p
                .iter()
                .position(|&x| {
                    sum += x;
                    sum >= top_p as f64
                })
                .map_or(p.len(), |i| i + 1);
            p.truncate(keep);
            order.truncate(keep);
            let kept: f64 = p.iter().sum();
            p.iter_mut().for_each(|x| *x /= kept);
        }
        let u: f64 = self.rng.random();
        let mut sum = 0.0;
        for (&i, &x) in order.iter().zip(&p) {
            sum += x;
            if u < sum {
                return i as u32;
            }
        }
        order[order.len() - 1] as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_largest_and_the_penalty_lowers_seen_tokens() {
        let mut s = Sampler::new(&GenerateOptions::greedy(1));
        assert_eq!(s.next(&[0.5, 2.0, 2.0, -1.0], &[]), 1);
        let o = GenerateOptions { repetition_penalty: 4.0, ..GenerateOptions::greedy(1) };
        let mut s = Sampler::new(&o);
        // 2.0 / 4 = 0.5 for the seen token 1: token 2 now leads.
        assert_eq!(s.next(&[0.5, 2.0, 1.9, -1.0], &[1]), 2);
    }

    #[test]
    fn sampling_follows_the_probabilities_and_top_k_and_top_p_cut_the_tail() {
        let logits = [2.0f32, 1.0, 0.0, -1.0];
        let draws = |o: GenerateOptions| -> Vec<usize> {
            let mut s = Sampler::new(&o);
            let mut n = vec![0usize; 4];
            for _ in 0..20000 {
                n[s.next(&logits, &[]) as usize] += 1;
            }
            n
        };
        let base = GenerateOptions { temperature: 1.0, seed: 3, ..GenerateOptions::greedy(1) };
        let n = draws(base.clone());
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        for (i, &c) in n.iter().enumerate() {
            let want = (logits[i] as f64).exp() / z;
            assert!((c as f64 / 20000.0 - want).abs() < 0.015, "token {i}: {c} of 20000, p {want}");
        }
        assert_eq!(draws(GenerateOptions { top_k: Some(2), ..base.clone() })[2..], [0, 0]);
        // p(0) = 0.644, p(0) + p(1) = 0.881: top-p 0.8 keeps tokens 0 and 1.
        assert_eq!(draws(GenerateOptions { top_p: Some(0.8), ..base.clone() })[2..], [0, 0]);
        // The same seed, the same tokens.
        assert_eq!(draws(base.clone()), n);
    }

    #[test]
    fn bad_options_are_refused() {
        let g = GenerateOptions::greedy(1);
        for bad in [
            GenerateOptions { temperature: -1.0, ..g.clone() },
            GenerateOptions { top_k: Some(0), ..g.clone() },
            GenerateOptions { top_p: Some(1.5), ..g.clone() },
            GenerateOptions { repetition_penalty: 0.0, ..g.clone() },
            GenerateOptions { block_size: 0, ..g.clone() },
        ] {
            assert!(bad.check().is_err(), "{bad:?}");
        }
    }
}
