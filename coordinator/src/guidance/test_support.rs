//! Test fixtures shared by the guidance submodules' tests: a fixed clock, a global guidance
//! file with one mission, a seeded repository and op constructors.
//!
//! The tests live next to the code they test, but most of them need the same seeded run, so the
//! fixtures live here once instead of being copied into every test module.

use super::{GuidanceOp, GuidanceRepo, RepoOptions, RuleKey, snapshots_dir};
use serde_json::{Value, json};
use stageb_shared::domain::TicketKey;
use std::fs;
use std::path::{Path, PathBuf};

pub(super) const MISSION: &str = "挡风板安装检查";

pub(super) fn fixed_clock() -> String {
    "2025-12-19T08:00:00.000000+00:00".to_string()
}

pub(super) fn opts() -> RepoOptions {
    RepoOptions {
        retention: 3,
        clock: fixed_clock,
    }
}

pub(super) fn tk(s: &str) -> TicketKey {
    TicketKey(s.to_string())
}

pub(super) fn write_global(dir: &Path, section: Value) -> PathBuf {
    let path = dir.join("initial_guidance.json");
    fs::write(
        &path,
        serde_json::to_vec_pretty(&json!({ MISSION: section })).unwrap(),
    )
    .unwrap();
    path
}

pub(super) fn base_section() -> Value {
    json!({
        "step": 1,
        "updated_at": "2025-12-16T12:54:39.555188+00:00",
        "experiences": {"S1": "若关键点无法确认则不通过", "G0": "至少需要检测到挡风板，判断挡风板安装方向", "G1": "若挡风板缺失则不通过"},
        "metadata": {"G1": {"updated_at": "2025-12-16T12:54:39+00:00", "reflection_id": "a1b2c3d4e5f6", "sources": ["QC-0::fail"], "rationale": "seed", "hit_count": 1, "miss_count": 0, "confidence": 0.99999}}
    })
}

pub(super) fn repo(dir: &Path) -> GuidanceRepo {
    let global = write_global(dir, base_section());
    GuidanceRepo::create(&global, MISSION, &dir.join("run"), opts()).unwrap()
}

pub(super) fn add(text: &str, ev: &[&str]) -> GuidanceOp {
    GuidanceOp::Add {
        text: text.into(),
        rationale: Some("r".into()),
        evidence: ev.iter().map(|e| tk(e)).collect(),
    }
}

pub(super) fn update(key: RuleKey, text: &str, ev: &[&str]) -> GuidanceOp {
    GuidanceOp::Update {
        key,
        text: text.into(),
        rationale: Some("r".into()),
        evidence: ev.iter().map(|e| tk(e)).collect(),
    }
}

pub(super) fn delete(key: RuleKey) -> GuidanceOp {
    GuidanceOp::Delete {
        key,
        rationale: None,
        evidence: vec![tk("QC-9::fail")],
    }
}

pub(super) fn snapshot_names(run: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(snapshots_dir(run))
        .map(|rd| {
            rd.map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

pub(super) fn no_tmp_files(run: &Path) -> bool {
    fs::read_dir(run)
        .unwrap()
        .all(|e| !e.unwrap().file_name().to_string_lossy().ends_with(".tmp"))
}
