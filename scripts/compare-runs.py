#!/usr/bin/env python3
"""Compare two stageb run directories: are their artifacts the same, aside runtime facts?

    scripts/compare-runs.py REFERENCE_RUN_DIR RUN_DIR

Used by the launcher tests (scripts/test-slurm.sh, scripts/test-torchrun.sh) to check that a
run made by several ranks under a real launcher, killed workers and requeues included, wrote
exactly what the single-process reference run (`stageb run --workers 1`) wrote. The rules
are those of tests/resume.rs (`comparable`, `artifact_names`):

- every file of the run directory takes part, except the job journal (jobs.jsonl: its rows
  are in completion order, a runtime fact), the lock file (.stageb.lock: it names the
  process holding it) and report.html (a view of the other files that shows their times;
  `stageb report` rebuilds it);
- in every JSON object, at any depth, the keys `runtime` and `timing` (workers, leases,
  replay counts, durations), every `*_at` key (wall-clock timestamps) and the keys that name
  the run itself (`config`, `config_path`, `config_sha256`, `run_dir`) are dropped;
- manifest.json's top-level `mode` is dropped too: it says how the processes were started
  ("embedded" for `stageb run`, "cluster" for `stageb launch`), which is what these tests vary;
- what is left must be equal, row by row.

Prints one line per file and exits 0 when all are equal, 1 (with the first difference of
each differing file) when not, 2 on bad usage. Standard library only.
"""

import json
import os
import sys

SKIPPED_FILES = {"jobs.jsonl", ".stageb.lock", "report.html"}
DROPPED_KEYS = {"runtime", "timing", "config", "config_path", "config_sha256", "run_dir"}


def strip(value):
    if isinstance(value, dict):
        return {
            k: strip(v)
            for k, v in value.items()
            if k not in DROPPED_KEYS and not k.endswith("_at")
        }
    if isinstance(value, list):
        return [strip(v) for v in value]
    return value


def comparable(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".jsonl"):
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        rows = [json.loads(text)]
    rows = [strip(r) for r in rows]
    if os.path.basename(path) == "manifest.json":
        for r in rows:
            r.pop("mode", None)
    return rows


def first_difference(a, b, at):
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


def artifact_names(run_dir):
    return sorted(
        n
        for n in os.listdir(run_dir)
        if os.path.isfile(os.path.join(run_dir, n)) and n not in SKIPPED_FILES
    )


def main(argv):
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    ref, run = argv[1], argv[2]
    for d in (ref, run):
        if not os.path.isdir(d):
            print(f"compare-runs: not a directory: {d}", file=sys.stderr)
            return 2
    ref_names, run_names = artifact_names(ref), artifact_names(run)
    ok = True
    if ref_names != run_names:
        print(f"files differ: reference {ref_names}, run {run_names}")
        ok = False
    for name in ref_names:
        if name not in run_names:
            continue
        d = first_difference(
            comparable(os.path.join(ref, name)), comparable(os.path.join(run, name)), name
        )
        if d:
            print(f"DIFFERENT {d}")
            ok = False
        else:
            print(f"same      {name}")
    print("artifacts: identical (runtime fields aside)" if ok else "artifacts: DIFFERENT")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
