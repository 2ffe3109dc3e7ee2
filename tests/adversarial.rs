//! The loop's contract against a hostile reflection model: nothing it writes breaks guidance.
//!
//! A test double answers reflection calls from a corpus of hostile outputs
//! (`tests/fixtures/adversarial/hostile.jsonl`, one line per case with its rationale): label
//! leaks in every spelling, no-op updates, `S*` edits, `G0` delete/merge/replacement by a
//! version string, evidence outside `L` or naming a stop-gradient ticket, key reuse after
//! delete, huge rationales, duplicate ops, unknown ids, truncated JSON, ops beyond
//! `max_operations`, copied summaries. Honest answers of the scripted reflector are mixed in so
//! the guidance changes and later hostile cases meet learned rules. Rollouts come from the
//! scripted engine of `support`.
//!
//! Over a multi-epoch run, after every cycle (read back from `reflection.jsonl` and the
//! guidance chain):
//! - `stageb audit` passes (chain replays, `S*` unchanged, `G0` present in every version,
//!   evidence ⊆ learnable, stop-gradient isolation, coverage = applied evidence ∩ L);
//! - no rule text of any version names a ticket, a group id of the run or a label;
//! - no rule text is a number, version, identifier or punctuation, and `G0` keeps its focus;
//! - coverage counts only ops that changed the guidance.

use crate::support;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use stageb_coordinator::artifacts::files;
use stageb_coordinator::learn::rule_text;
use stageb_worker::engine::{
    Engine, EngineError, GenerateOutput, GenerateRequest, ModelFingerprint, RolloutOutput,
    RolloutRequest,
};
use support::{
    ReflectionPrompt, ScriptedEngine, ScriptedMission, ScriptedRun, assert_audit_ok, read_json,
    read_jsonl, str_set, toy_fail_key,
};

const CORPUS: &str = include_str!("fixtures/adversarial/hostile.jsonl");

/// One hostile case of the corpus.
#[derive(Debug, Clone)]
struct Hostile {
    name: String,
    pass: String,
    output: Value,
}

fn corpus() -> Vec<Hostile> {
    CORPUS
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"));
            for field in ["name", "why", "pass"] {
                assert!(
                    v[field].as_str().is_some_and(|s| !s.trim().is_empty()),
                    "corpus line without `{field}`: {l}"
                );
            }
            Hostile {
                name: v["name"].as_str().unwrap().to_string(),
                pass: v["pass"].as_str().unwrap().to_string(),
                output: v["output"].clone(),
            }
        })
        .collect()
}

fn full_width(s: &str) -> String {
    s.chars()
        .map(|c| match c {
            '!'..='~' => char::from_u32(c as u32 - 0x21 + 0xFF01).unwrap_or(c),
            _ => c,
        })
        .collect()
}

fn spaced(s: &str) -> String {
    s.chars()
        .map(|c| c.to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

/// The corpus output with the prompt's placeholders filled in.
fn render(case: &Hostile, prompt: &ReflectionPrompt, stop: &str, n: usize) -> String {
    let key = |i: usize| {
        prompt
            .cases
            .get(i)
            .or_else(|| prompt.cases.first())
            .map(|c| c.key.clone())
            .unwrap_or_default()
    };
    let group0 = key(0).split("::").next().unwrap_or("").to_string();
    let rule = |k: &str| {
        prompt
            .rules
            .iter()
            .find(|(key, _)| key == k)
            .map(|(_, t)| t.clone())
            .unwrap_or_default()
    };
    let last_g = prompt
        .rules
        .iter()
        .filter(|(k, _)| k.starts_with('G'))
        .max_by_key(|(k, _)| k[1..].parse::<u32>().unwrap_or(0))
        .map(|(k, _)| k.clone())
        .unwrap_or_else(|| "G0".into());
    let text = match &case.output {
        Value::String(raw) => raw.clone(),
        other => other.to_string(),
    };
    // Placeholders are substituted inside JSON strings: escape what is substituted.
    let esc = |s: &str| {
        let quoted = serde_json::to_string(s).unwrap();
        quoted[1..quoted.len() - 1].to_string()
    };
    text.replace("{L0}", &esc(&key(0)))
        .replace("{L1}", &esc(&key(1)))
        .replace("{GROUP0_FW}", &esc(&full_width(&group0)))
        .replace("{GROUP0_SP}", &esc(&spaced(&group0)))
        .replace("{GROUP0}", &esc(&group0))
        .replace("{STOP}", &esc(stop))
        .replace("{LAST_G_TEXT}", &esc(&rule(&last_g)))
        .replace("{LAST_G}", &esc(&last_g))
        .replace("{G0_TEXT}", &esc(&rule("G0")))
        .replace("{HUGE}", &"理".repeat(5000))
        .replace("{N}", &n.to_string())
}

/// Counts of hostile answers given, per pass.
#[derive(Default)]
struct Tally {
    decision: usize,
    ops: usize,
    used: BTreeSet<String>,
}

/// Rollouts and honest answers from the scripted engine; reflection answers from the corpus
/// (ops calls cycle through the ops cases, every third decision call through the decision
/// cases).
struct HostileEngine {
    inner: ScriptedEngine,
    corpus: Arc<Vec<Hostile>>,
    tally: Arc<Mutex<Tally>>,
    stop: String,
}

impl Engine for HostileEngine {
    fn fingerprint(&self) -> &ModelFingerprint {
        self.inner.fingerprint()
    }

    fn rollout(&mut self, request: &RolloutRequest) -> Result<RolloutOutput, EngineError> {
        self.inner.rollout(request)
    }

    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateOutput, EngineError> {
        let schema = request.json_schema.clone().unwrap_or(Value::Null);
        let is_ops = schema.pointer("/properties/operations").is_some();
        let user = request
            .messages
            .iter()
            .find(|m| m.role == "user")
            .map(|m| m.content.clone())
            .unwrap_or_default();
        let pass = if is_ops { "ops" } else { "decision" };
        let pick = {
            let mut tally = self.tally.lock().unwrap();
            let cases: Vec<&Hostile> = self.corpus.iter().filter(|c| c.pass == pass).collect();
            let n = if is_ops {
                tally.ops += 1;
                Some(tally.ops - 1)
            } else {
                tally.decision += 1;
                tally
                    .decision
                    .is_multiple_of(3)
                    .then(|| tally.decision / 3 - 1)
            };
            let case = n.map(|n| (n, cases[n % cases.len()].clone()));
            if let Some((_, c)) = &case {
                tally.used.insert(c.name.clone());
            }
            case
        };
        let honest = self.inner.generate(request)?;
        let Some((n, case)) = pick else {
            return Ok(honest);
        };
        if case.output == json!("@honest") {
            return Ok(honest);
        }
        let text = render(&case, &ReflectionPrompt::parse(&user), &self.stop, n);
        Ok(GenerateOutput {
            completion_tokens: text.chars().count() as u32,
            text,
            ..honest
        })
    }
}

fn group_ids(run_dir: &std::path::Path) -> BTreeSet<String> {
    read_jsonl(run_dir, files::SELECTIONS)
        .iter()
        .map(|r| r["group_id"].as_str().unwrap().to_string())
        .collect()
}

/// Every rule text of every guidance version, by version index.
fn version_texts(run_dir: &std::path::Path) -> Vec<(usize, String, String)> {
    let g = read_json(run_dir, "guidance.json");
    let mut out = Vec::new();
    let section = &g[support::MISSION];
    for (k, t) in section["experiences"].as_object().unwrap() {
        out.push((usize::MAX, k.clone(), t.as_str().unwrap().to_string()));
    }
    for (i, v) in section["versions"].as_array().unwrap().iter().enumerate() {
        for op in v["ops"].as_array().into_iter().flatten() {
            if let Some(t) = op["text"].as_str() {
                out.push((i, op["key"].as_str().unwrap_or("add").to_string(), t.into()));
            }
        }
    }
    out
}

#[test]
fn every_corpus_case_has_a_rationale_and_there_are_at_least_15_hostile_ones() {
    let cases = corpus();
    let hostile = cases
        .iter()
        .filter(|c| c.output != json!("@honest"))
        .count();
    assert!(hostile >= 15, "only {hostile} hostile cases");
    let names: BTreeSet<&str> = cases.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names.len(), cases.len(), "case names are unique");
}

#[test]
fn the_loop_contract_holds_against_a_hostile_reflection_model() {
    let stop = toy_fail_key(1);
    let corpus = Arc::new(corpus());
    let tally = Arc::new(Mutex::new(Tally::default()));
    let make = {
        let (corpus, tally, stop) = (corpus.clone(), tally.clone(), stop.clone());
        move |script, _| HostileEngine {
            inner: ScriptedEngine::new(script),
            corpus: corpus.clone(),
            tally: tally.clone(),
            stop: stop.clone(),
        }
    };
    // The run completes whatever the model writes.
    let ScriptedRun { run_dir, .. } = ScriptedMission::toy()
        .always_stop([&stop])
        .workers(2)
        .run_with(
            json!({"runner": {"epochs": 4}, "reflection": {"batch_size": 2, "max_operations": 4}}),
            make,
        );

    // The run exercised the whole corpus.
    let used = tally.lock().unwrap().used.clone();
    let all: BTreeSet<String> = corpus.iter().map(|c| c.name.clone()).collect();
    assert_eq!(used, all, "cases never served: {:?}", all.difference(&used));

    assert_audit_ok(&run_dir);

    let groups = group_ids(&run_dir);
    for (version, key, text) in version_texts(&run_dir) {
        assert_eq!(
            rule_text::label_leak(&text, &groups),
            None,
            "version {version} {key}: {text}"
        );
        assert_eq!(
            rule_text::not_a_rule(&text),
            None,
            "version {version} {key}: {text}"
        );
    }
    let g = read_json(&run_dir, "guidance.json");
    let g0 = g[support::MISSION]["experiences"]["G0"].as_str().unwrap();
    assert!(g0.contains("挡风板"), "G0 lost its focus: {g0}");

    let reflections = read_jsonl(&run_dir, files::REFLECTION);
    assert!(reflections.iter().any(|r| r["applied"] == true));
    for r in &reflections {
        // Coverage counts only ops that changed the guidance.
        let learnable = str_set(&r["learnable"]);
        let applied: BTreeSet<String> = r["applied_ops"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|op| str_set(&op["evidence"]))
            .collect();
        let covered = str_set(&r["covered"]);
        assert_eq!(
            covered,
            applied.intersection(&learnable).cloned().collect(),
            "cycle {}",
            r["reflection_cycle"]
        );
        assert!(learnable.is_disjoint(&str_set(&r["stop_gradient"])));
        for rej in r["rejected_ops"].as_array().into_iter().flatten() {
            assert!(rej["reason"].is_string());
        }
    }
    // The corpus's distinctive rejections were each seen with their own code.
    let reasons: BTreeSet<String> = reflections
        .iter()
        .flat_map(|r| r["rejected_ops"].as_array().cloned().unwrap_or_default())
        .map(|rej| rej["reason"].as_str().unwrap().to_string())
        .collect();
    for code in [
        "label_leak",
        "unchanged_text",
        "scaffold_key",
        "g0_delete",
        "merged_from_invalid",
        "not_a_rule",
        "g0_not_focus",
        "script_mismatch",
        "evidence_outside_learnable",
        "unknown_key",
        "invalid_key",
        "unknown_op",
        "max_operations_exceeded",
    ] {
        assert!(reasons.contains(code), "{code} never rejected: {reasons:?}");
    }
}
