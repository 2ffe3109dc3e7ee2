"""Helpers the GPU check's Python steps share (standard library, plus torch where a function
says so). See docs/GPU-TEST.md; scripts/gpu/gpu-check.sh runs the steps."""

import json
import os
import platform
import sys
import time

# Qwen3's end of turn in the project's tokenizer (worker/tests/fixtures/parity/qwen3).
EOS_ID = 2


def write_json(path, obj):
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False)
        f.write("\n")
    os.replace(tmp, path)


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_prompts(path):
    """Token ids as `stageb probe ids` writes them: an array of arrays (or one array)."""
    ids = read_json(path)
    if ids and isinstance(ids[0], int):
        ids = [ids]
    return ids


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def versions():
    """Python, torch, transformers, safetensors, CUDA as torch sees them."""
    import safetensors
    import torch
    import transformers

    v = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "torch_cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        v["gpu"] = torch.cuda.get_device_name(0)
    return v


def torch_setup(device):
    """Exact f32 matmuls (no TF32) and quiet transformers; returns the torch device."""
    import torch
    import transformers

    torch.set_float32_matmul_precision("highest")
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return torch.device(device)


def sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def dtype_of(name):
    import torch

    return {"bf16": torch.bfloat16, "f32": torch.float32, "f16": torch.float16}[name]


def free(device):
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def die(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def load_model(path, dtype, attn, device):
    """`AutoModelForCausalLM.from_pretrained` in `dtype` with `attn`, on `device` (straight onto
    the GPU through `device_map` when accelerate is there, else loaded then moved)."""
    import importlib.util

    import transformers

    kwargs = {}
    if device.type == "cuda" and importlib.util.find_spec("accelerate"):
        kwargs["device_map"] = str(device)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype_of(dtype), attn_implementation=attn, **kwargs)
    return model.to(device).eval()
