//! 10: greedy generation with a published model, tensor-parallel over the ranks.
//!
//! Run: `cargo run --release --example 10_generate -- --model DIR [--ranks N | --processes N]
//! [--device cuda] --tokens 1,17,42 [--max-new 20] [--greedy] [--dtype f32|bf16|f16]`
//!
//! `DIR` is a Hugging Face model directory (`config.json`, `model.safetensors` or the sharded
//! `model-0000x-of-0000y.safetensors` with their index): Llama 2 / 3, Mistral, Qwen2, Qwen3 or
//! GPT-2, for example `tests/data/models/llama3`. Each rank reads only its slice of the weights
//! (`models::load`). The example prints one line `ids: 5 9 ...` (the new token ids), then the
//! time per token. `--ranks N` runs N ranks as threads (1 by default), `--processes N` as N
//! processes of this program; under mpirun or torchrun each process is one rank.
//!
//! Sampling is greedy (`--greedy` is accepted and is the only mode so far), each step
//! recomputing the whole window (no KV cache yet). Text prompts through `tokenizer.json` are not
//! supported yet: pass token ids with `--tokens`.

#[path = "common/device.rs"]
mod device;

use std::time::Instant;

use dist_tensor::{Element, Error, World, models};
use half::{bf16, f16};

struct Args {
    model: String,
    tokens: Vec<u32>,
    max_new: usize,
    dtype: String,
}

fn parse(args: Vec<String>) -> Result<Args, String> {
    let mut out =
        Args { model: String::new(), tokens: Vec::new(), max_new: 20, dtype: "f32".into() };
    let mut it = args.into_iter();
    while let Some(flag) = it.next() {
        if flag == "--greedy" {
            continue;
        }
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--model" => out.model = value,
            "--tokens" => {
                out.tokens = value
                    .split(',')
                    .map(|t| t.trim().parse().map_err(|_| format!("--tokens: {t:?} is not an id")))
                    .collect::<Result<_, _>>()?
            }
            "--max-new" => {
                out.max_new =
                    value.parse().map_err(|_| format!("--max-new {value}: not a number"))?
            }
            "--dtype" if ["f32", "bf16", "f16"].contains(&value.as_str()) => out.dtype = value,
            _ => return Err(format!("unknown argument {flag} {value}; see the file's header")),
        }
    }
    if out.model.is_empty() {
        return Err("--model DIR is required".into());
    }
    if out.tokens.is_empty() {
        return Err("--tokens 1,17,42 is required (text prompts are not supported yet)".into());
    }
    Ok(out)
}

fn generate<T: Element>(world: &World, args: &Args) -> Result<Vec<(Vec<u32>, f64)>, Error> {
    world.run(|rank| {
        let model = models::load::<T>(rank, &args.model)?;
        let start = Instant::now();
        let ids = model.generate_greedy(&args.tokens, args.max_new)?;
        Ok((ids, start.elapsed().as_secs_f64()))
    })
}

fn main() -> Result<(), Error> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let Some(world) = device::world_from_args(&mut args, 1)? else { return Ok(()) };
    let args = parse(args).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2);
    });
    let out = match args.dtype.as_str() {
        "bf16" => generate::<bf16>(&world, &args)?,
        "f16" => generate::<f16>(&world, &args)?,
        _ => generate::<f32>(&world, &args)?,
    };
    if world.ranks_here().contains(&0) {
        let (ids, secs) = &out[0];
        let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
        println!("ids: {}", ids.join(" "));
        println!(
            "time per token: {:.3} ms ({} tokens, {} ranks, {}, the window recomputed each step)",
            secs * 1e3 / args.max_new.max(1) as f64,
            args.max_new,
            world.num_ranks(),
            args.dtype
        );
    }
    Ok(())
}
