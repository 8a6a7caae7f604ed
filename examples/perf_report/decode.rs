//! `perf_report --decode-model`: decoding a Llama-shaped model of a few hundred million
//! parameters, built at random and written as a Hugging Face directory in a scratch folder, on
//! 1, 2 and 4 ranks: ms per token at batch 1 and tokens per second at batch 16 (continuous
//! batching), each beside the machine's floor: the bytes a decode step must read (the weights
//! and the KV cache) over the measured read bandwidth on all cores, or the products' flops over
//! the measured f32 peak on all cores, whichever takes longer (batch 1 is bound by the bytes,
//! batch 16 with its prefills by the flops).
//! `--quick`: a smaller model and fewer tokens.

use std::time::Instant;

use dist_tensor::checkpoint::write_safetensors;
use dist_tensor::models::{self, GenerateOptions};
use dist_tensor::{Error, Result, Tensor, World};

use super::machine::{Cpu, Limits};

/// The model's shape: Llama with grouped-query attention.
struct Shape {
    hidden: usize,
    ffn: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    vocab: usize,
}

impl Shape {
    fn params(&self) -> usize {
        let d = self.hidden / self.heads;
        let attn = self.hidden * (2 * self.hidden + 2 * self.kv_heads * d);
        let mlp = 3 * self.hidden * self.ffn;
        2 * self.vocab * self.hidden + self.layers * (attn + mlp + 2 * self.hidden) + self.hidden
    }
}

/// Seeded values in `+-scale`, quickly (xorshift: the values only need to be varied).
fn random(shape: &[usize], seed: u64, scale: f32) -> Result<Tensor<f32>> {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let values = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect();
    Tensor::from_shape_vec(shape, values)
}

/// Writes the model of `shape` (f32) into `dir` as `config.json` and `model.safetensors`.
fn write_model(dir: &std::path::Path, s: &Shape) -> Result<()> {
    let io = |e: std::io::Error| Error::InvalidArgument {
        op: "perf_report --decode-model",
        rank: 0,
        reason: format!("{}: {e}", dir.display()),
    };
    std::fs::create_dir_all(dir).map_err(io)?;
    let d = s.hidden / s.heads;
    let config = format!(
        "{{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\", \"hidden_size\": {}, \
         \"intermediate_size\": {}, \"num_hidden_layers\": {}, \"num_attention_heads\": {}, \
         \"num_key_value_heads\": {}, \"vocab_size\": {}, \"rms_norm_eps\": 1e-5, \
         \"rope_theta\": 10000.0, \"max_position_embeddings\": 4096, \"hidden_act\": \"silu\", \
         \"tie_word_embeddings\": false, \"dtype\": \"float32\"}}",
        s.hidden, s.ffn, s.layers, s.heads, s.kv_heads, s.vocab
    );
    std::fs::write(dir.join("config.json"), config).map_err(io)?;
    let (h, scale) = (s.hidden, 1.0 / (s.hidden as f32).sqrt());
    let mut tensors: Vec<(String, Tensor<f32>)> = vec![
        ("model.embed_tokens.weight".into(), random(&[s.vocab, h], 1, 1.0)?),
        ("lm_head.weight".into(), random(&[s.vocab, h], 2, scale)?),
        ("model.norm.weight".into(), Tensor::from(vec![1.0f32; h])),
    ];
    for l in 0..s.layers {
        let p = format!("model.layers.{l}");
        let seed = 100 + 10 * l as u64;
        let shapes = [
            ("self_attn.q_proj", [s.heads * d, h]),
            ("self_attn.k_proj", [s.kv_heads * d, h]),
            ("self_attn.v_proj", [s.kv_heads * d, h]),
            ("self_attn.o_proj", [h, s.heads * d]),
            ("mlp.gate_proj", [s.ffn, h]),
            ("mlp.up_proj", [s.ffn, h]),
            ("mlp.down_proj", [h, s.ffn]),
        ];
        for (i, (name, shape)) in shapes.iter().enumerate() {
            let w = random(shape, seed + i as u64, 1.0 / (shape[1] as f32).sqrt())?;
            tensors.push((format!("{p}.{name}.weight"), w));
        }
        for norm in ["input_layernorm", "post_attention_layernorm"] {
            tensors.push((format!("{p}.{norm}.weight"), Tensor::from(vec![1.0f32; h])));
        }
    }
    let refs: Vec<(&str, &Tensor<f32>)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    write_safetensors(dir.join("model.safetensors"), &refs)
}

pub fn main(quick: bool) -> Result<()> {
    let shape = if quick {
        Shape { hidden: 512, ffn: 1408, layers: 4, heads: 8, kv_heads: 4, vocab: 8000 }
    } else {
        Shape { hidden: 1024, ffn: 2816, layers: 16, heads: 16, kv_heads: 4, vocab: 32000 }
    };
    let (prompt_len, new) = if quick { (16, 8) } else { (16, 32) };
    let batch = 16;
    let dir = std::env::temp_dir().join(format!("dist-tensor-decode-model-{}", std::process::id()));
    let limits = Limits::measure();
    println!("CPU: {}", Cpu::read().describe());
    println!("{}", limits.describe());
    let params = shape.params();
    write_model(&dir, &shape)?;
    let d = shape.hidden / shape.heads;
    println!(
        "model: Llama shape, hidden {}, ffn {}, {} layers, {} heads ({} KV), vocab {}: {:.0} M \
         parameters, f32 ({:.2} GB); prompt {prompt_len} tokens, {new} new",
        shape.hidden,
        shape.ffn,
        shape.layers,
        shape.heads,
        shape.kv_heads,
        shape.vocab,
        params as f64 / 1e6,
        params as f64 * 4.0 / 1e9
    );
    // Bytes a decode step reads: every weight once (the embedding only its rows, negligible),
    // and the KV cache of every sequence so far (its mean length over the decode).
    let weights = (params - shape.vocab * shape.hidden) as f64 * 4.0;
    let kv_per_position = (shape.layers * 2 * shape.kv_heads * d) as f64 * 4.0;
    let mean_len = (prompt_len + new / 2) as f64;
    // Flops of one position through the products (2 per weight; attention's are few here).
    let flops_per_position = 2.0 * (params - shape.vocab * shape.hidden) as f64;
    let bytes_floor =
        |sequences: f64| (weights + sequences * kv_per_position * mean_len) / limits.read_bw;
    // Batch 1: a decode step. Batch 16: the whole run, prefills included, in seconds.
    let floor1 = bytes_floor(1.0).max(flops_per_position / limits.flops_all);
    let positions_run = (batch * (prompt_len + new)) as f64;
    let floor_run = (new as f64 * bytes_floor(batch as f64))
        .max(positions_run * flops_per_position / limits.flops_all);
    println!(
        "\n| ranks | batch 1: ms/token | floor ms | of floor | batch {batch}: tokens/s | floor tokens/s | of floor |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for ranks in [1, 2, 4] {
        let prompt: Vec<u32> =
            (0..prompt_len as u32).map(|i| (i * 37 + 11) % shape.vocab as u32).collect();
        let prompts: Vec<Vec<u32>> = (0..batch)
            .map(|b| prompt.iter().map(|&t| (t + 101 * b as u32) % shape.vocab as u32).collect())
            .collect();
        let out = World::threads(ranks)?.run(|rank| {
            let model = models::load::<f32>(rank, &dir)?;
            let options = GenerateOptions::greedy(new);
            // Batch 1: the decode's time per token, from the first token (the prefill's) on.
            let mut stamps = Vec::with_capacity(new);
            let start = Instant::now();
            model.generate(&prompt, &options, |_| stamps.push(start.elapsed().as_secs_f64()))?;
            let per_token = (stamps[new - 1] - stamps[0]) / (new - 1) as f64;
            // Batch 16: every token of every request over the whole run, prefills included.
            let positions = batch * (prompt_len + new);
            let blocks = positions.div_ceil(options.block_size) + batch;
            let start = Instant::now();
            let all = model.generate_batch(&prompts, &options, blocks)?;
            let tokens: usize = all.iter().map(Vec::len).sum();
            Ok((per_token, tokens as f64 / start.elapsed().as_secs_f64()))
        })?;
        let (per_token, rate) = out[0];
        let floor_rate = (batch * new) as f64 / floor_run;
        println!(
            "| {ranks} | {:.2} | {:.2} | {:.2}x | {:.0} | {:.0} | {:.2}x |",
            per_token * 1e3,
            floor1 * 1e3,
            per_token / floor1,
            rate,
            floor_rate,
            floor_rate / rate
        );
    }
    println!(
        "\nfloor: the weights ({:.2} GB, all ranks together) and the KV cache read once per decode \
         step at {:.1} GB/s (this machine's read bandwidth on all cores), or {:.2} GFLOP a \
         position at {:.0} GFLOP/s (its f32 peak on all cores), whichever is longer; batch \
         {batch}'s rate and floor include its prefills. \"of floor\": the time over the floor's.",
        weights / 1e9,
        limits.read_bw / 1e9,
        flops_per_position / 1e9,
        limits.flops_all / 1e9
    );
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}
