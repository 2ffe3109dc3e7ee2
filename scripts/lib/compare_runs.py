#!/usr/bin/env python3
"""Are two stageb run directories' artifacts the same, aside runtime fields? And did any
ticket row get lost or duplicated?

The one Python statement of the determinism rules of tests/support/compare.rs (ARCHITECTURE
§10); scripts/compare-runs.py (the launcher tests' entry point) imports them from here, and
the soak (scripts/soak.sh) runs this file. The rules:

- every top-level file takes part except jobs.jsonl (rows in completion order), checkpoint.json
  (the journal's place: artifact byte lengths, which count runtime objects, and the guidance
  file's timestamps), .stageb.lock (names the process holding it) and report.html (a view of
  the others that shows their times);
- in every JSON object, at any depth, the keys `runtime`, `timing`, `*_at`, `config`,
  `config_path`, `config_sha256`, `run_dir` are dropped, and manifest.json's top-level `mode`
  (how the processes were started: embedded, cluster);
- what is left must be equal, row by row.

Rows lost / duplicated compare the (epoch, ticket key) pairs of selections.jsonl against the
reference.

usage: compare_runs.py REFERENCE_RUN_DIR RUN_DIR; prints one JSON object; exits 0 when equal.
"""

import collections
import json
import os
import sys

SKIPPED = {"jobs.jsonl", "checkpoint.json", ".stageb.lock", "report.html"}
DROPPED = {"runtime", "timing", "config", "config_path", "config_sha256", "run_dir"}


def strip(v):
    if isinstance(v, dict):
        return {k: strip(x) for k, x in v.items() if k not in DROPPED and not k.endswith("_at")}
    if isinstance(v, list):
        return [strip(x) for x in v]
    return v


def comparable(path):
    """The rows of a JSONL file (or the one object of a JSON file), stripped."""
    with open(path, encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            out = [strip(json.loads(line)) for line in f if line.strip()]
        else:
            out = [strip(json.load(f))]
    if os.path.basename(path) == "manifest.json":
        for r in out:
            r.pop("mode", None)
    return out


def artifact_names(run_dir):
    return sorted(n for n in os.listdir(run_dir)
                  if n not in SKIPPED and os.path.isfile(os.path.join(run_dir, n)))


def first_difference(a, b, at):
    """The first place two stripped values differ, as a path, or None."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k, v in a.items():
            if k not in b:
                return f"{at}.{k}: only in the reference"
            d = first_difference(v, b[k], f"{at}.{k}")
            if d:
                return d
        for k in b:
            if k not in a:
                return f"{at}.{k}: only in the run"
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{at}: {len(a)} rows/items in the reference, {len(b)} in the run"
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{at}[{i}]")
            if d:
                return d
        return None
    if a == b:
        return None
    return f"{at}: {json.dumps(a, ensure_ascii=False)[:200]} vs {json.dumps(b, ensure_ascii=False)[:200]}"


def keys(run_dir):
    out = collections.Counter()
    for row in comparable(os.path.join(run_dir, "selections.jsonl")):
        out[(row.get("epoch"), row.get("ticket_key") or row.get("group_id"))] += 1
    return out


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    ref, run = sys.argv[1:]
    differing = []
    if artifact_names(ref) != artifact_names(run):
        differing.append(f"file sets differ: {artifact_names(ref)} vs {artifact_names(run)}")
    for name in artifact_names(ref):
        if name in artifact_names(run):
            d = first_difference(comparable(os.path.join(ref, name)),
                                 comparable(os.path.join(run, name)), name)
            if d:
                differing.append(d)
    want, got = keys(ref), keys(run)
    lost = sum((want - got).values())
    duplicated = sum(max(0, got[k] - 1) for k in got) + sum((got - want).values())
    print(json.dumps({"equal": not differing, "differing": differing,
                      "selection_rows": sum(got.values()), "rows_lost": lost,
                      "rows_duplicated": duplicated}, ensure_ascii=False))
    sys.exit(0 if not differing and lost == 0 and duplicated == 0 else 1)


if __name__ == "__main__":
    main()
