//! 10: generation with a published model, tensor-parallel over the ranks, through a paged KV
//! cache.
//!
//! Run: `cargo run --release --example 10_generate -- --model DIR [--ranks N | --processes N]
//! [--device cuda] --tokens 1,17,42 [--max-new 20] [--greedy] [--dtype f32|bf16|f16]
//! [--temperature T] [--top-k K] [--top-p P] [--repetition-penalty R] [--seed S] [--stop 2,7]
//! [--recompute] [--batch N] [--prompt TEXT] [--experts auto|tp|ep]`
//!
//! `DIR` is a Hugging Face model directory (`config.json`, `model.safetensors` or the sharded
//! `model-0000x-of-0000y.safetensors` with their index): Llama 2 / 3, Mistral, Qwen2, Qwen3,
//! GPT-2, Mixtral or Qwen2-MoE, for example `tests/data/models/llama3`. Each rank reads only its
//! slice of the weights (`models::load_with`); `--experts tp|ep` splits an MoE model's experts
//! tensor-parallel or expert-parallel (`auto`, the default: expert-parallel where the backend
//! has the dispatch, see `models::ExpertLayout`). The example prints one line `ids: 5 9 ...` (the new token ids), then the
//! time per token. `--ranks N` runs N ranks as threads (1 by default), `--processes N` as N
//! processes of this program; under mpirun or torchrun each process is one rank.
//!
//! Greedy by default (`--greedy`); `--temperature T` (above 0) samples, with `--top-k`,
//! `--top-p`, `--repetition-penalty` and a `--seed` (the same tokens on any number of ranks);
//! `--stop` ends at any of those ids. The prompt is prefilled into the KV cache, then each token
//! decoded against it: the example prints the prefill's and the decode's tokens per second.
//! `--recompute` times the loop that recomputes the whole window at every token instead (the
//! reference the cached path is tested against). `--batch N` serves N prompts (the given one
//! and its rotations) by continuous batching in one shared cache and prints their total tokens
//! per second. `--prompt TEXT` instead of `--tokens` encodes the text with the model's
//! `tokenizer.json` (special tokens added as the tokenizer says), and the new tokens are printed
//! decoded too (`text: ...`).

#[path = "common/device.rs"]
mod device;

use std::time::Instant;

use dist_tensor::models::{ExpertLayout, GenerateOptions, LoadOptions};
use dist_tensor::{Element, Error, World, models};
use half::{bf16, f16};

struct Args {
    model: String,
    tokens: Vec<u32>,
    dtype: String,
    options: GenerateOptions,
    recompute: bool,
    batch: usize,
    load: LoadOptions,
    /// The model's tokenizer, when the prompt was text.
    tokenizer: Option<tokenizers::Tokenizer>,
}

fn ids(flag: &str, value: &str) -> Result<Vec<u32>, String> {
    value
        .split(',')
        .map(|t| t.trim().parse().map_err(|_| format!("{flag}: {t:?} is not an id")))
        .collect()
}

fn number<N: std::str::FromStr>(flag: &str, value: &str) -> Result<N, String> {
    value.parse().map_err(|_| format!("{flag} {value}: not a number"))
}

fn parse(args: Vec<String>) -> Result<Args, String> {
    let mut out = Args {
        model: String::new(),
        tokens: Vec::new(),
        dtype: "f32".into(),
        options: GenerateOptions::greedy(20),
        recompute: false,
        batch: 0,
        load: LoadOptions::default(),
        tokenizer: None,
    };
    let mut prompt = None;
    let mut it = args.into_iter();
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--greedy" => {
                out.options.temperature = 0.0;
                continue;
            }
            "--recompute" => {
                out.recompute = true;
                continue;
            }
            _ => {}
        }
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let o = &mut out.options;
        match flag.as_str() {
            "--model" => out.model = value,
            "--tokens" => out.tokens = ids(&flag, &value)?,
            "--prompt" => prompt = Some(value),
            "--stop" => o.stop = ids(&flag, &value)?,
            "--max-new" => o.max_new = number(&flag, &value)?,
            "--temperature" => o.temperature = number(&flag, &value)?,
            "--top-k" => o.top_k = Some(number(&flag, &value)?),
            "--top-p" => o.top_p = Some(number(&flag, &value)?),
            "--repetition-penalty" => o.repetition_penalty = number(&flag, &value)?,
            "--seed" => o.seed = number(&flag, &value)?,
            "--batch" => out.batch = number(&flag, &value)?,
            "--dtype" if ["f32", "bf16", "f16"].contains(&value.as_str()) => out.dtype = value,
            "--experts" => {
                out.load.experts = match value.as_str() {
                    "auto" => ExpertLayout::Auto,
                    "tp" => ExpertLayout::TensorParallel,
                    "ep" => ExpertLayout::ExpertParallel,
                    _ => return Err(format!("--experts {value}: auto, tp or ep")),
                }
            }
            _ => return Err(format!("unknown argument {flag} {value}; see the file's header")),
        }
    }
    out.options.check().map_err(|e| e.to_string())?;
    if out.recompute && out.options.temperature != 0.0 {
        return Err("--recompute is the greedy reference: no sampling".into());
    }
    if out.model.is_empty() {
        return Err("--model DIR is required".into());
    }
    if let Some(text) = prompt {
        let path = std::path::Path::new(&out.model).join("tokenizer.json");
        let tokenizer = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| format!("--prompt: {}: {e}", path.display()))?;
        let encoding =
            tokenizer.encode(text.as_str(), true).map_err(|e| format!("--prompt: {e}"))?;
        out.tokens = encoding.get_ids().to_vec();
        out.tokenizer = Some(tokenizer);
    }
    if out.tokens.is_empty() {
        return Err("--tokens 1,17,42 or --prompt TEXT is required".into());
    }
    Ok(out)
}

/// The new ids, the seconds to the first (the prefill), and the seconds of the rest.
fn generate<T: Element>(world: &World, args: &Args) -> Result<Vec<(Vec<u32>, f64, f64)>, Error> {
    world.run(|rank| {
        let model = models::load_with::<T>(rank, &args.model, &args.load)?;
        let start = Instant::now();
        if args.recompute {
            let ids = model.generate_greedy(&args.tokens, args.options.max_new)?;
            return Ok((ids, 0.0, start.elapsed().as_secs_f64()));
        }
        let mut first = None;
        let ids = model.generate(&args.tokens, &args.options, |_| {
            first.get_or_insert_with(|| start.elapsed().as_secs_f64());
        })?;
        let total = start.elapsed().as_secs_f64();
        let prefill = first.unwrap_or(total);
        Ok((ids, prefill, total - prefill))
    })
}

/// Every request's new ids, and the seconds of the whole batch.
type Batch = (Vec<Vec<u32>>, f64);

/// `--batch N`: N rotations of the prompt by continuous batching, on every rank.
fn batch<T: Element>(world: &World, args: &Args) -> Result<Vec<Batch>, Error> {
    let n = args.tokens.len();
    let prompts: Vec<Vec<u32>> =
        (0..args.batch).map(|i| (0..n).map(|j| args.tokens[(i + j) % n]).collect()).collect();
    let positions = prompts.iter().map(|p| p.len() + args.options.max_new).sum::<usize>();
    let blocks = positions.div_ceil(args.options.block_size) + args.batch;
    world.run(|rank| {
        let model = models::load_with::<T>(rank, &args.model, &args.load)?;
        let start = Instant::now();
        let out = model.generate_batch(&prompts, &args.options, blocks)?;
        Ok((out, start.elapsed().as_secs_f64()))
    })
}

fn main() -> Result<(), Error> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let Some(world) = device::world_from_args(&mut args, 1)? else { return Ok(()) };
    let args = parse(args).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2);
    });
    if args.batch > 0 {
        let out = match args.dtype.as_str() {
            "bf16" => batch::<bf16>(&world, &args)?,
            "f16" => batch::<f16>(&world, &args)?,
            _ => batch::<f32>(&world, &args)?,
        };
        if world.ranks_here().contains(&0) {
            let (all, secs) = &out[0];
            for (i, ids) in all.iter().enumerate() {
                let text: Vec<String> = ids.iter().map(u32::to_string).collect();
                println!("request {i}: ids: {}", text.join(" "));
            }
            let tokens: usize = all.iter().map(Vec::len).sum();
            println!(
                "{} requests, {tokens} tokens in {:.3} ms ({:.0} tokens/s), continuous batching; \
                 {} ranks, {}",
                args.batch,
                secs * 1e3,
                tokens as f64 / secs.max(1e-12),
                world.num_ranks(),
                args.dtype
            );
        }
        return Ok(());
    }
    let out = match args.dtype.as_str() {
        "bf16" => generate::<bf16>(&world, &args)?,
        "f16" => generate::<f16>(&world, &args)?,
        _ => generate::<f32>(&world, &args)?,
    };
    if world.ranks_here().contains(&0) {
        let (ids, prefill, decode) = &out[0];
        let n = ids.len();
        let text: Vec<String> = ids.iter().map(u32::to_string).collect();
        println!("ids: {}", text.join(" "));
        if let Some(tokenizer) = &args.tokenizer {
            let decoded = tokenizer.decode(ids, true).map_err(|e| Error::InvalidArgument {
                op: "10_generate",
                rank: 0,
                reason: format!("decoding the new tokens: {e}"),
            })?;
            println!("text: {decoded}");
        }
        let (ranks, dtype) = (world.num_ranks(), &args.dtype);
        if args.recompute {
            println!(
                "time per token: {:.3} ms ({n} tokens, {ranks} ranks, {dtype}, the window \
                 recomputed each step)",
                decode * 1e3 / n.max(1) as f64
            );
        } else {
            println!(
                "prefill: {} tokens in {:.3} ms ({:.0} tokens/s); decode: {} tokens in {:.3} ms \
                 ({:.3} ms/token, {:.0} tokens/s); {ranks} ranks, {dtype}, KV cache",
                args.tokens.len(),
                prefill * 1e3,
                args.tokens.len() as f64 / prefill.max(1e-12),
                n.saturating_sub(1),
                decode * 1e3,
                decode * 1e3 / n.saturating_sub(1).max(1) as f64,
                n.saturating_sub(1) as f64 / decode.max(1e-12)
            );
        }
    }
    Ok(())
}
