//! Shared fixtures of the integration tests, one file per role:
//! - [`engine`]: the scripted [`stageb_worker::engine::Engine`] (test double) that follows
//!   guidance rules literally, and the [`Script`] its instances in one run share;
//! - [`reflector`]: the scripted reflector that answers both reflection passes from evidence;
//! - [`rules`]: the rule language the engine reads and the reflector writes;
//! - [`behaviour`]: the scripted misbehaviours a spec switches on;
//! - [`missions`]: the synthetic toy mission, the demo mission, and config writers;
//! - [`harness`]: running a mission through the real cluster runtime in the test process
//!   ([`ScriptedMission`], [`try_run`]), rank 0's service on loopback, child processes, and
//!   reading what a run wrote;
//! - [`compare`]: comparing two runs' artifacts aside runtime fields (`stageb_inspect`'s);
//! - [`isolated`]: a spec that owns something process-wide, run in a child process.
//!
//! `tests/main.rs` declares `mod support;` once; each area uses its own subset.

// Each area uses its own subset of the helpers and of these re-exports.
#![allow(dead_code, unused_imports)]

pub mod behaviour;
pub mod compare;
pub mod engine;
pub mod harness;
pub mod isolated;
pub mod missions;
pub mod reflector;
pub mod rules;

pub use behaviour::Behaviour;
pub use engine::{Script, ScriptedEngine};
pub use harness::{
    Loopback, Proc, RunDir, ScriptedMission, ScriptedRun, assert_audit_ok, audit_checks,
    coordinator_command, coordinator_settings, copy_of_run, fingerprint, journal_rows,
    open_service, read_json, read_jsonl, real_model, rewrite_jsonl, rollout_job, run_prepared,
    run_scripted, serve_for_workers, serve_loopback, str_set, try_run, try_run_watched,
    wait_for_exit, worker_options,
};
pub use missions::{
    MISSION, TOY_CONFIRMATION, TOY_DEFECTS, TicketSpec, copy_demo_mission, toy_fail_key,
    write_config, write_stage_a, write_toy_guidance, write_toy_mission,
};
pub use reflector::{Pass, ReflectionPrompt};

/// Whether this is the long suite (`scripts/ci/test.sh --full`, `STAGEB_TEST_DEPTH=full`): a
/// run that repeats, under another schedule, what CI's run already showed goes there.
pub fn full_depth() -> bool {
    std::env::var("STAGEB_TEST_DEPTH").as_deref() == Ok("full")
}
