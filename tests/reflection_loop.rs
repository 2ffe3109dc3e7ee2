//! Two-pass reflection over the real cluster runtime (seed 003; docs/design/reflection.md): the
//! stop-gradient, closure-retry, non-sticky need-review and JSON-retry guarantees, observed
//! only through the run's artifacts and the requests the scripted engine received.
//!
//! Fixture: the synthetic 16-ticket mission of `support::write_toy_mission` (8 pass tickets
//! with a confirmed panel, 8 fail tickets with one distinct, trigger-free defect each). The
//! scripted engine passes everything until rules are learned, so every fail ticket is a
//! gradient candidate in epoch 1, and the scripted reflector learns one phrase per fail ticket
//! it is allowed to see. Reflection batches hold 4 tickets and retries halve (4 → 2 → 1).

use crate::support;

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::{Value, json};
use stageb_coordinator::artifacts::files;
use stageb_coordinator::learn::reflection::retry_batch_size;
use support::{
    Pass, ScriptedMission, ScriptedRun, TOY_DEFECTS, TicketSpec, assert_audit_ok, read_json,
    read_jsonl, str_set, toy_fail_key,
};

const NO_EVIDENCE: &str = "reflection_no_evidence_after_gt";
const BUDGET_EXHAUSTED: &str = "budget_exhausted";

fn keys(list: &[usize]) -> BTreeSet<String> {
    list.iter().map(|&i| toy_fail_key(i)).collect()
}

/// Need-review rows for `key`: `(epoch, reason_code, reflection_id)`.
fn routed(queue: &[Value], key: &str) -> Vec<(u64, String, Option<String>)> {
    queue
        .iter()
        .filter(|r| r["ticket_key"] == key)
        .map(|r| {
            (
                r["epoch"].as_u64().unwrap(),
                r["reason_code"].as_str().unwrap().to_string(),
                r["reflection_id"].as_str().map(str::to_string),
            )
        })
        .collect()
}

fn guidance_texts(run_dir: &Path) -> Vec<String> {
    let g = read_json(run_dir, "guidance.json");
    g[support::MISSION]["experiences"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap().to_string())
        .collect()
}

/// Stop-gradient isolation: tickets the decision pass declares no-evidence go to need-review
/// with `reflection_no_evidence_after_gt` (in every epoch that declares them), are absent from
/// every ops-pass prompt and every applied op's evidence, and so never shape a rule; the
/// other fail tickets are learned from the same batches.
#[test]
fn stop_gradient_tickets_never_reach_the_ops_pass() {
    let stopped = keys(&[1, 4, 6]);
    let ScriptedRun {
        summary,
        run_dir,
        script,
    } = ScriptedMission::toy()
        .always_stop(&stopped)
        .workers(2)
        .run(json!({"runner": {"epochs": 2}}));

    let reflections = read_jsonl(&run_dir, files::REFLECTION);
    let declared: BTreeSet<String> = reflections
        .iter()
        .flat_map(|r| str_set(&r["stop_gradient"]))
        .collect();
    assert!(
        stopped.is_subset(&declared),
        "decision passes declared {declared:?}"
    );

    // The decision pass saw them; no ops pass ever did.
    let calls = script.calls();
    let decisions: Vec<_> = calls.iter().filter(|c| c.pass == Pass::Decision).collect();
    let ops: Vec<_> = calls.iter().filter(|c| c.pass == Pass::Ops).collect();
    assert!(!ops.is_empty(), "no ops pass ran");
    for k in &stopped {
        assert!(decisions.iter().any(|c| c.user.contains(k.as_str())));
        let group = k.split("::").next().unwrap();
        for c in &ops {
            assert!(
                !c.user.contains(group),
                "stop-gradient {k} appears in an ops prompt:\n{}",
                c.user
            );
        }
    }

    // Never learnable, never evidence of an applied op.
    let mut applied = 0;
    for r in &reflections {
        assert!(str_set(&r["learnable"]).is_disjoint(&stopped));
        for op in r["applied_ops"].as_array().into_iter().flatten() {
            applied += 1;
            let evidence = str_set(&op["evidence"]);
            assert!(
                evidence.is_disjoint(&stopped),
                "applied op {op} cites a stop-gradient ticket"
            );
        }
    }
    assert!(applied > 0, "reflection never applied an op");

    // Routed with the decision pass's reason code, once per epoch that declared them.
    let queue = read_jsonl(&run_dir, files::NEED_REVIEW_QUEUE);
    for k in &stopped {
        let rows = routed(&queue, k);
        let epochs: Vec<u64> = rows.iter().map(|(e, _, _)| *e).collect();
        assert_eq!(epochs, vec![1, 2], "{k}: {rows:?}");
        assert!(
            rows.iter()
                .all(|(_, code, id)| code == NO_EVIDENCE && id.is_some())
        );
    }
    let aggregate = read_json(&run_dir, files::NEED_REVIEW);
    let listed = aggregate.to_string();
    assert!(stopped.iter().all(|k| listed.contains(k.as_str())));

    // Their defects never became rules; the other fail tickets' did.
    let rules = guidance_texts(&run_dir).join("\n");
    for (i, defect) in TOY_DEFECTS.iter().enumerate() {
        assert_eq!(
            rules.contains(defect),
            ![1, 4, 6].contains(&i),
            "defect {defect} of ticket {i} in guidance:\n{rules}"
        );
    }
    assert!(summary.guidance_step > 1);
    assert_audit_ok(&run_dir);
}

/// Closure `L == E` with bounded retries: learnable tickets that no applied op covers are
/// retried reflection-only in batches whose size halves per attempt (4 → 2 → 1, visible as
/// `retry_attempt` and batch sizes in `reflection.jsonl`), and after
/// `retry_budget_per_group_per_epoch` (2) retries are routed `budget_exhausted` with the id of
/// their last reflection. Nothing else exhausts its budget.
#[test]
fn uncovered_tickets_are_retried_in_halving_batches_then_exhausted() {
    let never = keys(&[2, 5]);
    let ScriptedRun { run_dir, .. } = ScriptedMission::toy().never_cover(&never).run(json!({}));

    let reflections = read_jsonl(&run_dir, files::REFLECTION);
    let queue = read_jsonl(&run_dir, files::NEED_REVIEW_QUEUE);
    for k in &never {
        let rows: Vec<&Value> = reflections
            .iter()
            .filter(|r| str_set(&r["batch"]).contains(k))
            .collect();
        let attempts: Vec<u64> = rows
            .iter()
            .map(|r| r["retry_attempt"].as_u64().unwrap())
            .collect();
        assert_eq!(attempts, vec![0, 1, 2], "{k} was reflected on in {rows:#?}");
        for r in &rows {
            let attempt = r["retry_attempt"].as_u64().unwrap() as u32;
            let size = r["batch"].as_array().unwrap().len();
            assert!(
                size <= retry_batch_size(4, attempt),
                "attempt {attempt} batch of {size}"
            );
            assert!(str_set(&r["learnable"]).contains(k), "{k} is learnable");
            assert!(str_set(&r["uncovered"]).contains(k), "{k} stays uncovered");
            assert!(!str_set(&r["covered"]).contains(k));
        }
        // Both uncovered tickets wait for each other: one retry batch of 2, then two of 1.
        assert_eq!(str_set(&rows[1]["batch"]), never);
        assert_eq!(rows[2]["batch"].as_array().unwrap().len(), 1);

        let last_id = rows[2]["reflection_id"].as_str().map(str::to_string);
        assert_eq!(
            routed(&queue, k),
            vec![(1, BUDGET_EXHAUSTED.to_string(), last_id)],
            "{k} is exhausted after its last retry"
        );
        assert!(str_set(&rows[2]["routing"]["budget_exhausted"]).contains(k));
    }
    let exhausted: BTreeSet<String> = queue
        .iter()
        .filter(|r| r["reason_code"] == BUDGET_EXHAUSTED)
        .map(|r| r["ticket_key"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(exhausted, never);
    assert_audit_ok(&run_dir);
}

/// need-review is non-sticky: a ticket the decision pass stops in epoch 1 is a gradient
/// candidate again in epoch 2, lands in a reflection batch as learnable (the reflector no longer
/// stops it), is covered, and has no need-review row for epoch 2; its defect is learned then.
#[test]
fn need_review_in_epoch_1_is_reconsidered_in_epoch_2() {
    let k = toy_fail_key(3);
    let ScriptedRun { run_dir, .. } = ScriptedMission::toy()
        .stop_first_sighting([&k])
        .workers(2)
        .run(json!({"runner": {"epochs": 2}}));

    let queue = read_jsonl(&run_dir, files::NEED_REVIEW_QUEUE);
    let rows = routed(&queue, &k);
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!((rows[0].0, rows[0].1.as_str()), (1, NO_EVIDENCE));

    let reflections = read_jsonl(&run_dir, files::REFLECTION);
    let in_epoch = |epoch: u64| -> Vec<&Value> {
        reflections
            .iter()
            .filter(|r| r["epoch"] == epoch && str_set(&r["batch"]).contains(&k))
            .collect()
    };
    assert!(
        in_epoch(1)
            .iter()
            .any(|r| str_set(&r["stop_gradient"]).contains(&k))
    );
    let epoch2 = in_epoch(2);
    assert!(!epoch2.is_empty(), "{k} was not reflected on in epoch 2");
    assert!(
        epoch2
            .iter()
            .all(|r| !str_set(&r["stop_gradient"]).contains(&k))
    );
    assert!(epoch2.iter().any(|r| str_set(&r["learnable"]).contains(&k)));
    assert!(epoch2.iter().any(|r| str_set(&r["covered"]).contains(&k)));

    // Epoch 1 never learned its defect (it was stop-gradient); epoch 2 did.
    let selections = read_jsonl(&run_dir, files::SELECTIONS);
    let sel2 = selections
        .iter()
        .find(|s| s["epoch"] == 2 && s["ticket_key"] == k.as_str())
        .unwrap();
    assert_eq!(sel2["result"]["label_match"], false);
    assert!(guidance_texts(&run_dir).join("\n").contains(TOY_DEFECTS[3]));
    assert_audit_ok(&run_dir);
}

/// A decision call whose output is not JSON is retried with a new seed before it costs any
/// ticket its budget: the cycle records both calls (the failed one with its parse error), the
/// second parses, the batch proceeds to the ops pass, and nothing is ever retried or exhausted.
#[test]
fn invalid_decision_json_is_retried_with_a_new_seed_first() {
    let ScriptedRun {
        run_dir, script, ..
    } = ScriptedMission::toy()
        .invalid_json_decisions(1)
        .workers(2)
        .run(json!({}));

    let reflections = read_jsonl(&run_dir, files::REFLECTION);
    let first = &reflections[0];
    let calls = first["calls"].as_array().unwrap();
    let decision: Vec<&Value> = calls.iter().filter(|c| c["pass"] == "decision").collect();
    assert_eq!(decision.len(), 2, "{calls:#?}");
    assert_eq!(
        (decision[0]["attempt"].as_u64(), decision[0]["ok"].as_bool()),
        (Some(0), Some(false))
    );
    assert!(!decision[0]["parse_error"].is_null());
    assert_eq!(
        (decision[1]["attempt"].as_u64(), decision[1]["ok"].as_bool()),
        (Some(1), Some(true))
    );
    assert_ne!(decision[0]["seed"], decision[1]["seed"]);
    assert!(
        calls.iter().any(|c| c["pass"] == "ops"),
        "the batch went on to the ops pass"
    );
    assert!(!first["warnings"].to_string().contains("decision_error"));
    assert!(first["decision"].is_object());

    // The engine saw the same prompt twice, under two seeds.
    let seen: Vec<_> = script
        .calls()
        .into_iter()
        .filter(|c| c.pass == Pass::Decision)
        .take(2)
        .collect();
    assert_eq!(seen[0].user, seen[1].user);
    assert_ne!(seen[0].seed, seen[1].seed);

    // No ticket paid for it.
    assert!(reflections.iter().all(|r| r["retry_attempt"] == 0));
    let queue = read_jsonl(&run_dir, files::NEED_REVIEW_QUEUE);
    assert!(queue.iter().all(|r| r["reason_code"] != BUDGET_EXHAUSTED));
    assert_audit_ok(&run_dir);
}

/// The audit accepts the metrics a run wrote. Regression for a false positive: the epoch row's
/// `acc` is re-read with serde_json's default float parser, which is not round-trip exact
/// (12/13 is written as `0.9230769230769231` and read back as `…232`), so the exact comparison
/// with the recomputed value fails for about 9% of `k/n` ratios (n ≤ 48).
///
/// Fixture: 12 pass tickets and one fail ticket, no rollout noise; the fail ticket is decided
/// 通过 and declared no-evidence, so the include-manual-review accuracy is exactly 12/13.
#[test]
fn audit_accepts_an_epoch_accuracy_of_12_of_13() {
    let mut tickets: Vec<TicketSpec> = (0..12)
        .map(|i| TicketSpec {
            group_id: format!("QC-ACC-P{i}"),
            label: "pass",
            per_image: vec!["挡风板/显示完整/安装方向正确×1".into()],
        })
        .collect();
    tickets.push(TicketSpec {
        group_id: "QC-ACC-F0".into(),
        label: "fail",
        per_image: vec!["挡风板/显示完整×1，备注: 挡风板装反了".into()],
    });
    let ScriptedRun { run_dir, .. } = ScriptedMission::of(tickets)
        .quiet()
        .always_stop(["QC-ACC-F0::fail"])
        .run(json!({}));
    let epoch_row = read_jsonl(&run_dir, files::METRICS)
        .into_iter()
        .find(|r| r["event"] == "epoch_end")
        .unwrap();
    assert_eq!(epoch_row["include_manual_review"]["n"], 13);
    assert_audit_ok(&run_dir);
}

/// Validate–revise (seed 001): ops the validator rejects go back once with their reasons, and
/// the revision prompt asks for all operations again. The cycle must then apply each op once:
/// the ops already accepted in the first round are not accepted a second time (eating the
/// `max_operations` cap), and the corrected op is accepted.
#[test]
fn a_revision_round_applies_every_op_once() {
    let ScriptedRun { run_dir, .. } = ScriptedMission::toy()
        .third_state_op_then_revise()
        .run(json!({}));

    let first = &read_jsonl(&run_dir, files::REFLECTION)[0];
    let passes: Vec<&str> = first["calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["pass"].as_str().unwrap())
        .collect();
    assert_eq!(passes, ["decision", "ops", "ops_revision"]);
    let rejected = first["rejected_ops"].as_array().unwrap();
    assert!(
        rejected
            .iter()
            .any(|r| r["reason"] == "third_state_text" && r["index"].as_u64() < Some(1000)),
        "{rejected:#?}"
    );

    let accepted = first["accepted_ops"].as_array().unwrap();
    let signatures: Vec<String> = accepted
        .iter()
        .map(|a| format!("{} {} {}", a["op"]["op"], a["op"]["key"], a["op"]["text"]))
        .collect();
    let unique: BTreeSet<&String> = signatures.iter().collect();
    assert_eq!(
        unique.len(),
        signatures.len(),
        "ops accepted twice: {signatures:#?}\nrejected: {rejected:#?}"
    );
    let corrected = format!("“{}”", support::TOY_CONFIRMATION);
    assert!(
        first["applied_ops"]
            .as_array()
            .unwrap()
            .iter()
            .zip(accepted)
            .any(|(_, a)| a["op"]["text"]
                .as_str()
                .is_some_and(|t| t.contains(&corrected))),
        "the corrected op was not applied: {signatures:#?}\nrejected: {rejected:#?}"
    );
    assert_audit_ok(&run_dir);
}

/// Reflection reuses its prefixes: every prompt puts what the run's calls
/// share (mission, guidance) before what changes from cycle to cycle, and the cases before what
/// one call alone adds, so the revision round is the ops prompt plus its rejected ops; the
/// summary counts the prefill the workers' prefix caches saved on reflection calls.
#[test]
fn reflection_prompts_put_their_shared_head_first_and_the_summary_counts_its_reuse() {
    let ScriptedRun {
        summary,
        run_dir,
        script,
    } = ScriptedMission::toy()
        .third_state_op_then_revise()
        .run(json!({}));

    let calls = script.calls();
    for c in &calls {
        let at = |s: &str| {
            c.user
                .find(s)
                .unwrap_or_else(|| panic!("{s} in {}", c.user))
        };
        assert!(at("当前规则") < at("反思周期"), "{}", c.user);
        assert!(at("反思周期") < at("第1组"), "{}", c.user);
    }
    let ops = calls.iter().position(|c| c.pass == Pass::Ops).unwrap();
    let (ops, revision) = (&calls[ops], &calls[ops + 1]);
    let head = ops.user.strip_suffix("\n请输出 JSON。").unwrap();
    assert!(
        revision.system == ops.system && revision.user.starts_with(head),
        "the revision round extends the ops prompt:\n{}\n---\n{}",
        ops.user,
        revision.user
    );

    let answered: usize = read_jsonl(&run_dir, files::REFLECTION)
        .iter()
        .map(|r| r["calls"].as_array().unwrap().len())
        .sum();
    let reuse = &summary.runtime["prefix_cache"]["reflection"];
    assert_eq!(reuse["calls"].as_u64(), Some(answered as u64), "{reuse}");
    let saved = reuse["prefill_tokens_saved"].as_u64().unwrap();
    assert!(
        saved > 0 && saved < reuse["prompt_tokens"].as_u64().unwrap(),
        "{reuse}"
    );
}

/// Budgets are charged for what happened: cases the token budget drops
/// before any model saw them are re-batched without being charged a reflection retry. With a
/// budget that fits one case per prompt, every case is reflected on at attempt 0, nothing is
/// retried for having been dropped, and nothing is exhausted.
///
/// Fails on the old code: dropped cases went through retry-or-route (attempts 1, 2, then
/// `budget_exhausted`).
#[test]
fn regression_cases_dropped_by_the_token_budget_are_not_charged_a_retry() {
    let ScriptedRun { run_dir, .. } = ScriptedMission::toy()
        .quiet()
        .run(json!({"reflection": {"token_budget": 1}}));
    let reflections = read_jsonl(&run_dir, files::REFLECTION);
    let dropped: BTreeSet<String> = reflections
        .iter()
        .flat_map(|r| str_set(&r["dropped_by_token_budget"]))
        .collect();
    assert!(!dropped.is_empty(), "the budget must drop cases");
    for r in &reflections {
        assert_eq!(r["retry_attempt"], 0, "a retry was charged: {r:#}");
    }
    // Every dropped case was reflected on later, at attempt 0.
    let reflected: BTreeSet<String> = reflections
        .iter()
        .flat_map(|r| str_set(&r["learnable"]))
        .collect();
    assert!(dropped.is_subset(&reflected));
    let queue = read_jsonl(&run_dir, files::NEED_REVIEW_QUEUE);
    assert!(
        queue.iter().all(|r| r["reason_code"] != BUDGET_EXHAUSTED),
        "{queue:#?}"
    );
    assert_audit_ok(&run_dir);
}

/// When the epoch's change cap is reached, no further reflection call is made that epoch and
/// the remaining gradient tickets are routed `change_cap_reached` (they used up no budget), not
/// `budget_exhausted`.
///
/// Fails on the old code: later cycles still called the model, and their uncovered tickets were
/// retried and ended `budget_exhausted`.
#[test]
fn regression_change_cap_stops_ops_calls_and_routes_with_its_own_code() {
    let ScriptedRun { run_dir, .. } = ScriptedMission::toy()
        .quiet()
        .run(json!({"reflection": {"change_cap_per_epoch": 1}}));
    let reflections = read_jsonl(&run_dir, files::REFLECTION);
    let first_applied = reflections
        .iter()
        .position(|r| r["applied"] == true)
        .expect("one cycle applies");
    let after = &reflections[first_applied + 1..];
    assert!(!after.is_empty(), "later batches exist");
    let mut capped = BTreeSet::new();
    for r in after {
        assert_eq!(
            r["calls"].as_array().unwrap().len(),
            0,
            "a call after the cap: {r:#}"
        );
        assert!(
            r["warnings"]
                .to_string()
                .contains("epoch_change_cap_reached")
        );
        capped.extend(str_set(&r["routing"]["change_cap_reached"]));
    }
    let queue = read_jsonl(&run_dir, files::NEED_REVIEW_QUEUE);
    let routed: BTreeSet<String> = queue
        .iter()
        .filter(|r| r["reason_code"] == "change_cap_reached")
        .map(|r| r["ticket_key"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(routed, capped);
    assert!(!routed.is_empty());
    assert!(queue.iter().all(|r| r["reason_code"] != BUDGET_EXHAUSTED));
    let aggregate = read_json(&run_dir, files::NEED_REVIEW);
    assert_eq!(aggregate["final_epoch"], 1);
    assert_eq!(
        aggregate["final_epoch_items"].as_array().unwrap().len(),
        queue.len()
    );
    assert_audit_ok(&run_dir);
}

/// No configuration may make every reflection call fail silently: when no
/// decision pass of an epoch yields a usable answer, `summary.json` says so.
///
/// Fails on the old code: the run ended normally with no trace beyond per-cycle
/// `decision_error` warnings in `reflection.jsonl`.
#[test]
fn regression_an_epoch_without_a_usable_decision_pass_is_reported_loudly() {
    let ScriptedRun {
        summary, run_dir, ..
    } = ScriptedMission::toy()
        .invalid_json_decisions(usize::MAX)
        .run(json!({}));
    assert_eq!(summary.warnings.len(), 1, "{:?}", summary.warnings);
    assert!(summary.warnings[0].contains("epoch 1"));
    let written = read_json(&run_dir, files::SUMMARY);
    assert_eq!(written["warnings"], json!(summary.warnings));
    assert_audit_ok(&run_dir);
}
