#!/usr/bin/env python3
"""Tables of `scripts/bench-engine.sh` (medians over the alternated runs).

usage: bench_tables.py ticket STAGEB.txt LLAMA.jsonl   # workload 1: the rollout ticket
       bench_tables.py demo-run RUNS_DIR T0 T1          # one `stageb run` of the demo → JSON line
       bench_tables.py demo RESULTS.jsonl               # workload 2: the demo mission
"""

import json
import pathlib
import statistics
import sys

med = statistics.median


def ticket(stageb_txt, llama_jsonl):
    stageb = {}
    for line in open(stageb_txt, encoding="utf-8"):
        if line.startswith("BENCH "):
            b = json.loads(line[6:])
            stageb.setdefault(b["variant"], []).append(b)
    ll = [json.loads(line) for line in open(llama_jsonl) if line.strip()]
    rows = []
    for v in ("fixed", "constrained"):
        bs = stageb.get(v)
        if bs:
            ts = [b["ticket_s"] for b in bs]
            rows.append((f"stageb ({v})", med(ts), f"{min(ts):.2f}-{max(ts):.2f}",
                         med(b["prefill_tok_s"] for b in bs), med(b["decode_agg_tok_s"] for b in bs),
                         bs[-1]["generated_last_run"]))
    lt = None
    if ll:
        # batched-bench: t_pp = prefill of the shared prompt, t_tg = 8 x 48 decode, t = total.
        ts = [r["t"] for r in ll]
        lt = med(ts)
        rows.append(("llama.cpp (batched-bench)", lt, f"{min(ts):.2f}-{max(ts):.2f}",
                     med(r["speed_pp"] for r in ll), med(r["speed_tg"] for r in ll),
                     ll[0]["pl"] * ll[0]["tg"]))
    print()
    print(f'{"engine":28} {"s/ticket":>9} {"spread":>11} {"prefill tok/s":>14} {"decode agg tok/s":>17} '
          f'{"tokens":>7} {"llama.cpp time / this time":>27}')
    for name, t, sp, pp, tg, gen in rows:
        ratio = f"{lt / t:.2f}x" if lt else "-"
        print(f"{name:28} {t:9.2f} {sp:>11} {pp:14.1f} {tg:17.1f} {gen:7d} {ratio:>27}")
    print("\n(last column: llama.cpp seconds per ticket divided by this engine's; >= 1.00x means as "
          "fast as llama.cpp or faster)")


def demo_run(runs_dir, t0, t1):
    run = next(pathlib.Path(runs_dir).iterdir())
    jobs = {}
    for line in open(run / "trajectories.jsonl", encoding="utf-8"):
        r = json.loads(line)
        rt = r.get("runtime") or {}
        jobs[r["ticket_key"]] = (rt.get("prefill_us", 0) + rt.get("decode_us", 0)) / 1e6
    summary = json.loads((run / "summary.json").read_text(encoding="utf-8"))
    engine_s = sum(jobs.values())
    print(json.dumps({"engine": "stageb run", "tickets": len(jobs), "seconds": engine_s,
                      "tickets_per_min": 60 * len(jobs) / engine_s, "wall_s": float(t1) - float(t0),
                      "prefix_cache": (summary.get("runtime") or {}).get("prefix_cache")}))


def demo(results_jsonl):
    rows = [json.loads(line) for line in open(results_jsonl) if line.strip()]
    by = {}
    for r in rows:
        by.setdefault(r["engine"], []).append(r)
    llama = by.get("llama.cpp server")
    base = med(r["tickets_per_min"] for r in llama) if llama else None
    print()
    print(f'{"demo mission, 1 epoch":24} {"tickets":>7} {"tickets/min":>12} {"spread":>15} '
          f'{"run wall s":>11} {"this / llama.cpp":>17}')
    for name, rs in by.items():
        tpm = [r["tickets_per_min"] for r in rs]
        m = med(tpm)
        wall = f'{med(r["wall_s"] for r in rs):11.1f}' if "wall_s" in rs[0] else f'{"-":>11}'
        ratio = f"{m / base:.2f}x" if base else "-"
        print(f"{name:24} {rs[0]['tickets']:7d} {m:12.1f} {min(tpm):7.1f}-{max(tpm):<7.1f} {wall} {ratio:>17}")
    print("\n(tickets/min from engine time per ticket: stageb = prefill + decode of each rollout job as")
    print(" its trajectories record them; llama.cpp = wall time of each ticket's parallel requests, server")
    print(" warm. `run wall s` is the whole `stageb run`: model load, rank 0, one reflection call, artifacts.)")


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "ticket":
        ticket(sys.argv[2], sys.argv[3])
    elif cmd == "demo-run":
        demo_run(sys.argv[2], sys.argv[3], sys.argv[4])
    elif cmd == "demo":
        demo(sys.argv[2])
    else:
        sys.exit(__doc__)
