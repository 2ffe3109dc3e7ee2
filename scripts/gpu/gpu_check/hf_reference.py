#!/usr/bin/env python3
"""transformers' side of the parity check: next-token logits and a greedy continuation.

    python3 scripts/gpu/gpu_check/hf_reference.py --model DIR --ids FILE [--prompt 0] [--steps 32]
        [--dtypes bf16,f32] [--device cuda] [--attn eager] --out FILE

For each dtype: loads DIR with `AutoModelForCausalLM.from_pretrained(dtype=..., attn_implementation=
--attn)` straight onto --device, runs the prompt (token ids from `stageb probe ids`), keeps the
last position's logits (cast to f32), then feeds the argmax back --steps - 1 times through the
KV cache (never stopping at EOS, as `stageb probe logits` does), recording per step the 8 best
ids with their logits and the largest |logit| (to tell a near-tie from a real divergence).
f32 runs with TF32 off. Writes {"versions", "device", "attn", "<dtype>": {"logits", "greedy",
"greedy_steps", "load_s", "prefill_s", "greedy_s", "peak_mem_bytes"}} to --out.
"""

import argparse
import os
import sys
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    free, load_model, log, read_prompts, sync, torch_setup, versions, write_json)

TOP_K = 8


def run_dtype(a, dev, name, ids):
    import torch

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t = time.time()
    model = load_model(a.model, name, a.attn, dev)
    sync(dev)
    load_s = time.time() - t
    x = torch.tensor([ids], device=dev)
    with torch.no_grad():
        t = time.time()
        out = model(input_ids=x, use_cache=True)
        first = out.logits[0, -1].float()
        sync(dev)
        prefill_s = time.time() - t
        t = time.time()
        tokens, steps = [], []
        logits = first
        for step in range(a.steps):
            nxt = int(torch.argmax(logits))  # the first of equal maxima
            top = torch.topk(logits, TOP_K)
            tokens.append(nxt)
            steps.append(dict(top_ids=top.indices.tolist(), top_logits=top.values.tolist(),
                              max_abs_logit=float(logits.abs().max())))
            if step + 1 < a.steps:
                out = model(input_ids=torch.tensor([[nxt]], device=dev),
                            past_key_values=out.past_key_values, use_cache=True)
                logits = out.logits[0, -1].float()
        sync(dev)
        greedy_s = time.time() - t
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    log(f"{name}: load {load_s:.1f} s, prefill {prefill_s:.2f} s, {a.steps} greedy "
        f"{greedy_s:.2f} s, greedy {tokens[:8]}")
    result = dict(logits=first.tolist(), greedy=tokens, greedy_steps=steps, load_s=load_s,
                  prefill_s=prefill_s, greedy_s=greedy_s, peak_mem_bytes=peak)
    del model, out, logits, first
    free(dev)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids", required=True)
    ap.add_argument("--prompt", type=int, default=0)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--dtypes", default="bf16,f32")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--attn", default="eager")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = torch_setup(a.device)
    ids = read_prompts(a.ids)[a.prompt]
    result = dict(versions=versions(), device=a.device, attn=a.attn, prompt_tokens=len(ids))
    for name in a.dtypes.split(","):
        result[name] = run_dtype(a, dev, name, ids)
        write_json(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
