#!/usr/bin/env python3
"""The demo mission's rollouts through llama.cpp's server: the baseline of
`scripts/bench/bench-engine.sh --demo`.

usage: bench_demo_llama.py JOBS.jsonl --server BIN --model GGUF [--threads 2] [--port 18080]
                           [--parallel K]

JOBS.jsonl is `cargo run --example rollout_jobs -- CONFIG` (the epoch-1 rollout jobs exactly as
rank 0 builds them). The server runs with one slot per candidate of a ticket (`-np`), prompt
caching on (each slot keeps its previous prompt, so the shared system + guidance prefix is
reused from ticket to ticket), `--threads` threads. Tickets go one after the other (like one
stageb worker); a ticket's candidates go in parallel, each with its decode's temperature,
top-p, repetition penalty, max_new_tokens and seed, plain top-p sampling (top-k and min-p off),
and for constrained jobs a GBNF grammar of the two-line contract. Prints one JSON line:
tickets, seconds (sum of per-ticket wall times, server already warm), tickets_per_min, and the
token counts the server reported.

--parallel K (the baseline of `scripts/bench/bench-batching.sh`): K tickets in flight at once, the
server with K times the slots (its continuous batching decodes every slot's row together);
seconds is then the wall time of all tickets, server warm.
"""

import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.request

# The contract (shared/src/contract.rs): "Verdict: 通过|不通过", then "Reason: " and one line of
# at most 240 characters. The third-state word bans are left out: they only shape which
# tokens are allowed, not how many are decoded.
CONTRACT_GBNF = 'root ::= "Verdict: " ("通过" | "不通过") "\\nReason: " [^\\n]{1,240}'


def chatml(messages):
    # SmolLM2's chat template (ChatML), generation prompt appended: what stageb renders.
    out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return out + "<|im_start|>assistant\n"


def post(port, path, body, timeout=600):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(port, proc, deadline_s=120):
    t0 = time.time()
    while time.time() - t0 < deadline_s:
        if proc.poll() is not None:
            sys.exit(f"llama-server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    sys.exit("llama-server did not become ready")


def run_ticket(port, job):
    prompt = chatml(job["messages"])
    requests = []
    for d in job["decodes"]:
        for seed in d["seeds"]:
            body = {"prompt": prompt, "n_predict": d["max_new_tokens"], "temperature": d["temperature"],
                    "top_p": d["top_p"], "top_k": 0, "min_p": 0.0, "typical_p": 1.0,
                    "repeat_penalty": d["repetition_penalty"], "seed": seed % (2**32),
                    "cache_prompt": True}
            if job.get("constrained"):
                body["grammar"] = CONTRACT_GBNF
            requests.append(body)
    results = [None] * len(requests)

    def one(i):
        results[i] = post(port, "/completion", requests[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def run_all(port, jobs, parallel):
    """Every ticket: one after the other (summed wall times) or `parallel` at once (the wall
    time of all of them). Returns (seconds, per-ticket results)."""
    results = [None] * len(jobs)
    if parallel == 1:
        total = 0.0
        for i, job in enumerate(jobs):
            t0 = time.perf_counter()
            results[i] = run_ticket(port, job)
            total += time.perf_counter() - t0
        return total, results
    lock = threading.Lock()
    todo = list(range(len(jobs)))

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            results[i] = run_ticket(port, jobs[i])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(parallel)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("jobs")
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=18080)
    ap.add_argument("--parallel", type=int, default=1)
    a = ap.parse_args()
    jobs = [json.loads(line) for line in open(a.jobs, encoding="utf-8") if line.strip()]
    slots = max(sum(len(d["seeds"]) for d in j["decodes"]) for j in jobs) * a.parallel
    ctx_per_slot = 2048
    proc = subprocess.Popen([a.server, "-m", a.model, "-t", str(a.threads), "-tb", str(a.threads),
                             "-np", str(slots), "-c", str(slots * ctx_per_slot), "--port", str(a.port),
                             "--host", "127.0.0.1", "--no-webui"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(a.port, proc)
        # Warm-up (not timed): one ticket, so every engine starts with the model in memory.
        run_ticket(a.port, jobs[0])
        total, results = run_all(a.port, jobs, a.parallel)
        prompt_n = predicted_n = 0
        for res in results:
            for r in res:
                t = r.get("timings", {})
                prompt_n += t.get("prompt_n", 0)
                predicted_n += t.get("predicted_n", 0)
        name = "llama.cpp server" if a.parallel == 1 else f"llama.cpp server x{a.parallel}"
        print(json.dumps({"engine": name, "tickets": len(jobs), "seconds": total,
                          "tickets_per_min": 60 * len(jobs) / total, "slots": slots,
                          "prompt_tokens_computed": prompt_n, "tokens_generated": predicted_n}))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
