#!/usr/bin/env python3
"""Run one command and record what it cost: CPU seconds (user + system) and peak RSS.

Owned by the cluster benchmark (scripts/bench/bench-cluster.sh), which measures rank 0 this way:
getrusage(RUSAGE_CHILDREN) after the child exits counts exactly that process (and anything it
waited for), with no sampling. SIGTERM/SIGINT are forwarded so the child can drain.

usage: rusage.py OUT.json -- COMMAND [ARG...]; exits with the child's code.
"""

import json
import resource
import signal
import subprocess
import sys
import time


def main() -> int:
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    out, cmd = sys.argv[1], sys.argv[3:]
    started = time.monotonic()
    child = subprocess.Popen(cmd)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    rc = child.wait()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(out, "w") as f:
        json.dump({"rc": rc, "wall_s": time.monotonic() - started,
                   "cpu_user_s": usage.ru_utime, "cpu_sys_s": usage.ru_stime,
                   "cpu_s": usage.ru_utime + usage.ru_stime,
                   "max_rss_kib": usage.ru_maxrss}, f)
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main())
