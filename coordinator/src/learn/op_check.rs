//! Rank 0's validation of ops-pass proposals (docs/design/reflection.md, "Op validation"): the
//! stage that receives the ops validates them, never the model that wrote them.
//!
//! Every proposed op is checked and either accepted (as a typed [`GuidanceOp`]) or rejected
//! with a stable [`RejectReason`] code and a detail; nothing is skipped silently (the original
//! dropped rejected ops without a trace). Checks, in order (the first failure is the reason):
//! 1. kind ∈ `add|update|delete|merge` (`unknown_op`);
//! 2. key: required for update/delete/merge (`missing_key`), canonical (`invalid_key`), not
//!    `S*` (`scaffold_key`), existing (`unknown_key`; stricter than the original, which created a
//!    missing key on update: a typo must not invent a rule), `G0` not deleted (`g0_delete`).
//!    An `add`'s key is ignored (adds always take a fresh key or reuse an identical rule's);
//! 3. merge: `merged_from` non-empty, canonical, existing, distinct, without the target, without
//!    `S*` (`scaffold_key`) and without `G0` (the checklist cannot be merged away)
//!    (`merged_from_invalid`);
//! 4. evidence: non-empty (`empty_evidence`), each id resolved through the `第N组` shorthand,
//!    and every key ∈ L; one outside key rejects the whole op (`evidence_outside_learnable`),
//!    never a partial filter and never a "whole bundle" default;
//! 5. text (add/update/merge): present (`missing_text`); no ticket key, group id or label
//!    suffix (`label_leak`); no third-state wording in text or rationale (`third_state_text`);
//!    no Stage-A object chain (`stage_a_leak`); text ≤ 160 and rationale ≤ 80 characters (the
//!    schema's bound) (`text_too_long`, `rationale_too_long`; rejected, never truncated: a cut
//!    rule can mean something else); then the text must be a rule ([`crate::learn::rule_text`]):
//!    `not_a_rule`, `script_mismatch`, `text_too_short`, `copies_case_summary`, `g0_not_focus`;
//! 6. duplicates: an `update` whose text equals the rule's current text, or an `add` equal to
//!    an existing `G` rule, changes nothing (`unchanged_text`: it must not count as coverage);
//!    an `add` nearly equal to an existing `G` rule becomes an `update` of that
//!    key; text equal to an `S` rule (`duplicate_of_scaffold`) or, for update/merge, to another
//!    rule (`duplicate_text`) is rejected; an op identical to an accepted one is `duplicate_op`;
//!    an op touching a key an accepted op already touches is `key_conflict` (op order inside one
//!    reflection must not matter);
//! 7. `max_operations` caps *accepted* ops; further valid ops are `max_operations_exceeded`;
//! 8. the input budget ([`stageb_shared::budget`]): an `add` that would take the mission past
//!    `MAX_RULES` rules, or any op whose text would take all rules past `MAX_GUIDANCE_CHARS`
//!    (counting every accepted op's text as added), is `guidance_budget`: the guidance a run
//!    writes always loads again on resume.
//!
//! The covered set `E` is computed from the ops that were actually applied
//! ([`evidence_covered`]), never from accepted proposals: an op skipped at apply time (e.g. a
//! delete of a key that no longer exists) does not cover its evidence (B9).

use crate::guidance::{AppliedOp, GuidanceOp, MissionGuidance, RuleKey, dedupe_form, loose_form};
use crate::learn::rule_text::{self, TextContext, TextIssue};
use serde::{Deserialize, Serialize};
use stageb_shared::domain::TicketKey;
pub use stageb_shared::reflection_schema::ProposedOp;
use stageb_shared::text::{self, THIRD_STATE_REFLECTION};
use std::collections::{BTreeMap, BTreeSet};

/// Cap on a rule's text, in characters.
pub const MAX_TEXT_CHARS: usize = 160;
/// Cap on an op's rationale, in characters.
pub const MAX_RATIONALE_CHARS: usize = stageb_shared::reflection_schema::RATIONALE_MAX_CHARS;
/// An `add` whose text contains (or is contained in) an existing rule's text with at least this
/// length ratio is treated as the same rule (the original's deterministic "prefer update").
pub const SIMILAR_CONTAINMENT_RATIO: f64 = 0.85;

/// Stable rejection codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RejectReason {
    UnknownOp,
    MissingKey,
    InvalidKey,
    ScaffoldKey,
    UnknownKey,
    G0Delete,
    MergedFromInvalid,
    EmptyEvidence,
    EvidenceOutsideLearnable,
    MissingText,
    LabelLeak,
    ThirdStateText,
    StageALeak,
    TextTooLong,
    RationaleTooLong,
    NotARule,
    ScriptMismatch,
    TextTooShort,
    CopiesCaseSummary,
    G0NotFocus,
    UnchangedText,
    DuplicateOfScaffold,
    DuplicateText,
    DuplicateOp,
    KeyConflict,
    MaxOperationsExceeded,
    GuidanceBudget,
    /// The same edit was rejected in an earlier cycle (`learn::rejected_memory`).
    AlreadyRejected,
    /// Validated, but the candidate guidance did not earn its place on the gate split
    /// (`learn::gate_decision`).
    GateRegression,
}

impl RejectReason {
    pub fn code(self) -> &'static str {
        match self {
            RejectReason::UnknownOp => "unknown_op",
            RejectReason::MissingKey => "missing_key",
            RejectReason::InvalidKey => "invalid_key",
            RejectReason::ScaffoldKey => "scaffold_key",
            RejectReason::UnknownKey => "unknown_key",
            RejectReason::G0Delete => "g0_delete",
            RejectReason::MergedFromInvalid => "merged_from_invalid",
            RejectReason::EmptyEvidence => "empty_evidence",
            RejectReason::EvidenceOutsideLearnable => "evidence_outside_learnable",
            RejectReason::MissingText => "missing_text",
            RejectReason::LabelLeak => "label_leak",
            RejectReason::ThirdStateText => "third_state_text",
            RejectReason::StageALeak => "stage_a_leak",
            RejectReason::TextTooLong => "text_too_long",
            RejectReason::RationaleTooLong => "rationale_too_long",
            RejectReason::NotARule => "not_a_rule",
            RejectReason::ScriptMismatch => "script_mismatch",
            RejectReason::TextTooShort => "text_too_short",
            RejectReason::CopiesCaseSummary => "copies_case_summary",
            RejectReason::G0NotFocus => "g0_not_focus",
            RejectReason::UnchangedText => "unchanged_text",
            RejectReason::DuplicateOfScaffold => "duplicate_of_scaffold",
            RejectReason::DuplicateText => "duplicate_text",
            RejectReason::DuplicateOp => "duplicate_op",
            RejectReason::KeyConflict => "key_conflict",
            RejectReason::MaxOperationsExceeded => "max_operations_exceeded",
            RejectReason::GuidanceBudget => "guidance_budget",
            RejectReason::AlreadyRejected => "already_rejected",
            RejectReason::GateRegression => "gate_regression",
        }
    }
}

/// What the validator needs besides the proposal.
#[derive(Debug, Clone, Copy)]
pub struct OpsContext<'a> {
    /// L: the learnable ticket keys of this ops pass.
    pub learnable: &'a BTreeSet<TicketKey>,
    /// `第N组` → ticket key, as rendered in the prompt's CASES.
    pub shorthand: &'a BTreeMap<String, TicketKey>,
    pub guidance: &'a MissionGuidance,
    /// Cap on accepted ops (`reflection.max_operations`); `None` = unlimited.
    pub max_operations: Option<usize>,
    /// Group ids of every ticket of the run (a rule must never name one).
    pub group_ids: &'a BTreeSet<String>,
    /// Stage-A summaries of this pass's cases (a rule must not copy one).
    pub case_summaries: &'a [String],
}

impl RejectReason {
    fn of_text_issue(issue: &TextIssue) -> RejectReason {
        match issue {
            TextIssue::LabelLeak(_) => RejectReason::LabelLeak,
            TextIssue::NotARule(_) => RejectReason::NotARule,
            TextIssue::ScriptMismatch { .. } => RejectReason::ScriptMismatch,
            TextIssue::TooShort { .. } => RejectReason::TextTooShort,
            TextIssue::CopiesCaseSummary => RejectReason::CopiesCaseSummary,
            TextIssue::G0NotFocus => RejectReason::G0NotFocus,
        }
    }
}

/// An accepted op, ready for [`crate::guidance::GuidanceRepo::apply`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AcceptedOp {
    /// Position in the proposal.
    pub index: usize,
    pub op: GuidanceOp,
    /// Set when an `add` was turned into an update of an existing rule with the same text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reused_key: Option<RuleKey>,
    /// The evidence tickets the op claims to flip ([`ProposedOp::expected_flips`] resolved,
    /// kept only where they are its evidence); checked in the next epoch.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub expected_flips: Vec<TicketKey>,
}

/// A rejected op with its reason (recorded in `reflection.jsonl`, and sent back for revision).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RejectedOp {
    pub index: usize,
    pub proposed: ProposedOp,
    pub reason: RejectReason,
    pub detail: String,
}

/// The validator's verdict on a proposal, in proposal order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpsValidation {
    pub accepted: Vec<AcceptedOp>,
    pub rejected: Vec<RejectedOp>,
}

impl OpsValidation {
    /// The accepted ops, in order, for applying.
    pub fn ops(&self) -> Vec<GuidanceOp> {
        self.accepted.iter().map(|a| a.op.clone()).collect()
    }

    /// Union of the accepted ops' evidence (what *would* be covered if all applied; coverage
    /// itself must use [`evidence_covered`] on the applied ops).
    pub fn proposed_evidence(&self) -> BTreeSet<TicketKey> {
        self.accepted
            .iter()
            .flat_map(|a| a.op.evidence().iter().cloned())
            .collect()
    }
}

/// Validate a proposal. Pure and deterministic.
pub fn validate_ops(proposed: &[ProposedOp], ctx: &OpsContext<'_>) -> OpsValidation {
    let mut out = OpsValidation::default();
    let mut signatures: Vec<String> = Vec::new();
    let mut touched: BTreeSet<RuleKey> = BTreeSet::new();
    for (index, p) in proposed.iter().enumerate() {
        let checked = check_op(p, ctx).and_then(|(op, reused_key)| {
            let sig = signature(&op);
            if signatures.contains(&sig) {
                return Err((
                    RejectReason::DuplicateOp,
                    "identical to an accepted op".to_string(),
                ));
            }
            let keys = op_keys(&op);
            if let Some(k) = keys.iter().find(|k| touched.contains(k)) {
                return Err((
                    RejectReason::KeyConflict,
                    format!("{k} is already changed by an accepted op"),
                ));
            }
            if ctx
                .max_operations
                .is_some_and(|max| out.accepted.len() >= max)
            {
                return Err((
                    RejectReason::MaxOperationsExceeded,
                    format!("max_operations={} already accepted", out.accepted.len()),
                ));
            }
            if let Some(detail) = over_budget(&op, ctx.guidance, &out.accepted) {
                return Err((RejectReason::GuidanceBudget, detail));
            }
            signatures.push(sig);
            touched.extend(keys);
            let expected_flips = claimed_flips(p, &op, ctx);
            Ok(AcceptedOp {
                index,
                op,
                reused_key,
                expected_flips,
            })
        });
        match checked {
            Ok(accepted) => out.accepted.push(accepted),
            Err((reason, detail)) => out.rejected.push(RejectedOp {
                index,
                proposed: p.clone(),
                reason,
                detail,
            }),
        }
    }
    out
}

/// The op's claimed flips resolved to ticket keys, those among its evidence only, in evidence
/// order (a claim outside the evidence is no claim about this op's own cases).
fn claimed_flips(p: &ProposedOp, op: &GuidanceOp, ctx: &OpsContext<'_>) -> Vec<TicketKey> {
    let Some(raw) = &p.expected_flips else {
        return Vec::new();
    };
    let claimed: BTreeSet<TicketKey> = raw.iter().map(|r| resolve_id(r, ctx.shorthand)).collect();
    op.evidence()
        .iter()
        .filter(|k| claimed.contains(*k))
        .cloned()
        .collect()
}

/// Why `op`, on top of the ops already accepted, would take the guidance past the input
/// budget (see step 8 of the module header); `None` when it fits.
fn over_budget(op: &GuidanceOp, g: &MissionGuidance, accepted: &[AcceptedOp]) -> Option<String> {
    use stageb_shared::budget::{MAX_GUIDANCE_CHARS, MAX_RULES};
    let is_add = |op: &GuidanceOp| matches!(op, GuidanceOp::Add { .. });
    let rules = g.experiences.len() + accepted.iter().filter(|a| is_add(&a.op)).count();
    if is_add(op) && rules >= MAX_RULES {
        return Some(format!(
            "the guidance would hold more than {MAX_RULES} rules"
        ));
    }
    let chars = |t: &str| t.chars().count();
    let text = op_text(op).map_or(0, chars);
    let total = g.experiences.values().map(|t| chars(t)).sum::<usize>()
        + accepted
            .iter()
            .filter_map(|a| op_text(&a.op))
            .map(chars)
            .sum::<usize>()
        + text;
    (text > 0 && total > MAX_GUIDANCE_CHARS)
        .then(|| format!("the rules would hold more than {MAX_GUIDANCE_CHARS} characters together"))
}

fn op_text(op: &GuidanceOp) -> Option<&str> {
    match op {
        GuidanceOp::Add { text, .. }
        | GuidanceOp::Update { text, .. }
        | GuidanceOp::Merge { text, .. } => Some(text),
        GuidanceOp::Delete { .. } => None,
    }
}

type Check<T> = Result<T, (RejectReason, String)>;

fn reject<T>(reason: RejectReason, detail: impl Into<String>) -> Check<T> {
    Err((reason, detail.into()))
}

fn check_op(p: &ProposedOp, ctx: &OpsContext<'_>) -> Check<(GuidanceOp, Option<RuleKey>)> {
    let g = ctx.guidance;
    let kind = p.op.trim().to_lowercase();
    if !matches!(kind.as_str(), "add" | "update" | "delete" | "merge") {
        return reject(
            RejectReason::UnknownOp,
            format!("op '{}' is not add|update|delete|merge", p.op),
        );
    }
    let key = if kind == "add" {
        None
    } else {
        Some(target_key(p.key.as_deref(), g)?)
    };
    if kind == "delete" && key == Some(RuleKey::G0) {
        return reject(RejectReason::G0Delete, "G0 cannot be deleted");
    }
    let merged_from = if kind == "merge" {
        merged_from(p.merged_from.as_deref(), key.unwrap_or(RuleKey::G0), g)?
    } else {
        Vec::new()
    };
    let evidence = resolve_evidence(&p.evidence, ctx)?;
    let rationale = p
        .rationale
        .as_deref()
        .map(text::normalize)
        .filter(|r| !r.is_empty());
    if let Some(r) = &rationale {
        if let Some(w) = text::find_third_state(r, THIRD_STATE_REFLECTION) {
            return reject(
                RejectReason::ThirdStateText,
                format!("rationale contains '{w}'"),
            );
        }
        if r.chars().count() > MAX_RATIONALE_CHARS {
            return reject(
                RejectReason::RationaleTooLong,
                format!(
                    "rationale has {} characters (max {MAX_RATIONALE_CHARS})",
                    r.chars().count()
                ),
            );
        }
    }
    if kind == "delete" {
        let key = key.unwrap_or(RuleKey::G0);
        return Ok((
            GuidanceOp::Delete {
                key,
                rationale,
                evidence,
            },
            None,
        ));
    }
    let rule_text = p
        .text
        .as_deref()
        .map(text::normalize)
        .filter(|t| !dedupe_form(t).is_empty());
    let Some(rule_text) = rule_text else {
        return reject(
            RejectReason::MissingText,
            format!("{kind} needs a non-empty text"),
        );
    };
    if let Some(what) = rule_text::label_leak(&rule_text, ctx.group_ids) {
        return reject(RejectReason::LabelLeak, TextIssue::LabelLeak(what).detail());
    }
    if let Some(w) = text::find_third_state(&rule_text, THIRD_STATE_REFLECTION) {
        return reject(RejectReason::ThirdStateText, format!("text contains '{w}'"));
    }
    if let Some(marker) = stage_a_leak(&rule_text) {
        return reject(
            RejectReason::StageALeak,
            format!("text looks like a Stage-A object chain ({marker})"),
        );
    }
    let n = rule_text.chars().count();
    if n > MAX_TEXT_CHARS {
        return reject(
            RejectReason::TextTooLong,
            format!("text has {n} characters (max {MAX_TEXT_CHARS})"),
        );
    }
    let text_ctx = TextContext {
        guidance: g,
        group_ids: ctx.group_ids,
        case_summaries: ctx.case_summaries,
    };
    if let Err(issue) = rule_text::check(&rule_text, key, &text_ctx) {
        return reject(RejectReason::of_text_issue(&issue), issue.detail());
    }
    match (kind.as_str(), key) {
        ("add", _) => match similar_rule(g, &rule_text) {
            Some(k) if k.is_scaffold() => reject(
                RejectReason::DuplicateOfScaffold,
                format!("same rule as {k}"),
            ),
            Some(k)
                if g.text(k)
                    .is_some_and(|t| loose_form(t) == loose_form(&rule_text)) =>
            {
                reject(
                    RejectReason::UnchangedText,
                    format!("{k} already says this; an add must add a new rule"),
                )
            }
            Some(k) => Ok((
                GuidanceOp::Update {
                    key: k,
                    text: rule_text,
                    rationale,
                    evidence,
                },
                Some(k),
            )),
            None => Ok((
                GuidanceOp::Add {
                    text: rule_text,
                    rationale,
                    evidence,
                },
                None,
            )),
        },
        ("update", Some(key)) => {
            if g.text(key)
                .is_some_and(|t| loose_form(t) == loose_form(&rule_text))
            {
                return reject(
                    RejectReason::UnchangedText,
                    format!("{key} already says this; an update must change the rule"),
                );
            }
            duplicate_elsewhere(g, &rule_text, &[key])?;
            Ok((
                GuidanceOp::Update {
                    key,
                    text: rule_text,
                    rationale,
                    evidence,
                },
                None,
            ))
        }
        (_, Some(key)) => {
            let mut own = merged_from.clone();
            own.push(key);
            duplicate_elsewhere(g, &rule_text, &own)?;
            Ok((
                GuidanceOp::Merge {
                    key,
                    merged_from,
                    text: rule_text,
                    rationale,
                    evidence,
                },
                None,
            ))
        }
        _ => reject(RejectReason::MissingKey, format!("{kind} needs a key")),
    }
}

fn parse_key(raw: &str) -> Check<RuleKey> {
    raw.trim()
        .parse::<RuleKey>()
        .map_err(|e| (RejectReason::InvalidKey, e.to_string()))
}

fn target_key(raw: Option<&str>, g: &MissionGuidance) -> Check<RuleKey> {
    let Some(raw) = raw.filter(|k| !k.trim().is_empty()) else {
        return reject(RejectReason::MissingKey, "update/delete/merge need a key");
    };
    let key = parse_key(raw)?;
    if key.is_scaffold() {
        return reject(
            RejectReason::ScaffoldKey,
            format!("{key} is read-only scaffold"),
        );
    }
    if !g.experiences.contains_key(&key) {
        return reject(RejectReason::UnknownKey, format!("{key} does not exist"));
    }
    Ok(key)
}

fn merged_from(
    raw: Option<&[String]>,
    target: RuleKey,
    g: &MissionGuidance,
) -> Check<Vec<RuleKey>> {
    let raw = raw.unwrap_or_default();
    if raw.is_empty() {
        return reject(
            RejectReason::MergedFromInvalid,
            "merged_from must be non-empty",
        );
    }
    let mut keys = Vec::new();
    for r in raw {
        let k = parse_key(r).map_err(|(_, d)| (RejectReason::MergedFromInvalid, d))?;
        if k.is_scaffold() {
            return reject(
                RejectReason::ScaffoldKey,
                format!("merged_from contains read-only {k}"),
            );
        }
        if k.is_g0() {
            return reject(RejectReason::MergedFromInvalid, "G0 cannot be merged away");
        }
        if k == target {
            return reject(
                RejectReason::MergedFromInvalid,
                format!("merged_from contains the target {k}"),
            );
        }
        if !g.experiences.contains_key(&k) {
            return reject(
                RejectReason::MergedFromInvalid,
                format!("merged_from {k} does not exist"),
            );
        }
        if keys.contains(&k) {
            return reject(
                RejectReason::MergedFromInvalid,
                format!("merged_from lists {k} twice"),
            );
        }
        keys.push(k);
    }
    Ok(keys)
}

fn resolve_evidence(raw: &[String], ctx: &OpsContext<'_>) -> Check<Vec<TicketKey>> {
    let mut keys: Vec<TicketKey> = Vec::new();
    for r in raw {
        let k = resolve_id(r, ctx.shorthand);
        if k.as_str().is_empty() {
            continue;
        }
        if !ctx.learnable.contains(&k) {
            return reject(
                RejectReason::EvidenceOutsideLearnable,
                format!(
                    "evidence '{}' is not a learnable ticket of this pass",
                    r.trim()
                ),
            );
        }
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    if keys.is_empty() {
        return reject(
            RejectReason::EmptyEvidence,
            "every op needs non-empty evidence",
        );
    }
    Ok(keys)
}

/// Resolve one id written by the model: `第N组` (spaces allowed) through the shorthand map,
/// anything else as a ticket key (trimmed). An unmapped shorthand stays as written (and then
/// fails the membership check).
pub fn resolve_id(raw: &str, shorthand: &BTreeMap<String, TicketKey>) -> TicketKey {
    let trimmed = raw.trim();
    let compact: String = trimmed.chars().filter(|c| !c.is_whitespace()).collect();
    if let Some(n) = compact
        .strip_prefix('第')
        .and_then(|s| s.strip_suffix('组'))
        && !n.is_empty()
        && n.chars().all(|c| c.is_ascii_digit())
        && let Some(k) = shorthand.get(&format!("第{}组", n.trim_start_matches('0')))
    {
        return k.clone();
    }
    TicketKey(trimmed.to_string())
}

/// Decision-pass ids resolved against a batch.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResolvedIds {
    /// Ticket keys of the batch, in first-mention order, deduplicated.
    pub keys: Vec<TicketKey>,
    /// Ids that are not (and do not resolve to) a ticket key of the batch; ignored.
    pub unknown: Vec<String>,
}

/// Resolve `no_evidence_group_ids` (or any id list) against the batch: shorthand first, then
/// ticket keys; unknown ids (including bare group ids without `::label`) are ignored.
pub fn resolve_ids(
    raw: &[String],
    shorthand: &BTreeMap<String, TicketKey>,
    batch: &BTreeSet<TicketKey>,
) -> ResolvedIds {
    let mut out = ResolvedIds::default();
    for r in raw {
        let k = resolve_id(r, shorthand);
        if batch.contains(&k) {
            if !out.keys.contains(&k) {
                out.keys.push(k);
            }
        } else {
            out.unknown.push(r.clone());
        }
    }
    out
}

/// The evidence covered by ops that were actually applied (E). Ops skipped at apply time
/// are not in `applied`, so they never count (B9).
pub fn evidence_covered(applied: &[AppliedOp]) -> BTreeSet<TicketKey> {
    applied
        .iter()
        .flat_map(|a| a.evidence.iter().cloned())
        .collect()
}

/// `L \ E`, sorted.
pub fn uncovered(learnable: &BTreeSet<TicketKey>, covered: &BTreeSet<TicketKey>) -> Vec<TicketKey> {
    learnable.difference(covered).cloned().collect()
}

/// Why `text` looks like a Stage-A summary fragment rather than a rule, if it does: `image_`
/// or `imageN`, `×` counts, `备注:`, `标签/`, or two or more `/` (an object chain such as
/// `BBU设备/显示完整/…`).
pub fn stage_a_leak(text: &str) -> Option<&'static str> {
    let lower = text.to_lowercase();
    if lower.contains("image_") {
        return Some("image_");
    }
    if lower
        .match_indices("image")
        .any(|(i, m)| lower[i + m.len()..].starts_with(|c: char| c.is_ascii_digit()))
    {
        return Some("imageN");
    }
    if text.contains('×') {
        return Some("×");
    }
    if text.contains("备注:") || text.contains("备注：") {
        return Some("备注:");
    }
    if text.contains("标签/") {
        return Some("标签/");
    }
    if text.chars().filter(|c| matches!(c, '/' | '／')).count() >= 2 {
        return Some("two or more '/'");
    }
    None
}

/// An existing rule that is the same as `text`: equal in loose form, or one containing the
/// other with a length ratio ≥ [`SIMILAR_CONTAINMENT_RATIO`]. Exact matches win over
/// containment; ties go to the lowest key.
pub fn similar_rule(g: &MissionGuidance, text: &str) -> Option<RuleKey> {
    let t = loose_form(text);
    if t.is_empty() {
        return None;
    }
    if let Some(k) = g
        .experiences
        .iter()
        .find(|(_, v)| loose_form(v) == t)
        .map(|(k, _)| *k)
    {
        return Some(k);
    }
    g.experiences
        .iter()
        .find(|(_, v)| {
            let v = loose_form(v);
            let (a, b) = (t.chars().count() as f64, v.chars().count() as f64);
            !v.is_empty()
                && (v.contains(&t) || t.contains(&v))
                && a.min(b) / a.max(b) >= SIMILAR_CONTAINMENT_RATIO
        })
        .map(|(k, _)| *k)
}

/// Reject text equal (loose form) to a rule other than `own`.
fn duplicate_elsewhere(g: &MissionGuidance, text: &str, own: &[RuleKey]) -> Check<()> {
    let t = loose_form(text);
    match g
        .experiences
        .iter()
        .find(|(k, v)| !own.contains(k) && loose_form(v) == t)
    {
        Some((k, _)) if k.is_scaffold() => reject(
            RejectReason::DuplicateOfScaffold,
            format!("same text as {k}"),
        ),
        Some((k, _)) => reject(RejectReason::DuplicateText, format!("same text as {k}")),
        None => Ok(()),
    }
}

fn signature(op: &GuidanceOp) -> String {
    let mut evidence: Vec<&str> = op.evidence().iter().map(TicketKey::as_str).collect();
    evidence.sort_unstable();
    let merged = match op {
        GuidanceOp::Merge { merged_from, .. } => merged_from
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        _ => Vec::new(),
    };
    format!(
        "{}|{}|{}|{}|{}",
        op.kind(),
        op.key().map(|k| k.to_string()).unwrap_or_default(),
        op.text().map(loose_form).unwrap_or_default(),
        evidence.join(","),
        merged.join(",")
    )
}

fn op_keys(op: &GuidanceOp) -> Vec<RuleKey> {
    let mut keys: Vec<RuleKey> = op.key().into_iter().collect();
    if let GuidanceOp::Merge { merged_from, .. } = op {
        keys.extend(merged_from.iter().copied());
    }
    keys
}

#[cfg(test)]
mod tests;
