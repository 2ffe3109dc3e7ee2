#!/usr/bin/env python3
"""Re-creates the transformers parity fixtures of worker/tests/parity_transformers.rs.

Run by hand (not in CI), from anywhere, with the pinned versions:

    python3 -m venv .parity-venv
    .parity-venv/bin/pip install -r scripts/parity-requirements.txt
    .parity-venv/bin/python scripts/make-parity-fixtures.py
    .parity-venv/bin/python scripts/make-parity-fixtures.py --rss-checkpoint DIR   # see below

Pinned (scripts/parity-requirements.txt; each reference.json records what produced it):
torch 2.11.0, transformers 5.17.0, safetensors 0.8.0, tokenizers 0.23.3, numpy 2.4.6,
jinja2 3.1.6. Everything runs on the CPU, in about 10 s. transformers 5 always saves
safetensors (`save_pretrained` has no `safe_serialization` switch any more).

It rewrites worker/tests/fixtures/parity/ (built in parity.new/ beside it and swapped in at
the end, so a failed run leaves the old fixtures), deterministically (fixed seeds, sorted
parameter order, single-threaded torch), one directory per case:

    llama/     LlamaForCausalLM, tied embeddings (no lm_head.weight), f32, rope_parameters
               (transformers-5 config), Llama-3 style template using bos_token
    qwen2/     Qwen2ForCausalLM, nonzero q/k/v biases, f32, top-level rope_theta
               (transformers-4 config, rewritten after saving)
    qwen3/     Qwen3ForCausalLM, q_norm/k_norm away from 1, f32, rope_parameters, saved in two
               shards with model.safetensors.index.json
    qwen3_vl/  Qwen3VLForConditionalGeneration, bf16 (as published), with a tiny vision tower
               (model.visual.*, which stageb must skip), text tower under
               model.language_model.*, lm_head.weight at the top level, text_config in the
               transformers-4 form of the published checkpoints (top-level rope_theta,
               rope_scaling with mrope_section, rewritten after saving), and its template in
               chat_template.jinja beside the tokenizer instead of tokenizer_config.json

Every case holds config.json, the weights, tokenizer.json, tokenizer_config.json (bos/eos and,
except qwen3_vl, the chat template), generation_config.json (eos_token_id) and reference.json:

- `tokenize`: a fixed string and the ids transformers' tokenizer gives it (no special tokens
  added, as stageb encodes);
- `chats`: two conversations (system + user in Chinese and English; and a multi-turn one with
  a reasoning block) rendered by `apply_chat_template(..., tokenize=False,
  add_generation_prompt=True, enable_thinking=False)`, and their token ids;
- `prompts`: three token-id lists (the first chat's ids; ~200 tokens of mixed Chinese and
  English; seeded random ids), each with transformers' next-token logits at the last position
  in float32 and in bfloat16 (model converted to that dtype, eager attention, logits cast to
  float) and a 12-token greedy continuation in each dtype, with the 8 best ids and logits and
  the largest |logit| of every greedy step (how close its choice was to a tie).

The tokenizer is a byte-level BPE trained here with `tokenizers` on a small built-in corpus
(scripts/parity_templates.py), with the Qwen2 pre-tokenizer (so transformers' Qwen2Tokenizer,
which rebuilds its pipeline from vocab and merges, agrees with tokenizer.json), NFC and the
special tokens of the templates.

Weights are not committed. transformers saves each model (which decides the tensor names,
dtypes and shards); scripts/parity_weights.py then overwrites those files with seeded uniform
values of the usual spreads (matrices std 1/sqrt(fan_in), embeddings std 0.25, biases std 0.5,
norm weights U(0.5, 1.5)), using only IEEE-exact arithmetic, and the recipe (names, shapes,
dtypes, seeds, ranges, each file's sha256) goes into reference.json as `weights`. References
are computed from those files (loaded back with from_pretrained). scripts/fetch-model.sh runs
parity_weights.py, which writes the same bytes from the recipe on any machine without torch.

`--rss-checkpoint DIR` writes only a ~366 MiB Qwen3-shaped bf16 checkpoint (two shards, the
qwen3 tokenizer and template) for measuring the loader's peak host memory (docs/PERFORMANCE.md).
"""

import json
import platform
import shutil
import sys
from pathlib import Path

import numpy as np
import tokenizers
import torch
import transformers
from tokenizers import (
    Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers)

sys.dont_write_bytecode = True  # no scripts/__pycache__ from importing the templates
sys.path.insert(0, str(Path(__file__).resolve().parent))
import parity_templates as T  # noqa: E402
import parity_weights as W  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "worker" / "tests" / "fixtures" / "parity"
SEED = 20240521
VOCAB_TARGET = 1000
GREEDY_STEPS = 12
# Seeds the weight streams (scripts/parity_weights.py); chosen so that no f32 greedy step is a
# near-tie (check_no_near_tie).
WEIGHT_SEED = 2
TOP_K = 8
# Small enough that the layers, not the input embedding, dominate the residual stream (with
# tied embeddings a dominant embedding makes the model repeat its input token).
EMBED_STD = 0.25
QWEN_PRETOKENIZE = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>",
]
# Added but not special (as in Qwen3): the template writes them, the model may emit them.
PLAIN_ADDED = ["<think>", "</think>"]


def versions():
    import jinja2
    import safetensors

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "tokenizers": tokenizers.__version__,
        "numpy": np.__version__,
        "jinja2": jinja2.__version__,
    }


def train_tokenizer():
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = T.CORPUS + [T.SYSTEM, T.USER, T.LONG_TEXT]
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED])
    return tok


def tok_id(tok, s):
    i = tok.token_to_id(s)
    assert i is not None, s
    return i


def padded_vocab(tok):
    n = tok.get_vocab_size(with_added_tokens=True)
    return (n + 63) // 64 * 64


# ---------------------------------------------------------------------------------------------
# Cases


def case_specs(tok):
    vocab = padded_vocab(tok)
    text = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=4096, hidden_act="silu",
    )
    qwen_tok = dict(cls="Qwen2Tokenizer", bos=None, eos="<|im_end|>", pad="<|endoftext|>")
    return [
        dict(name="llama", arch="LlamaForCausalLM",
             config=dict(text, model_type="llama", rms_norm_eps=1e-5, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                         bos_token_id=tok_id(tok, "<|begin_of_text|>"),
                         eos_token_id=tok_id(tok, "<|eot_id|>")),
             dtype=torch.float32, old_style=False, shard=None, template=T.LLAMA, jinja=False,
             tok=dict(cls="PreTrainedTokenizerFast", bos="<|begin_of_text|>", eos="<|eot_id|>",
                      pad=None),
             gen_eos=["<|end_of_text|>", "<|eot_id|>"]),
        dict(name="qwen2", arch="Qwen2ForCausalLM",
             config=dict(text, model_type="qwen2", rms_norm_eps=1e-6, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                         eos_token_id=tok_id(tok, "<|im_end|>")),
             dtype=torch.float32, old_style=True, shard=None, template=T.QWEN2, jinja=False,
             tok=qwen_tok, gen_eos=["<|im_end|>", "<|endoftext|>"]),
        dict(name="qwen3", arch="Qwen3ForCausalLM",
             config=dict(text, model_type="qwen3", rms_norm_eps=1e-6, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                         eos_token_id=tok_id(tok, "<|im_end|>")),
             dtype=torch.float32, old_style=False, shard="500KB", template=T.QWEN3, jinja=False,
             tok=qwen_tok, gen_eos=["<|im_end|>", "<|endoftext|>"]),
        dict(name="qwen3_vl", arch="Qwen3VLForConditionalGeneration",
             config=qwen3_vl_config(tok, text),
             dtype=torch.bfloat16, old_style=True, shard=None, template=T.QWEN3_VL, jinja=True,
             tok=qwen_tok, gen_eos=["<|im_end|>", "<|endoftext|>"]),
    ]


def qwen3_vl_config(tok, text):
    text_config = dict(
        text, model_type="qwen3_vl_text", rms_norm_eps=1e-6, attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                         "mrope_section": [4, 2, 2], "mrope_interleaved": True},
    )
    vision_config = dict(
        model_type="qwen3_vl_vision", depth=2, hidden_size=32, num_heads=2,
        intermediate_size=64, out_hidden_size=64, patch_size=8, temporal_patch_size=2,
        spatial_merge_size=2, in_channels=3, num_position_embeddings=16,
        deepstack_visual_indexes=[0],
    )
    return dict(
        model_type="qwen3_vl", text_config=text_config, vision_config=vision_config,
        tie_word_embeddings=False,
        image_token_id=tok_id(tok, "<|image_pad|>"),
        video_token_id=tok_id(tok, "<|video_pad|>"),
        vision_start_token_id=tok_id(tok, "<|vision_start|>"),
        vision_end_token_id=tok_id(tok, "<|vision_end|>"),
    )


# ---------------------------------------------------------------------------------------------
# Checkpoints


def init_range(name, shape):
    """The uniform range a parameter is drawn from: same spread as the usual initialisers
    (matrices std 1/sqrt(fan_in), embeddings std EMBED_STD, biases std 0.5, norm weights
    U(0.5, 1.5)), so a wrong RoPE theta, a dropped bias or a mis-applied norm changes the
    logits."""
    if name.endswith(".bias"):
        half = 0.5 * 3**0.5
    elif len(shape) == 1:
        return 0.5, 1.5
    elif "embed_tokens" in name or "pos_embed" in name:
        half = EMBED_STD * 3**0.5
    else:
        fan_in = int(np.prod(shape[1:]))
        half = (3 / fan_in) ** 0.5
    return -half, half


def build_model(spec):
    cfg = transformers.AutoConfig.for_model(**spec["config"])
    cfg.architectures = [spec["arch"]]
    torch.manual_seed(SEED)
    model = getattr(transformers, spec["arch"])(cfg).to(torch.float32).eval()
    return model.to(spec["dtype"])


def save_model(spec, model, out):
    kwargs = {}
    if spec["shard"]:
        kwargs["max_shard_size"] = spec["shard"]
    model.save_pretrained(out, **kwargs)
    if spec["shard"]:
        shards = sorted(p.name for p in out.glob("model-*.safetensors"))
        assert len(shards) == 2 and (out / "model.safetensors.index.json").exists(), shards
    if spec["old_style"]:
        to_old_style_config(out / "config.json")


def replace_weights(spec, out):
    """Rewrites the weight files transformers saved (same tensors, names, dtypes and shards)
    with values from scripts/parity_weights.py, and returns the recipe that recreates them
    (reference.json's `weights`: the files are not committed, scripts/fetch-model.sh writes
    them). Every tensor has its own seeded stream."""
    import safetensors

    case_seed = WEIGHT_SEED * 1000 + sum(map(ord, spec["name"]))
    files, index = [], 0
    for path in sorted(out.glob("*.safetensors")):
        tensors = []
        with safetensors.safe_open(path, "pt") as f:
            for name in sorted(f.keys()):
                sl = f.get_slice(name)
                shape = list(sl.get_shape())
                low, high = init_range(name, shape)
                tensors.append(dict(name=name, dtype=sl.get_dtype(), shape=shape,
                                    seed=case_seed * 4096 + index, low=low, high=high))
                index += 1
        files.append(dict(file=path.name, sha256=None, tensors=tensors))
    recipe = dict(generator=W.GENERATOR, files=files)
    sums = W.write_files(out, recipe, check=False)
    for f in files:
        f["sha256"] = sums[f["file"]]
    return recipe


def to_old_style_config(path):
    """transformers 5 writes `rope_parameters`; the published checkpoints (and transformers 4)
    have `rope_theta` at the top level of the (text) config and `rope_scaling` beside it."""
    cfg = json.loads(path.read_text())
    for c in [cfg] + ([cfg["text_config"]] if "text_config" in cfg else []):
        rp = c.pop("rope_parameters", None)
        if rp is None:
            continue
        c["rope_theta"] = rp.pop("rope_theta")
        extra = {k: v for k, v in rp.items() if k != "rope_type"}
        c["rope_scaling"] = dict(rp) if extra else None
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def write_json(path, obj, indent=2):
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=indent) + "\n", encoding="utf-8")


def save_tokenizer(spec, tok, out):
    if spec["tok"]["bos"]:
        # As Llama 3's tokenizer.json: encoding with special tokens prepends bos (stageb
        # encodes without; the chat template writes bos itself).
        tok = Tokenizer.from_str(tok.to_str())
        bos = spec["tok"]["bos"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok_id(tok, bos))])
    tok.save(str(out / "tokenizer.json"))
    added = {}
    for i, t in sorted(tok.get_added_tokens_decoder().items()):
        added[str(i)] = dict(content=t.content, lstrip=t.lstrip, normalized=t.normalized,
                             rstrip=t.rstrip, single_word=t.single_word, special=t.special)
    t = spec["tok"]
    cfg = dict(
        tokenizer_class=t["cls"], added_tokens_decoder=added, bos_token=t["bos"],
        eos_token=t["eos"], pad_token=t["pad"], unk_token=None, add_prefix_space=False,
        clean_up_tokenization_spaces=False, errors="replace", split_special_tokens=False,
        model_max_length=4096,
    )
    if spec["jinja"]:
        (out / "chat_template.jinja").write_text(spec["template"], encoding="utf-8")
    else:
        cfg["chat_template"] = spec["template"]
    write_json(out / "tokenizer_config.json", cfg)
    eos = [tok_id(tok, e) for e in spec["gen_eos"]]
    gen = dict(do_sample=False, eos_token_id=eos)
    if t["bos"]:
        gen["bos_token_id"] = tok_id(tok, t["bos"])
    write_json(out / "generation_config.json", gen)


# ---------------------------------------------------------------------------------------------
# References


def conversations():
    multi = [
        {"role": "system", "content": T.SYSTEM},
        {"role": "user", "content": "第一张照片：gasket seated。"},
        {"role": "assistant",
         "content": "<think>\n标签完整。\n</think>\n\nVerdict: 通过\nReason: 密封条到位。"},
        {"role": "user", "content": T.USER},
    ]
    return [[{"role": "system", "content": T.SYSTEM}, {"role": "user", "content": T.USER}], multi]


def render_chats(hf_tok):
    chats = []
    for messages in conversations():
        prompt = hf_tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
        ids = hf_tok.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, enable_thinking=False,
            return_dict=False)
        assert list(ids) == hf_tok.encode(prompt, add_special_tokens=False), "chat ids"
        chats.append(dict(messages=messages, prompt=prompt, ids=list(map(int, ids))))
    return chats


def prompt_ids(hf_tok, chats, vocab_in_tokenizer, exclude):
    long_ids = hf_tok.encode(T.LONG_TEXT, add_special_tokens=False)
    assert 180 <= len(long_ids) <= 260, len(long_ids)
    g = np.random.default_rng(SEED)
    allowed = [i for i in range(vocab_in_tokenizer) if i not in exclude]
    rand = [int(x) for x in g.choice(allowed, size=37)]
    return [("chat", chats[0]["ids"]), ("long_mixed", long_ids), ("random_ids", rand)]


def f32_str(x):
    """The shortest decimal that reads back as the same float32."""
    return float(str(np.float32(x)))


@torch.no_grad()
def last_logits(model, ids):
    out = model(input_ids=torch.tensor([ids]), use_cache=False)
    return out.logits[0, -1].float()


@torch.no_grad()
def greedy(model, ids, steps):
    """Argmax continuation with the KV cache, never stopping at EOS (transformers' generate with
    do_sample=False stops there; the comparison wants all steps). Returns the tokens and, per
    step, the TOP_K best ids with their logits and the largest |logit| (so a test can tell
    whether a different choice was a near-tie)."""
    out = model(input_ids=torch.tensor([ids]), use_cache=True)
    tokens, details = [], []
    for step in range(steps):
        logits = out.logits[0, -1].float()
        nxt = int(torch.argmax(logits))  # the first of equal maxima
        top = torch.topk(logits, TOP_K)
        tokens.append(nxt)
        details.append(dict(top_ids=[int(i) for i in top.indices],
                            top_logits=[f32_str(v) for v in top.values],
                            max_abs_logit=f32_str(logits.abs().max())))
        if step + 1 < steps:
            out = model(input_ids=torch.tensor([[nxt]]), past_key_values=out.past_key_values,
                        use_cache=True)
    return tokens, details


@torch.no_grad()
def check_against_generate(model, ids, tokens, eos):
    gen = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                         dtype=torch.long), do_sample=False, max_new_tokens=len(tokens))
    got = gen[0, len(ids):].tolist()
    n = len(got)
    assert got == tokens[:n], (got, tokens)
    assert n == len(tokens) or tokens[n - 1] in eos, (got, tokens)


def load_reference_model(spec, out, dtype):
    cls = getattr(transformers, spec["arch"])
    model = cls.from_pretrained(out, dtype=dtype, attn_implementation="eager").eval()
    assert next(model.parameters()).dtype == dtype
    return model


def references(spec, out, hf_tok, tok):
    chats = render_chats(hf_tok)
    exclude = {tok_id(tok, s) for s in ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                        "<|vision_end|>"]}
    prompts = prompt_ids(hf_tok, chats, tok.get_vocab_size(with_added_tokens=True), exclude)
    eos = [tok_id(tok, e) for e in spec["gen_eos"]]
    result = [dict(name=n, ids=list(map(int, ids))) for n, ids in prompts]
    for key, dtype in [("f32", torch.float32), ("bf16", torch.bfloat16)]:
        model = load_reference_model(spec, out, dtype)
        for entry in result:
            logits = last_logits(model, entry["ids"])
            tokens, details = greedy(model, entry["ids"], GREEDY_STEPS)
            if dtype == torch.float32:
                check_against_generate(model, entry["ids"], tokens, eos)
                check_no_near_tie(details)
            entry[key] = dict(logits=[f32_str(x) for x in logits.tolist()], greedy=tokens,
                              greedy_steps=details)
    return chats, result


def check_no_near_tie(details):
    """The Rust test demands the f32 greedy tokens exactly, which is fair only if no step's
    top-1/top-2 margin is within what its f32 tolerance allows (1e-4 relative per logit, so
    2e-4 between two). Checked here with a factor 2 on that, so a regenerated fixture with a
    near-tie fails here rather than in the Rust test."""
    for d in details:
        margin = (d["top_logits"][0] - d["top_logits"][1]) / d["max_abs_logit"]
        assert margin > 4e-4, f"f32 greedy near-tie ({margin:.2e}); change WEIGHT_SEED"


def check_tokenizer_agrees(hf_tok, tok, chats):
    """transformers' tokenizer must agree with tokenizer.json on the fixtures' text. (Its
    Qwen2Tokenizer rebuilds normalizer and pre-tokenizer from its own code and takes only vocab
    and merges from tokenizer.json; stageb uses tokenizer.json as it is.)"""
    for text in [T.TOKENIZE_TEXT, T.LONG_TEXT] + [c["prompt"] for c in chats]:
        assert hf_tok.encode(text, add_special_tokens=False) == tok.encode(text).ids, text


def make_case(spec, tok, vers, root):
    out = root / spec["name"]
    out.mkdir(parents=True)
    save_model(spec, build_model(spec), out)
    recipe = replace_weights(spec, out)
    save_tokenizer(spec, tok, out)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok.chat_template == spec["template"], "template not loaded as written"
    chats, prompts = references(spec, out, hf_tok, tok)
    check_tokenizer_agrees(hf_tok, tok, chats)
    ids = hf_tok.encode(T.TOKENIZE_TEXT, add_special_tokens=False)
    ref = dict(
        case=spec["name"], architecture=spec["arch"], versions=vers,
        weights_dtype=str(spec["dtype"]).removeprefix("torch."),
        config_style="top-level rope_theta" if spec["old_style"] else "rope_parameters",
        sharded=bool(spec["shard"]), chat_template_file=spec["jinja"],
        tokenize=dict(text=T.TOKENIZE_TEXT, ids=list(map(int, ids))),
        chats=chats, prompts=prompts, weights=recipe,
    )
    write_json(out / "reference.json", ref, indent=1)
    report(spec["name"], out, prompts)


def report(name, out, prompts):
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"{name}: {size / 1024:.0f} KiB")
    for p in prompts:
        for key in ["f32", "bf16"]:
            m = min((d["top_logits"][0] - d["top_logits"][1]) / d["max_abs_logit"]
                    for d in p[key]["greedy_steps"])
            print(f"  {p['name']:<11} {key:<4} len {len(p['ids']):>3} greedy {p[key]['greedy']}"
                  f" min rel margin {m:.3g}")


def rss_checkpoint(out):
    """A Qwen3-shaped bf16 checkpoint of ~366 MiB in two shards (8 layers, hidden 1024, MLP
    4096, vocab 32,000, untied) with the fixtures' qwen3 tokenizer and template, for measuring
    the loader's peak host memory (docs/PERFORMANCE.md). Not committed; no references."""
    tok = train_tokenizer()
    spec = next(s for s in case_specs(tok) if s["name"] == "qwen3")
    spec = dict(spec, name="rss", dtype=torch.bfloat16, shard="200MB")
    spec["config"] = dict(spec["config"], vocab_size=32000, hidden_size=1024,
                          intermediate_size=4096, num_hidden_layers=8, num_attention_heads=16,
                          num_key_value_heads=8, head_dim=64)
    out.mkdir(parents=True, exist_ok=True)
    save_model(spec, build_model(spec), out)
    save_tokenizer(spec, tok, out)
    print(f"wrote {out}: {sum(f.stat().st_size for f in out.iterdir()) / 2**20:.0f} MiB")


def main():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if len(sys.argv) == 3 and sys.argv[1] == "--rss-checkpoint":
        return rss_checkpoint(Path(sys.argv[2]))
    if len(sys.argv) != 1:
        sys.exit("usage: make-parity-fixtures.py [--rss-checkpoint DIR]")
    # Written beside the fixtures and swapped in at the end: a run that fails (or is killed)
    # leaves the committed fixtures as they were.
    new = OUT.with_name(OUT.name + ".new")
    if new.exists():
        shutil.rmtree(new)
    new.mkdir(parents=True)
    vers = versions()
    tok = train_tokenizer()
    print(f"tokenizer: {tok.get_vocab_size(with_added_tokens=True)} tokens "
          f"(model vocab {padded_vocab(tok)})")
    for spec in case_specs(tok):
        make_case(spec, tok, vers, new)
    if OUT.exists():
        shutil.rmtree(OUT)
    new.rename(OUT)


if __name__ == "__main__":
    main()
