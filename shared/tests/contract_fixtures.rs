//! The two-line contract parser against its fixture corpus (`tests/fixtures/contract/`), in
//! the style of seed 004: every fixture states the expected result and why; the test loads all
//! of them, reports every mismatch at once, and fails if any fixture is misclassified.
//! A property test adds that `parse` is total (never panics) on arbitrary input.

use std::path::{Path, PathBuf};

use proptest::prelude::*;
use serde::Deserialize;
use stageb_shared::contract::{self, MAX_REASON_CHARS, ViolationCode};
use stageb_shared::domain::Verdict;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Fixture {
    id: String,
    text: String,
    expected: Expected,
    rationale: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Expected {
    valid: bool,
    verdict: Option<Verdict>,
    reason: Option<String>,
    violation: Option<String>,
}

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/contract")
}

fn load(kind: &str) -> Vec<(PathBuf, Fixture)> {
    let dir = corpus_dir().join(kind);
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    paths
        .into_iter()
        .map(|p| {
            let raw = std::fs::read_to_string(&p).unwrap();
            let f: Fixture =
                serde_json::from_str(&raw).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p, f)
        })
        .collect()
}

/// Checks one fixture; `None` when it behaves as its file says.
fn mismatch(path: &Path, f: &Fixture, expect_valid: bool) -> Option<String> {
    let name = path.file_name().unwrap().to_string_lossy();
    if f.rationale.trim().is_empty() {
        return Some(format!("{name}: fixture has no rationale"));
    }
    if f.expected.valid != expect_valid {
        return Some(format!(
            "{name}: lives in the wrong folder (expected.valid={})",
            f.expected.valid
        ));
    }
    let got = contract::parse(&f.text);
    match (&got, expect_valid) {
        (Ok(p), true) => {
            let want_v = f.expected.verdict;
            let want_r = f.expected.reason.as_deref();
            if want_v != Some(p.verdict) || want_r != Some(p.reason.as_str()) {
                return Some(format!(
                    "{name} ({}): parsed as ({}, {:?}), fixture expects ({want_v:?}, {want_r:?})",
                    f.id, p.verdict, p.reason
                ));
            }
            None
        }
        (Err(v), false) => {
            let want = f.expected.violation.as_deref().unwrap_or("<missing>");
            if ViolationCode::from_code(want).is_none() {
                return Some(format!("{name}: unknown violation code {want:?}"));
            }
            (v.code.code() != want).then(|| {
                format!(
                    "{name} ({}): got {} ({}), fixture expects {want}",
                    f.id, v.code, v.detail
                )
            })
        }
        (Ok(p), false) => Some(format!(
            "{name} ({}): accepted as {p:?}, fixture expects a violation",
            f.id
        )),
        (Err(v), true) => Some(format!("{name} ({}): rejected: {v}", f.id)),
    }
}

#[test]
fn every_fixture_is_classified_as_its_file_says() {
    let valid = load("valid");
    let invalid = load("invalid");
    assert!(
        valid.len() >= 10,
        "seed-004 style corpus needs ≥10 valid fixtures, has {}",
        valid.len()
    );
    assert!(
        invalid.len() >= 18,
        "corpus needs ≥18 invalid fixtures, has {}",
        invalid.len()
    );

    let mut problems = Vec::new();
    let mut ids = std::collections::BTreeSet::new();
    for (expect_valid, set) in [(true, &valid), (false, &invalid)] {
        for (path, f) in set.iter() {
            if !ids.insert(f.id.clone()) {
                problems.push(format!("duplicate fixture id {}", f.id));
            }
            problems.extend(mismatch(path, f, expect_valid));
        }
    }
    assert!(
        problems.is_empty(),
        "{} fixture mismatch(es):\n  {}",
        problems.len(),
        problems.join("\n  ")
    );
}

#[test]
fn every_violation_code_is_exercised_by_the_corpus() {
    let used: std::collections::BTreeSet<String> = load("invalid")
        .into_iter()
        .filter_map(|(_, f)| f.expected.violation)
        .collect();
    let missing: Vec<&str> = ViolationCode::ALL
        .iter()
        .map(|c| c.code())
        .filter(|c| !used.contains(*c))
        .collect();
    assert!(missing.is_empty(), "no fixture exercises {missing:?}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn parse_never_panics_on_arbitrary_text(s in any::<String>()) {
        let _ = contract::parse(&s);
    }

    /// Arbitrary text in the contract's own shape: exercises the reason checks rather than the
    /// early prefix checks, and pins that an accepted reason is trimmed, within the cap and
    /// free of third-state words.
    #[test]
    fn accepted_reasons_respect_every_rule(
        verdict in prop::sample::select(vec!["通过", "不通过", "需复核", "pass"]),
        reason in "[ a-zA-Z_\\-复複核需待定证據\\u{3000}\\t\\n\\r]{0,20}",
        tail in "[ \\n\\t]{0,3}",
    ) {
        let text = format!("Verdict: {verdict}\nReason: {reason}{tail}");
        if let Ok(p) = contract::parse(&text) {
            prop_assert_eq!(p.reason.trim(), p.reason.as_str());
            prop_assert!(!p.reason.is_empty());
            prop_assert!(p.reason.chars().count() <= MAX_REASON_CHARS);
            prop_assert!(!p.reason.contains(['\n', '\r']));
            prop_assert!(stageb_shared::text::find_third_state(
                &p.reason, stageb_shared::text::THIRD_STATE_ROLLOUT).is_none());
        }
    }
}
