#!/usr/bin/env python3
"""Load a Hugging Face model directory with `transformers` and compare its logits to a reference.

    check_hf_model.py DIR REFERENCE_JSON [--tol 1e-4]

loads DIR with AutoModelForCausalLM.from_pretrained (unchanged transformers code; no missing,
unexpected or mismatched tensors allowed), runs the reference's "prompt_ids", prints the max abs
difference to its "prompt_logits", and exits 1 above --tol. When the reference has
"greedy_new_ids" the greedy continuation (model.generate, do_sample=False, EOS disabled) must
match it too (float32 runs only; skip with --no-greedy). With --dtype bfloat16 (or auto on a bf16
checkpoint) the model runs in bf16 and is compared to "bf16_prompt_logits" (pass a larger --tol).

    check_hf_model.py DIR --write-logits OUT.json [--prompt-ids 1,0,17]

dumps the model's float32 logits for a prompt (default: the reference's prompt_ids) in the
reference.json layout ("prompt_ids", "prompt_logits", "greedy_new_ids"), e.g. to compare a
directory saved by the Rust library against the Rust logits.

The main use: a model fine-tuned and saved back by the Rust library must load in transformers
unchanged and give the logits the Rust side computed.
"""

import argparse
import copy
import json
import os
import sys

INSTALL = """install (CPython 3.11, CPU only, PyPI only):
  python3 -m venv ~/.venv-ref
  ~/.venv-ref/bin/pip install -r scripts/requirements-reference.txt
  (PyPI's Linux torch wheel needs the nvidia-*-cu12 wheels to import, even on CPU)

examples:
  ~/.venv-ref/bin/python scripts/check_hf_model.py tests/data/models/llama3 tests/data/models/llama3/reference.json
  ~/.venv-ref/bin/python scripts/check_hf_model.py tests/data/models/qwen2 tests/data/models/qwen2/reference.json \\
      --dtype bfloat16 --tol 1e-3
  ~/.venv-ref/bin/python scripts/check_hf_model.py /tmp/saved --write-logits /tmp/saved_logits.json --prompt-ids 1,0,17
"""


def parse_args():
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=INSTALL,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dir", help="model directory (config.json + safetensors)")
    p.add_argument("reference", nargs="?", help="reference JSON with prompt_ids and prompt_logits")
    p.add_argument("--tol", type=float, default=1e-4, help="max allowed abs logit difference (default: %(default)s)")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16", "auto"],
        default="float32",
        help="dtype to load and run the model in; 'auto' uses the config's dtype (default: %(default)s)",
    )
    p.add_argument("--no-greedy", action="store_true", help="do not compare greedy_new_ids")
    p.add_argument("--write-logits", metavar="OUT.json", help="write the model's logits for the prompt to OUT.json")
    p.add_argument("--prompt-ids", help="comma-separated prompt ids (default: the reference's prompt_ids)")
    p.add_argument("--max-new", type=int, default=8, help="greedy tokens written by --write-logits (default: 8)")
    p.add_argument("--attn", default="eager", help="attn_implementation (default: %(default)s)")
    args = p.parse_args()
    if args.reference is None and args.write_logits is None:
        p.error("give REFERENCE_JSON, --write-logits OUT.json, or both")
    if args.reference is None and args.prompt_ids is None:
        p.error("--write-logits without REFERENCE_JSON needs --prompt-ids")
    return args


def load_model(path, dtype_name, attn):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = "auto" if dtype_name == "auto" else getattr(torch, dtype_name)
    model, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attn, output_loading_info=True
    )
    problems = {k: v for k, v in info.items() if v}
    # error_msgs is a list of strings; the others are lists of tensor names.
    if problems:
        for k, v in problems.items():
            print(f"FAIL loading {path}: {k}: {sorted(v) if not isinstance(v, str) else v}")
        sys.exit(1)
    model.eval()
    return model


def greedy(model, prompt, n_new):
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


def main():
    args = parse_args()
    import numpy as np
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)

    ref = None
    if args.reference:
        with open(args.reference) as f:
            ref = json.load(f)
    prompt = [int(x) for x in args.prompt_ids.split(",")] if args.prompt_ids else ref["prompt_ids"]

    model = load_model(args.dir, args.dtype, args.attn)
    vocab = model.config.vocab_size
    if max(prompt) >= vocab or min(prompt) < 0:
        print(f"FAIL: prompt ids {prompt} outside vocab {vocab}")
        return 1
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    print(
        f"{args.dir}: {type(model).__name__} dtype={next(model.parameters()).dtype} "
        f"transformers={transformers.__version__} torch={torch.__version__} prompt={prompt}"
    )

    rc = 0
    if args.write_logits:
        new_ids = greedy(model, prompt, args.max_new)
        out = {
            "model_dir": os.path.abspath(args.dir),
            "architecture": type(model).__name__,
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__.split("+")[0],
            "prompt_ids": prompt,
            "prompt_logits_shape": list(logits.shape),
            "prompt_logits": [[float(str(np.float32(x))) for x in row] for row in logits.numpy()],
            "greedy_new_ids": new_ids,
        }
        with open(args.write_logits, "w") as f:
            json.dump(out, f)
            f.write("\n")
        print(f"wrote {args.write_logits}: logits {list(logits.shape)}, greedy {new_ids}")

    if ref is not None:
        run_dtype = next(model.parameters()).dtype
        key = "bf16_prompt_logits" if run_dtype == torch.bfloat16 else "prompt_logits"
        if prompt != ref["prompt_ids"]:
            print(f"FAIL: --prompt-ids {prompt} differ from the reference's {ref['prompt_ids']}")
            return 1
        want = torch.tensor(ref[key], dtype=torch.float32)
        if want.shape != logits.shape:
            print(f"FAIL: logits shape {list(logits.shape)} != reference {key} {list(want.shape)}")
            return 1
        diff = (logits - want).abs()
        max_diff = float(diff.max())
        pos, tok = divmod(int(diff.argmax()), diff.shape[1])
        ok = max_diff <= args.tol
        print(
            f"{'ok  ' if ok else 'FAIL'} logits vs {key}: max abs diff {max_diff:.3e} "
            f"(at position {pos}, token {tok}; tol {args.tol:g})"
        )
        rc |= 0 if ok else 1
        if not args.no_greedy and "greedy_new_ids" in ref and run_dtype == torch.float32:
            got = greedy(model, prompt, len(ref["greedy_new_ids"]))
            ok = got == ref["greedy_new_ids"]
            print(f"{'ok  ' if ok else 'FAIL'} greedy {got} {'==' if ok else '!='} reference {ref['greedy_new_ids']}")
            rc |= 0 if ok else 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
