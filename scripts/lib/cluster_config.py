#!/usr/bin/env python3
"""Write a stageb config for the cluster benchmark and the soak (scripts/bench/bench-cluster.sh,
scripts/ci/soak.sh): the demo mission's guidance, a synthetic Stage-A file, a model path no worker
has (the load generator's scripted fingerprint pins the run), and the knobs those scripts vary.

usage: cluster_config.py OUT.yaml --stage-a F --root DIR --run-name NAME [--step-tickets N]
       [--epochs E] [--reflection on|off] [--ttl S] [--heartbeat S] [--speculation M]
       [--pipeline-steps D] [--pipeline-cycles C] [--real-model GGUF]

--real-model: real `stageb worker`s serve the run (the real-model soak), so the model's work
is kept small: 2 candidates of 24 tokens per ticket, reflection answers of at most 96 tokens
and at most 2 reflection calls per epoch (a CPU worker with one thread spends seconds per
call).

Reflection has no off switch in stageb: `off` here is the cheapest setting, one reflection
call per epoch (`max_calls_per_epoch: 1`, no retries); `on` is the demo's (batch 4, 40 calls
per epoch). JSON is YAML, so the file is written as one JSON document.
"""

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--stage-a", type=Path, required=True)
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--run-name", required=True)
    ap.add_argument("--step-tickets", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--reflection", choices=["on", "off"], default="on")
    ap.add_argument("--ttl", type=int, default=60)
    ap.add_argument("--heartbeat", type=int, default=5)
    ap.add_argument("--speculation", type=int, default=3)
    ap.add_argument("--pipeline-steps", type=int, default=0, choices=range(0, 17))
    ap.add_argument("--pipeline-cycles", type=int, default=0, choices=range(0, 17))
    ap.add_argument("--real-model", type=Path)
    a = ap.parse_args()
    on = a.reflection == "on"
    config = {
        "seed": 17,
        "stage_a_paths": [str(a.stage_a.resolve())],
        "model": {"model_name_or_path": "loadgen-scripted-engine"},
        "guidance": {"path": str(ROOT / "examples/demo/guidance.json"), "retention": 5,
                     "reset_on_rerun": True},
        "output": {"root": str(a.root.resolve()), "run_name": a.run_name},
        "sampler": {"samples_per_decode": 2, "grid": [
            {"temperature": 0.3, "top_p": 0.9, "max_new_tokens": 32, "repetition_penalty": 1.05},
            {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 32, "repetition_penalty": 1.05},
        ]},
        "manual_review": {"min_verdict_agreement": 0.67},
        "runner": {"epochs": a.epochs,
                   "per_rank_rollout_batch_size": max(1, -(-a.step_tickets // 8)),
                   "logging_steps": 8, "lease_ttl_s": a.ttl, "heartbeat_interval_s": a.heartbeat,
                   "speculation_multiple": a.speculation, "pipeline_steps": a.pipeline_steps,
                   "pipeline_cycles": a.pipeline_cycles},
        "reflection": {"batch_size": 4, "max_operations": 3, "temperature": 0.3, "top_p": 0.9,
                       "repetition_penalty": 1.05, "max_new_tokens": 384,
                       "max_reflection_length": 2048, "token_budget": 2048,
                       "retry_budget_per_group_per_epoch": 2 if on else 0,
                       "max_calls_per_epoch": 40 if on else 1},
        "selection": {"policy": "top_label", "tie_break": "temperature"},
    }
    if a.real_model:
        config["model"]["model_name_or_path"] = str(a.real_model.resolve())
        config["sampler"] = {"samples_per_decode": 1, "grid": [
            {"temperature": 0.3, "top_p": 0.9, "max_new_tokens": 24, "repetition_penalty": 1.05},
            {"temperature": 0.9, "top_p": 0.9, "max_new_tokens": 24, "repetition_penalty": 1.05},
        ]}
        config["reflection"].update({"batch_size": 2, "max_operations": 2, "max_new_tokens": 96,
                                     "max_calls_per_epoch": 2 if on else 1})
    a.out.write_text(json.dumps(config, ensure_ascii=False, indent=1))


if __name__ == "__main__":
    main()
