#!/usr/bin/env python3
"""transformers' side of the throughput check: the rollout workload with `generate`.

    python3 scripts/gpu/gpu_check/hf_throughput.py --model DIR --ids FILE [--tickets N]
        [--candidates 8] [--new-tokens 256] [--reps 3] [--batches auto|4|1,2,4]
        [--budget-s S] [--dtype bf16] [--attn sdpa] [--device cuda] --out FILE

The Python original's way: a batch of B tickets (prompts from `stageb probe ids`, left-padded
to the longest) goes through one `model.generate(..., num_return_sequences=candidates)` call,
sampling at temperature 0.7 / top-p 0.9 (no top-k), exactly --new-tokens per candidate
(`min_new_tokens` = `max_new_tokens`, so EOS cannot end a row early).

1. warm-up: one ticket, 4 new tokens;
2. batch search (--batches auto): B = 1, 2, 4, ... up to --tickets, one timed batch each, until
   one runs out of GPU memory or is >5 % slower per ticket than the best so far; the best B
   wins. (--batches 1,2,4 tries those; --batches 8 takes 8 without searching.)
3. the prefill of each batch size used, alone (`max_new_tokens=1`), to split a batch's time
   into prefill and decode;
4. --reps timed passes over the first --tickets prompts in batches of B; no batch starts after
   --budget-s seconds of steps 2-4 (the pass is then marked incomplete).

Writes the passes (tickets/min, decode tokens/s = generated tokens / (batch time - its
prefill), prefill tokens/s, decode step time), the search, and the peak GPU memory
(`torch.cuda.max_memory_allocated` over the timed passes) to --out.
"""

import argparse
import os
import sys
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    EOS_ID, free, load_model, log, read_prompts, sync, torch_setup, versions, write_json)


class Runner:
    def __init__(self, a, dev):
        import torch

        self.a, self.dev, self.torch = a, dev, torch
        t = time.time()
        self.model = load_model(a.model, a.dtype, a.attn, dev)
        sync(dev)
        self.load_s = time.time() - t
        self.pad = self.model.config.pad_token_id
        if self.pad is None:
            self.pad = EOS_ID
        self.prefill_s = {}

    def generate(self, prompts, new_tokens):
        """Seconds for one `generate` of these prompts (left-padded)."""
        torch = self.torch
        n = max(len(p) for p in prompts)
        ids = [[self.pad] * (n - len(p)) + p for p in prompts]
        mask = [[0] * (n - len(p)) + [1] * len(p) for p in prompts]
        x = torch.tensor(ids, device=self.dev)
        m = torch.tensor(mask, device=self.dev)
        sync(self.dev)
        t = time.time()
        with torch.no_grad():
            out = self.model.generate(
                input_ids=x, attention_mask=m, do_sample=True, temperature=self.a.temperature,
                top_p=self.a.top_p, top_k=0, max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, num_return_sequences=self.a.candidates,
                pad_token_id=self.pad, eos_token_id=EOS_ID, use_cache=True)
        sync(self.dev)
        dt = time.time() - t
        got = out.shape[1] - n
        assert got == new_tokens, f"generated {got} tokens, asked {new_tokens}"
        del out, x, m
        return dt

    def prefill(self, prompts):
        b = len(prompts)
        if b not in self.prefill_s:
            self.prefill_s[b] = self.generate(prompts, 1)
        return self.prefill_s[b]


def is_oom(e):
    return "out of memory" in str(e).lower()


def search(r, prompts, sizes, deadline):
    """[(B, seconds, tickets/min)] tried, and the best B."""
    tried, best = [], None
    for b in sizes:
        if time.time() > deadline and tried:
            break
        try:
            dt = r.generate(prompts[:b], r.a.new_tokens)
        except RuntimeError as e:  # torch.OutOfMemoryError is a RuntimeError
            if not is_oom(e):
                raise
            free(r.dev)
            tried.append(dict(batch=b, oom=True))
            log(f"batch {b}: out of memory")
            break
        rate = b / dt * 60
        tried.append(dict(batch=b, seconds=dt, tickets_per_min=rate))
        log(f"batch {b}: {dt:.2f} s, {rate:.2f} tickets/min")
        if best is None or rate > best[1]:
            best = (b, rate)
        elif rate < 0.95 * best[1]:
            break
    if best is None:
        raise SystemExit("no batch size fits")
    return tried, best[0]


def timed_pass(r, prompts, b, deadline):
    a = r.a
    batches, t0 = [], time.time()
    for i in range(0, len(prompts), b):
        if time.time() > deadline:
            break
        chunk = prompts[i:i + b]
        dt = r.generate(chunk, a.new_tokens)
        batches.append(dict(tickets=len(chunk), seconds=dt,
                            prompt_tokens=sum(len(p) for p in chunk)))
    wall = time.time() - t0
    done = sum(x["tickets"] for x in batches)
    if not done:
        return None
    for x in batches:
        x["prefill_s"] = r.prefill(prompts[:x["tickets"]])
    gen = done * a.candidates * a.new_tokens
    decode = sum(max(x["seconds"] - x["prefill_s"], 1e-9) for x in batches)
    prefill = sum(x["prefill_s"] for x in batches)
    rows_tokens = sum(x["prompt_tokens"] for x in batches) * a.candidates
    return dict(
        tickets_done=done, complete=done == len(prompts), wall_s=wall,
        tickets_per_min=done / wall * 60, decode_tok_s=gen / decode,
        # num_return_sequences copies each prompt before the prefill: every row is prefilled.
        prefill_tok_s=rows_tokens / prefill, prefill_rows_tokens=rows_tokens,
        generated_tok_s=gen / wall,
        decode_step_ms=decode * 1e3 / (len(batches) * max(a.new_tokens - 1, 1)),
        batches=batches)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids", required=True)
    ap.add_argument("--tickets", type=int)
    ap.add_argument("--candidates", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batches", default="auto")
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import torch

    dev = torch_setup(a.device)
    prompts = read_prompts(a.ids)[:a.tickets]
    r = Runner(a, dev)
    log(f"loaded {a.model} ({a.dtype}, {a.attn}) in {r.load_s:.1f} s; {len(prompts)} tickets")
    t = time.time()
    r.generate(prompts[:1], 4)
    warmup_s = time.time() - t
    deadline = time.time() + a.budget_s
    if a.batches == "auto":
        sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= len(prompts)]
    else:
        sizes = [int(x) for x in a.batches.split(",")]
    tried, best = (search(r, prompts, sizes, deadline) if len(sizes) > 1
                   else ([], min(sizes[0], len(prompts))))
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    passes = []
    for _ in range(a.reps):
        p = timed_pass(r, prompts, best, deadline)
        if p is None:
            break
        passes.append(p)
        log(f"pass: {p['tickets_done']} tickets in {p['wall_s']:.1f} s, "
            f"{p['tickets_per_min']:.2f} tickets/min, decode {p['decode_tok_s']:.0f} tok/s")
        if not p["complete"]:
            break
    complete = [i for i, p in enumerate(passes) if p["complete"]]
    pool = complete or list(range(len(passes)))
    best_pass = max(pool, key=lambda i: passes[i]["tickets_per_min"]) if pool else None
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    reserved = torch.cuda.max_memory_reserved(dev) if dev.type == "cuda" else None
    write_json(a.out, dict(
        versions=versions(), device=a.device, dtype=a.dtype, attn=a.attn, load_s=r.load_s,
        warmup_s=warmup_s, tickets=len(prompts), candidates=a.candidates,
        new_tokens=a.new_tokens, temperature=a.temperature, top_p=a.top_p, search=tried,
        batch=best, prefill_s_by_batch={str(k): v for k, v in r.prefill_s.items()},
        passes=passes, best=best_pass,
        budget_exhausted=any(not p["complete"] for p in passes) or len(passes) < a.reps,
        peak_mem_allocated_bytes=peak, peak_mem_reserved_bytes=reserved))
    return 0


if __name__ == "__main__":
    sys.exit(main())
