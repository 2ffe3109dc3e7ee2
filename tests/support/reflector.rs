//! The scripted reflector: answers the two reflection passes the way the prompts ask a model
//! to, deterministically. It parses the reflection prompt (rules, `第N组 (ticket_key=…)` cases,
//! `参考答案 gt_label`, `最终结论`, summaries) and reasons:
//! - phrases are the attribute and remark parts of Stage-A summaries (object names dropped);
//!   "positive" confirmations (`安装方向正确`, `显示完整`, …) never explain a fail;
//! - it remembers every labelled case it has seen (a memory shared by all engines of a run,
//!   deterministic because rank 0 runs reflection calls one at a time);
//! - a fail-labelled case decided `通过` is explained by the defect-looking phrase that explains
//!   the most such cases and that no pass-labelled case ever contained; failing that, by the
//!   absence of a confirmation that ≥90% of pass-labelled cases contain;
//! - a pass-labelled case decided `不通过` by a learned rule gets that rule narrowed or deleted,
//!   unless the rule is trusted (it fails more than twice as many fail-labelled as
//!   pass-labelled cases remembered): then the label, not the rule, looks wrong;
//! - decision pass: a wrongly decided case with none of these directions is no-evidence;
//! - ops pass: the explaining rule is added (or an existing presence rule extended), and every
//!   other learnable case is cited as further evidence of that change, so closure `L == E`
//!   holds whenever the cycle changes something (a restated rule is no change).

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value, json};

use super::behaviour::Behaviour;
use super::missions::TOY_CONFIRMATION;
use super::rules::{Rule, rule_line};

/// Which reflection pass a generate request was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    Decision,
    Ops,
    /// Neither schema (unexpected).
    Other,
}

impl Pass {
    /// The pass whose JSON schema a request carries.
    pub(super) fn of_schema(schema: Option<&Value>) -> Pass {
        let has = |property: &str| schema.and_then(|s| s.pointer(property)).is_some();
        if has("/properties/no_evidence_group_ids") {
            Pass::Decision
        } else if has("/properties/operations") {
            Pass::Ops
        } else {
            Pass::Other
        }
    }
}

const POSITIVE_WORDS: &[&str] = &[
    "正确",
    "完整",
    "符合要求",
    "按要求",
    "可以识别",
    "整齐",
    "到位",
    "牢固",
];
const NEGATION_MARKS: &[&str] = &["未", "不", "无", "没", "错"];
const DEFECT_MARKS: &[&str] = &[
    "未", "不", "无", "没", "错", "反", "松", "缺", "损", "晃", "翘", "裂", "脱", "模糊",
];

/// A confirmation such as `安装方向正确`: never an explanation of a fail.
fn is_positive(phrase: &str) -> bool {
    POSITIVE_WORDS.iter().any(|w| phrase.contains(w))
        && !NEGATION_MARKS.iter().any(|w| phrase.contains(w))
}

fn looks_like_defect(phrase: &str) -> bool {
    DEFECT_MARKS.iter().any(|w| phrase.contains(w))
}

/// Attribute and remark phrases of one summary: clauses split on `，`, counts (`×N`) and the
/// object name (first chain element) dropped, `备注:` remarks kept whole.
pub fn phrases_of(summary: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for clause in summary.split(['，', ',', '；', ';']) {
        let clause = clause.trim();
        if let Some(remark) = clause
            .strip_prefix("备注:")
            .or_else(|| clause.strip_prefix("备注："))
        {
            out.insert(remark.trim().to_string());
            continue;
        }
        let chain = clause.split('×').next().unwrap_or("");
        let parts: Vec<&str> = chain.split('/').map(str::trim).collect();
        let attrs = if parts.len() > 1 {
            &parts[1..]
        } else {
            &parts[..]
        };
        out.extend(attrs.iter().map(|p| p.to_string()));
    }
    out.retain(|p| p.chars().count() >= 2);
    out
}

fn phrases_of_all(summaries: &[String]) -> BTreeSet<String> {
    summaries.iter().flat_map(|s| phrases_of(s)).collect()
}

/// Every labelled case the reflector has seen, in any call: what it knows about the mission.
#[derive(Debug, Default)]
struct Memory {
    cases: BTreeMap<String, Case>,
}

/// One `第N组` case of a reflection prompt.
#[derive(Debug, Clone, Default)]
pub struct Case {
    pub key: String,
    pub gt_fail: bool,
    /// `None` when the prompt says 格式错误.
    pub final_fail: Option<bool>,
    pub summaries: Vec<String>,
}

impl Case {
    fn wrong_pass(&self) -> bool {
        self.gt_fail && self.final_fail == Some(false)
    }

    fn wrong_fail(&self) -> bool {
        !self.gt_fail && self.final_fail == Some(true)
    }
}

/// A parsed reflection user prompt (`coordinator/src/reflection.rs` `header_text`/`case_text`).
#[derive(Debug, Clone, Default)]
pub struct ReflectionPrompt {
    pub rules: Vec<(String, String)>,
    pub cases: Vec<Case>,
}

fn verdict_is_fail(word: &str) -> Option<bool> {
    match word.trim() {
        "不通过" => Some(true),
        "通过" => Some(false),
        _ => None,
    }
}

impl ReflectionPrompt {
    pub fn parse(user: &str) -> Self {
        let mut out = ReflectionPrompt::default();
        let mut in_summaries = false;
        for line in user.lines() {
            let trimmed = line.trim();
            if let Some(rest) = trimmed.split_once("(ticket_key=").map(|(_, r)| r)
                && trimmed.starts_with('第')
            {
                out.cases.push(Case {
                    key: rest
                        .trim_end_matches("):")
                        .trim_end_matches(')')
                        .to_string(),
                    ..Case::default()
                });
                in_summaries = false;
                continue;
            }
            let Some(case) = out.cases.last_mut() else {
                if let Some(rule) = rule_line(line) {
                    out.rules.push(rule);
                }
                continue;
            };
            if let Some(gt) = trimmed.strip_prefix("参考答案 gt_label:") {
                case.gt_fail = verdict_is_fail(gt).unwrap_or(false);
            } else if let Some(fin) = trimmed.strip_prefix("最终结论:") {
                case.final_fail = verdict_is_fail(fin.split('；').next().unwrap_or(""));
            } else if trimmed == "摘要:" {
                in_summaries = true;
            } else if trimmed == "候选:" {
                in_summaries = false;
            } else if in_summaries
                && let Some((n, s)) = trimmed.split_once(". ")
                && n.chars().all(|c| c.is_ascii_digit())
            {
                case.summaries.push(s.to_string());
            }
        }
        out
    }
}

impl Memory {
    fn learn(&mut self, cases: &[Case]) {
        for c in cases {
            self.cases.insert(c.key.clone(), c.clone());
        }
    }

    fn pass_cases(&self) -> impl Iterator<Item = &Case> {
        self.cases.values().filter(|c| !c.gt_fail)
    }

    /// Does any pass-labelled case contain `phrase`?
    fn seen_in_pass(&self, phrase: &str) -> bool {
        self.pass_cases()
            .any(|c| c.summaries.iter().any(|s| s.contains(phrase)))
    }

    /// `(fail-labelled, pass-labelled)` cases the rule fails.
    fn support(&self, rule: &Rule) -> (usize, usize) {
        let fired = self.cases.values().filter(|c| rule.fires(&c.summaries));
        fired.fold(
            (0, 0),
            |(f, p), c| if c.gt_fail { (f + 1, p) } else { (f, p + 1) },
        )
    }

    /// A rule (or phrase) is trusted when it fails at least twice as many fail-labelled as
    /// pass-labelled cases: a pass-labelled case it fails is then more likely mislabelled
    /// than the rule wrong.
    fn trusted(&self, rule: &Rule) -> bool {
        let (fails, passes) = self.support(rule);
        fails > 2 * passes
    }

    /// Confirmations nearly every pass-labelled case carries: `(phrase, cases)`, once a few
    /// pass-labelled cases have been seen.
    fn confirmations(&self) -> Vec<(String, usize)> {
        let n = self.pass_cases().count();
        if n < 3 {
            return Vec::new();
        }
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        for c in self.pass_cases() {
            for p in phrases_of_all(&c.summaries) {
                *counts.entry(p).or_default() += 1;
            }
        }
        counts
            .into_iter()
            .filter(|(p, c)| is_positive(p) && *c * 10 >= n * 9)
            .collect()
    }
}

/// Presence phrases that could explain failing `case`: defect-looking or neutral phrases no
/// pass-labelled case contains.
fn presence_candidates(case: &Case, memory: &Memory) -> Vec<String> {
    phrases_of_all(&case.summaries)
        .into_iter()
        .filter(|p| !is_positive(p) && !memory.seen_in_pass(p))
        .collect()
}

/// Absent confirmations that could explain failing `case`.
fn absence_candidates(case: &Case, memory: &Memory) -> Vec<(String, usize)> {
    memory
        .confirmations()
        .into_iter()
        .filter(|(p, _)| !case.summaries.iter().any(|s| s.contains(p.as_str())))
        .collect()
}

/// The parts of `rule` to take back because they fail `case` (pass-labelled) without enough
/// support: phrases of a presence rule, or the whole absence rule. Empty when the rule does
/// not fire on `case` or is trusted.
fn blamed(rule: &Rule, case: &Case, memory: &Memory) -> Vec<String> {
    match rule {
        Rule::Present(ps) => ps
            .iter()
            .filter(|p| case.summaries.iter().any(|s| s.contains(p.as_str())))
            .filter(|p| !memory.trusted(&Rule::Present(vec![(*p).clone()])))
            .cloned()
            .collect(),
        Rule::Absent(p) if rule.fires(&case.summaries) && !memory.trusted(rule) => {
            vec![p.clone()]
        }
        Rule::Absent(_) => Vec::new(),
    }
}

/// Whether a wrongly decided case has any learnable direction.
fn has_direction(case: &Case, rules: &[(String, String)], memory: &Memory) -> bool {
    if case.wrong_pass() {
        !presence_candidates(case, memory).is_empty()
            || !absence_candidates(case, memory).is_empty()
    } else if case.wrong_fail() {
        rules
            .iter()
            .filter(|(k, _)| k.starts_with('G'))
            .filter_map(|(_, t)| Rule::parse(t))
            .any(|r| !blamed(&r, case, memory).is_empty())
    } else {
        true
    }
}

/// What the scripted reflector keeps between calls (one for all engines of a run): the cases
/// it has seen, how often each was shown to a decision pass, and how many calls of each pass
/// it has answered.
#[derive(Debug, Default)]
pub(super) struct Reflector {
    memory: Memory,
    sightings: BTreeMap<String, u32>,
    decision_calls: usize,
    ops_calls: usize,
}

impl Reflector {
    /// The answer to one reflection call of `pass` whose user prompt is `user`.
    pub(super) fn answer(&mut self, pass: Pass, user: &str, behaviour: &Behaviour) -> String {
        let prompt = ReflectionPrompt::parse(user);
        self.memory.learn(&prompt.cases);
        match pass {
            Pass::Decision => {
                self.decision_calls += 1;
                if self.decision_calls <= behaviour.invalid_json_decisions {
                    "好的，以下是判定结果：no_evidence_group_ids 为空".to_string()
                } else {
                    self.decide(&prompt, behaviour).to_string()
                }
            }
            Pass::Ops => {
                self.ops_calls += 1;
                let mut out = match &behaviour.propose_only {
                    Some(text) => propose_only(&prompt, text),
                    None => propose(&prompt, behaviour, &self.memory),
                };
                let revision = user.contains("以下操作被拒绝");
                if behaviour.third_state_op_then_revise && (self.ops_calls == 1 || revision) {
                    let ops = out["operations"].as_array_mut().unwrap();
                    ops.push(third_state_op(&prompt, revision));
                }
                if user.contains("expected_flips") {
                    claim_flips(&mut out, &prompt);
                }
                if behaviour.repeat_bad_op && !revision {
                    let evidence: Vec<&str> = prompt
                        .cases
                        .iter()
                        .map(|c| c.key.as_str())
                        .take(1)
                        .collect();
                    let ops = out["operations"].as_array_mut().unwrap();
                    ops.push(json!({"op": "add", "text": "1.00", "evidence": evidence, "rationale": "x"}));
                }
                out.to_string()
            }
            Pass::Other => "{}".to_string(),
        }
    }

    /// The decision pass: the cases with no learnable direction (or scripted to stop) are
    /// no-evidence.
    fn decide(&mut self, prompt: &ReflectionPrompt, behaviour: &Behaviour) -> Value {
        let mut stop = Vec::new();
        for case in &prompt.cases {
            let seen = self.sightings.entry(case.key.clone()).or_default();
            *seen += 1;
            let scripted = behaviour.always_stop.contains(&case.key)
                || (*seen == 1 && behaviour.stop_first_sighting.contains(&case.key));
            let natural = !behaviour.no_natural_stops
                && (case.wrong_pass() || case.wrong_fail())
                && !has_direction(case, &prompt.rules, &self.memory);
            if scripted || natural {
                stop.push(case.key.clone());
            }
        }
        json!({
            "no_evidence_group_ids": stop,
            "decision_analysis": "逐例尝试了摘要短语出现、确认信息缺失和既有规则收窄三个方向；列出的案例三个方向都找不到可泛化依据。",
        })
    }
}

/// Asked for predictions (`reflection.gate` on), every op claims the cases of its evidence that
/// are decided wrongly now: the ones it is meant to fix.
fn claim_flips(out: &mut Value, prompt: &ReflectionPrompt) {
    let wrong: BTreeSet<&str> = prompt
        .cases
        .iter()
        .filter(|c| c.wrong_pass() || c.wrong_fail())
        .map(|c| c.key.as_str())
        .collect();
    for op in out["operations"].as_array_mut().into_iter().flatten() {
        let claimed: Vec<Value> = op["evidence"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|k| k.as_str().is_some_and(|k| wrong.contains(k)))
            .cloned()
            .collect();
        op["expected_flips"] = Value::Array(claimed);
    }
}

/// The absence rule [`Behaviour::third_state_op_then_revise`] adds, citing the wrongly passed
/// cases: worded with the third-state `待定` unless this is the revision call.
fn third_state_op(prompt: &ReflectionPrompt, revision: bool) -> Value {
    let evidence: Vec<&str> = prompt
        .cases
        .iter()
        .filter(|c| c.wrong_pass())
        .map(|c| c.key.as_str())
        .collect();
    let mut text = Rule::Absent(TOY_CONFIRMATION.into()).render();
    if !revision {
        text = text.replace("按其他规则判定", "待定");
    }
    json!({
        "op": "add", "text": text, "evidence": evidence,
        "rationale": "所有图片都看不到方向确认时要点无法确认",
    })
}

/// One op under construction.
struct Draft {
    op: &'static str,
    key: Option<String>,
    text: Option<String>,
    rationale: &'static str,
    evidence: Vec<String>,
}

impl Draft {
    fn json(&self) -> Value {
        let mut v = json!({"op": self.op, "rationale": self.rationale, "evidence": self.evidence});
        if let Some(k) = &self.key {
            v["key"] = json!(k);
        }
        if let Some(t) = &self.text {
            v["text"] = json!(t);
        }
        v
    }
}

/// The ops answer under [`Behaviour::propose_only`]: the one rule, citing the wrongly passed
/// cases it fails, else every case.
fn propose_only(prompt: &ReflectionPrompt, text: &str) -> Value {
    let rule = Rule::parse(text).expect("a rule of the scripted language");
    let fixed: Vec<&str> = prompt
        .cases
        .iter()
        .filter(|c| c.wrong_pass() && rule.fires(&c.summaries))
        .map(|c| c.key.as_str())
        .collect();
    let evidence = if fixed.is_empty() {
        prompt.cases.iter().map(|c| c.key.as_str()).collect()
    } else {
        fixed
    };
    json!({
        "has_evidence": true,
        "evidence_analysis": "按脚本给出的规则。",
        "operations": [{"op": "add", "text": text, "evidence": evidence,
                        "rationale": "脚本给出的规则"}],
    })
}

/// The ops pass, step by step:
/// 1. a learned rule that fails pass-labelled cases without enough support is narrowed (its
///    blamed phrases dropped) or deleted;
/// 2. fail-labelled cases decided 通过 that no rule fails yet are explained by phrases they
///    contain and no pass-labelled case does ...
/// 3. ... and those still open by the absence of a confirmation every pass case has;
/// 4. every other learnable case was considered for this cycle's change: cited as its
///    evidence. Without a change they stay uncovered (a restated rule changes nothing and
///    covers nothing).
fn propose(prompt: &ReflectionPrompt, behaviour: &Behaviour, memory: &Memory) -> Value {
    let mut ops = OpsDraft::new(&prompt.rules);
    ops.take_back_blamed_rules(&prompt.cases, memory);
    let open = ops.explain_by_phrases(&prompt.cases, memory);
    ops.explain_by_absence(&open, memory);
    ops.cite_the_rest(&prompt.cases);
    ops.answer(behaviour)
}

/// The ops pass under construction: the learned rules as the ops drafted so far leave them,
/// the drafts, and the cases they cite.
struct OpsDraft {
    rules: BTreeMap<String, Option<Rule>>,
    drafts: Vec<Draft>,
    cited: BTreeSet<String>,
}

impl OpsDraft {
    fn new(rules: &[(String, String)]) -> Self {
        OpsDraft {
            rules: rules
                .iter()
                .filter(|(k, _)| k.starts_with('G'))
                .map(|(k, t)| (k.clone(), Rule::parse(t)))
                .collect(),
            drafts: Vec::new(),
            cited: BTreeSet::new(),
        }
    }

    /// Step 1: every learned rule blamed by wrongly failed cases is narrowed or deleted.
    fn take_back_blamed_rules(&mut self, cases: &[Case], memory: &Memory) {
        let keys: Vec<String> = self.rules.keys().cloned().collect();
        for key in keys {
            let Some(rule) = self.rules[&key].clone() else {
                continue;
            };
            let (evidence, drop) = blame(&rule, cases, memory);
            if evidence.is_empty() {
                continue;
            }
            let narrowed = narrowed(&rule, &drop);
            self.cited.extend(evidence.iter().cloned());
            self.drafts.push(match &narrowed {
                Some(r) => Draft {
                    op: "update",
                    key: Some(key.clone()),
                    text: Some(r.render()),
                    rationale: "原规则使参考答案为通过的案例判不通过，去掉误伤的短语",
                    evidence,
                },
                None => Draft {
                    op: "delete",
                    key: Some(key.clone()),
                    text: None,
                    rationale: "该规则使参考答案为通过的案例判不通过",
                    evidence,
                },
            });
            self.rules.insert(key, narrowed);
        }
    }

    /// Step 2: the wrongly passed cases no rule fails yet, explained by phrases (added to an
    /// existing presence rule where one has room). Returns the cases still unexplained.
    fn explain_by_phrases<'c>(&mut self, cases: &'c [Case], memory: &Memory) -> Vec<&'c Case> {
        let open: Vec<&Case> = cases
            .iter()
            .filter(|c| c.wrong_pass() && !self.fires_on(c))
            .collect();
        let (phrases, evidence, open) = pick_phrases(open, memory);
        if phrases.is_empty() {
            return open;
        }
        let existing = self.extendable_presence_rule(&phrases);
        self.cited.extend(evidence.iter().cloned());
        match existing {
            Some((key, rule)) => self.extend_rule(key, rule, evidence),
            None => {
                let rule = Rule::Present(phrases);
                self.drafts.push(Draft {
                    op: "add",
                    key: None,
                    text: Some(rule.render()),
                    rationale: "新增缺陷短语规则，现有规则未检查这些现象",
                    evidence,
                });
                self.rules.insert("new-present".into(), Some(rule));
            }
        }
        open
    }

    fn fires_on(&self, case: &Case) -> bool {
        self.rules
            .values()
            .flatten()
            .any(|r| r.fires(&case.summaries))
    }

    /// The first presence rule that still fits the length limit with `phrases` added.
    fn extendable_presence_rule(&self, phrases: &[String]) -> Option<(String, Rule)> {
        self.rules.iter().find_map(|(k, r)| match r {
            Some(Rule::Present(ps)) => {
                let mut all = ps.clone();
                all.extend(phrases.iter().cloned());
                let r = Rule::Present(all);
                (r.render().chars().count() <= 150).then(|| (k.clone(), r))
            }
            _ => None,
        })
    }

    /// `key` becomes `rule`: its draft (if step 1 made one) is updated, or an update is drafted.
    fn extend_rule(&mut self, key: String, rule: Rule, evidence: Vec<String>) {
        if let Some(d) = self
            .drafts
            .iter_mut()
            .find(|d| d.key.as_deref() == Some(key.as_str()))
        {
            d.op = "update";
            d.text = Some(rule.render());
            d.evidence.extend(evidence);
        } else {
            self.drafts.push(Draft {
                op: "update",
                key: Some(key.clone()),
                text: Some(rule.render()),
                rationale: "补充新的缺陷短语，覆盖同类不通过案例",
                evidence,
            });
        }
        self.rules.insert(key, Some(rule));
    }

    /// Step 3: the cases still open, explained by the absence of the confirmation most of them
    /// lack.
    fn explain_by_absence(&mut self, open: &[&Case], memory: &Memory) {
        let Some(phrase) = best_absent_confirmation(open, memory) else {
            return;
        };
        let evidence: Vec<String> = open
            .iter()
            .filter(|c| !c.summaries.iter().any(|s| s.contains(phrase.as_str())))
            .map(|c| c.key.clone())
            .collect();
        self.cited.extend(evidence.iter().cloned());
        self.drafts.push(Draft {
            op: "add",
            key: None,
            text: Some(Rule::Absent(phrase).render()),
            rationale: "所有图片都看不到该确认信息时要点无法确认，现有规则未覆盖",
            evidence,
        });
    }

    /// Step 4: every case not cited yet becomes evidence of the first op.
    fn cite_the_rest(&mut self, cases: &[Case]) {
        let rest: Vec<String> = cases
            .iter()
            .map(|c| c.key.clone())
            .filter(|k| !self.cited.contains(k))
            .collect();
        if let Some(first) = self.drafts.first_mut() {
            first.evidence.extend(rest);
        }
    }

    /// The ops-pass JSON: ops citing nothing (after [`Behaviour::never_cover`]) are left out.
    fn answer(mut self, behaviour: &Behaviour) -> Value {
        for d in &mut self.drafts {
            d.evidence.retain(|k| !behaviour.never_cover.contains(k));
        }
        self.drafts.retain(|d| !d.evidence.is_empty());
        let operations: Vec<Value> = self.drafts.iter().map(Draft::json).collect();
        json!({
            "has_evidence": !operations.is_empty(),
            "evidence_analysis": "按摘要短语与参考答案的对应关系提出规则，其余案例与检查清单一致。",
            "operations": operations,
        })
    }
}

/// The wrongly failed cases that blame `rule` (its evidence) and the parts they blame.
fn blame(rule: &Rule, cases: &[Case], memory: &Memory) -> (Vec<String>, BTreeSet<String>) {
    let mut drop: BTreeSet<String> = BTreeSet::new();
    let mut evidence: Vec<String> = Vec::new();
    for c in cases.iter().filter(|c| c.wrong_fail()) {
        let blame = blamed(rule, c, memory);
        if !blame.is_empty() {
            evidence.push(c.key.clone());
            drop.extend(blame);
        }
    }
    (evidence, drop)
}

/// `rule` without the `drop`ped phrases; `None` when nothing is left (or it is an absence rule).
fn narrowed(rule: &Rule, drop: &BTreeSet<String>) -> Option<Rule> {
    match rule {
        Rule::Present(ps) => {
            let keep: Vec<String> = ps.iter().filter(|p| !drop.contains(*p)).cloned().collect();
            (!keep.is_empty()).then_some(Rule::Present(keep))
        }
        Rule::Absent(_) => None,
    }
}

/// Phrases explaining the `open` cases, best first (defect-looking, then the most cases
/// explained, then the shortest), while one presence rule can hold them: the phrases, the
/// cases they explain, and the cases left open (they wait for the next cycle, retried as
/// uncovered).
fn pick_phrases<'c>(
    mut open: Vec<&'c Case>,
    memory: &Memory,
) -> (Vec<String>, Vec<String>, Vec<&'c Case>) {
    let mut phrases: Vec<String> = Vec::new();
    let mut evidence: Vec<String> = Vec::new();
    loop {
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        for c in &open {
            for p in presence_candidates(c, memory) {
                *counts.entry(p).or_default() += 1;
            }
        }
        let best = counts.into_iter().max_by(|(pa, na), (pb, nb)| {
            looks_like_defect(pa)
                .cmp(&looks_like_defect(pb))
                .then(na.cmp(nb))
                .then(pb.chars().count().cmp(&pa.chars().count()))
                .then(pb.cmp(pa))
        });
        let Some((phrase, _)) = best else { break };
        let mut longer = phrases.clone();
        longer.push(phrase.clone());
        if Rule::Present(longer).render().chars().count() > 150 {
            break;
        }
        let (hit, rest): (Vec<&Case>, Vec<&Case>) = open
            .into_iter()
            .partition(|c| c.summaries.iter().any(|s| s.contains(phrase.as_str())));
        evidence.extend(hit.iter().map(|c| c.key.clone()));
        phrases.push(phrase);
        open = rest;
    }
    (phrases, evidence, open)
}

/// The confirmation the most `open` cases lack (ties: the most supported, the longest).
fn best_absent_confirmation(open: &[&Case], memory: &Memory) -> Option<String> {
    let mut counts: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for c in open {
        for (p, support) in absence_candidates(c, memory) {
            let e = counts.entry(p).or_insert((0, support));
            e.0 += 1;
        }
    }
    let best = counts.into_iter().max_by(|(pa, (na, sa)), (pb, (nb, sb))| {
        na.cmp(nb)
            .then(sa.cmp(sb))
            .then(pa.chars().count().cmp(&pb.chars().count()))
            .then(pb.cmp(pa))
    });
    best.map(|(phrase, _)| phrase)
}
