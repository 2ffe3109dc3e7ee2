//! `stageb compare RUN_A RUN_B`: exit 0 when two runs' artifacts are the same aside runtime
//! fields, 1 with the first difference of each file when not, 2 when a run cannot be read.
//! The runs here are small hand-written run directories; the determinism specs (`resume`,
//! `pipeline`, `speculation`, `gate`) compare real scripted runs with the same function.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::{Value, json};

/// A run directory with the files a run writes, `timing` and `runtime` fields included; runs
/// over 11 s were started as a cluster.
fn write_run(dir: &Path, wall_s: f64) {
    let mode = if wall_s > 11.0 { "cluster" } else { "embedded" };
    std::fs::create_dir_all(dir.join("snapshots")).unwrap();
    let write = |name: &str, text: String| std::fs::write(dir.join(name), text).unwrap();
    write(
        "manifest.json",
        json!({"mission": "m", "seed": 17, "mode": mode, "started_at": format!("{wall_s}")})
            .to_string(),
    );
    write(
        "summary.json",
        json!({"tickets": 2, "epochs": 1, "runtime": {"wall_s": wall_s}}).to_string(),
    );
    let rows = [("a", "pass"), ("b", "fail")]
        .iter()
        .map(|(key, verdict)| {
            json!({"epoch": 1, "ticket_key": key, "verdict": verdict,
                   "timing": {"decode_s": wall_s / 2.0}})
            .to_string()
                + "\n"
        })
        .collect::<String>();
    write("selections.jsonl", rows);
    write("jobs.jsonl", format!("{{\"done_in_s\": {wall_s}}}\n"));
    write(".stageb.lock", format!("pid {wall_s}\n"));
}

fn compare(a: &Path, b: &Path, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_stageb"))
        .arg("compare")
        .args([a, b])
        .args(extra)
        .output()
        .unwrap()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Two runs of the same work, apart from their times, the journal's order and the lock.
fn two_runs() -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    write_run(&a, 10.0);
    write_run(&b, 12.5);
    (tmp, a, b)
}

#[test]
fn runs_that_differ_only_in_runtime_fields_are_identical() {
    let (_tmp, a, b) = two_runs();
    let out = compare(&a, &b, &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    let text = stdout(&out);
    for name in ["manifest.json", "selections.jsonl", "summary.json"] {
        assert!(text.contains(&format!("same      {name}")), "{text}");
    }
    assert!(
        !text.contains("jobs.jsonl"),
        "the journal takes no part: {text}"
    );
    assert!(text.contains("artifacts: identical"), "{text}");
}

#[test]
fn a_changed_byte_is_a_difference_named_by_its_place() {
    let (_tmp, a, b) = two_runs();
    let path = b.join("selections.jsonl");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, text.replacen("\"fail\"", "\"pasS\"", 1)).unwrap();
    let out = compare(&a, &b, &[]);
    assert_eq!(out.status.code(), Some(1));
    let text = stdout(&out);
    assert!(
        text.contains("DIFFERENT selections.jsonl[1].verdict: \"fail\" vs \"pasS\""),
        "{text}"
    );
    assert!(text.contains("same      summary.json"), "{text}");
    assert!(text.contains("artifacts: DIFFERENT"), "{text}");
}

#[test]
fn a_timing_field_is_ignored_but_a_field_beside_it_is_not() {
    let (_tmp, a, b) = two_runs();
    let summary = |tickets: u64| {
        json!({"tickets": tickets, "epochs": 1,
               "timing": {"wall_s": tickets * 7}, "finished_at": "now"})
        .to_string()
    };
    std::fs::write(b.join("summary.json"), summary(2)).unwrap();
    assert_eq!(compare(&a, &b, &[]).status.code(), Some(0));
    std::fs::write(b.join("summary.json"), summary(3)).unwrap();
    let out = compare(&a, &b, &["--json"]);
    assert_eq!(out.status.code(), Some(1));
    let verdict: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(verdict["equal"], false);
    assert_eq!(
        verdict["differing"],
        json!(["summary.json[0].tickets: 2 vs 3"])
    );
}

#[test]
fn a_missing_artifact_is_a_difference_and_a_missing_run_an_error() {
    let (tmp, a, b) = two_runs();
    std::fs::remove_file(b.join("summary.json")).unwrap();
    let out = compare(&a, &b, &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stdout(&out).contains("only in the reference [\"summary.json\"]"),
        "{}",
        stdout(&out)
    );

    let out = compare(&a, &tmp.path().join("nowhere"), &[]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("nowhere: not a directory"), "{err}");
}

#[test]
fn a_lost_or_duplicated_selection_row_is_counted() {
    let (_tmp, a, b) = two_runs();
    let path = b.join("selections.jsonl");
    let text = std::fs::read_to_string(&path).unwrap();
    let first = text.lines().next().unwrap();
    std::fs::write(&path, format!("{first}\n{first}\n")).unwrap();
    let out = compare(&a, &b, &["--json"]);
    assert_eq!(out.status.code(), Some(1));
    let verdict: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(verdict["selection_rows"], 2);
    assert_eq!(verdict["rows_lost"], 1);
    assert_eq!(verdict["rows_duplicated"], 1);
}

#[test]
fn an_artifact_that_is_not_json_is_an_error() {
    let (_tmp, a, b) = two_runs();
    std::fs::write(b.join("summary.json"), "{\"tickets\": 2,").unwrap();
    let out = compare(&a, &b, &[]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("summary.json: line 1: not JSON"), "{err}");
}
