#!/usr/bin/env python3
"""Are two stageb run directories' artifacts the same, aside runtime fields? And did any
ticket row get lost or duplicated?

Owned by the soak (scripts/soak.sh): a run killed and resumed many times must write what an
uninterrupted run wrote. The rules are tests/support/compare.rs's (ARCHITECTURE §10): every
top-level file except jobs.jsonl (completion order), .stageb.lock and report.html (a view
of the others that shows their times); in every JSON object
the keys `runtime`, `timing`, `*_at`, `config`, `config_path`, `config_sha256`, `run_dir` are
dropped; the rest must be equal row by row. Rows lost / duplicated compare the (epoch,
ticket key) pairs of selections.jsonl against the reference.

usage: compare_runs.py REFERENCE_RUN_DIR RUN_DIR; prints one JSON object; exits 0 when equal.
"""

import collections
import json
import os
import sys

SKIPPED = {"jobs.jsonl", ".stageb.lock", "report.html"}  # report.html: a view of the rest
DROPPED = {"runtime", "timing", "config", "config_path", "config_sha256", "run_dir"}


def strip(v):
    if isinstance(v, dict):
        return {k: strip(x) for k, x in v.items() if k not in DROPPED and not k.endswith("_at")}
    if isinstance(v, list):
        return [strip(x) for x in v]
    return v


def rows(path):
    with open(path, encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            return [strip(json.loads(line)) for line in f if line.strip()]
        return [strip(json.load(f))]


def files(run_dir):
    return sorted(n for n in os.listdir(run_dir)
                  if n not in SKIPPED and os.path.isfile(os.path.join(run_dir, n)))


def keys(run_dir):
    out = collections.Counter()
    for row in rows(os.path.join(run_dir, "selections.jsonl")):
        out[(row.get("epoch"), row.get("ticket_key") or row.get("group_id"))] += 1
    return out


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    ref, run = sys.argv[1:]
    differing = []
    if files(ref) != files(run):
        differing.append(f"file sets differ: {files(ref)} vs {files(run)}")
    for name in files(ref):
        if name in files(run) and rows(os.path.join(ref, name)) != rows(os.path.join(run, name)):
            differing.append(name)
    want, got = keys(ref), keys(run)
    lost = sum((want - got).values())
    duplicated = sum(max(0, got[k] - 1) for k in got) + sum((got - want).values())
    print(json.dumps({"equal": not differing, "differing": differing,
                      "selection_rows": sum(got.values()), "rows_lost": lost,
                      "rows_duplicated": duplicated}, ensure_ascii=False))
    sys.exit(0 if not differing and lost == 0 and duplicated == 0 else 1)


if __name__ == "__main__":
    main()
