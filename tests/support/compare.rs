//! Comparing two runs' artifacts "aside runtime fields": what determinism means for stageb
//! (ARCHITECTURE §10). Shared by the resume, speculation and drain specs.

use std::path::Path;

use serde_json::Value;
use stageb_coordinator::cluster::scheduler::journal::JOURNAL_FILE;
use stageb_coordinator::run::checkpoint::CHECKPOINT_FILE;
use stageb_coordinator::run::start::LOCK_FILE;

const REPORT_FILE: &str = "report.html";

/// A file's rows (or its one object) without what legitimately differs between two runs of
/// the same work: `runtime` and `timing` objects (workers, leases, replay counts, durations), wall-clock
/// timestamps (`*_at`), and what names the run itself (its config path and text).
pub fn comparable(path: &Path) -> Vec<Value> {
    fn strip(v: &mut Value) {
        match v {
            Value::Object(o) => {
                o.retain(|k, _| {
                    !(k == "runtime"
                        || k == "timing"
                        || k.ends_with("_at")
                        || ["config", "config_path", "config_sha256", "run_dir"]
                            .contains(&k.as_str()))
                });
                o.values_mut().for_each(strip);
            }
            Value::Array(a) => a.iter_mut().for_each(strip),
            _ => {}
        }
    }
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut rows: Vec<Value> = if path.extension().is_some_and(|e| e == "jsonl") {
        text.lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    } else {
        vec![serde_json::from_str(&text).unwrap()]
    };
    rows.iter_mut().for_each(strip);
    rows
}

/// The first place two JSON values differ, as a path (keeps failure messages readable).
pub fn first_difference(a: &Value, b: &Value, at: String) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            for (k, v) in x {
                match y.get(k) {
                    Some(w) => {
                        if let Some(d) = first_difference(v, w, format!("{at}.{k}")) {
                            return Some(d);
                        }
                    }
                    None => return Some(format!("{at}.{k}: only in the first")),
                }
            }
            y.keys()
                .find(|k| !x.contains_key(*k))
                .map(|k| format!("{at}.{k}: only in the second"))
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (v, w))| first_difference(v, w, format!("{at}[{i}]"))),
        _ if a == b => None,
        _ => Some(format!("{at}: {a} vs {b}")),
    }
}

/// Every artifact except the journal (its rows are in completion order, a runtime fact) and
/// the step checkpoint (it holds the journal's place: artifact byte lengths, which count
/// `runtime` objects, and the guidance file's timestamps), the run directory's lock file (it names the process holding it) and the HTML report (a view of
/// the others that shows their times).
pub fn artifact_names(run_dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(run_dir)
        .unwrap()
        .filter_map(|e| {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().to_string();
            (e.file_type().unwrap().is_file()
                && name != JOURNAL_FILE
                && name != CHECKPOINT_FILE
                && name != LOCK_FILE
                && name != REPORT_FILE)
                .then_some(name)
        })
        .collect();
    names.sort();
    names
}

/// Both run directories hold the same artifacts with the same comparable content.
pub fn assert_same_artifacts(a: &Path, b: &Path) {
    assert_eq!(artifact_names(a), artifact_names(b));
    for name in artifact_names(a) {
        let (x, y) = (
            Value::Array(comparable(&a.join(&name))),
            Value::Array(comparable(&b.join(&name))),
        );
        assert!(
            x == y,
            "{name} differs at {}",
            first_difference(&x, &y, String::new()).unwrap_or_default()
        );
    }
}
