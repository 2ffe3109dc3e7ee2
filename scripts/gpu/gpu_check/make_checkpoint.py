#!/usr/bin/env python3
"""Write a random-weight Qwen3 checkpoint with the project's tokenizer, for the GPU check.

    python3 scripts/gpu/gpu_check/make_checkpoint.py --shape qwen3-8b --out DIR [--device cuda]
        [--seed 20261125] [--vocab-size N] [--max-shard-size 4GB]
        [--logit-scale S [--base FLAT_DIR]]

Shapes (`--shape`):
  qwen3-8b    Qwen3-8B: 36 layers, hidden 4096, 32 heads / 8 KV heads, head_dim 128, MLP 12288,
              untied lm_head, vocabulary 151,936 (8.19 B parameters, 16.4 GB in bf16)
  qwen3-0.6b  Qwen3-0.6B: 28 layers, hidden 1024, 16 / 8 heads, head_dim 128, MLP 3072, tied
              embeddings, vocabulary 151,936 (0.6 B parameters, 1.2 GB)
  tiny        2 layers, hidden 64, 4 / 2 heads, head_dim 16, MLP 128, vocabulary 2,048 (the CPU
              rehearsal; two shards)
All bf16, RoPE theta 1e6, rms_norm_eps 1e-6, max_position_embeddings 40,960, written by
transformers' `save_pretrained` (config.json in the transformers-5 form, safetensors shards with
model.safetensors.index.json).

The tokenizer (tokenizer.json, tokenizer_config.json with the Qwen3 chat template,
generation_config.json) is the project's: worker/tests/fixtures/parity/qwen3/, a 1,014-token
byte-level BPE; the model's vocabulary is larger (as Qwen's is), the extra ids have no text.

Weights from one seeded torch generator on --device (parameters in name order), with the
spreads of the parity fixtures (scripts/fixtures/make-parity-fixtures.py) as normals: matrices
N(0, 1/fan_in), embeddings N(0, 0.25^2), norm weights U(0.5, 1.5); with two changes for deep
models, so that the greedy continuation depends on the prompt (one token repeated whatever
the prompt would hide a broken KV cache or position):
- untied: o_proj and down_proj also divided by sqrt(2 * layers) (GPT-2's residual scaling):
  without it 36 random layers pull every position towards one direction (on a 2048-wide,
  36-layer stand-in a greedy run repeated one token 5 times in 12; with it, none);
- tied (the embedding is also the output layer): embeddings N(0, 0.05^2), no scaling (at
  0.25 the qwen3-0.6b shape repeated one token for all 32 greedy steps; with the scaling the
  model repeats its input token).
The same seed on the same device gives the same files; both engines read these files, so
nothing else needs to match. Writes DIR/.done (the spec) last: a
DIR holding a .done with the same spec is left as it is.

The logits' spread (`--logit-scale`): random weights give flat logits (a std of ~1 over
151,936 tokens: at temperature 0.7 and top-p 0.9 the nucleus holds most of the vocabulary),
a trained model peaked ones (a few tokens hold most of the mass). The sampler's cost depends on
that, so the GPU check measures both. `--logit-scale S` multiplies the final norm's weight
(`model.norm.weight`, which every logit goes through, tied or untied) by S, so every logit is
S times the flat model's: S = 8 (a power of two: exact in bf16) gives the peaked spread. With
`--base FLAT_DIR` (the same shape and seed, scale 1) only the shard holding the final norm is
rewritten and the others are symlinks to FLAT_DIR's (seconds, not another 16.4 GB); the files
are the same as a full build's. The logits of one 16-token prompt are measured on --device
while the model is there and summarised in DIR/spread.json: the mean top-1 probability and
nucleus size at temperature 0.7 and top-p 0.9 (what the sampler sees).
"""

import argparse
import json
import os
import shutil
import sys
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import EOS_ID, log, torch_setup  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TOKENIZER_DIR = os.path.join(ROOT, "worker", "tests", "fixtures", "parity", "qwen3")
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
EMBED_STD = 0.25
TIED_EMBED_STD = 0.05
FINAL_NORM = "model.norm.weight"

SHAPES = {
    "qwen3-8b": dict(num_hidden_layers=36, hidden_size=4096, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                     tie_word_embeddings=False, vocab_size=151936),
    "qwen3-0.6b": dict(num_hidden_layers=28, hidden_size=1024, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                       tie_word_embeddings=True, vocab_size=151936),
    "tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=128,
                 tie_word_embeddings=False, vocab_size=2048),
}


def spec_of(a):
    shape = dict(SHAPES[a.shape])
    if a.vocab_size:
        shape["vocab_size"] = a.vocab_size
    tied = shape["tie_word_embeddings"]
    spec = dict(shape=a.shape, config=shape, seed=a.seed, device=a.device,
                embed_std=TIED_EMBED_STD if tied else EMBED_STD,
                branch_scale=1.0 if tied else (2 * shape["num_hidden_layers"]) ** -0.5,
                max_shard_size=a.max_shard_size or ("200KB" if a.shape == "tiny" else "4GB"))
    if a.logit_scale != 1.0:  # absent at 1: a flat checkpoint's .done is what it was
        spec["logit_scale"] = a.logit_scale
    return spec


def randomize(model, seed, device, embed_std, branch_scale, logit_scale=1.0):
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            shape = tuple(p.shape)
            if len(shape) == 1:
                v = torch.rand(shape, generator=g, device=device) + 0.5
            elif "embed_tokens" in name:
                v = torch.randn(shape, generator=g, device=device) * embed_std
            else:
                v = torch.randn(shape, generator=g, device=device) / shape[1] ** 0.5
                if "o_proj" in name or "down_proj" in name:
                    v *= branch_scale
            p.copy_(v.to(p.dtype))
            if name == FINAL_NORM and logit_scale != 1.0:
                p.mul_(logit_scale)  # after the bf16 rounding, as derive_scaled does
            del v


def build(spec, out):
    import torch
    import transformers

    dev = torch_setup(spec["device"])
    cfg = transformers.Qwen3Config(
        **spec["config"], hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        attention_bias=False, eos_token_id=EOS_ID, bos_token_id=None, pad_token_id=None,
        use_cache=True)
    cfg.architectures = ["Qwen3ForCausalLM"]
    t = time.time()
    torch.manual_seed(spec["seed"])
    # Built in bf16 straight away (16.4 GB for qwen3-8b, not 32.8 GB of f32 first).
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            model = transformers.Qwen3ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    randomize(model, spec["seed"], dev, spec["embed_std"], spec["branch_scale"],
              spec.get("logit_scale", 1.0))
    n = sum(p.numel() for p in model.parameters())
    log(f"{spec['shape']}: {n / 1e6:,.1f} M parameters drawn on {dev} in {time.time() - t:.1f} s")
    write_spread(out, probe_logits(model, dev))
    t = time.time()
    model = model.to("cpu")
    model.save_pretrained(out, max_shard_size=spec["max_shard_size"])
    for f in TOKENIZER_FILES:
        shutil.copy(os.path.join(TOKENIZER_DIR, f), os.path.join(out, f))
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    log(f"wrote {out}: {size / 2**20:,.1f} MiB in {time.time() - t:.1f} s")
    return n


def derive_scaled(spec, base, out):
    """`out` as `base` with the final norm scaled: the shard holding it rewritten, every other
    file a symlink to base's. The same bytes as a full build of `spec`."""
    import torch
    from safetensors.torch import load_file, save_file

    base_spec = dict(spec)
    del base_spec["logit_scale"]
    with open(os.path.join(base, ".done")) as f:
        if json.load(f) != base_spec:
            raise SystemExit(f"--base {base}: not the flat checkpoint of this shape and seed")
    index = os.path.join(base, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shard = json.load(f)["weight_map"][FINAL_NORM]
    else:
        shard = "model.safetensors"
    t = time.time()
    for f in sorted(os.listdir(base)):
        if f not in (shard, ".done", "spread.json", SPREAD_LOGITS):
            os.symlink(os.path.abspath(os.path.join(base, f)), os.path.join(out, f))
    tensors = load_file(os.path.join(base, shard))
    tensors[FINAL_NORM] = (tensors[FINAL_NORM] * spec["logit_scale"]).to(torch.bfloat16)
    save_file(tensors, os.path.join(out, shard), metadata={"format": "pt"})
    # A power-of-two scale of the final norm scales every bf16 logit exactly.
    write_spread(out, torch.load(os.path.join(base, SPREAD_LOGITS)) * spec["logit_scale"])
    log(f"wrote {out}: {shard} rewritten (final norm x {spec['logit_scale']}), the rest "
        f"linked to {base}, in {time.time() - t:.1f} s")


SPREAD_LOGITS = "spread-logits.pt"


def probe_logits(model, dev, tokens=16):
    """The next-token logits (f32, on the CPU) at each position of one prompt (ids
    1..tokens): what the spread is measured on."""
    import torch

    with torch.no_grad():
        ids = torch.arange(1, tokens + 1, device=dev).unsqueeze(0)
        return model(ids).logits[0].float().cpu()


def write_spread(out, logits, temperature=0.7, top_p=0.9):
    """Mean top-1 probability and nucleus size of `logits` at `temperature` and `top_p`, as
    the rollout sampler sees them, into out/spread.json (and the logits beside it, for a
    checkpoint derived with --base)."""
    import torch

    torch.save(logits, os.path.join(out, SPREAD_LOGITS))
    probs = torch.softmax(logits / temperature, dim=-1)
    top = probs.sort(dim=-1, descending=True).values
    nucleus = (top.cumsum(dim=-1) < top_p).sum(dim=-1) + 1
    r = dict(positions=int(logits.shape[0]), temperature=temperature, top_p=top_p,
             logit_std=float(logits.std(dim=-1).mean()), top1_p=float(top[:, 0].mean()),
             nucleus_mean=float(nucleus.float().mean()), nucleus_max=int(nucleus.max()),
             vocab=int(logits.shape[-1]))
    with open(os.path.join(out, "spread.json"), "w") as f:
        json.dump(r, f)
    log(f"logits at T {temperature}: std {r['logit_std']:.2f}, top-1 p {r['top1_p']:.3f}, "
        f"nucleus (top-p {top_p}) {r['nucleus_mean']:.0f} of {r['vocab']} tokens on average")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=20261125)
    ap.add_argument("--vocab-size", type=int)
    ap.add_argument("--max-shard-size")
    ap.add_argument("--logit-scale", type=float, default=1.0,
                    help="multiply every logit by this (8: a trained model's peaked spread)")
    ap.add_argument("--base", help="the flat checkpoint to derive a --logit-scale one from")
    a = ap.parse_args()
    if a.base and a.logit_scale == 1.0:
        ap.error("--base goes with --logit-scale")
    spec = spec_of(a)
    stamp = os.path.join(a.out, ".done")
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == spec:
                log(f"{a.out}: already written ({a.shape}, seed {a.seed})")
                return 0
    if os.path.exists(a.out):
        shutil.rmtree(a.out)
    os.makedirs(a.out)
    spec_out = dict(spec)
    if a.base:
        derive_scaled(spec, a.base, a.out)
    else:
        build(spec, a.out)
    with open(stamp, "w") as f:
        json.dump(spec_out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
