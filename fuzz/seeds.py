#!/usr/bin/env python3
"""Writes the seed corpus under fuzz/corpus/<target>/ from the repository's test fixtures
(and, for the run-file targets, from a finished run directory given with --run-dir).

Run from the repository root: python3 fuzz/seeds.py [--run-dir DIR]. Seeds are small (a few
KB per target); libFuzzer grows its working corpus elsewhere (scripts/ci/fuzz.sh), never here.
"""
import argparse, glob, hashlib, hmac, json, os, struct

OUT = "fuzz/corpus"


def put(target, name, data):
    d = os.path.join(OUT, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def contract():
    for p in sorted(glob.glob("tests/fixtures/contract/*/*.json")):
        case = json.load(open(p, encoding="utf-8"))
        put("contract_parse", os.path.basename(os.path.dirname(p)) + "-" + os.path.basename(p)[:-5], case["text"])


def reflection(run_dir):
    put("reflection_decision", "basic", '{"no_evidence_group_ids": ["QC-xxx::fail", "QC-yyy::pass"], "decision_analysis": "..."}')
    put("reflection_decision", "empty_ids", '{"no_evidence_group_ids":[],"decision_analysis":"逐例尝试"}')
    put("reflection_decision", "unknown_field", '{"no_evidence_group_ids":[],"decision_analysis":"x","extra":1}')
    put("reflection_decision", "trailing", '{"no_evidence_group_ids":[],"decision_analysis":"x"} {}')
    ops = {"has_evidence": True, "evidence_analysis": "...", "operations": [
        {"op": "add", "text": "...", "rationale": "...", "evidence": ["QC-1", "QC-2"]},
        {"op": "update", "key": "G1", "text": "...", "rationale": "...", "evidence": ["QC-3"]},
        {"op": "delete", "key": "G2", "rationale": "...", "evidence": ["QC-4"]},
        {"op": "merge", "key": "G3", "merged_from": ["G4", "G5"], "text": "...", "rationale": "...", "evidence": ["QC-6"], "expected_flips": ["QC-6::fail"]}],
        "coverage": {"learnable_group_ids": ["QC-1::pass"], "covered_group_ids": [], "uncovered_group_ids": []}}
    put("reflection_ops", "all_ops", json.dumps(ops, ensure_ascii=False, indent=2))
    put("reflection_ops", "no_ops", '{"has_evidence":false,"evidence_analysis":"","operations":[]}')
    if run_dir:
        for i, line in enumerate(open(os.path.join(run_dir, "reflection.jsonl"), encoding="utf-8")):
            row = json.loads(line)
            d = row.get("decision") or {}
            put("reflection_decision", f"run-{i}", json.dumps({"no_evidence_group_ids": d.get("no_evidence_group_ids", []), "decision_analysis": d.get("decision_analysis", "")}, ensure_ascii=False))
            for j, p in enumerate(row.get("proposals") or []):
                p = {k: p[k] for k in ("has_evidence", "evidence_analysis", "operations") if k in p}
                put("reflection_ops", f"run-{i}-{j}", json.dumps(p, ensure_ascii=False))
            if i >= 4:
                break


def config():
    for p in sorted(glob.glob("tests/fixtures/config/*.yaml")) + sorted(glob.glob("examples/**/*.yaml", recursive=True))[:10]:
        put("config_yaml", p.replace("/", "_"), open(p, "rb").read())


def stage_a():
    for p in ["examples/demo/small/stage_a.jsonl", "tests/fixtures/adversarial/hostile.jsonl"]:
        data = open(p, "rb").read()
        put("stage_a_ingest", p.replace("/", "_"), data[:4096])
    one = '{"group_id":"QC-1","mission":"m","label":"pass","per_image":{"image_1":"ok","img02":"{\\"a\\":\\"b\\"}"},"images":["a.jpg"],"label_source":"human"}\n'
    put("stage_a_ingest", "one", one)
    put("stage_a_ingest", "crlf_bom", "\ufeff" + one.replace("\n", "\r\n") + one.replace("QC-1", "7").replace('"QC-1"', "7"))


def guidance(run_dir):
    g = {"m": {"step": 1, "updated_at": "2026-01-01T00:00:00Z", "experiences": {"G0": "检查挡风板", "S1": "rule"},
               "metadata": {"S1": {"reflection_id": "r1"}}}}
    put("guidance_json", "minimal", json.dumps(g, ensure_ascii=False))
    put("guidance_json", "focus", json.dumps({"m": {"step": 0, "updated_at": "2026-01-01", "focus": "legacy", "experiences": {"G0": "Initial guidance placeholder"}}}))
    for p in sorted(glob.glob("examples/**/*guidance*.json", recursive=True))[:4]:
        put("guidance_json", p.replace("/", "_"), open(p, "rb").read()[:8192])
    if run_dir:
        put("guidance_json", "run", open(os.path.join(run_dir, "guidance.json"), "rb").read())


def journal():
    out = {"kind": "rollout", "candidates": [{"decode_index": 0, "sample_index": 0, "seed": 1, "text": "Verdict: 通过\nReason: ok", "completion_tokens": 9, "finish_reason": "stop"}],
           "prompt_tokens": 100, "prefix_tokens": 0, "prefill_us": 5, "decode_us": 9}
    gen = {"kind": "generate", "text": "{}", "prompt_tokens": 10, "completion_tokens": 2, "finish_reason": "stop", "latency_us": 3}
    rows = [json.dumps({"journal_version": 1, "digest": f"sha256:{i}", "output": o}, ensure_ascii=False, separators=(",", ":")) for i, o in enumerate([out, gen])]
    put("journal_replay", "plain", "\n".join(rows) + "\n" + rows[0][:20])
    key = b"k"
    macd = [r[:-1] + ',"mac":"' + hmac.new(key, r.encode(), hashlib.sha256).hexdigest() + '"}' for r in rows]
    put("journal_replay", "keyed", key + b"\0" + ("\n".join(macd) + "\n").encode())
    seal_key = bytes.fromhex("00112233445566778899aabbccddeeff")
    put("seal_verify", "row_mac", b"\x02" + macd[0].encode())
    put("seal_verify", "row", b"\x02" + rows[0].encode())
    body = ("\n".join(rows) + "\n").encode()
    put("seal_verify", "prefix", b"\x01" + body)
    seal = json.dumps({"bytes": len(body), "hmac": hmac.new(seal_key, body, hashlib.sha256).hexdigest()})
    put("seal_verify", "good_seal", b"\x00" + body + b"\0" + seal.encode())
    put("seal_verify", "long_seal", b"\x00" + body + b"\0" + json.dumps({"bytes": 1 << 40, "hmac": "00"}).encode())


def checkpoint(run_dir):
    if not run_dir:
        return
    c = json.load(open(os.path.join(run_dir, "checkpoint.json"), encoding="utf-8"))
    c["run"] = {"config_sha256": "c", "tickets_digest": "t"}
    c["artifact_bytes"] = {k: min(v, 16) for k, v in c["artifact_bytes"].items()}
    put("checkpoint_load", "run", json.dumps(c, ensure_ascii=False, separators=(",", ":")))


def varint(n):
    out = b""
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def field(num, wire, payload):
    key = varint((num << 3) | wire)
    return key + (varint(payload) if wire == 0 else varint(len(payload)) + payload)


def submit():
    def cand(d, s, seed, text=b"Verdict: \xe9\x80\x9a\xe8\xbf\x87\nReason: ok", reason=b"stop"):
        return field(1, 0, d) + field(2, 0, s) + field(3, 0, seed) + field(4, 2, text) + field(5, 0, 9) + field(6, 2, reason)
    rollout = b"".join(field(1, 2, c) for c in [cand(0, 0, 11), cand(0, 1, 12), cand(3, 0, 13)])
    rollout += field(2, 0, 100) + field(3, 0, 5) + field(4, 0, 9) + field(5, 0, 10)
    put("submit_validate", "rollout_ok", field(1, 2, b"session") + field(2, 0, 7) + field(3, 2, rollout))
    put("submit_validate", "rollout_wrong_seed", field(1, 2, b"s") + field(3, 2, b"".join(field(1, 2, c) for c in [cand(0, 0, 12), cand(0, 1, 12), cand(3, 0, 13)])))
    gen = field(1, 2, b"{}") + field(2, 0, 10) + field(3, 0, 2) + field(4, 2, b"length") + field(5, 0, 3) + field(6, 0, 1)
    put("submit_validate", "generate_ok", field(1, 2, b"s") + field(4, 2, gen))
    put("submit_validate", "error", field(1, 2, b"s") + field(5, 2, field(1, 2, b"PROMPT_TOO_LONG") + field(2, 2, b"too long")))


def finisher():
    # Byte 0 picks the reason cap; then op bytes (7 forced, 6 a refused token, 5 fork, below 96
    # an end token when one is allowed, else two bytes index the allowed set).
    import random
    rng = random.Random(7)
    pick = lambda: bytes([0x60 | rng.randrange(0, 5) << 3 | rng.randrange(0, 5), rng.randrange(256), rng.randrange(256)])
    for cap in (0, 1, 3, 11, 39, 255):
        # The header forced, a verdict picked, the separator forced, then reason tokens.
        steps = b"\x07" + pick() + b"\x07" + b"".join(pick() for _ in range(1 + cap % 40))
        put("contract_finisher", f"cap_{cap + 1 if cap < 250 else 240}", bytes([cap]) + steps + b"\x00")
    put("contract_finisher", "forced_first", b"\x05" + b"\x07" * 4 + b"".join(pick() for _ in range(8)) + b"\x00" * 4)
    put("contract_finisher", "fork_and_refusals", b"\x02\x05" + b"".join(b"\x06" + bytes([rng.randrange(256), rng.randrange(256)]) + pick() for _ in range(12)) + b"\x00")
    put("contract_finisher", "random", bytes(rng.randrange(256) for _ in range(300)))


def run_dir_audit(run_dir):
    if not run_dir:
        return
    names = ["manifest.json", "summary.json", "guidance.json", "need_review.json", "trajectories.jsonl", "selections.jsonl",
             "metrics.jsonl", "failure_malformed.jsonl", "need_review_queue.jsonl", "reflection.jsonl"]
    parts = []
    for n in names:
        data = open(os.path.join(run_dir, n), "rb").read()
        if n.endswith(".jsonl"):
            data = b"".join(data.splitlines(keepends=True)[:2])
        parts.append(data)
    put("run_dir_audit", "run", b"\0".join(parts))
    put("run_dir_audit", "manifest_only", parts[0])


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir")
    a = ap.parse_args()
    contract(); reflection(a.run_dir); config(); stage_a(); guidance(a.run_dir); journal()
    checkpoint(a.run_dir); submit(); finisher(); run_dir_audit(a.run_dir)
