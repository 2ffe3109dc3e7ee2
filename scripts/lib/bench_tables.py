#!/usr/bin/env python3
"""Tables of `scripts/bench/bench-engine.sh` (medians over the alternated runs).

usage: bench_tables.py ticket STAGEB.txt LLAMA.jsonl   # workload 1: the rollout ticket
       bench_tables.py demo-run RUNS_DIR T0 T1          # one `stageb run` of the demo → JSON line
       bench_tables.py demo RESULTS.jsonl               # workload 2: the demo mission
       bench_tables.py prefill STAGEB.txt LLAMA.jsonl KIND  # workload 3: prefill per prompt length
       bench_tables.py batching-run WORKLOAD NAME RUN_DIR RUSAGE.json LOG SAME
                                                        # one run of scripts/bench/bench-batching.sh
       bench_tables.py batching RESULTS.jsonl           # scripts/bench/bench-batching.sh's tables
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


def prefill(stageb_txt, llama_jsonl, llama_kind):
    stageb, kernels = {}, set()
    for line in open(stageb_txt, encoding="utf-8"):
        if line.startswith("BENCH "):
            b = json.loads(line[6:])
            stageb.setdefault(b["prompt_tokens"], []).append(b["prefill_tok_s"])
        elif line.startswith("model "):
            kernels.add(line.split("; kernels ", 1)[-1].split("; threads")[0].strip())
    llama = {}
    for line in open(llama_jsonl, encoding="utf-8"):
        if line.strip():
            r = json.loads(line)
            llama.setdefault(r["n_prompt"], []).append(r["avg_ts"])
    print()
    print(f'{"prompt tokens":>13} {"stageb tok/s":>13} {"spread":>15} {"llama.cpp tok/s":>16} '
          f'{"spread":>15} {"stageb / llama.cpp":>19}')
    for n in sorted(stageb):
        s, ll = stageb[n], llama.get(n)
        ratio = f"{med(s) / med(ll):.2f}x" if ll else "-"
        lcol = f"{med(ll):16.1f} {min(ll):7.1f}-{max(ll):<7.1f}" if ll else f'{"-":>16} {"-":>15}'
        print(f"{n:13d} {med(s):13.1f} {min(s):7.1f}-{max(s):<7.1f} {lcol} {ratio:>19}")
    print(f"\n(stageb kernels: {', '.join(sorted(kernels)) or '?'}; llama.cpp: {llama_kind or 'skipped'},")
    print(" `llama-bench -p N -n 0`. Prefill tokens per second, medians of the alternated runs;")
    print(" > 1.00x means stageb prefills faster.)")


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


def batching_run(workload, name, run_dir, rusage_json, log, same):
    """One `stageb run` of scripts/bench/bench-batching.sh → one JSON line: wall time, tickets/min,
    peak RSS, the reflection calls' model time, and whether its artifacts match the first run."""
    run = pathlib.Path(run_dir)
    usage = json.loads(pathlib.Path(rusage_json).read_text())
    tickets = {json.loads(line)["ticket_key"] for line in open(run / "trajectories.jsonl", encoding="utf-8")}
    summary = json.loads((run / "summary.json").read_text(encoding="utf-8"))
    refl_s, calls = 0.0, 0
    refl = run / "reflection.jsonl"
    if refl.exists():
        for line in open(refl, encoding="utf-8"):
            for c in json.loads(line).get("calls") or []:
                lat = (c.get("runtime") or {}).get("latency_us")
                if lat:
                    refl_s += lat / 1e6
                    calls += 1
    epochs = summary.get("epochs") or 1
    idle = ((summary.get("runtime") or {}).get("workers") or {}).get("idle_fraction")
    print(json.dumps({"idle_fraction": idle, "workload": workload, "engine": f"stageb {name}", "tickets": len(tickets) * epochs,
                      "wall_s": usage["wall_s"], "seconds": usage["wall_s"],
                      "tickets_per_min": 60 * len(tickets) * epochs / usage["wall_s"],
                      "max_rss_mib": usage["max_rss_kib"] / 1024, "reflection_calls": calls,
                      "reflection_s": refl_s, "artifacts": same, "rc": usage["rc"]}))


def batching(results_jsonl):
    rows = [json.loads(line) for line in open(results_jsonl) if line.strip()]
    for workload, title, base_name in (
            ("rollouts", "rollouts (demo, 1 epoch, 1 reflection call)", "stageb K=1"),
            ("demo", "the README demo (2 epochs, reflection on)", "stageb K=1,pipeline=0")):
        rs = [r for r in rows if r.get("workload", "rollouts") == workload]
        if not rs:
            continue
        by = {}
        for r in rs:
            by.setdefault(r["engine"], []).append(r)
        base = med(r["tickets_per_min"] for r in by[base_name]) if base_name in by else None
        print()
        print(f'{title:46} {"tickets/min":>11} {"spread":>15} {"wall s":>8} {"refl s":>7} '
              f'{"idle":>5} {"peak RSS MiB":>12} {"vs base":>7} {"artifacts":>10}')
        for name, group in by.items():
            tpm = [r["tickets_per_min"] for r in group]
            m = med(tpm)
            wall = med(r["seconds"] for r in group)
            refl = f'{med(r["reflection_s"] for r in group):7.1f}' if "reflection_s" in group[0] else f'{"-":>7}'
            rss = f'{max(r["max_rss_mib"] for r in group):12.0f}' if "max_rss_mib" in group[0] else f'{"-":>12}'
            idles = [r["idle_fraction"] for r in group if r.get("idle_fraction") is not None]
            idle = f"{med(idles):5.2f}" if idles else f'{"-":>5}'
            ratio = f"{m / base:.2f}x" if base else "-"
            same = ",".join(sorted({r.get("artifacts", "-") for r in group}))
            print(f"{name:46} {m:11.1f} {min(tpm):7.1f}-{max(tpm):<7.1f} {wall:8.1f} {refl} {idle} {rss} "
                  f"{ratio:>7} {same:>10}")
    print("\n(stageb: tickets/min over the whole `stageb run` wall time, model load and reflection")
    print(" included; llama.cpp server xK: K tickets in flight, requests' wall time, server warm.")
    print(" `refl s`: the reflection calls' model time; `idle`: summary.json runtime.workers.idle_fraction")
    print(" (the share of live worker time holding no lease); `artifacts`: each run against the first;")
    print(" `vs base`: tickets/min against `stageb K=1` (rollouts) or `stageb K=1,pipeline=0` (demo).)")


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "ticket":
        ticket(sys.argv[2], sys.argv[3])
    elif cmd == "demo-run":
        demo_run(sys.argv[2], sys.argv[3], sys.argv[4])
    elif cmd == "demo":
        demo(sys.argv[2])
    elif cmd == "prefill":
        prefill(sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else "")
    elif cmd == "batching-run":
        batching_run(*sys.argv[2:8])
    elif cmd == "batching":
        batching(sys.argv[2])
    else:
        sys.exit(__doc__)
