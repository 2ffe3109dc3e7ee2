#!/usr/bin/env python3
"""Turn the GPU check's raw outputs into summary lines and results.json.

    python3 scripts/gpu/gpu_check/report.py --work DIR [--hbm-tbs TB/S] STEP [STEP ...]

For each STEP (env, checkpoints, parity, mission, split, throughput, reflection) reads what
scripts/gpu/gpu-check.sh left in DIR/steps/STEP/ and stores its figures under results["STEP"] in
DIR/results.json (earlier steps, from earlier commands on the same machine, are kept), then
rewrites DIR/summary.txt (one or more lines per step, in step order) and prints this call's
lines. Standard library only: it runs wherever the check ran.

Verdicts use the tolerances of worker/tests/parity_transformers.rs (logits relative to the
largest |logit| of the reference: 1e-4 in f32, 6e-2 in bf16; a greedy continuation may part
from transformers' only at a near-tie, where transformers' logit for stageb's token is within
twice the tolerance of its best). The memory-bandwidth bound of a decode step is the bytes of
weights it reads (every tensor but an untied input embedding, of which a step reads a few rows)
divided by --hbm-tbs; by default the GPU's, from its name in the env step's nvidia-smi query
(H200 4.8 TB/s, H100 SXM 3.35 TB/s, H100 PCIe 2.0 TB/s, A100 80GB 2.0 TB/s), else 4.8.
"""

import argparse
import glob
import json
import os
import re
import struct
import sys
import time

STEPS = ["env", "kernels", "checkpoints", "parity", "mission", "split", "throughput", "reflection"]
SPLIT_PHASES = ["sampling", "forward_issued", "forward_done", "readback", "prefill"]
TOL = {"f32": 1e-4, "bf16": 6e-2}
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "U8": 1, "I8": 1}


def load(path, default=None):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def text(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def status(d):
    """The step's status file: 'ok', 'failed ...' or 'skipped ...'."""
    return text(os.path.join(d, "status")).strip() or "not run"


def measured(d, label):
    return load(os.path.join(d, f"{label}.measure.json"), {})


def gpu_peak(m):
    """GiB the GPU's used memory rose by during a command (whole GPU, nvidia-smi)."""
    if m.get("gpu_mem_peak_mib") is None:
        return None
    return (m["gpu_mem_peak_mib"] - (m.get("gpu_mem_before_mib") or 0)) / 1024


def fmt_mem(gib, rss_mib):
    if gib is not None:
        return f"peak GPU +{gib:.1f} GiB"
    return f"peak RSS {rss_mib / 1024:.2f} GiB" if rss_mib else "peak memory n/a"


# ---- env -----------------------------------------------------------------------------------

def env(d):
    gpu = text(os.path.join(d, "gpu.csv")).strip().splitlines()
    smi = text(os.path.join(d, "nvidia-smi.txt"))
    cuda = re.search(r"CUDA Version:\s*([0-9.]+)", smi)
    ldd = text(os.path.join(d, "ldd.txt"))
    missing = sorted({ln.split()[0] for ln in ldd.splitlines() if "not found" in ln})
    packed_ldd = text(os.path.join(d, "ldd-packed.txt"))
    packed_missing = sorted({ln.split()[0] for ln in packed_ldd.splitlines()
                             if "not found" in ln})
    r = dict(
        gpu=gpu[-1] if len(gpu) > 1 else None,
        cuda_driver_api=cuda.group(1) if cuda else None,
        glibc=text(os.path.join(d, "glibc.txt")).strip(),
        python=load(os.path.join(d, "python.json"), {}),
        cuda_lib_dirs=text(os.path.join(d, "cuda-libs.txt")).strip(),
        stageb_version=text(os.path.join(d, "version.txt")).strip(),
        binary=text(os.path.join(d, "binary.txt")).strip(),
        ldd_not_found=missing,
        probe=text(os.path.join(d, "probe.txt")).strip() or None,
        packed_binary_version=text(os.path.join(d, "version-packed.txt")).strip() or None,
        packed_ldd_not_found=packed_missing if packed_ldd else None,
        status=status(d),
    )
    smoke = smoke_test(d)
    r["smoke"] = smoke
    r["ok"] = r["status"] == "ok" and bool(smoke and smoke["ok"])
    line = (f"ENV {r['gpu'] or 'no GPU (nvidia-smi absent)'}; CUDA {r['cuda_driver_api'] or '-'};"
            f" {r['glibc']}; torch {r['python'].get('torch')} transformers "
            f"{r['python'].get('transformers')}; {r['stageb_version'] or 'stageb did not start'};"
            f" probe: {r['probe']}; ldd: "
            f"{'all resolved' if not missing else 'NOT FOUND ' + ' '.join(missing)}")
    lines = [line]
    if smoke:
        lines.append(
            f"ENV smoke test (qwen3 fixture, f32, stageb vs transformers' reference): "
            f"rel {smoke['logits']['rel']:.2e}, greedy {smoke['greedy']['equal_steps']}/12 same "
            f"-> {'PASS' if smoke['ok'] else 'FAIL'}")
    else:
        lines.append("ENV smoke test: no output (see steps/env/smoke.log)")
    if packed_ldd:
        started = (r["packed_binary_version"] or "").startswith("stageb ")
        lines.append(f"ENV packed binary (dist/cuda): "
                     f"{r['packed_binary_version'] if started else 'did not start'}; ldd: "
                     + ("all resolved" if not packed_missing
                        else "not found " + " ".join(packed_missing)))
    return r, lines


def smoke_test(d):
    got, ref = load(os.path.join(d, "smoke.json")), load(os.path.join(d, "smoke-ref.json"))
    if not got or not ref:
        return None
    lg = compare_logits(got["logits"], ref["logits"])
    gr = compare_greedy(got["greedy"], ref, TOL["f32"])
    return dict(logits=lg, greedy=gr, fingerprint=got.get("fingerprint"),
                ok=lg["rel"] <= TOL["f32"] and gr["ok"] and lg["vocab"][0] == lg["vocab"][1])


# ---- kernels ------------------------------------------------------------------------------

def kernels(d):
    """The worker's unit tests on the device: libtest's summary, the failed tests, and whether
    the device half ran (a test without a device says so and returns)."""
    log = text(os.path.join(d, "tests.log")) or ""
    m = measured(d, "tests") or {}
    summary = re.search(r"test result: (\w+)\. (\d+) passed; (\d+) failed", log)
    failed = re.findall(r"^test (\S+) \.\.\. FAILED", log, re.M)
    no_device = "no CUDA device" in log
    on_cpu = (load(os.path.join(d, "meta.json"), {}) or {}).get("device") == "cpu"
    if os.path.exists(os.path.join(d, "missing")):
        return dict(status=status(d), ok=False), ["KERNELS no kernel tests carried (dist/cuda/kernel-tests.xz) -> FAIL"]
    if not summary:
        rc = m.get("rc")
        return dict(status=status(d), ok=False, rc=rc), [
            f"KERNELS device tests: no result (exit {rc}; see steps/kernels/tests.log) -> FAIL"]
    passed, nfail = int(summary.group(2)), int(summary.group(3))
    ok = summary.group(1) == "ok" and nfail == 0 and (on_cpu or not no_device)
    where = "not on the device (no CUDA device)" if no_device else "on the device"
    line = (f"KERNELS engine::kernels tests {where}, CUDA_LAUNCH_BLOCKING=1: {passed} passed, "
            f"{nfail} failed{' (' + ', '.join(failed) + ')' if failed else ''}"
            f" in {m.get('wall_s', 0):.1f} s -> {'PASS' if ok else 'FAIL'}")
    return dict(status=status(d), ok=ok, passed=passed, failed=failed, on_device=not no_device), [line]


# ---- checkpoints ---------------------------------------------------------------------------

def safetensors_bytes(model_dir):
    """(all tensor bytes, bytes of an untied input embedding) from the shards' headers."""
    total = embed = 0
    for f in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name == "__metadata__":
                continue
            size = DTYPE_BYTES.get(t["dtype"], 2)
            for s in t["shape"]:
                size *= s
            total += size
            if name.endswith("embed_tokens.weight"):
                embed = size
    cfg = load(os.path.join(model_dir, "config.json"), {})
    tied = cfg.get("tie_word_embeddings", False)
    return total, 0 if tied else embed


def checkpoints(d, work):
    r, lines = {}, []
    for stamp in sorted(glob.glob(os.path.join(work, "ckpt", "*", ".done"))):
        cdir = os.path.dirname(stamp)
        total, embed = safetensors_bytes(cdir)
        m = measured(d, f"ckpt-{os.path.basename(cdir)}")
        spread = load(os.path.join(cdir, "spread.json"))
        r[os.path.basename(cdir)] = dict(spec=load(stamp), bytes=total, wall_s=m.get("wall_s"),
                                         spread=spread)
        size = f"{total / 2**30:.2f} GiB" if total >= 2**30 else f"{total / 2**20:.2f} MiB"
        lines.append(f"CHECKPOINT {os.path.basename(cdir)}: {size} bf16"
                     + (f", written in {m['wall_s']:.0f} s" if m.get("wall_s") else "")
                     + (f"; logits std {spread['logit_std']:.2f}, at T {spread['temperature']}"
                        f" top-1 p {spread['top1_p']:.3f}, top-p {spread['top_p']} nucleus "
                        f"{spread['nucleus_mean']:.0f} of {spread['vocab']} tokens"
                        if spread else ""))
    r["status"] = status(d)
    return r, lines or [f"CHECKPOINT none ({r['status']})"]


# ---- parity --------------------------------------------------------------------------------

def first_argmax(v):
    """The first index of the largest value, as `torch.argmax` picks."""
    return max(range(len(v)), key=lambda i: (v[i], -i))


def compare_logits(got, want):
    n = min(len(got), len(want))
    diff = max(abs(got[i] - want[i]) for i in range(n))
    scale = max(abs(x) for x in want[:n]) or 1.0
    return dict(max_abs=diff, rel=diff / scale, vocab=(len(got), len(want)),
                argmax=(first_argmax(got), first_argmax(want)))


def compare_greedy(got, ref, tol):
    """Equal leading steps, the first divergent step, and whether it was a near-tie."""
    want = ref["greedy"]
    k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if k is None:
        same = min(len(got), len(want))
        return dict(equal_steps=same, first_divergence=None, near_tie=None,
                    ok=len(got) == len(want))
    step = ref["greedy_steps"][k]
    top = dict(zip(step["top_ids"], step["top_logits"]))
    gap = (step["top_logits"][0] - top[got[k]]) / step["max_abs_logit"] if got[k] in top else None
    near = gap is not None and gap <= 2 * tol
    return dict(equal_steps=k, first_divergence=k, stageb_token=got[k], reference_token=want[k],
                reference_gap=gap, near_tie=near, ok=near)


def parity_case(cdir, case):
    hf = load(os.path.join(cdir, "hf.json"), {})
    out, lines = {}, []
    for dt in ("bf16", "f32"):
        sb = load(os.path.join(cdir, f"stageb-{dt}.json"))
        ref = hf.get(dt)
        if not sb or not ref:
            why = "stageb output missing" if not sb else "transformers output missing"
            out[dt] = dict(ok=False, error=why)
            lines.append(f"PARITY {case} {dt}: FAIL ({why})")
            continue
        lg = compare_logits(sb["logits"], ref["logits"])
        gr = compare_greedy(sb["greedy"], ref, TOL[dt])
        r = dict(logits=lg, greedy=gr, tolerance=TOL[dt], prompt_tokens=sb.get("prompt_tokens"),
                 fingerprint=sb.get("fingerprint"), stageb_load_s=sb.get("load_s"),
                 hf_load_s=ref.get("load_s"))
        if dt == "bf16" and "f32" in hf:
            # Accuracy: each side's bf16 against transformers' f32.
            exact = hf["f32"]["logits"]
            r["stageb_bf16_vs_hf_f32_rel"] = compare_logits(sb["logits"], exact)["rel"]
            r["hf_bf16_vs_hf_f32_rel"] = compare_logits(ref["logits"], exact)["rel"]
        r["ok"] = lg["rel"] <= TOL[dt] and gr["ok"] and lg["vocab"][0] == lg["vocab"][1]
        out[dt] = r
        steps = len(ref["greedy"])
        g = (f"greedy {gr['equal_steps']}/{steps} same" if gr["first_divergence"] is None
             else f"greedy first divergence at step {gr['first_divergence']} "
                  f"({gr['stageb_token']} vs {gr['reference_token']}, "
                  + ("near-tie" if gr["near_tie"] else "NOT a near-tie") + ")")
        acc = ""
        if "stageb_bf16_vs_hf_f32_rel" in r:
            acc = (f"; vs transformers f32: stageb {r['stageb_bf16_vs_hf_f32_rel']:.2e}, "
                   f"transformers bf16 {r['hf_bf16_vs_hf_f32_rel']:.2e}")
        lines.append(
            f"PARITY {case} {dt}: max|dlogit| {lg['max_abs']:.3g} (rel {lg['rel']:.2e}, tol "
            f"{TOL[dt]:.0e}), argmax {'same' if lg['argmax'][0] == lg['argmax'][1] else 'DIFFERS'}"
            f"; {g}{acc} -> {'PASS' if r['ok'] else 'FAIL'}")
    return out, lines


def parity(d):
    r, lines = {}, []
    for cdir in sorted(p for p in glob.glob(os.path.join(d, "*")) if os.path.isdir(p)):
        case = os.path.basename(cdir)
        r[case], case_lines = parity_case(cdir, case)
        lines += case_lines
    r["status"] = status(d)
    r["ok"] = r["status"] == "ok" and all(
        v.get("ok") for c in r.values() if isinstance(c, dict) for v in c.values())
    return r, lines or [f"PARITY nothing compared ({r['status']})"]


# ---- mission -------------------------------------------------------------------------------

def run_dir(root):
    found = glob.glob(os.path.join(root, "*", "*", "manifest.json"))
    return os.path.dirname(found[0]) if found else None


def jsonl(path):
    rows = []
    for ln in text(path).splitlines():
        if ln.strip():
            rows.append(json.loads(ln))
    return rows


def mission(d):
    r = dict(runs={})
    for name in ("a", "b"):
        rd = run_dir(os.path.join(d, f"run-{name}"))
        m_run, m_audit = measured(d, f"run-{name}"), measured(d, f"audit-{name}")
        traj = jsonl(os.path.join(rd, "trajectories.jsonl")) if rd else []
        manifest = load(os.path.join(rd, "manifest.json"), {}) if rd else {}
        r["runs"][name] = dict(
            rc=m_run.get("rc"), wall_s=m_run.get("wall_s"), audit_rc=m_audit.get("rc"),
            candidates=len(traj), format_ok=sum(1 for t in traj if t["result"]["format_ok"]),
            malformed_rows=len(jsonl(os.path.join(rd, "failure_malformed.jsonl"))) if rd else None,
            fingerprint=(manifest.get("model") or {}).get("fingerprint"),
            gpu_peak_gib=gpu_peak(m_run), peak_rss_mib=m_run.get("peak_rss_mib"))
    cmp = measured(d, "compare")
    r["identical"] = cmp.get("rc") == 0
    a, b = r["runs"]["a"], r["runs"]["b"]
    contract = all(x["candidates"] > 0 and x["format_ok"] == x["candidates"] for x in (a, b))
    audit = all(x["audit_rc"] == 0 for x in (a, b))
    runs_ok = all(x["rc"] == 0 for x in (a, b))
    r["ok"] = contract and audit and runs_ok and r["identical"]
    r["status"] = status(d)
    meta = load(os.path.join(d, "meta.json"), {})
    r["meta"] = meta
    sw = f" (engine switches {meta['switches']})" if meta.get("switches") else ""
    line = (f"MISSION small demo on {meta.get('device', '?')}{sw}: runs exit {a['rc']}/{b['rc']} "
            f"({a['wall_s'] or 0:.0f} s, {b['wall_s'] or 0:.0f} s); contract "
            f"{a['format_ok']}/{a['candidates']} and {b['format_ok']}/{b['candidates']} "
            f"candidates; audit {'OK' if audit else 'FAILED'}; runs "
            f"{'byte-identical' if r['identical'] else 'DIFFERENT'} (8 jobs in flight, prefix store on, steps and cycles ahead, vs 1 job, store off, nothing ahead); fingerprint "
            f"{a['fingerprint']}; {fmt_mem(a['gpu_peak_gib'], a['peak_rss_mib'])} -> "
            f"{'PASS' if r['ok'] else 'FAIL'}")
    return r, [line]


# ---- split ---------------------------------------------------------------------------------

def fmt_split(split):
    """`sampling 1.20 + issued 3.40 + done 20.10 + readback 0.80 ms` (prefill apart), or n/a
    when the binary does not report a split."""
    if not isinstance(split, dict):
        return "step split n/a"
    parts = [f"{k.replace('forward_', '')} {split.get(k, 0):.2f}" for k in SPLIT_PHASES[:-1]]
    return (" + ".join(parts) + f" ms (prefill {split.get('prefill', 0):.1f} ms per step that"
            " ran one)")


def bound_of(split):
    """Host- or device-bound: the host issuing a step's work against waiting for the device."""
    if not isinstance(split, dict) or not split.get("forward_done") and not split.get(
            "forward_issued"):
        return None
    host = split.get("sampling", 0) + split.get("forward_issued", 0) + split.get("readback", 0)
    dev = split.get("forward_done", 0)
    return dict(host_ms=host, device_wait_ms=dev,
                verdict="host-bound" if host >= dev else "device-bound")


def split_run(d, label):
    run = load(os.path.join(d, f"{label}.run.json"), {})
    res = load(os.path.join(d, f"{label}.json"))
    m = measured(d, label)
    r = dict(run=run.get("run"), state=run.get("state"), jobs=run.get("jobs"),
             spread=run.get("spread"), switches_asked=run.get("switches"))
    head = f"SPLIT {run.get('state')} @ {run.get('jobs')} job(s), {run.get('spread')} logits"
    if not res or res.get("best") is None:
        why = "skipped (budget)" if not m else f"no result (exit {m.get('rc')})"
        r["ok"] = None if not m else False
        return r, f"{head}: {why}"
    p = res["passes"][res["best"]]
    split = p.get("step_split_ms")
    ops = p.get("host_ops_per_step")
    r.update(switches=res.get("switches"), decode_step_ms=p["decode_step_ms"],
             rows_per_step=p.get("mean_rows_per_step"), tickets_per_min=p["tickets_per_min"],
             step_split_ms=split, host_ops_per_step=ops, bound=bound_of(split),
             load_s=res.get("load_s"), gpu_peak_gib=gpu_peak(m), ok=True)
    sw = res.get("switches") or f"not reported (asked {run.get('switches')})"
    bound = r["bound"]
    verdict = (f"; {bound['verdict']} (host {bound['host_ms']:.2f} ms, device wait "
               f"{bound['device_wait_ms']:.2f} ms)" if bound else "")
    line = (f"{head} [{sw}]: {r['rows_per_step'] or 0:.1f} rows/step, {p['decode_step_ms']:.2f}"
            f" ms/step = {fmt_split(split)}; host ops/step "
            f"{'n/a' if ops is None else f'{ops:.0f}'}{verdict}; {p['tickets_per_min']:.2f} "
            f"tickets/min; {fmt_mem(r['gpu_peak_gib'], m.get('peak_rss_mib'))}")
    return r, line


def split_step(d):
    meta = load(os.path.join(d, "meta.json"), {})
    order = meta.get("runs", "").split(",")
    asked = {os.path.basename(f)[:-len(".run.json")]: load(f, {}).get("run")
             for f in glob.glob(os.path.join(d, "split-*.run.json"))}
    # In the order the runs were asked for (most telling first); runs of an earlier command
    # with another list after them.
    labels = sorted(asked, key=lambda lb: (order.index(asked[lb]) if asked[lb] in order
                                           else len(order), lb))
    r = dict(meta=meta, runs={}, status=status(d))
    lines = [f"SPLIT workload on {meta.get('device')}: {meta.get('case')}, prompts of "
             f"~{meta.get('prompt_tokens')} tokens, {meta.get('candidates')} candidates x "
             f"{meta.get('new_tokens')} new tokens, all jobs in flight at once"] if meta else []
    for lb in labels:
        r["runs"][lb], line = split_run(d, lb)
        lines.append(line)
    r["ok"] = r["status"] in ("ok", "not run") and all(
        v.get("ok") is not False for v in r["runs"].values())
    return r, lines or [f"SPLIT nothing run ({r['status']})"]


# ---- throughput and reflection -------------------------------------------------------------

# Peak HBM bandwidth (TB/s) by the name nvidia-smi gives; the first match wins.
HBM_TBS = [("H200", 4.8), ("H100 PCIe", 2.0), ("H100 NVL", 3.9), ("H100", 3.35),
           ("A100-SXM4-80GB", 2.039), ("A100", 1.555)]


def hbm_tbs_of(gpu_csv):
    try:
        text = open(gpu_csv).read()
    except OSError:
        return 4.8
    for name, tbs in HBM_TBS:
        if name in text:
            return tbs
    return 4.8


def bound_ms(ckpt, dtype, tbs):
    total, embed = safetensors_bytes(ckpt)
    per_step = total - embed
    if dtype.endswith("f32"):
        per_step *= 2  # stageb's f32 numerics hold the bf16 weights as f32
    return per_step, per_step / (tbs * 1e12) * 1e3


def side(name, res, m, ckpt, dtype, tbs, rows_per_step, on_gpu):
    if not res or res.get("best") is None:
        if not m:  # this side runs in another command (--throughput-sides)
            return dict(ok=None), f"{name}: not run (yet)"
        return dict(ok=False), f"{name}: no result (exit {m.get('rc')})"
    p = res["passes"][res["best"]]
    if p.get("mean_rows_per_step"):  # stageb's probe counts the rows its steps computed
        rows_per_step = round(p["mean_rows_per_step"], 1)
    weight_bytes, bms = bound_ms(ckpt, dtype, tbs)
    r = dict(tickets_per_min=p["tickets_per_min"], decode_tok_s=p["decode_tok_s"],
             prefill_tok_s=p["prefill_tok_s"], decode_step_ms=p["decode_step_ms"],
             tickets_done=p["tickets_done"], passes=len(res["passes"]),
             complete=p["complete"], budget_exhausted=res.get("budget_exhausted"),
             rows_per_step=rows_per_step, load_s=res.get("load_s"), wall_s=m.get("wall_s"),
             gpu_peak_gib=gpu_peak(m), peak_rss_mib=m.get("peak_rss_mib"),
             weight_bytes_per_step=weight_bytes, bound_step_ms=bms, hbm_tbs=tbs,
             x_bound=p["decode_step_ms"] / bms if bms else None, ok=True)
    if res.get("peak_mem_allocated_bytes"):
        r["torch_peak_allocated_gib"] = res["peak_mem_allocated_bytes"] / 2**30
    mem = fmt_mem(r["gpu_peak_gib"], r["peak_rss_mib"])
    if "torch_peak_allocated_gib" in r:
        mem += f" (torch allocated {r['torch_peak_allocated_gib']:.1f} GiB)"
    bound = (f" = {r['x_bound']:.1f}x the {bms:.2f} ms bandwidth bound at {tbs} TB/s" if on_gpu
             else "; no bandwidth bound on the CPU")
    split = ""
    if p.get("sample_step_ms"):  # stageb's probe, one ticket at a time: where a step goes
        r["sample_step_ms"], r["forward_step_ms"] = p["sample_step_ms"], p["forward_step_ms"]
        split = (f"; of a step: sampling {p['sample_step_ms']:.2f} ms, forward "
                 f"{p['forward_step_ms']:.2f} ms")
    line = (f"{name}: {p['tickets_per_min']:.2f} tickets/min, decode {p['decode_tok_s']:.0f} tok/s"
            f" ({rows_per_step} rows/step, {p['decode_step_ms']:.2f} ms/step{bound}{split}), prefill "
            f"{p['prefill_tok_s']:.0f} tok/s; {mem}; {p['tickets_done']} ticket(s), best of "
            f"{len(res['passes'])}{'' if p['complete'] else ' (cut by the budget)'}")
    return r, line


def throughput(d, work, tbs, label):
    meta = load(os.path.join(d, "meta.json"), {})
    ckpt = meta.get("checkpoint", "")
    sb, hf = load(os.path.join(d, "stageb.json")), load(os.path.join(d, "hf.json"))
    tag = label.upper()
    r = dict(meta=meta, status=status(d))
    if not os.path.isdir(ckpt):
        return r, [f"{tag} not run ({r['status']})"]
    sdtype = (sb or {}).get("fingerprint", {}).get("dtype", "bf16")
    cands = meta.get("candidates", 1)
    on_gpu = str(meta.get("device", "")).startswith("cuda")
    r["stageb"], l1 = side(f"{tag} stageb" + (f" ({sdtype})" if sb else ""), sb, measured(d, "stageb"), ckpt, sdtype,
                           tbs, cands, on_gpu)
    hb = (hf or {}).get("batch", 1)
    r["transformers"], l2 = side(f"{tag} transformers ({(hf or {}).get('dtype', 'bf16')}, "
                                 f"{(hf or {}).get('attn', 'sdpa')}, batch {hb} tickets)", hf,
                                 measured(d, "hf"), ckpt, (hf or {}).get("dtype", "bf16"), tbs,
                                 hb * cands, on_gpu)
    peaked = load(os.path.join(d, "stageb-peaked.json"))
    l_peaked = None
    if peaked or measured(d, "stageb-peaked"):
        r["stageb_peaked"], l_peaked = side(f"{tag} stageb, peaked logits ({sdtype})", peaked,
                                            measured(d, "stageb-peaked"), ckpt, sdtype, tbs,
                                            cands, on_gpu)
    if r["stageb"].get("ok") and r["transformers"].get("ok"):
        r["stageb_vs_transformers_tickets_per_min"] = (
            r["stageb"]["tickets_per_min"] / r["transformers"]["tickets_per_min"])
    lens = [len(p) for p in load(os.path.join(d, "ids.json"), [])] or [0]
    plen = f"{min(lens)}-{max(lens)}" if min(lens) != max(lens) else f"{lens[0]}"
    shape = (f"{tag} workload on {meta.get('device')}: {meta.get('case')}, prompts of {plen} "
             f"tokens, {cands} x {meta.get('new_tokens')} new tokens; stageb "
             f"{meta.get('stageb_tickets')} ticket(s), transformers {meta.get('tickets')}")
    sides = [r["stageb"].get("ok"), r["transformers"].get("ok")]
    r["ok"] = r["status"] == "ok" and False not in sides and True in sides
    lines = [shape, l1] + ([l_peaked] if l_peaked else []) + [l2]
    if "stageb_vs_transformers_tickets_per_min" in r:
        lines.append(f"{tag} stageb / transformers tickets per minute: "
                     f"{r['stageb_vs_transformers_tickets_per_min']:.2f}")
    flat, pk = r["stageb"], r.get("stageb_peaked", {})
    if flat.get("ok") and pk.get("ok"):
        lines.append(f"{tag} stageb flat | peaked logits: {flat['tickets_per_min']:.2f} | "
                     f"{pk['tickets_per_min']:.2f} tickets/min, sampling "
                     f"{flat.get('sample_step_ms', 0):.2f} | {pk.get('sample_step_ms', 0):.2f}"
                     f" ms/step, {flat['decode_step_ms']:.2f} | {pk['decode_step_ms']:.2f} "
                     "ms/step")
    return r, lines


# ---- main ----------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True)
    ap.add_argument("--hbm-tbs", type=float, default=None)
    ap.add_argument("steps", nargs="+", choices=STEPS)
    a = ap.parse_args()
    if a.hbm_tbs is None:
        a.hbm_tbs = hbm_tbs_of(os.path.join(a.work, "steps", "env", "gpu.csv"))
    res_path = os.path.join(a.work, "results.json")
    results = load(res_path, {})
    lines_by_step = load(os.path.join(a.work, "summary-lines.json"), {})
    printed, ok = [], True
    for step in a.steps:
        d = os.path.join(a.work, "steps", step)
        if not os.path.isdir(d):
            continue
        if status(d).startswith("skipped"):
            r, lines = dict(status=status(d)), [f"{step.upper()} {status(d)}"]
        elif step == "env":
            r, lines = env(d)
        elif step == "kernels":
            r, lines = kernels(d)
        elif step == "checkpoints":
            r, lines = checkpoints(d, a.work)
        elif step == "parity":
            r, lines = parity(d)
        elif step == "mission":
            r, lines = mission(d)
        elif step == "split":
            r, lines = split_step(d)
        else:
            r, lines = throughput(d, a.work, a.hbm_tbs, step)
        r["reported_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        results[step] = r
        if not str(r.get("status", "")).startswith("skipped"):
            ok = ok and bool(r.get("ok", r.get("status") == "ok"))
        lines_by_step[step] = lines
        printed += lines
    results["hbm_tbs"] = a.hbm_tbs
    with open(res_path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, ensure_ascii=False)
        f.write("\n")
    with open(os.path.join(a.work, "summary-lines.json"), "w", encoding="utf-8") as f:
        json.dump(lines_by_step, f, ensure_ascii=False)
    with open(os.path.join(a.work, "summary.txt"), "w", encoding="utf-8") as f:
        for step in STEPS:
            for ln in lines_by_step.get(step, []):
                f.write(ln + "\n")
    for ln in printed:
        print(ln)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
