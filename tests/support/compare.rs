//! The specs' view of `stageb_inspect::compare` (the one statement of what determinism means
//! for stageb, also behind `stageb compare`): assertions that panic with the differences.

use std::path::Path;

use serde_json::Value;
use stageb_inspect::compare::compare_runs;

/// A file's rows (or its one object) without the runtime fields.
pub fn comparable(path: &Path) -> Vec<Value> {
    stageb_inspect::compare::comparable(path).unwrap_or_else(|e| panic!("{e}"))
}

/// Both run directories hold the same artifacts with the same comparable content, and no
/// selection row was lost or duplicated.
#[track_caller]
pub fn assert_same_artifacts(a: &Path, b: &Path) {
    let comparison = compare_runs(a, b).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        comparison.identical(),
        "{} differs from {}:\n{}",
        b.display(),
        a.display(),
        serde_json::to_string_pretty(&comparison.summary_json()).unwrap_or_default()
    );
}
