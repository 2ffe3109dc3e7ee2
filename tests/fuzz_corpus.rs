//! The fuzz targets' invariants on every committed input, on stable, in every test run.
//!
//! Coverage-guided fuzzing needs the nightly toolchain and a sanitizer build of its own
//! (`scripts/ci/fuzz.sh`, docs/FUZZING.md), too slow to build cold in CI. This spec runs the
//! same checks (`fuzz/src/checks/`, included by path) over each target's seed corpus
//! (`fuzz/corpus/<target>/`) and every input a fuzzer once crashed on
//! (`fuzz/regressions/<target>-<cause>`), so a change that breaks an invariant on a known
//! input fails here first.

#[path = "../fuzz/src/checks/mod.rs"]
mod checks;

use std::path::{Path, PathBuf};

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz")
}

/// The plain files of `dir`, sorted (a missing folder has none).
fn files_in(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|entries| entries.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    files.retain(|p| p.is_file());
    files.sort();
    files
}

/// Runs `check` on `input`, naming the target and file when an invariant fails.
fn replay(target: &str, check: fn(&[u8]), input: &Path) {
    let data = std::fs::read(input).expect("read a committed fuzz input");
    let outcome = std::panic::catch_unwind(|| check(&data));
    assert!(
        outcome.is_ok(),
        "fuzz target {target}: an invariant fails on {}",
        input.display()
    );
}

#[test]
fn every_committed_seed_holds_its_targets_invariants() {
    let mut replayed = 0;
    for (target, check) in checks::TARGETS {
        let seeds = files_in(&fuzz_dir().join("corpus").join(target));
        assert!(
            !seeds.is_empty(),
            "fuzz target {target} has no committed seed"
        );
        for seed in &seeds {
            replay(target, *check, seed);
        }
        replayed += seeds.len();
    }
    assert!(replayed >= checks::TARGETS.len());
}

#[test]
fn every_input_a_fuzzer_crashed_on_holds_its_targets_invariants_now() {
    let regressions = files_in(&fuzz_dir().join("regressions"));
    assert!(
        !regressions.is_empty(),
        "the committed regression inputs are gone"
    );
    for input in &regressions {
        let name = input.file_name().unwrap_or_default().to_string_lossy();
        let (target, check) = checks::TARGETS
            .iter()
            .find(|(t, _)| name.starts_with(&format!("{t}-")))
            .unwrap_or_else(|| panic!("regression input {name} names no fuzz target"));
        replay(target, *check, input);
    }
}

#[test]
fn every_fuzz_target_has_a_check_and_a_seed_folder() {
    let mut on_disk: Vec<String> = files_in(&fuzz_dir().join("fuzz_targets"))
        .iter()
        .filter_map(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .collect();
    on_disk.sort();
    let mut listed: Vec<String> = checks::TARGETS.iter().map(|(t, _)| t.to_string()).collect();
    listed.sort();
    assert_eq!(
        on_disk, listed,
        "fuzz/fuzz_targets and checks::TARGETS disagree"
    );
}
