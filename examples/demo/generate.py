#!/usr/bin/env python3
"""Generate the synthetic Stage-B demo mission 挡风板安装检查 (BBU windshield-panel check).

Writes two files into --out:

  stage_a.jsonl  one ticket per line, in the Stage-A format stageb ingests
                 (keys: group_id, mission, label, images, per_image; UTF-8, not escaped)
  truth.jsonl    one line per ticket, same order: the hidden ground truth (true label, the
                 scenario, which rule decided it, whether the published label was flipped as
                 noise). stageb never reads this file; it is for analysing a run afterwards.

The summaries imitate Stage-A output: per image a "，"-joined list of object chains
`对象/属性/…×数量`, optionally ending in `备注: …`.

Hidden rule set (what the human labels follow, before noise):
  fail  the BBU is not fitted with the panel (未按要求配备 / 缺失 / 未安装)
  fail  the panel is mounted the wrong way (安装方向错误 / 反向 / 装反)
  fail  the panel's fixing screws are loose (松动 / 未拧紧)
  fail  no image shows the panel completely, so none of the points can be confirmed
  pass  otherwise — in particular negated phrases (无错误, 未发现松动), pending views that a
        complete view in another image resolves, and defects of other objects (光纤 bending
        radius, cable ties, labels) do not fail the ticket.

Only the Python standard library is used; the output depends only on the arguments
(same --seed and --tickets give byte-identical files).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

MISSION = "挡风板安装检查"

# Scenario weights within each label. Pass and fail tickets are allocated half/half before
# noise, so the published pass rate stays near 50% at every size.
PASS_SCENARIOS = [
    ("pass_plain", 0.32),
    ("pass_negated", 0.24),
    ("pass_irrelevant_negative", 0.24),
    ("pass_pending_resolved", 0.20),
]
FAIL_SCENARIOS = [
    ("fail_missing", 0.28),
    ("fail_direction", 0.24),
    ("fail_loose", 0.20),
    ("fail_hidden_in_other_image", 0.14),
    ("fail_unconfirmed", 0.14),
]

# Which hidden rule decides each scenario (written to truth.jsonl).
RULE_OF = {
    "pass_plain": "pass.all_points_confirmed",
    "pass_negated": "pass.all_points_confirmed",
    "pass_irrelevant_negative": "pass.all_points_confirmed",
    "pass_pending_resolved": "pass.all_points_confirmed",
    "fail_missing": "fail.panel_missing",
    "fail_direction": "fail.wrong_direction",
    "fail_loose": "fail.loose_screws",
    "fail_unconfirmed": "fail.not_confirmable",
}

BRANDS = ["华为", "华为", "华为", "中兴", "中兴", "爱立信"]


def pick(rng: random.Random, items):
    return items[rng.randrange(len(items))]


# ---------------------------------------------------------------------------------------------
# Object chains. Each builder returns one "，"-free chain string ending in ×N.
# ---------------------------------------------------------------------------------------------


def bbu_chain(rng: random.Random, state: str, tags: list[str]) -> str:
    """The BBU itself; its last attribute says whether the panel is fitted."""
    if rng.random() < 0.12:
        brand = "无法判断品牌"
        tags.append("brand_unknown")
    else:
        brand = pick(rng, BRANDS)
    if state == "fitted":
        tail = "显示完整/这个BBU设备按要求配备了挡风板"
    elif state == "missing":
        tail = pick(rng, ["显示完整/这个BBU设备未按要求配备挡风板", "显示完整/这个BBU设备未安装挡风板"])
    elif state == "partial":
        tail = pick(rng, ["只显示部分/无法确认是否配备挡风板", "显示不完整/无法确认是否配备挡风板"])
    else:
        raise ValueError(state)
    return f"BBU设备/{brand}/{tail}×1"


def panel_chain(rng: random.Random, state: str) -> str:
    if state == "ok":
        return "挡风板/显示完整/安装方向正确×1"
    if state == "wrong":
        return pick(rng, [
            "挡风板/显示完整/安装方向错误×1",
            "挡风板/显示完整/反向安装×1",
            "挡风板/显示完整/安装方向不正确×1",
        ])
    if state == "partial":
        return pick(rng, [
            "挡风板/只显示部分/无法确认安装方向×1",
            "挡风板/模糊/无法确认安装方向×1",
        ])
    if state == "bare":  # visible, but Stage-A said nothing about direction
        return "挡风板/显示完整×1"
    raise ValueError(state)


def screw_chain(rng: random.Random, state: str) -> str:
    n = rng.randint(2, 4)
    if state == "ok":
        return pick(rng, [
            f"螺丝/显示完整/符合要求×{n}",
            f"螺丝、光纤插头/BBU安装螺丝/显示完整/符合要求×{n}",
        ])
    if state == "ok_negated":
        return pick(rng, [
            f"挡风板螺丝/显示完整/未发现松动×{n}",
            f"挡风板固定螺丝/显示完整/无松动×{n}",
            f"挡风板螺丝/显示完整/未见明显松动×{n}",
        ])
    if state == "loose":
        return pick(rng, [
            "挡风板螺丝/显示完整/松动×1",
            "挡风板固定螺丝/显示完整/松动×1",
            "挡风板固定螺丝/显示完整/未拧紧×1",
        ])
    raise ValueError(state)


def label_chain(rng: random.Random) -> str:
    return f"标签/可以识别×{rng.randint(1, 7)}"


# Context objects that carry no information about the panel.
NEUTRAL_CHAINS = [
    "光纤/显示完整/弯曲半径符合要求×{n}",
    "光纤插头/显示完整/插接到位×{n}",
    "接地线/显示完整/符合要求×1",
    "电源线/显示完整/符合要求×{n}",
    "线缆/显示完整/绑扎整齐×{n}",
    "机柜/显示完整×1",
    "走线架/显示完整/符合要求×1",
]

# Real defects of *other* objects: trigger words, but irrelevant to 挡风板.
IRRELEVANT_NEGATIVES = [
    "光纤/显示完整/弯曲半径不符合要求×1",
    "尾纤/显示完整/未按要求绑扎×{n}",
    "线缆/显示完整/布放不合理×1",
    "线缆标签/显示完整/缺失×1",
    "走线架/显示完整/线缆绑扎不合格×1",
]

# Pending words about other objects: uncertain, but irrelevant to 挡风板.
IRRELEVANT_PENDING = [
    "标签/模糊/无法识别×1",
    "光纤插头/只显示部分×{n}",
]


def fill(rng: random.Random, template: str) -> str:
    return template.format(n=rng.randint(2, 5))


# ---------------------------------------------------------------------------------------------
# Images. An image is a list of chains plus an optional 备注.
# ---------------------------------------------------------------------------------------------


def render(chains: list[str], remark: str | None) -> str:
    parts = list(chains)
    if remark:
        parts.append(f"备注: {remark}")
    return "，".join(parts)


def context_image(rng: random.Random, tags: list[str], allow_irrelevant: bool) -> str:
    """An image that does not show the panel (cabinet overview, fibres, labels)."""
    k = rng.randint(1, 3)
    chains = [fill(rng, t) for t in rng.sample(NEUTRAL_CHAINS, k)]
    if rng.random() < 0.6:
        chains.append(label_chain(rng))
    if allow_irrelevant and rng.random() < 0.25:
        chains.insert(rng.randrange(len(chains) + 1), fill(rng, pick(rng, IRRELEVANT_PENDING)))
        tags.append("irrelevant_pending")
    return render(chains, None)


def bbu_image(
    rng: random.Random,
    tags: list[str],
    bbu: str,
    panel: str | None,
    screws: str | None,
    remark: str | None = None,
) -> str:
    """A close-up of the BBU front where the panel (if fitted) is visible."""
    chains = [bbu_chain(rng, bbu, tags)]
    if screws is not None and rng.random() < 0.5:
        chains.append(screw_chain(rng, screws))
        screws = None
    if rng.random() < 0.7:
        chains.append(label_chain(rng))
    if panel is not None:
        chains.append(panel_chain(rng, panel))
    if screws is not None:
        chains.append(screw_chain(rng, screws))
    if remark is None and "brand_unknown" in tags and rng.random() < 0.6:
        remark = "无法判断品牌"
    return render(chains, remark)


def partial_image(rng: random.Random, tags: list[str]) -> str:
    """A view where the panel is cut off or blurred: a pending signal, not a defect."""
    tags.append("pending")
    if rng.random() < 0.5:
        chains = [bbu_chain(rng, "partial", tags), label_chain(rng)]
    else:
        chains = [label_chain(rng), panel_chain(rng, "partial")]
    remark = pick(rng, [None, "图片模糊，无法确认挡风板安装情况", "只拍到挡风板一角"])
    return render(chains, remark)


# ---------------------------------------------------------------------------------------------
# Scenarios: each returns (list of image summaries, tags). Evidence images are placed at a
# random position among the context images.
# ---------------------------------------------------------------------------------------------


def n_images(rng: random.Random, minimum: int) -> int:
    n = rng.choices([1, 2, 3, 4], weights=[25, 35, 25, 15])[0]
    return max(n, minimum)


def assemble(rng: random.Random, evidence: list[str], tags: list[str], minimum: int,
             allow_irrelevant: bool, keep_order: bool = False) -> list[str]:
    total = n_images(rng, max(minimum, len(evidence)))
    images = [context_image(rng, tags, allow_irrelevant) for _ in range(total - len(evidence))]
    if keep_order:
        # Insert the evidence images in their given order (e.g. partial view before the
        # complete one), each at a random position after the previous one.
        pos = 0
        for img in evidence:
            pos = rng.randint(pos, len(images))
            images.insert(pos, img)
            pos += 1
    else:
        for img in evidence:
            images.insert(rng.randint(0, len(images)), img)
    return images


def scenario_images(rng: random.Random, scenario: str) -> tuple[list[str], list[str], str]:
    """Build one ticket. Returns (images, tags, rule)."""
    tags: list[str] = []
    rule = RULE_OF.get(scenario, "")

    if scenario == "pass_plain":
        ev = [bbu_image(rng, tags, "fitted", "ok", "ok")]
        return assemble(rng, ev, tags, 1, allow_irrelevant=False), tags, rule

    if scenario == "pass_negated":
        tags.append("negation")
        if rng.random() < 0.5:
            ev = [bbu_image(rng, tags, "fitted", "ok", "ok_negated")]
        else:
            remark = pick(rng, ["挡风板安装无错误", "挡风板未见明显损坏，安装牢固", "挡风板未发现松动",
                                "挡风板无缺失"])
            ev = [bbu_image(rng, tags, "fitted", "ok", pick(rng, ["ok", "ok_negated"]), remark)]
        return assemble(rng, ev, tags, 1, allow_irrelevant=False), tags, rule

    if scenario == "pass_irrelevant_negative":
        tags.append("irrelevant_negative")
        ev_img = bbu_image(rng, tags, "fitted", "ok", "ok")
        bad = fill(rng, pick(rng, IRRELEVANT_NEGATIVES))
        if rng.random() < 0.4:
            # The defect sits in the same image as the panel evidence.
            ev = [ev_img + "，" + bad if "备注:" not in ev_img else ev_img.replace("，备注:", "，" + bad + "，备注:", 1)]
            return assemble(rng, ev, tags, 1, allow_irrelevant=True), tags, rule
        other = render([fill(rng, pick(rng, NEUTRAL_CHAINS)), bad],
                       pick(rng, [None, None, "光纤弯曲半径过小", "尾纤绑扎不规范"]))
        return assemble(rng, [ev_img, other], tags, 2, allow_irrelevant=True), tags, rule

    if scenario == "pass_pending_resolved":
        tags.append("multi_image")
        partial = partial_image(rng, tags)
        complete = bbu_image(rng, tags, "fitted", "ok", pick(rng, ["ok", "ok_negated"]))
        ev = [partial, complete] if rng.random() < 0.7 else [complete, partial]
        return assemble(rng, ev, tags, 2, allow_irrelevant=True, keep_order=True), tags, rule

    if scenario == "fail_missing":
        remark = pick(rng, [None, None, "BBU机框上方未安装挡风板", "挡风板缺失"])
        ev = [bbu_image(rng, tags, "missing", None, pick(rng, [None, "ok"]), remark)]
        return assemble(rng, ev, tags, 1, allow_irrelevant=True), tags, rule

    if scenario == "fail_direction":
        if rng.random() < 0.2:
            # Only the 备注 says it, in words that are not on the trigger list.
            tags.append("no_trigger_word")
            ev = [bbu_image(rng, tags, "fitted", "bare", "ok", "挡风板装反了")]
        else:
            ev = [bbu_image(rng, tags, "fitted", "wrong", pick(rng, [None, "ok"]))]
        return assemble(rng, ev, tags, 1, allow_irrelevant=True), tags, rule

    if scenario == "fail_loose":
        if rng.random() < 0.3:
            tags.append("no_trigger_word")
            ev = [bbu_image(rng, tags, "fitted", "ok", None, pick(rng, ["挡风板有晃动，固定螺丝未拧紧",
                                                                        "挡风板一侧螺丝未拧紧"]))]
        else:
            ev = [bbu_image(rng, tags, "fitted", "ok", "loose")]
        return assemble(rng, ev, tags, 1, allow_irrelevant=True), tags, rule

    if scenario == "fail_hidden_in_other_image":
        # One view looks fine or is partial; a second, complete view shows the defect.
        tags.append("multi_image")
        defect = pick(rng, ["wrong", "loose"])
        rule = "fail.wrong_direction" if defect == "wrong" else "fail.loose_screws"
        first = partial_image(rng, tags) if rng.random() < 0.5 else bbu_image(rng, tags, "fitted", None, "ok")
        if defect == "wrong":
            second = render([panel_chain(rng, "wrong"), label_chain(rng)], None)
        else:
            second = render([screw_chain(rng, "loose")], pick(rng, [None, "挡风板固定螺丝特写"]))
        return assemble(rng, [first, second], tags, 2, allow_irrelevant=True, keep_order=True), tags, rule

    if scenario == "fail_unconfirmed":
        # Every view of the panel is partial or blurred: the key points cannot be confirmed.
        k = rng.randint(1, 2)
        ev = [partial_image(rng, tags) for _ in range(k)]
        return assemble(rng, ev, tags, k, allow_irrelevant=False), tags, rule

    raise ValueError(scenario)


# ---------------------------------------------------------------------------------------------
# Allocation, ids, noise.
# ---------------------------------------------------------------------------------------------


def allocate(n: int, weights: list[tuple[str, float]]) -> list[str]:
    """Largest-remainder allocation of n slots to scenarios (stable: ties keep list order)."""
    total = sum(w for _, w in weights)
    exact = [(name, n * w / total) for name, w in weights]
    counts = {name: int(x) for name, x in exact}
    rest = n - sum(counts.values())
    order = sorted(range(len(exact)), key=lambda i: (-(exact[i][1] - int(exact[i][1])), i))
    for i in order[:rest]:
        counts[exact[i][0]] += 1
    out: list[str] = []
    for name, _ in weights:
        out.extend([name] * counts[name])
    return out


def make_group_ids(rng: random.Random, n: int) -> list[str]:
    days = ["20260101", "20260102", "20260105", "20260106", "20260107"]
    numbers = sorted(rng.sample(range(1, 10_000_000), n))
    ids = []
    for i, num in enumerate(numbers):
        day = days[min(len(days) - 1, i * len(days) // max(n, 1))]
        ids.append(f"QC-DEMO-{day}-{num:07d}")
    return ids


def build(seed: int, tickets: int, noise: float, resubmissions: int | None):
    rng = random.Random(seed)
    if resubmissions is None:
        # About 8% of tickets belong to a resubmitted group (the real mission had 11 of 144),
        # and at least one pair whenever there is room, so small sets exercise the case too.
        resubmissions = max(1 if tickets >= 4 else 0, round(tickets * 0.04))
    if 2 * resubmissions > tickets:
        raise SystemExit(f"error: {resubmissions} resubmission pairs need at least {2 * resubmissions} tickets")
    base = tickets - 2 * resubmissions
    n_pass = base // 2 + (base % 2) * rng.randrange(2)
    scenarios = allocate(n_pass, PASS_SCENARIOS) + allocate(base - n_pass, FAIL_SCENARIOS)
    rng.shuffle(scenarios)

    group_ids = make_group_ids(rng, base + resubmissions)
    rng.shuffle(group_ids)

    rows = []  # (group_id, true_label, images, scenario, rule, tags)
    for gid, scenario in zip(group_ids[:base], scenarios):
        images, tags, rule = scenario_images(rng, scenario)
        label = "pass" if scenario.startswith("pass") else "fail"
        rows.append((gid, label, images, scenario, rule, tags))

    # Resubmissions: the same group was first rejected, then fixed and approved, so Stage-A
    # has it under both labels with different photos.
    for gid in group_ids[base:]:
        bad = pick(rng, ["fail_missing", "fail_direction", "fail_loose"])
        good = pick(rng, ["pass_plain", "pass_negated"])
        for scenario in (bad, good):
            images, tags, rule = scenario_images(rng, scenario)
            label = "pass" if scenario.startswith("pass") else "fail"
            rows.append((gid, label, images, scenario, rule, tags + ["resubmission"]))

    # Label noise: flip a fixed number of published labels, never on a resubmitted group
    # (flipping one half of a pair would duplicate its ticket key).
    flippable = [i for i, r in enumerate(rows) if "resubmission" not in r[5]]
    n_flip = min(len(flippable), round(tickets * noise))
    flipped = set(rng.sample(flippable, n_flip))
    rows = [r + (i in flipped,) for i, r in enumerate(rows)]

    rng.shuffle(rows)  # Stage-A interleaves labels; resubmission halves end up apart
    records, truths = [], []
    for gid, true_label, images, scenario, rule, tags, noisy in rows:
        label = ("fail" if true_label == "pass" else "pass") if noisy else true_label
        names = [f"{gid}_{rng.randrange(1_000_000, 10_000_000)}.jpeg" for _ in images]
        records.append({
            "group_id": gid,
            "mission": MISSION,
            "label": label,
            "images": names,
            "per_image": {f"image_{i + 1}": text for i, text in enumerate(images)},
        })
        truths.append({
            "ticket_key": f"{gid}::{label}",
            "group_id": gid,
            "label": label,
            "true_label": true_label,
            "noise_flipped": noisy,
            "scenario": scenario,
            "rule": rule,
            "tags": sorted(dict.fromkeys(tags)),
        })
    return records, truths


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        description="Generate the synthetic 挡风板安装检查 demo mission (Stage-A JSONL + hidden truth).")
    ap.add_argument("--seed", type=int, default=20260101, help="RNG seed (default: 20260101)")
    ap.add_argument("--tickets", type=int, default=48, help="number of tickets = JSONL lines (default: 48)")
    ap.add_argument("--noise", type=float, default=0.06,
                    help="fraction of published labels flipped against the hidden rules (default: 0.06)")
    ap.add_argument("--resubmissions", type=int, default=None,
                    help="number of group ids published with both labels (default: ~4%% of tickets, at least 1)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent,
                    help="output directory (default: the script's directory)")
    args = ap.parse_args(argv)
    if args.tickets < 1:
        ap.error("--tickets must be >= 1")
    if not 0.0 <= args.noise < 0.5:
        ap.error("--noise must be in [0, 0.5)")

    records, truths = build(args.seed, args.tickets, args.noise, args.resubmissions)
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / "stage_a.jsonl", records)
    write_jsonl(args.out / "truth.jsonl", truths)

    n_pass = sum(r["label"] == "pass" for r in records)
    n_flip = sum(t["noise_flipped"] for t in truths)
    n_groups = len({r["group_id"] for r in records})
    print(f"wrote {len(records)} tickets ({n_groups} group ids) to {args.out}: "
          f"pass {n_pass} / fail {len(records) - n_pass}, {n_flip} noisy labels", file=sys.stderr)
    return 0


def write_jsonl(path: Path, rows: list[dict]) -> None:
    # Write to a temporary name and rename, so an interrupted run never leaves half a file.
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8", newline="\n") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False, separators=(", ", ": ")) + "\n")
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
