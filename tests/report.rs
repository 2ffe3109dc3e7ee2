//! `stageb report`: the HTML report of a run says what the artifacts say, stays
//! inert whatever text the model wrote, loads nothing from the network, and survives missing
//! or damaged artifacts.
//!
//! Fixture: the synthetic 16-ticket mission of `support::write_toy_mission`, two epochs
//! through the real cluster runtime with the scripted engine, made sloppy so that some
//! candidates break the contract (the report then has malformed rates to show). Numbers are
//! read from the page by their `data-metric` names and compared with the artifacts' rows.

use crate::support;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;

use serde_json::{Value, json};
use stageb_coordinator::artifacts::files;
use stageb_inspect::report::{self, REPORT_FILE, ReportError};
use stageb_worker::engine::{
    CancelFlag, Engine, EngineError, GenerateOutput, GenerateRequest, ModelFingerprint,
    RolloutOutput, RolloutRequest,
};
use support::{RunDir, ScriptedEngine, ScriptedMission, ScriptedRun, copy_of_run, read_jsonl};

/// A candidate whose seed is a multiple of this is cut to one line (`LINE_COUNT`).
const SLOPPY_ONE_IN: u64 = 7;
const HOSTILE: &str = "<script>alert(1)</script>";
const HOSTILE_ATTR: &str = "\"><img src=x onerror=alert(2)>";

/// The scripted engine, with some rollout candidates broken so the run has malformed ones.
struct Sloppy(ScriptedEngine);

impl Engine for Sloppy {
    fn fingerprint(&self) -> &ModelFingerprint {
        self.0.fingerprint()
    }

    fn rollout(&mut self, request: &RolloutRequest) -> Result<RolloutOutput, EngineError> {
        let mut out = self.0.rollout(request)?;
        for c in &mut out.candidates {
            if c.seed.is_multiple_of(SLOPPY_ONE_IN) {
                c.text = "Verdict: 通过".into();
            }
        }
        Ok(out)
    }

    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, EngineError> {
        self.0.generate(request)
    }

    fn max_context(&self) -> u32 {
        self.0.max_context()
    }

    fn limit_context(&mut self, tokens: u32) {
        self.0.limit_context(tokens)
    }

    fn set_cancel(&mut self, flag: CancelFlag) {
        self.0.set_cancel(flag)
    }
}

/// One two-epoch run shared by every test (they copy it before changing anything).
fn fixture() -> &'static Path {
    static RUN: OnceLock<ScriptedRun> = OnceLock::new();
    let run = RUN.get_or_init(|| {
        ScriptedMission::toy()
            .workers(2)
            .run_with(json!({"runner": {"epochs": 2}}), |script, _| {
                Sloppy(ScriptedEngine::new(script))
            })
    });
    &run.run_dir
}

/// A copy of the fixture run to damage or poison.
fn copy_of_fixture() -> RunDir {
    copy_of_run(fixture())
}

/// The text of the element marked `data-metric="name"`.
fn metric(html: &str, name: &str) -> String {
    let marker = format!("data-metric=\"{name}\">");
    let start = html
        .find(&marker)
        .unwrap_or_else(|| panic!("no metric {name} in the report"))
        + marker.len();
    let end = start + html[start..].find('<').unwrap();
    html[start..end].to_string()
}

fn pct(share: f64) -> String {
    format!("{:.1}%", share * 100.0)
}

fn read_json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn write_jsonl(path: &Path, rows: &[Value]) {
    let text: String = rows.iter().map(|r| format!("{r}\n")).collect();
    std::fs::write(path, text).unwrap();
}

fn per_epoch(rows: &[Value], count: impl Fn(&Value) -> u64) -> BTreeMap<u64, u64> {
    let mut out = BTreeMap::new();
    for r in rows {
        *out.entry(r["epoch"].as_u64().unwrap()).or_default() += count(r);
    }
    out
}

/// Accuracy per epoch, run totals, per-epoch candidates and malformed, need-review rows and
/// reflection ops on the page are the artifacts' numbers.
#[test]
fn report_numbers_match_the_artifacts() {
    let run_dir = fixture();
    support::assert_audit_ok(run_dir);
    let html = report::render(run_dir).unwrap();
    assert!(metric(&html, "audit").starts_with("Audit OK"));

    let epoch_rows: Vec<Value> = read_jsonl(run_dir, files::METRICS)
        .into_iter()
        .filter(|r| r["event"] == "epoch_end")
        .collect();
    assert_eq!(epoch_rows.len(), 2);
    for r in &epoch_rows {
        let e = r["epoch"].as_u64().unwrap();
        for (block, tag) in [
            ("include_manual_review", "incl"),
            ("exclude_manual_review", "excl"),
        ] {
            let b = &r[block];
            assert_eq!(
                metric(&html, &format!("acc_{tag}_e{e}")),
                pct(b["acc"].as_f64().unwrap())
            );
            for k in ["n", "fn", "fp"] {
                assert_eq!(
                    metric(&html, &format!("{k}_{tag}_e{e}")),
                    b[k].to_string(),
                    "{k} {tag} e{e}"
                );
            }
        }
    }

    let summary = read_json(&run_dir.join(files::SUMMARY));
    for (name, key) in [
        ("tickets", "tickets"),
        ("epochs", "epochs"),
        ("candidates", "candidates"),
        ("malformed", "malformed_candidates"),
        ("hard_failures", "hard_failures"),
        ("need_review", "need_review"),
        ("reflection_cycles", "reflection_cycles"),
        ("guidance_step", "guidance_step"),
    ] {
        assert_eq!(metric(&html, name), summary[key].to_string(), "{name}");
    }

    let selections = read_jsonl(run_dir, files::SELECTIONS);
    let candidates = per_epoch(&selections, |r| {
        let v = &r["result"]["vote_counts"];
        ["pass", "fail", "malformed"]
            .iter()
            .map(|k| v[k].as_u64().unwrap())
            .sum()
    });
    let malformed_rows: Vec<Value> = read_jsonl(run_dir, files::FAILURE_MALFORMED)
        .into_iter()
        .filter(|r| r["reason"] == "format_error")
        .collect();
    let malformed = per_epoch(&malformed_rows, |_| 1);
    assert!(
        !malformed.is_empty(),
        "the sloppy engine made no malformed candidate"
    );
    for (e, n) in &candidates {
        let bad = malformed.get(e).copied().unwrap_or(0);
        assert_eq!(metric(&html, &format!("candidates_e{e}")), n.to_string());
        assert_eq!(metric(&html, &format!("malformed_e{e}")), bad.to_string());
        assert_eq!(
            metric(&html, &format!("malformed_rate_e{e}")),
            pct(bad as f64 / *n as f64)
        );
        assert_eq!(metric(&html, &format!("tickets_e{e}")), "16");
    }
    assert!(html.contains("LINE_COUNT"), "the violation code is named");

    let queue = read_jsonl(run_dir, files::NEED_REVIEW_QUEUE);
    for (e, n) in per_epoch(&queue, |_| 1) {
        assert_eq!(
            metric(&html, &format!("need_review_rows_e{e}")),
            n.to_string()
        );
    }
    assert_eq!(
        metric(&html, "need_review_rows_total"),
        queue.len().to_string()
    );

    let reflections = read_jsonl(run_dir, files::REFLECTION);
    let count = |key: &str| -> usize {
        reflections
            .iter()
            .map(|r| r[key].as_array().map_or(0, Vec::len))
            .sum()
    };
    assert!(count("accepted_ops") > 0, "reflection accepted no op");
    assert_eq!(
        metric(&html, "ops_accepted_total"),
        count("accepted_ops").to_string()
    );
    assert_eq!(
        metric(&html, "ops_rejected_total"),
        count("rejected_ops").to_string()
    );
    assert_eq!(
        metric(&html, "ops_applied_total"),
        count("applied_ops").to_string()
    );
    assert_eq!(metric(&html, "cycles_total"), reflections.len().to_string());

    let guidance = read_json(&run_dir.join("guidance.json"));
    let versions = guidance[support::MISSION]["versions"]
        .as_array()
        .unwrap()
        .len();
    assert!(metric(&html, "guidance_versions").starts_with(&format!("{versions} version(s)")));
}

/// Every section is there, with its id, and `write` puts the page in the run directory.
#[test]
fn report_has_every_section_and_is_written_into_the_run_directory() {
    let run_dir = copy_of_fixture();
    let path = report::write(&run_dir, &report::Options::default()).unwrap();
    assert_eq!(path, run_dir.join(REPORT_FILE));
    let html = std::fs::read_to_string(&path).unwrap();
    for id in [
        "overview",
        "accuracy",
        "votes",
        "malformed",
        "reflection",
        "guidance",
        "need-review",
        "throughput",
    ] {
        assert!(
            html.contains(&format!("<section id=\"{id}\">")),
            "section {id}"
        );
    }
    assert!(html.matches("<svg").count() >= 5, "charts are inline SVG");
    let leftovers: Vec<_> = std::fs::read_dir(&run_dir)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.contains(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
}

/// Text from artifacts is model output or hand-edited: markup in a need-review reason, a
/// rule, a ticket key, an op's rejection detail or a violation code (which reaches a chart
/// label) comes out as text, never as an element.
#[test]
fn hostile_text_in_artifacts_is_escaped() {
    let run_dir = copy_of_fixture();
    let queue_path = run_dir.join(files::NEED_REVIEW_QUEUE);
    let mut queue = read_jsonl(&run_dir, files::NEED_REVIEW_QUEUE);
    queue.push(json!({
        "ticket_key": format!("QC-{HOSTILE}::fail"), "group_id": "g", "mission": support::MISSION,
        "gt_label": "fail", "pred_verdict": "pass", "pred_reason": HOSTILE,
        "reason_code": "budget_exhausted", "epoch": 2, "reflection_cycle": 1,
        "reflection_id": HOSTILE_ATTR, "uncertainty_note": HOSTILE_ATTR, "schema_version": 1,
    }));
    write_jsonl(&queue_path, &queue);

    let guidance_path = run_dir.join("guidance.json");
    let mut guidance = read_json(&guidance_path);
    let section = &mut guidance[support::MISSION];
    section["experiences"]["G0"] = json!(HOSTILE);
    section["versions"][0]["seed"]["experiences"]["G7"] = json!(HOSTILE_ATTR);
    std::fs::write(&guidance_path, guidance.to_string()).unwrap();

    let mut reflections = read_jsonl(&run_dir, files::REFLECTION);
    reflections[0]["rejected_ops"] = json!([{
        // A valid reason code: the row must still read as a reflection row (an unknown code
        // makes the whole row a note), so the detail and the proposed text reach the page.
        "index": 0, "reason": "label_leak", "detail": HOSTILE_ATTR,
        "proposed": {"op": "add", "text": HOSTILE, "evidence": []},
    }]);
    write_jsonl(&run_dir.join(files::REFLECTION), &reflections);

    let mut failures = read_jsonl(&run_dir, files::FAILURE_MALFORMED);
    failures.push(json!({
        "schema_version": 1, "epoch": 1, "reason": "format_error",
        "violation": {"code": HOSTILE, "detail": HOSTILE_ATTR},
    }));
    write_jsonl(&run_dir.join(files::FAILURE_MALFORMED), &failures);

    let html = report::render(&run_dir).unwrap();
    let lower = html.to_lowercase();
    assert!(!lower.contains("<script"), "a script element got through");
    assert!(!lower.contains("<img"), "an img element got through");
    let escaped = "&lt;script&gt;alert(1)&lt;/script&gt;";
    assert!(
        html.matches(escaped).count() >= 6,
        "the hostile texts are shown, escaped: {}",
        html.matches(escaped).count()
    );
    assert!(
        html.contains("&quot;&gt;&lt;img src=x onerror=alert(2)&gt;"),
        "quotes are escaped too, so the text cannot close an attribute"
    );
    // The poisoned guidance breaks the chain: the verdict says so, the page still renders.
    assert!(metric(&html, "audit").starts_with("Audit FAILED"));
}

/// The page names the run by `{run_name}/{mission}`, never by the absolute path it was
/// rendered from (a shared report must not reveal the host's paths).
#[test]
fn the_page_does_not_show_the_absolute_run_path() {
    let html = report::render(fixture()).unwrap();
    let absolute = fixture().to_string_lossy().to_string();
    assert!(
        !html.contains(&absolute),
        "the absolute path {absolute} is on the page"
    );
    let parent = fixture().parent().unwrap().to_string_lossy().to_string();
    assert!(!html.contains(&parent), "nor its parent {parent}");
}

/// The page references nothing outside itself: no `src`, links only to its own sections,
/// no `url(...)` or `@import` in the styles, no `http(s)://` besides the SVG namespace, and
/// a Content-Security-Policy that forbids every load and script.
#[test]
fn report_loads_nothing_from_the_network() {
    let html = report::render(fixture()).unwrap();
    let lower = html.to_lowercase();
    assert!(!lower.contains(" src="), "no element loads a resource");
    for (i, _) in lower.match_indices("href=") {
        assert!(
            lower[i..].starts_with("href=\"#"),
            "a link leaves the page: {}",
            &html[i..(i + 60).min(html.len())]
        );
    }
    assert!(!lower.contains("url("), "no CSS url()");
    assert!(!lower.contains("@import"));
    let without_namespace = html.replace("xmlns=\"http://www.w3.org/2000/svg\"", "");
    assert!(!without_namespace.contains("http://"));
    assert!(!without_namespace.contains("https://"));
    assert!(html.contains("Content-Security-Policy\" content=\"default-src 'none'"));
}

/// Missing and damaged artifacts are notes in their sections; the page still has them all.
#[test]
fn missing_and_damaged_artifacts_become_notes() {
    let run_dir = copy_of_fixture();
    std::fs::remove_file(run_dir.join(files::SUMMARY)).unwrap();
    std::fs::remove_file(run_dir.join(files::METRICS)).unwrap();
    std::fs::remove_file(run_dir.join(files::TRAJECTORIES)).unwrap();
    let selections = run_dir.join(files::SELECTIONS);
    let mut text = std::fs::read_to_string(&selections).unwrap();
    text.push_str("{not json\n{\"epoch\": 2, \"torn");
    std::fs::write(&selections, text).unwrap();
    std::fs::write(run_dir.join("guidance.json"), "[]").unwrap();

    let html = report::render(&run_dir).unwrap();
    for id in [
        "overview",
        "accuracy",
        "votes",
        "malformed",
        "reflection",
        "guidance",
    ] {
        assert!(
            html.contains(&format!("<section id=\"{id}\">")),
            "section {id}"
        );
    }
    assert!(html.contains("summary.json is missing: the run has not completed"));
    assert!(html.contains("No epoch_end row in metrics.jsonl or summary.json"));
    assert!(html.contains("trajectories.jsonl is missing"));
    assert!(html.contains("selections.jsonl: 2 of 34 lines could not be used"));
    assert!(html.contains("guidance.json holds no mission section"));
    assert!(metric(&html, "audit").starts_with("Audit FAILED"));
}

/// A queue far longer than the table cap lists 200 rows and says how many it left out.
#[test]
fn long_tables_are_capped_with_a_note() {
    let run_dir = copy_of_fixture();
    let queue_path = run_dir.join(files::NEED_REVIEW_QUEUE);
    let mut queue = read_jsonl(&run_dir, files::NEED_REVIEW_QUEUE);
    let before = queue.iter().filter(|r| r["epoch"] == 2).count();
    for i in 0..1000 {
        queue.push(json!({
            "ticket_key": format!("QC-MANY-{i}::pass"), "group_id": format!("QC-MANY-{i}"),
            "mission": support::MISSION, "gt_label": "pass", "pred_verdict": "fail",
            "pred_reason": "reason", "reason_code": "budget_exhausted", "epoch": 2,
            "reflection_cycle": 1, "reflection_id": "r1", "uncertainty_note": null,
            "schema_version": 1,
        }));
    }
    write_jsonl(&queue_path, &queue);
    let html = report::render(&run_dir).unwrap();
    let section = &html[html.find("<section id=\"need-review\">").unwrap()..];
    let section = &section[..section.find("</section>").unwrap()];
    let rows_listed = section.matches("<span class=\"mono\">QC-").count();
    assert_eq!(rows_listed, 200);
    let total = before + 1000;
    assert!(section.contains(&format!(
        "The first 200 rows of {total} are listed; {} are left out",
        total - 200
    )));
    assert_eq!(metric(&html, "need_review_rows_e2"), total.to_string());
}

/// A directory that holds no run is bad input (exit code 2), with a hint when the run
/// directory is below it; `--out` writes where it is told; an unaudited report says so.
#[test]
fn cli_reports_a_run_and_refuses_a_directory_without_one() {
    let run_dir = fixture();
    let missing = report::render(&run_dir.join("nope")).err();
    assert!(
        matches!(missing, Some(ReportError::RunDir(_))),
        "{missing:?}"
    );
    let parent = run_dir.parent().unwrap();
    match report::render(parent) {
        Err(ReportError::RunDir(e)) => assert!(e.to_string().contains("run directories below it")),
        other => panic!("{:?}", other.map(|_| ())),
    }

    let stageb = env!("CARGO_BIN_EXE_stageb");
    let out = Command::new(stageb)
        .arg("report")
        .arg(parent)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a run directory"));

    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("r.html");
    let out = Command::new(stageb)
        .arg("report")
        .arg(run_dir)
        .arg("--out")
        .arg(&target)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        target.display().to_string()
    );
    assert!(
        std::fs::read_to_string(&target)
            .unwrap()
            .starts_with("<!DOCTYPE html>")
    );

    let help = Command::new(stageb)
        .args(["run", "--help"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&help.stdout).contains("--no-report"));
}
