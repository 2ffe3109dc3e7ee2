//! The step checkpoint read on resume (`Checkpoint::load`), a run file.
//!
//! The run directory holds every JSONL artifact with 16 bytes, and the input as
//! `checkpoint.json`. Invariants: an accepted checkpoint belongs to the run asked for, names
//! only the run's own JSONL artifacts (a name such as `../x` or `/x` would let `restore_files`
//! cut a file outside the run), none longer than it is; it saves and loads back to the same
//! JSON; loading is deterministic.

use super::support::fresh_dir;
use stageb_coordinator::run::checkpoint::{
    CHECKPOINT_FILE, Checkpoint, JSONL_ARTIFACTS, RunIdentity,
};

const ARTIFACT_BYTES: u64 = 16;

/// Runs one input; panics where an invariant does not hold.
pub fn check(data: &[u8]) {
    let dir = fresh_dir("run");
    for name in JSONL_ARTIFACTS {
        std::fs::write(dir.join(name), [b'x'; ARTIFACT_BYTES as usize]).unwrap();
    }
    std::fs::write(dir.join(CHECKPOINT_FILE), data).unwrap();
    let run = RunIdentity {
        config_sha256: "c".into(),
        tickets_digest: "t".into(),
    };
    let loaded = Checkpoint::load(&dir, &run);
    let again = Checkpoint::load(&dir, &run);
    assert_eq!(json(&loaded), json(&again), "not deterministic");
    if std::env::var_os("STAGEB_FUZZ_TRACE").is_some() {
        eprintln!("accepted: {}", loaded.is_some());
    }
    let Some(checkpoint) = loaded else {
        return;
    };
    assert_eq!(checkpoint.run, run);
    for (name, &len) in &checkpoint.artifact_bytes {
        assert!(
            JSONL_ARTIFACTS.contains(&name.as_str()),
            "an accepted checkpoint names {name:?}, not an artifact of the run"
        );
        assert!(len <= ARTIFACT_BYTES);
    }
    checkpoint.save(&dir).expect("save");
    let reloaded = Checkpoint::load(&dir, &run).expect("a saved checkpoint loads");
    assert_eq!(json(&Some(checkpoint)), json(&Some(reloaded)));
}

fn json(c: &Option<Checkpoint>) -> Option<serde_json::Value> {
    c.as_ref()
        .map(|c| serde_json::to_value(c).expect("serializes"))
}
