#!/usr/bin/env python3
"""Print the folders a CUDA build of stageb needs on LD_LIBRARY_PATH, joined by ':'.

    python3 scripts/gpu/gpu_check/cuda_libs.py [--explain]

The CUDA libraries come from the machine's Python packages (the `nvidia-*` cu13 wheels that
torch cu130 installs): every folder under the `nvidia` namespace package's paths that holds
one of the sonames below, `nvidia/cu13/lib` first. The driver's `libcuda.so.1` is added only
when the dynamic loader's cache does not know it (`ldconfig -p`), from the usual driver
folders; a folder named `stubs` is never used (its libcuda is a link-time stand-in).
Standard library only; prints nothing (exit 1) when no CUDA library is found.
"""

import glob
import os
import subprocess
import sys

SONAMES = ["libcublas.so.13", "libcublasLt.so.13", "libcurand.so.10", "libcudart.so.13",
           "libnvrtc.so.13"]
DRIVER_DIRS = ["/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/lib/x86_64-linux-gnu",
               "/usr/lib64", "/usr/local/cuda/compat", "/usr/lib/wsl/lib"]


def nvidia_roots():
    roots = []
    try:
        import nvidia  # namespace package of the nvidia-* wheels
        roots.extend(list(nvidia.__path__))
    except ImportError:
        pass
    for p in sys.path:
        cand = os.path.join(p, "nvidia")
        if os.path.isdir(cand) and cand not in roots:
            roots.append(cand)
    return roots


def cuda_dirs():
    found = []
    for root in nvidia_roots():
        preferred = [os.path.join(root, "cu13", "lib")]
        others = sorted(glob.glob(os.path.join(root, "*", "lib")))
        for d in preferred + others:
            if "stubs" in d.split(os.sep) or d in found or not os.path.isdir(d):
                continue
            if any(os.path.exists(os.path.join(d, s)) for s in SONAMES):
                found.append(d)
    return found


def driver_dir():
    try:
        cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    except OSError:
        cache = ""
    if "libcuda.so.1" in cache:
        return None
    for d in DRIVER_DIRS:
        if os.path.exists(os.path.join(d, "libcuda.so.1")):
            return d
    return None


def main():
    dirs = cuda_dirs()
    drv = driver_dir()
    if drv:
        dirs.append(drv)
    if "--explain" in sys.argv:
        for d in dirs:
            have = [s for s in SONAMES + ["libcuda.so.1"] if os.path.exists(os.path.join(d, s))]
            print(f"{d}: {' '.join(have)}", file=sys.stderr)
    if not dirs:
        return 1
    print(":".join(dirs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
