#!/usr/bin/env python3
"""Compare two stageb run directories: are their artifacts the same, aside runtime facts?

    scripts/compare-runs.py REFERENCE_RUN_DIR RUN_DIR

Used by the launcher tests (scripts/test-slurm.sh, scripts/test-torchrun.sh) to check that a
run made by several ranks under a real launcher, killed workers and requeues included, wrote
exactly what the single-process reference run (`stageb run --workers 1`) wrote. The rules
(which files take part, which keys are runtime facts; manifest.json's `mode` included, which
is what these tests vary) are stated once, in scripts/lib/compare_runs.py (the soak's
comparison, after tests/support/compare.rs); this entry point prints the verdict per file.

Prints one line per file and exits 0 when all are equal, 1 (with the first difference of
each differing file) when not, 2 on bad usage. Standard library only.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
from compare_runs import artifact_names, comparable, first_difference  # noqa: E402


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
