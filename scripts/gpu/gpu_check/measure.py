#!/usr/bin/env python3
"""Run one command of the GPU check under a time limit and measure it.

    python3 scripts/gpu/gpu_check/measure.py --timeout S --json FILE [--log FILE] -- CMD [ARG...]

Starts CMD in its own process group (stdout and stderr to --log, else inherited) and, while it
runs, reads the GPU's used memory every 0.2 s (`nvidia-smi --query-gpu=memory.used`, when
there is an nvidia-smi). After --timeout seconds the group gets SIGTERM, 10 s later SIGKILL,
and the exit code is 124 (as `timeout`). Writes FILE:

    {"cmd": [...], "rc": 0, "timed_out": false, "wall_s": 12.3, "timeout_s": 300,
     "gpu_mem_before_mib": 0, "gpu_mem_peak_mib": 30123, "peak_rss_mib": 1234}

`gpu_mem_peak_mib` is the whole GPU's (every process), so the steps run one at a time;
`peak_rss_mib` is the largest resident set of CMD's process tree as the kernel counts it for
waited-for children (ru_maxrss). Exits with CMD's exit code. Standard library only.
"""

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time


def gpu_used_mib(smi):
    try:
        out = subprocess.run([smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5).stdout
        return max(int(x) for x in out.split())
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, required=True)
    ap.add_argument("--json", required=True)
    ap.add_argument("--log")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("no command")
    smi = shutil.which("nvidia-smi")
    before = gpu_used_mib(smi) if smi else None
    peak = [before]
    done = threading.Event()

    def poll():
        while not done.wait(0.2):
            m = gpu_used_mib(smi)
            if m is not None and (peak[0] is None or m > peak[0]):
                peak[0] = m

    if smi:
        threading.Thread(target=poll, daemon=True).start()
    out = open(a.log, "ab") if a.log else None
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None,
                            start_new_session=True)

    def stop(sig):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    # A signal to this runner (the script's own limit) ends CMD's whole group too.
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: (stop(signal.SIGTERM), sys.exit(143)))
    timed_out = False
    try:
        rc = proc.wait(timeout=a.timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        stop(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            stop(signal.SIGKILL)
            proc.wait()
        rc = 124
    wall = time.monotonic() - t0
    done.set()
    rss_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    result = {
        "cmd": cmd, "rc": rc, "timed_out": timed_out, "wall_s": round(wall, 3),
        "timeout_s": a.timeout, "gpu_mem_before_mib": before, "gpu_mem_peak_mib": peak[0],
        "peak_rss_mib": round(rss_kib / 1024, 1),
    }
    with open(a.json, "w") as f:
        json.dump(result, f)
        f.write("\n")
    if out:
        out.close()
    return rc


if __name__ == "__main__":
    sys.exit(main())
