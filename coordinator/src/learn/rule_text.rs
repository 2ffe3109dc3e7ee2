//! Rule text as *content*: the checks that decide whether a proposed rule text is a rule a
//! rollout prompt may carry (not a label leak, a version string or a restatement).
//!
//! [`crate::learn::op_check`] checks the shape of an op (kind, keys, evidence, caps); this module checks
//! what its text says, because a model can write well-formed JSON whose text is not a rule:
//! - **label leak**: a ticket key, a group id of the run or a `::pass`/`::fail` suffix in a rule
//!   would put the human label into every later rollout prompt. Ids are matched in the
//!   [`text::fold`] form (full-width narrowed, case and whitespace, `-`, `_` removed), so
//!   `ＱＣ－ＴＯＹ－Ｆ１` and `QC TOY F1` are found too;
//! - **not a rule**: a bare number, a version string (`2.0.0`), an identifier (`rule_7`) or
//!   punctuation only (a real model replaced `G0` with `2.0.0`);
//! - **script**: the text is written in the guidance's own script (a Chinese guidance gets no
//!   English or other-script rule);
//! - **too short**: at least [`MIN_HAN_CHARS`] Han characters (Han guidance) or
//!   [`MIN_LATIN_WORDS`] words (Latin guidance);
//! - **copy of a case summary**: the text is (a piece of) one of the cases' Stage-A summaries;
//! - **`G0` keeps the focus**: a new `G0` shares at least one term (Han bigram or Latin word)
//!   with the current `G0` or the mission name.
//!
//! Every finding has its own [`TextIssue`] code, mapped by the validator to a rejection reason
//! that goes back to the model in the revision round.

use crate::guidance::{MissionGuidance, RuleKey};
use stageb_shared::text;
use std::collections::BTreeSet;

/// Minimum Han characters of a rule in a Han-script guidance.
pub const MIN_HAN_CHARS: usize = 6;
/// Minimum words of a rule in a Latin-script guidance.
pub const MIN_LATIN_WORDS: usize = 3;
/// Group ids shorter than this (after folding) are not searched for in rule texts: a two
/// character id such as `g1` would match ordinary words and rule references.
pub const MIN_ID_CHARS: usize = 4;
/// A summary piece shorter than this (loose form) is not considered a copy.
const MIN_COPY_CHARS: usize = 6;

/// The script a guidance is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Script {
    Han,
    Latin,
}

/// What is wrong with a rule text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TextIssue {
    /// Contains a ticket key, a group id of the run, or a label suffix.
    LabelLeak(String),
    /// A bare number, version, identifier or punctuation.
    NotARule(&'static str),
    /// Written (mostly) in another script than the guidance.
    ScriptMismatch { guidance: Script },
    /// Shorter than the minimum for the guidance's script.
    TooShort { script: Script, have: usize },
    /// The text is a copy of (a piece of) a case summary.
    CopiesCaseSummary,
    /// A new `G0` that no longer names what the mission checks.
    G0NotFocus,
}

impl TextIssue {
    /// A human-readable detail for `reflection.jsonl` and the revision prompt.
    pub fn detail(&self) -> String {
        match self {
            TextIssue::LabelLeak(what) => {
                format!("text contains {what}; rules must not name tickets or labels")
            }
            TextIssue::NotARule(what) => format!("text is {what}, not a rule"),
            TextIssue::ScriptMismatch { guidance } => format!(
                "text is not written in the guidance's script ({})",
                match guidance {
                    Script::Han => "Chinese",
                    Script::Latin => "Latin",
                }
            ),
            TextIssue::TooShort { script, have } => match script {
                Script::Han => {
                    format!("text has {have} Chinese characters (min {MIN_HAN_CHARS})")
                }
                Script::Latin => format!("text has {have} words (min {MIN_LATIN_WORDS})"),
            },
            TextIssue::CopiesCaseSummary => {
                "text copies a case summary; write the rule the case teaches".into()
            }
            TextIssue::G0NotFocus => {
                "G0 must keep stating what the mission checks (share its terms)".into()
            }
        }
    }
}

/// What the text checks need besides the text.
#[derive(Debug, Clone, Copy)]
pub struct TextContext<'a> {
    pub guidance: &'a MissionGuidance,
    /// Group ids of every ticket of the run, as ingested.
    pub group_ids: &'a BTreeSet<String>,
    /// Stage-A summaries of the cases of this pass.
    pub case_summaries: &'a [String],
}

/// Check `rule_text` (already normalized) proposed for `key` (`None` for an add).
pub fn check(
    rule_text: &str,
    key: Option<RuleKey>,
    ctx: &TextContext<'_>,
) -> Result<(), TextIssue> {
    if let Some(what) = label_leak(rule_text, ctx.group_ids) {
        return Err(TextIssue::LabelLeak(what));
    }
    if let Some(what) = not_a_rule(rule_text) {
        return Err(TextIssue::NotARule(what));
    }
    let script = guidance_script(ctx.guidance);
    if !in_script(rule_text, script) {
        return Err(TextIssue::ScriptMismatch { guidance: script });
    }
    let have = match script {
        Script::Han => rule_text.chars().filter(|c| is_han(*c)).count(),
        Script::Latin => latin_words(rule_text).len(),
    };
    let min = match script {
        Script::Han => MIN_HAN_CHARS,
        Script::Latin => MIN_LATIN_WORDS,
    };
    if have < min {
        return Err(TextIssue::TooShort { script, have });
    }
    if copies_summary(rule_text, ctx.case_summaries) {
        return Err(TextIssue::CopiesCaseSummary);
    }
    if key == Some(RuleKey::G0) && !keeps_focus(rule_text, ctx.guidance) {
        return Err(TextIssue::G0NotFocus);
    }
    Ok(())
}

/// A ticket key, group id or label suffix in `text`, described.
pub fn label_leak(text: &str, group_ids: &BTreeSet<String>) -> Option<String> {
    // `fold` drops `-`/`_` and whitespace but keeps `:`, so `：：ｐａｓｓ` folds to `::pass`.
    let folded = text::fold(text);
    for suffix in ["::pass", "::fail", "::通过", "::不通过"] {
        if folded.contains(suffix) {
            return Some(format!("the label suffix '{suffix}'"));
        }
    }
    group_ids
        .iter()
        .find(|g| {
            let id = text::fold(g);
            id.chars().count() >= MIN_ID_CHARS && folded.contains(&id)
        })
        .map(|g| format!("the group id '{g}'"))
}

/// Why `text` is a bare number, version, identifier or punctuation, if it is.
pub fn not_a_rule(text: &str) -> Option<&'static str> {
    let compact: String = text
        .chars()
        .map(text::halfwidth_char)
        .filter(|c| !c.is_whitespace())
        .collect();
    if !compact.chars().any(|c| c.is_alphanumeric()) {
        return Some("punctuation only");
    }
    let trimmed = compact.trim_matches(|c: char| !c.is_alphanumeric());
    if trimmed.chars().all(|c| c.is_ascii_digit()) {
        return Some("a bare number");
    }
    let version_body = trimmed
        .strip_prefix(['v', 'V'])
        .unwrap_or(trimmed)
        .split(['.', '-', '+']);
    if trimmed.contains('.')
        && version_body
            .clone()
            .all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_alphanumeric()))
        && version_body
            .clone()
            .next()
            .is_some_and(|p| p.chars().all(|c| c.is_ascii_digit()))
    {
        return Some("a version string");
    }
    if trimmed
        .chars()
        .all(|c| c.is_ascii_digit() || ".,:-+/%".contains(c))
    {
        return Some("a bare number");
    }
    if !text.trim().contains(char::is_whitespace)
        && compact
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-:.#/".contains(c))
    {
        return Some("an identifier");
    }
    None
}

fn is_han(c: char) -> bool {
    matches!(c as u32, 0x3400..=0x4DBF | 0x4E00..=0x9FFF | 0xF900..=0xFAFF | 0x20000..=0x2FFFF)
}

fn is_latin_letter(c: char) -> bool {
    c.is_ascii_alphabetic() || matches!(c as u32, 0xC0..=0x24F)
}

/// Letters of `text` by script: (Han, Latin, other alphabetic).
fn letter_counts(text: &str) -> (usize, usize, usize) {
    let mut counts = (0, 0, 0);
    for c in text.chars().map(text::halfwidth_char) {
        if is_han(c) {
            counts.0 += 1;
        } else if is_latin_letter(c) {
            counts.1 += 1;
        } else if c.is_alphabetic() {
            counts.2 += 1;
        }
    }
    counts
}

/// The script of the guidance: Han when its rules hold at least as many Han characters as
/// Latin letters.
pub fn guidance_script(g: &MissionGuidance) -> Script {
    let (han, latin, _) = g
        .experiences
        .values()
        .map(|t| letter_counts(t))
        .fold((0, 0, 0), |a, b| (a.0 + b.0, a.1 + b.1, a.2 + b.2));
    if han >= latin {
        Script::Han
    } else {
        Script::Latin
    }
}

/// Is `text` mostly written in `script`? (Codes such as `BBU` inside a Chinese rule are fine.)
fn in_script(text: &str, script: Script) -> bool {
    let (han, latin, other) = letter_counts(text);
    match script {
        Script::Han => han > 0 && han >= latin + other,
        Script::Latin => latin > 0 && latin >= han + other,
    }
}

fn latin_words(text: &str) -> Vec<String> {
    text.split(|c: char| !is_latin_letter(c))
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect()
}

/// Letters and digits only, simplified, lowercase: the form summary copies are compared in.
fn letters_only(s: &str) -> String {
    text::fold(s)
        .chars()
        .filter(|c| c.is_alphanumeric())
        .collect()
}

fn copies_summary(rule_text: &str, summaries: &[String]) -> bool {
    let t = letters_only(rule_text);
    if t.chars().count() < MIN_COPY_CHARS {
        return false;
    }
    summaries.iter().any(|s| {
        let s = letters_only(s);
        !s.is_empty()
            && (s.contains(&t)
                || (t.contains(&s) && s.chars().count() * 10 >= t.chars().count() * 6))
    })
}

/// Focus terms: Han bigrams and Latin words of at least 3 letters.
fn focus_terms(s: &str) -> BTreeSet<String> {
    let simplified = text::to_simplified(s);
    let han: Vec<char> = simplified.chars().collect();
    let mut terms: BTreeSet<String> = han
        .windows(2)
        .filter(|w| is_han(w[0]) && is_han(w[1]))
        .map(|w| w.iter().collect())
        .collect();
    terms.extend(
        latin_words(&simplified)
            .into_iter()
            .filter(|w| w.len() >= 3),
    );
    terms
}

/// Does a new `G0` still share a term with the current `G0` or the mission name?
fn keeps_focus(new_g0: &str, g: &MissionGuidance) -> bool {
    let mut reference = focus_terms(g.g0());
    reference.extend(focus_terms(&g.mission));
    // Generic verdict words are not a focus.
    for generic in ["通过", "检查", "判定", "是否", "需要", "要求"] {
        reference.remove(generic);
    }
    !focus_terms(new_g0).is_disjoint(&reference)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn guidance(g0: &str) -> MissionGuidance {
        let mut experiences = BTreeMap::new();
        experiences.insert(RuleKey::S(1), "若关键点无法确认则判不通过".to_string());
        experiences.insert(RuleKey::G0, g0.to_string());
        MissionGuidance {
            mission: "挡风板安装检查".into(),
            step: 1,
            updated_at: "2026-01-01".into(),
            experiences,
            metadata: BTreeMap::new(),
        }
    }

    fn run_groups() -> BTreeSet<String> {
        ["QC-TOY-F1", "QC-TOY-P10", "g1"]
            .iter()
            .map(|s| s.to_string())
            .collect()
    }

    fn check_text(text: &str, key: Option<RuleKey>) -> Result<(), TextIssue> {
        let g = guidance("检查BBU设备是否按要求配备挡风板；挡风板安装方向是否正确。");
        let groups = run_groups();
        let summaries = vec!["挡风板/显示完整×1，备注: 挡风板装反了，需要整改".to_string()];
        check(
            text,
            key,
            &TextContext {
                guidance: &g,
                group_ids: &groups,
                case_summaries: &summaries,
            },
        )
    }

    #[test]
    fn label_leaks_are_found_in_full_width_and_spaced_forms() {
        for leak in [
            "若工单QC-TOY-F1出现则判不通过",
            "若工单ＱＣ－ＴＯＹ－Ｆ１出现则判不通过",
            "若工单 QC TOY F1 出现则判不通过",
            "若工单q c _ t o y - f 1出现则判不通过",
            "若挡风板缺失则判不通过 x::fail",
            "若挡风板缺失则判不通过（ｘ：：ＰＡＳＳ）",
            "若挡风板缺失则判不通过 : : pass",
        ] {
            assert!(
                matches!(check_text(leak, None), Err(TextIssue::LabelLeak(_))),
                "{leak}"
            );
        }
        // A two-character group id is too common to search for.
        assert_eq!(check_text("若规则g1所述挡风板缺失则判不通过", None), Ok(()));
    }

    #[test]
    fn numbers_versions_identifiers_and_punctuation_are_not_rules() {
        for (text, want) in [
            ("2.0.0", "a version string"),
            ("1.0.0", "a version string"),
            ("v1.2.0", "a version string"),
            ("42", "a bare number"),
            ("３．５", "a version string"),
            ("rule_7", "an identifier"),
            ("G2", "an identifier"),
            ("。。。", "punctuation only"),
            ("12:30", "a bare number"),
        ] {
            assert_eq!(
                check_text(text, None),
                Err(TextIssue::NotARule(want)),
                "{text}"
            );
        }
    }

    #[test]
    fn rules_are_written_in_the_guidance_script_and_long_enough() {
        assert_eq!(
            check_text("Fail the ticket if the panel is missing", None),
            Err(TextIssue::ScriptMismatch {
                guidance: Script::Han
            })
        );
        assert!(matches!(
            check_text("패널이 없으면 불합격", None),
            Err(TextIssue::ScriptMismatch { .. })
        ));
        assert_eq!(
            check_text("判不通过", None),
            Err(TextIssue::TooShort {
                script: Script::Han,
                have: 4
            })
        );
        // Codes inside a Chinese rule are fine.
        assert_eq!(check_text("若BBU设备未配备挡风板则判不通过", None), Ok(()));
    }

    #[test]
    fn latin_guidance_counts_words() {
        let mut g = guidance("Check that every BBU has its wind baffle installed");
        g.experiences.remove(&RuleKey::S(1));
        let groups = BTreeSet::new();
        let ctx = TextContext {
            guidance: &g,
            group_ids: &groups,
            case_summaries: &[],
        };
        assert_eq!(guidance_script(&g), Script::Latin);
        assert!(matches!(
            check("fail now", None, &ctx),
            Err(TextIssue::TooShort { .. })
        ));
        assert_eq!(check("Fail when the baffle is missing", None, &ctx), Ok(()));
        assert!(matches!(
            check("若挡风板缺失则判不通过", None, &ctx),
            Err(TextIssue::ScriptMismatch { .. })
        ));
    }

    #[test]
    fn a_copied_case_summary_is_not_a_rule() {
        assert_eq!(
            check_text("备注: 挡风板装反了，需要整改", None),
            Err(TextIssue::CopiesCaseSummary)
        );
        assert_eq!(
            check_text("挡风板装反了需要整改", None),
            Err(TextIssue::CopiesCaseSummary)
        );
        assert_eq!(
            check_text("若摘要出现“挡风板装反了”则判不通过", None),
            Ok(())
        );
    }

    #[test]
    fn g0_keeps_stating_the_mission_focus() {
        assert_eq!(
            check_text(
                "检查BBU设备是否按要求配备挡风板且螺丝齐全",
                Some(RuleKey::G0)
            ),
            Ok(())
        );
        assert_eq!(
            check_text("所有样本都应当判为合格并给出理由", Some(RuleKey::G0)),
            Err(TextIssue::G0NotFocus)
        );
        // The same text is fine as a learned rule.
        assert_eq!(
            check_text("所有样本都应当判为合格并给出理由", Some(RuleKey::G1)),
            Ok(())
        );
    }
}
