#!/usr/bin/env python3
"""Writes the weights of the transformers parity fixtures from the recipe in their
reference.json, so no weight file is committed. Pure Python (standard library only).

    python3 scripts/parity_weights.py [FIXTURES_DIR]    # default: worker/tests/fixtures/parity

For every `<case>/reference.json` with a `weights` recipe, each listed safetensors file is
written unless one with the recorded sha256 is already there; a file that comes out with
another sha256 is an error (the generator drifted from the one that made the references).
scripts/fetch-model.sh (and so scripts/test.sh) and scripts/gpu-check.sh run it;
scripts/make-parity-fixtures.py writes the recipes and the references with the same code.

Recipe (`weights` in reference.json):

    {"generator": "splitmix64-uniform-v1",
     "files": [{"file": "model.safetensors", "sha256": "...",
                "tensors": [{"name": "...", "dtype": "F32" | "BF16", "shape": [..],
                             "seed": int, "low": float, "high": float}, ...]}, ...]}

Each tensor has its own stream: splitmix64 seeded with `seed`; a draw's top 53 bits make a
double u in [0, 1); the value is `low + (high - low) * u` in double, rounded to the nearest
float32 (ties to even) and, for BF16, from that float32 to the nearest bfloat16 (ties to
even). Only IEEE-exact operations, so every machine writes the same bytes. Tensors are laid
out in the recipe's order; the header is compact JSON with sorted keys plus
`{"__metadata__": {"format": "pt"}}`, padded with spaces to a multiple of 8 bytes.
"""

import hashlib
import json
import sys
from array import array
from pathlib import Path

GENERATOR = "splitmix64-uniform-v1"
MASK = (1 << 64) - 1
DEFAULT_DIR = Path(__file__).resolve().parent.parent / "worker" / "tests" / "fixtures" / "parity"


def uniform_f32(seed, count, low, high):
    """`count` values as an array('f') (float32, rounded to nearest by the conversion)."""
    width = high - low
    scale = 2.0 ** -53
    state = seed & MASK
    out = array("f", bytes(4 * count))
    for i in range(count):
        state = (state + 0x9E3779B97F4A7C15) & MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        z ^= z >> 31
        out[i] = low + width * ((z >> 11) * scale)
    return out


def to_bf16(values):
    """float32 array -> bfloat16 bit patterns (array('H')), round to nearest, ties to even."""
    bits = array("I", values.tobytes())
    return array("H", [((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF for b in bits])


def tensor_bytes(t):
    count = 1
    for d in t["shape"]:
        count *= d
    values = uniform_f32(t["seed"], count, t["low"], t["high"])
    if t["dtype"] == "F32":
        data = values
    elif t["dtype"] == "BF16":
        data = to_bf16(values)
    else:
        raise ValueError(f"{t['name']}: dtype {t['dtype']} is not F32 or BF16")
    if sys.byteorder != "little":
        data.byteswap()
    return data.tobytes()


def safetensors_bytes(tensors):
    """One safetensors file holding `tensors` (recipe entries) in the given order."""
    header, blobs, offset = {}, [], 0
    for t in tensors:
        blob = tensor_bytes(t)
        header[t["name"]] = {"dtype": t["dtype"], "shape": list(t["shape"]),
                             "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + b"".join(blobs)


def sha256_file(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_files(case_dir, recipe, check=True):
    """Writes the recipe's files into `case_dir`; returns {file: sha256}. With `check`, a file
    already there with the recorded sha256 is kept and a new one must match it."""
    if recipe.get("generator") != GENERATOR:
        raise ValueError(f"{case_dir}: weights generator {recipe.get('generator')!r}, "
                         f"this script writes {GENERATOR!r}")
    sums = {}
    for f in recipe["files"]:
        path = case_dir / f["file"]
        if check and path.is_file() and sha256_file(path) == f["sha256"]:
            sums[f["file"]] = f["sha256"]
            continue
        data = safetensors_bytes(f["tensors"])
        digest = hashlib.sha256(data).hexdigest()
        if check and digest != f["sha256"]:
            raise ValueError(f"{path}: generated sha256 {digest}, reference.json records "
                             f"{f['sha256']}; the generator no longer matches the references")
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
        sums[f["file"]] = digest
    return sums


def main(argv):
    if len(argv) > 2 or (len(argv) == 2 and argv[1].startswith("-")):
        sys.exit("usage: parity_weights.py [FIXTURES_DIR]")
    root = Path(argv[1]) if len(argv) == 2 else DEFAULT_DIR
    cases = sorted(p.parent for p in root.glob("*/reference.json"))
    if not cases:
        sys.exit(f"error: no */reference.json under {root}")
    for case in cases:
        recipe = json.loads((case / "reference.json").read_text(encoding="utf-8")).get("weights")
        if recipe is None:
            sys.exit(f"error: {case}/reference.json has no weights recipe")
        try:
            write_files(case, recipe)
        except ValueError as e:
            sys.exit(f"error: {e}")
    print(f"parity fixture weights ready in {root} ({len(cases)} cases)", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv)
