//! The per-run guidance repository: loading, applying ops, versions and snapshots
//! (docs/design/guidance.md).
//!
//! The global guidance file (`{mission: {step, updated_at, experiences, metadata}}`) is read
//! once; this mission's section is validated and copied to `{run_dir}/guidance.json`, which is
//! the only guidance rank 0 changes afterwards (the global file is never written).
//!
//! # Keys
//! `S<n>` are read-only scaffold rules, `G0` is the checklist (updatable, never deletable) and
//! `G1+` are learned rules. Keys are never renumbered (hit/miss counters and evidence refer to
//! them); a new rule takes the smallest unused `G<i>`; a rule whose normalized text already
//! exists reuses that key. [`RuleKey`] orders numerically, `S` before `G` (`G2` < `G10`, the
//! original's B5 bug was a lexicographic sort).
//!
//! # Versions
//! Every change of rule content is a version: `step + 1` per applied reflection (cleanup keeps
//! the step), content-addressed (`content_hash` = sha256 of the canonical JSON of experiences
//! and metadata *without* timestamps and hit/miss counters) and hash-chained (`version_hash`
//! commits to the parent's `version_hash`, the step, the ops and their outcome). The chain is
//! stored as a `versions` list inside the mission section of `guidance.json`, so content and
//! history are written by one atomic rename and can never disagree after a crash. The first
//! entry holds the seed content, so [`verify_chain`] can replay every version from the seed and
//! recompute every hash.
//!
//! Hit/miss counters are excluded from the content hash on purpose: they change on every
//! ticket's feedback without a step (as in the original), and a version per ticket would bury
//! the rule history. They are persisted with the same atomic write.
//!
//! # Persistence
//! Before a version is written, the current file is copied into `snapshots/` under a
//! deterministic name (`guidance-v{seq:04}-step{step:04}-{hash12}.json`, so reruns produce the
//! same names) and snapshots are pruned to `retention`; a snapshot failure aborts the change.
//! The write is temp file in the same directory, fsync, rename, fsync of the directory; on any
//! error the live file is unchanged and the temp file is removed. Feedback writes are not
//! snapshotted (the rule content did not change).
//!
//! # Layout
//! Each submodule owns one concern and everything public is re-exported here, so the public
//! API is `crate::guidance::*`. Dependencies point one way: `model` uses no sibling; `ops`,
//! `error`, `apply`, `parse` and `version` build on it in that order; `repo` and `chain` sit on
//! top (`chain` does not use `repo`: it reads the run file and replays the same transitions):
//! - `model`: rule keys, metadata, [`MissionGuidance`], the text normal forms.
//! - `edits`: the op vocabulary ([`GuidanceOp`]) and per-op outcomes.
//! - `error`: [`GuidanceError`], shared by op application and the repository.
//! - `apply`: the pure transitions ([`apply_ops`], cleanup's key removal).
//! - `parse`: reading and validating a mission section ([`load_mission_section`]).
//! - `version`: version records of the hash chain and the run file that stores them.
//! - `repo`: [`GuidanceRepo`], the persistence protocol around the transitions.
//! - `snapshot`: snapshot names and retention.
//! - `fs`: the atomic write.
//! - `chain`: [`verify_chain`].
//! - `time`: [`utc_now_iso`].

mod apply;
mod chain;
mod edits;
mod error;
mod fs;
mod model;
mod parse;
mod repo;
mod snapshot;
#[cfg(test)]
mod test_support;
mod time;
mod version;

pub use apply::{OpsApplication, apply_ops};
pub use chain::{ChainError, ChainReport, verify_chain};
pub use edits::{AppliedOp, GuidanceOp, OpEffect, SkipReason, SkippedOp};
pub use error::GuidanceError;
pub use model::{
    BadRuleKey, CONFIDENCE_EPSILON, HashedContent, HashedMetadata, MissionGuidance, RuleKey,
    RuleMetadata, confidence, dedupe_form, loose_form,
};
pub use parse::{G0_PLACEHOLDER, load_mission_section};
pub use repo::{ApplyOutcome, Clock, FeedbackOutcome, GuidanceRepo, RepoOptions};
pub use snapshot::{SNAPSHOTS_DIR, snapshot_name, snapshots_dir};
pub use time::utc_now_iso;
pub use version::{GUIDANCE_FILE, VersionBody, VersionEntry, VersionKind, guidance_path};
