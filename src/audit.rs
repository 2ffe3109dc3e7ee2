//! `stageb audit RUN_DIR`: re-derive what rank 0 decided from the raw rows and check every
//! invariant the artifacts promise. Used by users after a run and by the end-to-end tests.
//!
//! Checks (each violation is reported with the file and, where there is one, the line):
//! - every JSONL file parses line by line and ends with a newline; rows carry `schema_version`;
//! - exactly one selection row per ticket per epoch, for every ticket of the run;
//! - one trajectory row per candidate (`candidates_per_ticket` per ticket per epoch), each one's
//!   `format_ok`/`verdict`/`reason` equal to what the contract parser says of its raw `text`;
//! - every malformed candidate has its `failure_malformed.jsonl` row and vice versa;
//! - selections re-derived from the trajectories (vote counts, vote strength, the vote's
//!   verdict, `label_match` against the final verdict) and eligibility from the row's signals;
//! - `metrics.jsonl` epoch rows recomputed from `selections.jsonl` and the need-review queue;
//! - `need_review.json` equal to the aggregation of `need_review_queue.jsonl`;
//! - reflection: learnable ∩ stop-gradient = ∅, every applied op's evidence ⊆ that cycle's
//!   learnable set (so no stop-gradient key is ever evidence), `covered` = the applied ops'
//!   evidence ∩ learnable (a skipped or unapplied op covers nothing), no accepted rule text and
//!   no rule of the final guidance names a group id of the run or a label suffix;
//! - the guidance hash chain verifies and `S*` rules are unchanged from the seed.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use serde_json::Value;
use stageb_coordinator::eligibility;
use stageb_coordinator::guidance;
use stageb_coordinator::metrics;
use stageb_coordinator::need_review::{self, NeedReviewRow};
use stageb_coordinator::run::files;
use stageb_shared::config::RunConfig;
use stageb_shared::contract;
use stageb_shared::domain::{TicketKey, Verdict};

/// One broken invariant.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Violation {
    pub check: &'static str,
    pub file: String,
    pub line: Option<usize>,
    pub detail: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.line {
            Some(l) => write!(f, "[{}] {}:{}: {}", self.check, self.file, l, self.detail),
            None => write!(f, "[{}] {}: {}", self.check, self.file, self.detail),
        }
    }
}

/// What the audit looked at and what it found.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct AuditReport {
    pub run_dir: PathBuf,
    pub epochs: u32,
    pub tickets: usize,
    pub selections: usize,
    pub trajectories: usize,
    pub reflection_cycles: usize,
    pub violations: Vec<Violation>,
}

impl AuditReport {
    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }

    fn fail(
        &mut self,
        check: &'static str,
        file: &str,
        line: Option<usize>,
        detail: impl Into<String>,
    ) {
        self.violations.push(Violation {
            check,
            file: file.to_string(),
            line,
            detail: detail.into(),
        });
    }
}

/// Read a JSONL artifact as `(line, row)` pairs, recording parse and framing violations.
fn rows(report: &mut AuditReport, dir: &Path, name: &str) -> Vec<(usize, Value)> {
    let path = dir.join(name);
    let Ok(bytes) = fs::read(&path) else {
        report.fail("file_present", name, None, "missing");
        return Vec::new();
    };
    if !bytes.is_empty() && bytes.last() != Some(&b'\n') {
        report.fail(
            "jsonl_framing",
            name,
            None,
            "the file does not end with a newline (torn last line)",
        );
    }
    let Ok(text) = String::from_utf8(bytes) else {
        report.fail("jsonl_utf8", name, None, "not UTF-8");
        return Vec::new();
    };
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        match serde_json::from_str::<Value>(line) {
            Ok(v) => {
                if v.get("schema_version").is_none() {
                    report.fail(
                        "schema_version",
                        name,
                        Some(i + 1),
                        "row without schema_version",
                    );
                }
                out.push((i + 1, v));
            }
            Err(e) => report.fail("jsonl_parse", name, Some(i + 1), e.to_string()),
        }
    }
    out
}

fn verdict_of(v: &Value) -> Option<Verdict> {
    serde_json::from_value(v.clone()).ok()
}

/// Audit a run directory (`{output.root}/{run_name}/{mission}`).
pub fn audit(dir: &Path) -> AuditReport {
    let mut report = AuditReport {
        run_dir: dir.to_path_buf(),
        ..Default::default()
    };
    let manifest: Value = match fs::read(dir.join(files::MANIFEST))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
    {
        Some(m) => m,
        None => {
            report.fail("manifest", files::MANIFEST, None, "missing or not JSON");
            return report;
        }
    };
    let Some(config) = manifest
        .get("config")
        .and_then(|c| serde_json::from_value::<RunConfig>(c.clone()).ok())
    else {
        report.fail(
            "manifest",
            files::MANIFEST,
            None,
            "no readable resolved config",
        );
        return report;
    };
    let tickets = manifest.get("tickets").and_then(Value::as_u64).unwrap_or(0) as usize;
    report.tickets = tickets;
    report.epochs = config.runner.epochs;
    let per_ticket = config.candidates_per_ticket() as usize;

    let selections = rows(&mut report, dir, files::SELECTIONS);
    let trajectories = rows(&mut report, dir, files::TRAJECTORIES);
    let failures = rows(&mut report, dir, files::FAILURE_MALFORMED);
    let metric_rows = rows(&mut report, dir, files::METRICS);
    let queue = rows(&mut report, dir, files::NEED_REVIEW_QUEUE);
    let reflections = rows(&mut report, dir, files::REFLECTION);
    report.selections = selections.len();
    report.trajectories = trajectories.len();
    report.reflection_cycles = reflections.len();

    // One selection per ticket per epoch, for the same ticket set every epoch.
    let mut by_epoch: BTreeMap<u64, BTreeMap<String, (usize, Value)>> = BTreeMap::new();
    for (line, row) in &selections {
        let epoch = row["epoch"].as_u64().unwrap_or(0);
        let key = row["ticket_key"].as_str().unwrap_or("").to_string();
        if by_epoch
            .entry(epoch)
            .or_default()
            .insert(key.clone(), (*line, row.clone()))
            .is_some()
        {
            report.fail(
                "one_selection_per_ticket",
                files::SELECTIONS,
                Some(*line),
                format!("{key} selected twice in epoch {epoch}"),
            );
        }
    }
    for epoch in 1..=config.runner.epochs as u64 {
        let n = by_epoch.get(&epoch).map_or(0, BTreeMap::len);
        if n != tickets {
            report.fail(
                "one_selection_per_ticket",
                files::SELECTIONS,
                None,
                format!("epoch {epoch} has {n} selections for {tickets} tickets"),
            );
        }
    }

    // Trajectories: complete, unique, and honest about what the parser says.
    let mut cands: BTreeMap<(u64, String), BTreeMap<u64, Value>> = BTreeMap::new();
    let mut malformed: BTreeSet<(u64, String, u64)> = BTreeSet::new();
    for (line, row) in &trajectories {
        let epoch = row["epoch"].as_u64().unwrap_or(0);
        let key = row["ticket_key"].as_str().unwrap_or("").to_string();
        let r = &row["result"];
        let idx = r["candidate_index"].as_u64().unwrap_or(u64::MAX);
        let text = r["text"].as_str().unwrap_or("");
        let parsed = contract::parse(text);
        let format_ok = r["format_ok"].as_bool().unwrap_or(false);
        if parsed.is_ok() != format_ok {
            report.fail(
                "trajectory_parse",
                files::TRAJECTORIES,
                Some(*line),
                format!(
                    "format_ok={format_ok} but the parser says {}",
                    parsed.is_ok()
                ),
            );
        }
        if let Ok(p) = &parsed
            && (verdict_of(&r["verdict"]) != Some(p.verdict)
                || r["reason"].as_str() != Some(p.reason.as_str()))
        {
            report.fail(
                "trajectory_parse",
                files::TRAJECTORIES,
                Some(*line),
                "verdict/reason differ from the parsed text",
            );
        }
        if !format_ok {
            malformed.insert((epoch, key.clone(), idx));
        }
        if cands
            .entry((epoch, key.clone()))
            .or_default()
            .insert(idx, row.clone())
            .is_some()
        {
            report.fail(
                "one_row_per_candidate",
                files::TRAJECTORIES,
                Some(*line),
                format!("{key} candidate {idx} twice"),
            );
        }
    }
    for ((epoch, key), (line, sel)) in by_epoch
        .iter()
        .flat_map(|(e, m)| m.iter().map(move |(k, v)| ((*e, k.clone()), v)))
    {
        let Some(cs) = cands.get(&(epoch, key.clone())) else {
            if sel["result"]["ineligible_reason"]
                .as_str()
                .is_none_or(|r| !r.starts_with("engine_error"))
            {
                report.fail(
                    "one_row_per_candidate",
                    files::TRAJECTORIES,
                    None,
                    format!("{key} epoch {epoch} has no candidates"),
                );
            }
            continue;
        };
        if cs.len() != per_ticket {
            report.fail(
                "one_row_per_candidate",
                files::TRAJECTORIES,
                None,
                format!(
                    "{key} epoch {epoch}: {} candidates, expected {per_ticket}",
                    cs.len()
                ),
            );
        }
        // Re-derive the vote.
        let (mut pass, mut fail) = (0u64, 0u64);
        for c in cs.values() {
            match verdict_of(&c["result"]["verdict"]) {
                Some(Verdict::Pass) => pass += 1,
                Some(Verdict::Fail) => fail += 1,
                None => {}
            }
        }
        let r = &sel["result"];
        let counts = &r["vote_counts"];
        if counts["pass"].as_u64() != Some(pass) || counts["fail"].as_u64() != Some(fail) {
            report.fail(
                "selection_rederived",
                files::SELECTIONS,
                Some(*line),
                format!("{key}: vote counts differ from trajectories ({pass} pass, {fail} fail)"),
            );
        }
        let vote_verdict = if pass + fail == 0 {
            None
        } else if pass > fail {
            Some(Verdict::Pass)
        } else {
            Some(Verdict::Fail)
        };
        if verdict_of(&r["vote_verdict"]) != vote_verdict {
            report.fail(
                "selection_rederived",
                files::SELECTIONS,
                Some(*line),
                format!("{key}: vote verdict differs (majority, ties to fail)"),
            );
        }
        if let Some(v) = vote_verdict {
            let strength =
                (if v == Verdict::Pass { pass } else { fail }) as f64 / (pass + fail) as f64;
            if r["vote_strength"]
                .as_f64()
                .is_none_or(|s| (s - strength).abs() > 1e-9)
            {
                report.fail(
                    "selection_rederived",
                    files::SELECTIONS,
                    Some(*line),
                    format!("{key}: vote_strength should be {strength}"),
                );
            }
        }
        let gt = verdict_of(&sel["gt_label"]);
        let final_verdict = verdict_of(&r["verdict"]);
        // Eligibility is a pure function of the row's own signals: recompute and compare.
        if let Some(gt) = gt {
            let flag = |k: &str| r[k].as_bool().unwrap_or(false);
            let signals = eligibility::EligibilitySignals {
                has_verdict: final_verdict.is_some(),
                label_match: flag("label_match"),
                rollout_contradiction: flag("rollout_contradiction"),
                low_agreement: flag("low_agreement"),
                conflict_flag: flag("conflict_flag"),
                needs_manual_review: flag("needs_manual_review"),
                candidates_matching_gt: if gt == Verdict::Pass {
                    pass as u32
                } else {
                    fail as u32
                },
                valid_candidates: (pass + fail) as u32,
            };
            let expected =
                serde_json::to_value(eligibility::assess_signals(&signals)).unwrap_or_default();
            if sel["eligibility"] != expected {
                report.fail(
                    "eligibility_rederived",
                    files::SELECTIONS,
                    Some(*line),
                    format!("{key}: eligibility differs from its signals"),
                );
            }
        }
        if final_verdict.is_some() && r["label_match"].as_bool() != Some(final_verdict == gt) {
            report.fail(
                "selection_rederived",
                files::SELECTIONS,
                Some(*line),
                format!("{key}: label_match inconsistent with the final verdict"),
            );
        }
    }

    // Malformed candidates ↔ failure rows.
    let mut failure_keys = BTreeSet::new();
    for (line, row) in &failures {
        if row["reason"] == "format_error" {
            let k = (
                row["epoch"].as_u64().unwrap_or(0),
                row["ticket_key"].as_str().unwrap_or("").to_string(),
                row["candidate_index"].as_u64().unwrap_or(u64::MAX),
            );
            if !malformed.contains(&k) {
                report.fail(
                    "failure_malformed",
                    files::FAILURE_MALFORMED,
                    Some(*line),
                    "format_error row for a candidate that is not malformed",
                );
            }
            failure_keys.insert(k);
        }
    }
    for k in malformed.difference(&failure_keys) {
        report.fail(
            "failure_malformed",
            files::FAILURE_MALFORMED,
            None,
            format!(
                "malformed candidate {} #{} (epoch {}) not logged",
                k.1, k.2, k.0
            ),
        );
    }

    // need_review.json is the aggregation of the queue; need-review rows are per epoch.
    let queue_rows: Vec<NeedReviewRow> = queue
        .iter()
        .filter_map(|(_, v)| serde_json::from_value(v.clone()).ok())
        .collect();
    if queue_rows.len() != queue.len() {
        report.fail(
            "need_review",
            files::NEED_REVIEW_QUEUE,
            None,
            "rows that do not match the schema",
        );
    }
    let mission = manifest["mission"].as_str().unwrap_or("").to_string();
    match fs::read(dir.join(files::NEED_REVIEW))
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
    {
        Some(written) => {
            let expected = serde_json::to_value(need_review::aggregate(
                &mission,
                &queue_rows,
                config.runner.epochs,
            ))
            .unwrap_or_default();
            if written != expected {
                report.fail(
                    "need_review",
                    files::NEED_REVIEW,
                    None,
                    "differs from the aggregation of need_review_queue.jsonl",
                );
            }
        }
        None => report.fail(
            "need_review",
            files::NEED_REVIEW,
            None,
            "missing or not JSON",
        ),
    }

    // Metrics epoch rows recomputed from selections and the epoch's need-review routing.
    for (line, row) in metric_rows
        .iter()
        .filter(|(_, r)| r["event"] == "epoch_end")
    {
        let epoch = row["epoch"].as_u64().unwrap_or(0);
        let routed: BTreeSet<TicketKey> = queue_rows
            .iter()
            .filter(|q| q.epoch as u64 == epoch)
            .map(|q| q.ticket_key.clone())
            .collect();
        let Some(sels) = by_epoch.get(&epoch) else {
            continue;
        };
        let mut ordered: Vec<&(usize, Value)> = sels.values().collect();
        ordered.sort_by_key(|(l, _)| *l);
        let outcomes: Vec<metrics::Outcome> = ordered
            .iter()
            .map(|(_, s)| {
                let key = TicketKey(s["ticket_key"].as_str().unwrap_or("").to_string());
                let verdict = verdict_of(&s["result"]["verdict"]);
                metrics::Outcome {
                    in_manual_review: verdict.is_none() || routed.contains(&key),
                    ticket_key: key,
                    gt: verdict_of(&s["gt_label"]).unwrap_or(Verdict::Fail),
                    verdict,
                }
            })
            .collect();
        for (view, name) in [
            (metrics::ManualReview::Include, "include_manual_review"),
            (metrics::ManualReview::Exclude, "exclude_manual_review"),
        ] {
            let expected =
                serde_json::to_value(metrics::counts(&outcomes, view)).unwrap_or_default();
            if row[name] != expected {
                report.fail(
                    "metrics_recomputed",
                    files::METRICS,
                    Some(*line),
                    format!(
                        "epoch {epoch} {name}: written {} ≠ recomputed {expected}",
                        row[name]
                    ),
                );
            }
        }
    }

    // Reflection: stop-gradient isolation, evidence ⊆ learnable, coverage, no label in rules.
    let group_ids: BTreeSet<String> = selections
        .iter()
        .filter_map(|(_, r)| r["group_id"].as_str().map(str::to_string))
        .collect();
    for (line, row) in &reflections {
        let set = |v: &Value| -> BTreeSet<String> {
            v.as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|x| x.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default()
        };
        let learnable = set(&row["learnable"]);
        let stop = set(&row["stop_gradient"]);
        if !learnable.is_disjoint(&stop) {
            report.fail(
                "stop_gradient_isolation",
                files::REFLECTION,
                Some(*line),
                "a ticket is both learnable and stop-gradient",
            );
        }
        // Coverage counts only ops that changed the guidance: E = applied evidence ∩ L.
        let applied_evidence: BTreeSet<String> = row["applied_ops"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|op| set(&op["evidence"]))
            .collect();
        let expected: BTreeSet<String> =
            applied_evidence.intersection(&learnable).cloned().collect();
        if row.get("covered").is_some() && set(&row["covered"]) != expected {
            report.fail(
                "coverage_from_applied_ops",
                files::REFLECTION,
                Some(*line),
                "covered is not the evidence of the applied ops within the learnable set",
            );
        }
        for op in row["accepted_ops"].as_array().into_iter().flatten() {
            if let Some(leak) = op["op"]["text"]
                .as_str()
                .and_then(|t| stageb_coordinator::rule_text::label_leak(t, &group_ids))
            {
                report.fail(
                    "no_label_in_rules",
                    files::REFLECTION,
                    Some(*line),
                    format!("an accepted rule text contains {leak}"),
                );
            }
        }
        for op in row["applied_ops"].as_array().into_iter().flatten() {
            for ev in set(&op["evidence"]) {
                if !learnable.contains(&ev) {
                    report.fail(
                        "evidence_subset_of_learnable",
                        files::REFLECTION,
                        Some(*line),
                        format!("applied op evidence {ev} is not learnable in this cycle"),
                    );
                }
            }
        }
    }

    // Guidance chain and scaffold.
    match guidance::verify_chain(dir) {
        Ok(chain) => {
            if reflections.iter().any(|(_, r)| r["applied"] == true) && chain.versions < 2 {
                report.fail(
                    "guidance_chain",
                    guidance::GUIDANCE_FILE,
                    None,
                    "reflections were applied but the chain has no new version",
                );
            }
        }
        Err(e) => report.fail(
            "guidance_chain",
            guidance::GUIDANCE_FILE,
            None,
            e.to_string(),
        ),
    }
    if let Err(detail) = scaffold_unchanged(dir, &mission) {
        report.fail("scaffold_untouched", guidance::GUIDANCE_FILE, None, detail);
    }
    if let Ok(g) = guidance::load_mission_section(&dir.join(guidance::GUIDANCE_FILE), &mission) {
        for (k, t) in &g.experiences {
            if let Some(leak) = stageb_coordinator::rule_text::label_leak(t, &group_ids) {
                report.fail(
                    "no_label_in_rules",
                    guidance::GUIDANCE_FILE,
                    None,
                    format!("{k} contains {leak}"),
                );
            }
        }
    }
    report
}

/// `S*` rules of the current guidance equal those of the chain's seed version.
fn scaffold_unchanged(dir: &Path, mission: &str) -> Result<(), String> {
    let bytes = fs::read(dir.join(guidance::GUIDANCE_FILE)).map_err(|e| e.to_string())?;
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
    let section = v.get(mission).ok_or("mission section missing")?;
    let scaffold = |exp: &Value| -> BTreeMap<String, String> {
        exp.as_object()
            .map(|m| {
                m.iter()
                    .filter(|(k, _)| k.starts_with('S'))
                    .map(|(k, t)| (k.clone(), t.as_str().unwrap_or("").to_string()))
                    .collect()
            })
            .unwrap_or_default()
    };
    let current = scaffold(&section["experiences"]);
    let seed = section["versions"]
        .as_array()
        .and_then(|vs| vs.first())
        .and_then(|v0| v0.pointer("/seed/experiences").cloned())
        .ok_or("the first guidance version has no seed content")?;
    if scaffold(&seed) != current {
        return Err("S* rules differ from the seed guidance".into());
    }
    Ok(())
}
