#!/usr/bin/env python3
"""Write tiny, randomly initialised Hugging Face models and their `transformers` reference outputs.

For each architecture of issue 53 this writes tests/data/models/<name>/ holding exactly what
`save_pretrained` writes (config.json, generation_config.json, safetensors weights) plus
reference.json (prompt logits, greedy continuations, bf16 logits, versions, seed). The Rust tests
compare against these committed files, so CI never needs Python.

Install (CPython 3.11, Linux x86_64, CPU only, PyPI only):

    python3 -m venv ~/.venv-ref
    ~/.venv-ref/bin/pip install -r scripts/requirements-reference.txt

(PyPI's Linux torch wheel is the CUDA build and needs the nvidia-*-cu12 wheels at import time even
on CPU, so `pip install --no-deps torch` does not work; the whole venv is about 6.7 GB.)

Regenerate everything (from the repository root):

    ~/.venv-ref/bin/python scripts/make_reference_models.py --out tests/data/models

then check each directory loads back in transformers:

    for d in tests/data/models/*/; do
        ~/.venv-ref/bin/python scripts/check_hf_model.py "$d" "$d/reference.json" || exit 1
    done

The output is deterministic for the pinned versions: each model is built after
torch.manual_seed(seed); seeds are tried in order from --seed until every greedy step has a
top-1 minus top-2 logit gap of at least --min-margin (and, for MoE models, every router's k-th and
(k+1)-th expert logits differ by at least --min-router-margin), and the seed used is recorded.
"""

import argparse
import copy
import json
import os
import shutil
import sys

INSTALL = """install (CPython 3.11, CPU only, PyPI only):
  python3 -m venv ~/.venv-ref
  ~/.venv-ref/bin/pip install -r scripts/requirements-reference.txt
  (PyPI's Linux torch wheel needs the nvidia-*-cu12 wheels to import, even on CPU)

regenerate (from the repository root):
  ~/.venv-ref/bin/python scripts/make_reference_models.py --out tests/data/models
"""

# Fixed prompts. Ids near 0 and near vocab-1 are included on purpose (embedding / vocab-parallel
# edge rows). Every id is < 128.
VOCAB = 128
PROMPT_IDS = [1, 0, 17, 42, 99, 126, 127]
BATCH_PROMPT_IDS = [
    [3, 64, 127, 9],
    [1, 120, 5, 77, 0, 33, 101, 50, 12, 126],
]
MAX_NEW = 8
# Weight init std (config.initializer_range). The default 0.02 gives logits of std ~0.16 and
# top-1/top-2 gaps of ~1e-3 over a greedy run; 0.3 gives logits of std ~2.4, clear greedy
# margins, and continuations that do not collapse into one repeated token.
INIT_RANGE = 0.3

# Corpus for the llama2 tokenizer (a tiny BPE trained with the `tokenizers` package).
TOKENIZER_CORPUS = [
    "the quick brown fox jumps over the lazy dog.",
    "a tensor is split over many ranks, and each rank holds one slice of the weights.",
    "the model reads its weights from safetensors files and runs the same math as transformers.",
    "attention heads are divided between the devices; the mlp is split by columns and then by rows.",
    "every rank sends its partial sums, and the results are added together at the end.",
    "small models are fast to test, so the tests run on every change.",
    "the cat sat on the mat, and the dog sat on the log.",
    "we load a checkpoint, shard it, run it, train it and save it back.",
    "greedy decoding picks the token with the largest logit at every step.",
    "rotary position embeddings turn each pair of features by an angle that grows with the position.",
    "one, two, three, four, five, six, seven, eight, nine, ten.",
    "hello world! this is a test of the tiny tokenizer: it knows only a few words.",
]
TEXT_PROMPT = "the model reads the weights and the tests run"


def parse_args():
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=INSTALL,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="tests/data/models", help="output directory (default: %(default)s)")
    p.add_argument("--seed", type=int, default=53, help="first seed tried for every model (default: %(default)s)")
    p.add_argument("--max-tries", type=int, default=200, help="seeds tried per model before giving up")
    p.add_argument(
        "--min-margin",
        type=float,
        default=0.05,
        help="smallest allowed top-1 minus top-2 logit gap over all greedy steps (default: %(default)s)",
    )
    p.add_argument(
        "--min-router-margin",
        type=float,
        default=0.01,
        help="smallest allowed gap between the k-th and (k+1)-th router logit of MoE layers "
        "over every token the tests run (default: %(default)s)",
    )
    p.add_argument("--only", nargs="*", help="generate only these model names")
    return p.parse_args()


# ---------------------------------------------------------------------------------------------
# Model definitions
# ---------------------------------------------------------------------------------------------

COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


def model_specs(T):
    """name -> (config class, model class, config kwargs, save options)."""
    return {
        "llama2": (
            T.LlamaConfig,
            T.LlamaForCausalLM,
            dict(
                COMMON,
                num_key_value_heads=4,
                max_position_embeddings=256,
                rms_norm_eps=1e-5,
                rope_theta=10000.0,
                tie_word_embeddings=False,
                initializer_range=INIT_RANGE,
            ),
            dict(tokenizer=True),
        ),
        "llama3": (
            T.LlamaConfig,
            T.LlamaForCausalLM,
            dict(
                COMMON,
                num_key_value_heads=2,
                rms_norm_eps=1e-5,
                rope_theta=500000.0,
                # head_dim 16 and theta 5e5 give rotary wavelengths 6.3, 32.5, 168, 870, ... positions.
                # With original_max_position_embeddings 64 and the Llama 3.1 factors, the llama3
                # scaling leaves the first pair alone (wavelength < 64/4), smooths the second
                # (between 16 and 64) and divides the others by 8: all three branches matter, and
                # they change the logits of a 7-token prompt measurably (see reference.json
                # "rope_scaling_effect_max_abs").
                max_position_embeddings=512,
                rope_scaling=dict(
                    rope_type="llama3",
                    factor=8.0,
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=64,
                ),
                tie_word_embeddings=False,
                initializer_range=INIT_RANGE,
            ),
            dict(max_shard_size="150KB"),
        ),
        "mistral": (
            T.MistralConfig,
            T.MistralForCausalLM,
            dict(
                COMMON,
                num_key_value_heads=2,
                max_position_embeddings=4096,
                sliding_window=4096,
                rms_norm_eps=1e-5,
                rope_theta=10000.0,
                tie_word_embeddings=False,
                initializer_range=INIT_RANGE,
            ),
            dict(),
        ),
        "qwen2": (
            T.Qwen2Config,
            T.Qwen2ForCausalLM,
            dict(
                COMMON,
                num_key_value_heads=2,
                max_position_embeddings=1024,
                rms_norm_eps=1e-6,
                rope_theta=1000000.0,
                tie_word_embeddings=True,
                use_sliding_window=False,
                initializer_range=INIT_RANGE,
            ),
            dict(save_dtype="bfloat16"),
        ),
        "qwen3": (
            T.Qwen3Config,
            T.Qwen3ForCausalLM,
            dict(
                COMMON,
                num_key_value_heads=2,
                head_dim=32,  # != hidden_size / num_attention_heads (16)
                max_position_embeddings=1024,
                rms_norm_eps=1e-6,
                rope_theta=1000000.0,
                tie_word_embeddings=False,
                use_sliding_window=False,
                initializer_range=INIT_RANGE,
            ),
            dict(),
        ),
        "gpt2": (
            T.GPT2Config,
            T.GPT2LMHeadModel,
            dict(
                vocab_size=VOCAB,
                n_embd=64,
                n_layer=2,
                n_head=4,
                n_inner=128,
                n_positions=64,
                bos_token_id=VOCAB - 1,
                eos_token_id=VOCAB - 1,
                tie_word_embeddings=True,
                initializer_range=INIT_RANGE,
            ),
            dict(),
        ),
        "mixtral": (
            T.MixtralConfig,
            T.MixtralForCausalLM,
            dict(
                COMMON,
                intermediate_size=32,  # per expert
                num_key_value_heads=2,
                num_local_experts=4,
                num_experts_per_tok=2,
                max_position_embeddings=4096,
                sliding_window=None,
                rms_norm_eps=1e-5,
                rope_theta=1000000.0,
                tie_word_embeddings=False,
                initializer_range=INIT_RANGE,
            ),
            dict(),
        ),
        "qwen2_moe": (
            T.Qwen2MoeConfig,
            T.Qwen2MoeForCausalLM,
            dict(
                COMMON,
                num_key_value_heads=2,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=128,
                num_experts=4,
                num_experts_per_tok=2,
                # norm_topk_prob left at the config default (False), as Qwen1.5-MoE has it
                max_position_embeddings=1024,
                rms_norm_eps=1e-6,
                rope_theta=1000000.0,
                tie_word_embeddings=False,
                use_sliding_window=False,
                initializer_range=INIT_RANGE,
            ),
            dict(),
        ),
    }


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def f32_list(t):
    """Nested lists of Python floats, each the shortest decimal that round-trips to the float32."""
    return f32_list_np(t.detach().to("cpu").float().numpy())


def f32_list_np(a):
    import numpy as np

    if a.ndim == 1:
        return [float(str(np.float32(x))) for x in a]
    return [f32_list_np(row) for row in a]


def dump_json(obj, path):
    """JSON with one line per innermost list of numbers (readable, diff-friendly)."""

    def enc(o, ind):
        pad = "  " * ind
        if isinstance(o, dict):
            if not o:
                return "{}"
            items = [f'{pad}  {json.dumps(k)}: {enc(v, ind + 1)}' for k, v in o.items()]
            return "{\n" + ",\n".join(items) + "\n" + pad + "}"
        if isinstance(o, list):
            if all(not isinstance(x, (list, dict)) for x in o):
                return "[" + ", ".join(json.dumps(x) for x in o) + "]"
            items = [pad + "  " + enc(x, ind + 1) for x in o]
            return "[\n" + ",\n".join(items) + "\n" + pad + "]"
        return json.dumps(o)

    with open(path, "w") as f:
        f.write(enc(obj, 0) + "\n")


def perturb_constant_params(model, gen, scale=0.1):
    """Norm weights start at 1 and biases at 0: a loader that skipped them would still match.
    Add seeded noise to every parameter that is constant after init so each one matters."""
    import torch

    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if p.numel() > 1 and torch.all(p == p.reshape(-1)[0]):
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)
            elif p.numel() == 1:
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)


def eos_ids(config):
    e = getattr(config, "eos_token_id", None)
    if e is None:
        return []
    return list(e) if isinstance(e, (list, tuple)) else [e]


def greedy_manual(model, prompt, n_new):
    """Greedy continuation by full-sequence forwards (no KV cache); returns (new ids, margins)."""
    import torch

    ids = list(prompt)
    margins = []
    with torch.no_grad():
        for _ in range(n_new):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            top = torch.topk(logits, 2)
            margins.append(float(top.values[0] - top.values[1]))
            ids.append(int(top.indices[0]))
    return ids[len(prompt):], margins


def greedy_generate(model, prompt, n_new):
    """model.generate(do_sample=False) with EOS disabled, so it always runs n_new steps."""
    import torch

    gc = copy.deepcopy(model.generation_config)
    gc.eos_token_id = None
    gc.do_sample = False
    gc.max_new_tokens = n_new
    gc.min_new_tokens = None
    gc.temperature = None
    gc.top_p = None
    gc.top_k = None
    gc.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), generation_config=gc
        )
    return [int(x) for x in out[0, len(prompt):]]


def router_min_margin(model, sequences, k):
    """Smallest gap between the k-th and (k+1)-th router logit over all layers and tokens."""
    import torch

    best = float("inf")
    with torch.no_grad():
        for seq in sequences:
            out = model(torch.tensor([seq]), output_router_logits=True)
            for rl in out.router_logits:
                top = torch.topk(rl.float(), k + 1, dim=-1).values
                best = min(best, float((top[:, k - 1] - top[:, k]).min()))
    return best


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False, min_frequency=1
    )
    tok.train_from_iterator(TOKENIZER_CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    if tok.get_vocab_size() != VOCAB:
        raise SystemExit(f"tokenizer vocab is {tok.get_vocab_size()}, want {VOCAB}: extend TOKENIZER_CORPUS")
    assert tok.token_to_id("<unk>") == 0 and tok.token_to_id("<s>") == 1 and tok.token_to_id("</s>") == 2
    return tok


def dir_size(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


# ---------------------------------------------------------------------------------------------
# One model
# ---------------------------------------------------------------------------------------------


def try_seed(name, spec, seed, args, tok):
    import torch

    cfg_cls, model_cls, cfg_kwargs, opts = spec
    config = cfg_cls(**cfg_kwargs)
    torch.manual_seed(seed)
    model = model_cls._from_config(config, attn_implementation="eager", torch_dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1_000_003)
    perturb_constant_params(model, gen)
    model.eval()
    if opts.get("save_dtype") == "bfloat16":
        # The file holds bf16 weights: the f32 references are for those weights upcast to f32.
        # Round the parameters only: the rotary inv_freq buffer stays float32, as from_pretrained
        # computes it.
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).to(torch.float32))

    runs = {"prompt": PROMPT_IDS}
    for i, p in enumerate(BATCH_PROMPT_IDS):
        runs[f"batch{i}"] = p
    text_prompt_ids = None
    if tok is not None:
        text_prompt_ids = tok.encode(TEXT_PROMPT).ids
        assert 0 not in text_prompt_ids, "text prompt has <unk> tokens"
        runs["text"] = text_prompt_ids

    results = {}
    min_margin = float("inf")
    bad_eos = set(eos_ids(model.config))
    for key, prompt in runs.items():
        new_ids, margins = greedy_manual(model, prompt, MAX_NEW)
        results[key] = (new_ids, margins)
        min_margin = min(min_margin, min(margins))
        if bad_eos & set(new_ids):
            return None, f"continuation of {key} contains eos {sorted(bad_eos & set(new_ids))}"
        if len(set(new_ids)) < 3:
            return None, f"continuation of {key} is degenerate: {new_ids}"
    if min_margin < args.min_margin:
        return None, f"greedy margin {min_margin:.4g} < {args.min_margin}"

    rmm = None
    if hasattr(model.config, "num_experts_per_tok"):
        seqs = [p + results[k][0] for k, p in runs.items()]
        rmm = router_min_margin(model, seqs, model.config.num_experts_per_tok)
        if rmm < args.min_router_margin:
            return None, f"router margin {rmm:.4g} < {args.min_router_margin}"

    return (model, runs, results, min_margin, rmm, text_prompt_ids), None


def make_model(name, spec, args, tok, versions):
    import torch

    out_dir = os.path.join(args.out, name)
    found = None
    reasons = []
    for seed in range(args.seed, args.seed + args.max_tries):
        found, why = try_seed(name, spec, seed, args, tok)
        if found is not None:
            break
        reasons.append(f"seed {seed}: {why}")
    if found is None:
        raise SystemExit(f"{name}: no seed in {args.max_tries} tries passed:\n  " + "\n  ".join(reasons[-5:]))
    model, runs, results, min_margin, rmm, text_prompt_ids = found
    _, _, _, opts = spec

    # Cross-check the manual greedy loop against model.generate (KV cache path).
    for key, prompt in runs.items():
        g = greedy_generate(model, prompt, MAX_NEW)
        if g != results[key][0]:
            raise SystemExit(f"{name}/{key}: generate() {g} != manual greedy {results[key][0]}")

    # Write the directory exactly as save_pretrained does (reference.json is added below).
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    save_model = model
    if opts.get("save_dtype") == "bfloat16":
        save_model = copy.deepcopy(model).to(torch.bfloat16)
    save_kwargs = dict(safe_serialization=True)
    if "max_shard_size" in opts:
        save_kwargs["max_shard_size"] = opts["max_shard_size"]
    save_model.save_pretrained(out_dir, **save_kwargs)
    del save_model

    # The references come from the directory as transformers loads it (AutoModelForCausalLM),
    # in float32 and in bfloat16, so check_hf_model.py reproduces them exactly.
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager").eval()
    loaded16 = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.bfloat16, attn_implementation="eager").eval()
    assert next(loaded16.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        mem_logits = model(torch.tensor([PROMPT_IDS])).logits[0].float()
        prompt_logits = loaded(torch.tensor([PROMPT_IDS])).logits[0].float()
        bf16_logits = loaded16(torch.tensor([PROMPT_IDS])).logits[0].float()
    reload_diff = float((mem_logits - prompt_logits).abs().max())
    if reload_diff > 1e-5:
        raise SystemExit(f"{name}: reloaded logits differ from the in-memory model by {reload_diff}")
    for key, prompt in runs.items():
        g = greedy_generate(loaded, prompt, MAX_NEW)
        if g != results[key][0]:
            raise SystemExit(f"{name}/{key}: reloaded generate() {g} != greedy {results[key][0]}")

    ref = {
        "model": name,
        "architecture": type(model).__name__,
        "seed": seed,
        "seeds_tried": seed - args.seed + 1,
        "transformers_version": versions["transformers"],
        "torch_version": versions["torch"],
        "attn_implementation": "eager",
        "saved_dtype": opts.get("save_dtype", "float32"),
        "vocab_size": VOCAB,
        "prompt_ids": PROMPT_IDS,
        "prompt_logits_shape": list(prompt_logits.shape),
        "prompt_logits": f32_list(prompt_logits),
        "greedy_new_ids": results["prompt"][0],
        "greedy_margins": [float(f"{m:.6g}") for m in results["prompt"][1]],
        "greedy_min_margin": float(f"{min_margin:.6g}"),
        "greedy_min_margin_covers": "every step of prompt_ids, batch_prompt_ids and text_prompt_ids greedy runs",
        "batch_prompt_ids": BATCH_PROMPT_IDS,
        "batch_greedy_new_ids": [results[f"batch{i}"][0] for i in range(len(BATCH_PROMPT_IDS))],
        "batch_note": "each prompt's greedy continuation was run alone (batch of one, no padding)",
        "bf16_prompt_logits": f32_list(bf16_logits),
        "bf16_max_abs_diff_vs_f32": float(f"{float((bf16_logits - prompt_logits).abs().max()):.6g}"),
        "prompt_logits_max_abs": float(f"{float(prompt_logits.abs().max()):.6g}"),
    }
    if rmm is not None:
        ref["router_min_margin"] = float(f"{rmm:.6g}")
    if name == "llama3":
        # How much the llama3 rope scaling changes the prompt logits (same weights, scaling off).
        cfg2 = copy.deepcopy(model.config)
        cfg2.rope_scaling = None
        plain = type(model)._from_config(cfg2, attn_implementation="eager", torch_dtype=torch.float32)
        plain.load_state_dict(model.state_dict())
        plain.eval()
        with torch.no_grad():
            pl = plain(torch.tensor([PROMPT_IDS])).logits[0].float()
        ref["rope_scaling_effect_max_abs"] = float(f"{float((pl - prompt_logits).abs().max()):.6g}")
    if tok is not None:
        new_ids = results["text"][0]
        ref["tokenizer"] = "tokenizer.json"
        ref["text_prompt"] = TEXT_PROMPT
        ref["text_prompt_ids"] = text_prompt_ids
        ref["text_greedy_new_ids"] = new_ids
        ref["text_greedy_decoded"] = tok.decode(new_ids)
        ref["text_full_decoded"] = tok.decode(text_prompt_ids + new_ids)
        ref["text_decode_note"] = "decoded with tokenizers' Tokenizer.decode(ids, skip_special_tokens=True)"

    if tok is not None:
        from transformers import PreTrainedTokenizerFast

        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
        )
        fast.save_pretrained(out_dir)
        # Round-trip check: the saved tokenizer.json gives the same ids and text.
        from tokenizers import Tokenizer

        t2 = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
        assert t2.encode(TEXT_PROMPT).ids == text_prompt_ids
        assert t2.decode(results["text"][0]) == ref["text_greedy_decoded"]
    ref["files"] = sorted(f for f in os.listdir(out_dir))
    dump_json(ref, os.path.join(out_dir, "reference.json"))

    shards = [f for f in ref["files"] if f.endswith(".safetensors")]
    print(
        f"{name:10s} seed={seed:<4d} tries={ref['seeds_tried']:<3d} greedy_min_margin={min_margin:.4f}"
        + (f" router_min_margin={rmm:.4f}" if rmm is not None else "")
        + f" bf16_diff={ref['bf16_max_abs_diff_vs_f32']:.3g} reload_diff={reload_diff:.2g} shards={len(shards)}"
        + f" size={dir_size(out_dir) / 1024:.0f}KiB greedy={ref['greedy_new_ids']}"
    )


def main():
    args = parse_args()
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)  # fixed reduction order for reproducible references
    T = transformers
    versions = {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0]}
    specs = model_specs(T)
    names = args.only or list(specs)
    for n in names:
        if n not in specs:
            raise SystemExit(f"unknown model {n!r}; known: {', '.join(specs)}")
    os.makedirs(args.out, exist_ok=True)
    for name in names:
        spec = specs[name]
        tok = build_tokenizer() if spec[3].get("tokenizer") else None
        make_model(name, spec, args, tok, versions)


if __name__ == "__main__":
    sys.exit(main())
