//! The mission-scoped fail-first guardrail: deterministic evidence extraction from Stage-A
//! summaries (the reference's "Deterministic overrides": evidence of a failure overrides the
//! vote).
//!
//! A Stage-A summary is a list of object chains such as
//! `光纤/显示完整/缺失×1，螺丝/符合要求×3；备注: …`. The guardrail looks for explicit negative
//! findings ("缺失", "松动", `不符合要求/<issue>`, …) and sorts each hit into:
//! - **relevant**: the clause is about something the mission's `G0` checklist asks about; such a
//!   hit forces the final verdict to `fail` (see [`crate::decide::selection`]);
//! - **irrelevant**: a negative about something outside `G0`; it only flags manual review;
//! - **pending**: a soft "cannot confirm" phrase (无法确认, 模糊, …); it flags manual review and
//!   suppresses negatives in the same clause.
//!
//! This is a re-implementation, not a port: the original's double-escaped regexes (B1) split on
//! the letter `n`, never stripped `×N` counts and never matched the remark marker. Here the
//! scanning is plain string work on the normalized (simplified, space-normalized) text:
//! - coarse parts are split on `;`, `；` and newline (before whitespace normalization, which
//!   would turn newlines into spaces), clauses on `，` only: `需复核,备注:` uses an ASCII comma
//!   and must stay in one clause so its remark keeps its uncertainty context;
//! - `×N` counts are removed before matching and before a clause is quoted;
//! - `不符合要求/<issue>` is matched first and consumes the bare `不符合要求` trigger at the
//!   same position (one finding, one hit);
//! - a hit directly preceded by a negation prefix (无, 未见, 没有, …) is not a finding, and
//!   neither is one in question context (是否/能否/是不是 within the 6 preceding characters:
//!   wider than the original's "ends with", so `是否存在缺失` is a question too);
//! - a clause with an uncertainty phrase (or 需复核) yields no negative hits at all.

use serde::{Deserialize, Serialize};
use stageb_shared::text;

/// Substring triggers of an explicit negative finding. None contains `/` or a mission noun, so
/// the list is mission-independent; mission scoping happens through `G0` relevance.
pub const NEGATIVE_TRIGGERS: &[&str] = &[
    "未按要求",
    "错误",
    "缺失",
    "松动",
    "损坏",
    "方向不正确",
    "反向",
    "不符合要求",
    "不合格",
    "不合理",
    "未安装",
    "未配备",
];

/// The pattern-first trigger: `不符合要求/<issue>` names its own issue.
pub const PATTERN_FIRST_PREFIX: &str = "不符合要求/";

/// Phrases that make a clause "pending": not a negative, but not to be ignored either.
pub const PENDING_PHRASES: &[&str] = &["无法确认", "不能确认", "无法判断", "只显示部分", "模糊"];

/// A trigger directly preceded by one of these is negated ("无错误", "未见明显松动"). Longest
/// first is not required (we test `ends_with` for each), but kept for readability.
pub const NEGATION_PREFIXES: &[&str] = &[
    "未发现明显",
    "未见明显",
    "没有明显",
    "没有发现",
    "未发现",
    "未出现",
    "未见",
    "不存在",
    "没有",
    "无明显",
    "无",
];

/// A trigger with one of these among the 6 characters before it is a question, not a finding.
pub const QUESTION_MARKERS: &[&str] = &["是否", "能否", "是不是"];

/// How many characters before a trigger are searched for a question marker.
const QUESTION_WINDOW_CHARS: usize = 6;

/// Words that split `G0` into keywords: connectors of a checklist sentence and the generic
/// compliance words, which would otherwise make every clause relevant.
const G0_SEPARATORS: &[&str] = &[
    "至少需要检测到",
    "需要检测到",
    "不符合要求",
    "符合要求",
    "按要求",
    "检测到",
    "至少",
    "需要",
    "判断",
    "检查",
    "是否",
    "能否",
    "如果",
    "并且",
    "而且",
    "以及",
    "或者",
    "要求",
    "符合",
    "若",
    "则",
    "并",
    "且",
    "和",
    "与",
    "或",
    "还",
    "及",
];

/// One finding: which image, what matched, in which clause (normalized, counts stripped).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignalHit {
    pub image_key: String,
    pub trigger: String,
    pub clause: String,
}

/// The guardrail's evidence for one ticket, in summary order, then clause order, then position.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MissionEvidence {
    /// Negative findings about something `G0` checks: they force `fail`.
    pub relevant_hits: Vec<SignalHit>,
    /// Negative findings outside `G0`: manual-review flag only.
    pub irrelevant_hits: Vec<SignalHit>,
    /// Uncertainty phrases: manual-review flag only.
    pub pending_hits: Vec<SignalHit>,
}

impl MissionEvidence {
    pub fn is_empty(&self) -> bool {
        self.relevant_hits.is_empty()
            && self.irrelevant_hits.is_empty()
            && self.pending_hits.is_empty()
    }
}

/// Keywords of `G0`, split into `…设备` anchors and the other terms.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct G0Keywords {
    /// Lowercased, simplified `G0` text (for the "subject appears in G0" test).
    pub folded: String,
    pub anchors: Vec<String>,
    pub terms: Vec<String>,
}

impl G0Keywords {
    /// Split `G0` on punctuation and checklist connectors; keep tokens of ≥2 characters; for a
    /// token containing `安装X`, also keep `X` (a check like "BBU安装螺丝" is about 螺丝).
    pub fn from_g0(g0: &str) -> Self {
        let folded = fold_for_match(g0);
        let mut marked = folded.clone();
        for sep in G0_SEPARATORS {
            marked = marked.replace(sep, "|");
        }
        let marked: String = marked
            .chars()
            .map(|c| if is_separator_char(c) { '|' } else { c })
            .collect();
        let mut anchors = Vec::new();
        let mut terms = Vec::new();
        let mut push = |token: &str| {
            if token.chars().count() < 2 {
                return;
            }
            let list = if token.ends_with("设备") {
                &mut anchors
            } else {
                &mut terms
            };
            if !list.iter().any(|t| t == token) {
                list.push(token.to_string());
            }
        };
        for token in marked.split('|') {
            push(token);
            if let Some(pos) = token.find("安装") {
                push(&token[pos + "安装".len()..]);
            }
        }
        G0Keywords {
            folded,
            anchors,
            terms,
        }
    }

    /// Whether a clause with this subject is about something `G0` checks.
    ///
    /// Matches are the keywords found in the clause plus the subject when it appears in `G0`.
    /// Anchor rule: when `G0` has `…设备` anchors *and* other terms, matching only an anchor is
    /// not enough (every BBU clause mentions "BBU设备"; the checklist is about its parts).
    pub fn is_relevant(&self, clause: &str, subject: &str) -> bool {
        let clause = fold_for_match(clause);
        let subject = fold_for_match(subject);
        let mut anchor_match = self.anchors.iter().any(|k| clause.contains(k.as_str()));
        let mut term_match = self.terms.iter().any(|k| clause.contains(k.as_str()));
        if subject.chars().count() >= 2 && self.folded.contains(subject.as_str()) {
            if subject.ends_with("设备") {
                anchor_match = true;
            } else {
                term_match = true;
            }
        }
        term_match || (anchor_match && self.terms.is_empty())
    }
}

/// Extract the guardrail evidence from `(image key, summary)` pairs for a mission whose
/// checklist is `g0`. Pure and deterministic; hits are deduplicated on (image, trigger, clause).
///
/// An empty `g0` makes every negative irrelevant: without a checklist there is no mission scope
/// to justify forcing a verdict, but the finding still flags the ticket for review.
pub fn extract_mission_evidence(summaries: &[(String, String)], g0: &str) -> MissionEvidence {
    let keywords = G0Keywords::from_g0(g0);
    let mut evidence = MissionEvidence::default();
    for (image_key, summary) in summaries {
        for part in summary.split([';', '；', '\n']) {
            let part = text::normalize(part);
            for raw_clause in part.split('，') {
                let clause = strip_counts(raw_clause.trim());
                if clause.is_empty() {
                    continue;
                }
                scan_clause(image_key, &clause, &keywords, &mut evidence);
            }
        }
    }
    evidence
}

fn scan_clause(image_key: &str, clause: &str, keywords: &G0Keywords, out: &mut MissionEvidence) {
    let hit = |trigger: &str| SignalHit {
        image_key: image_key.to_string(),
        trigger: trigger.to_string(),
        clause: clause.to_string(),
    };
    let mut uncertain = clause.contains("需复核");
    for phrase in PENDING_PHRASES {
        if clause.contains(phrase) {
            push_unique(&mut out.pending_hits, hit(phrase));
            uncertain = true;
        }
    }
    if uncertain {
        // Soft uncertainty: "不能确认是否缺失" is not a finding of 缺失.
        return;
    }
    let negatives = negative_triggers(clause);
    if negatives.is_empty() {
        return;
    }
    let relevant = keywords.is_relevant(clause, &subject_of(clause));
    let list = if relevant {
        &mut out.relevant_hits
    } else {
        &mut out.irrelevant_hits
    };
    for trigger in negatives {
        push_unique(list, hit(&trigger));
    }
}

fn push_unique(list: &mut Vec<SignalHit>, hit: SignalHit) {
    if !list.contains(&hit) {
        list.push(hit);
    }
}

/// The negative triggers found in a clause, in position order, skipping negated and
/// questioned occurrences. `不符合要求/<issue>` wins over the bare `不符合要求` at its position.
pub fn negative_triggers(clause: &str) -> Vec<String> {
    let mut found: Vec<(usize, String)> = Vec::new();
    let mut pattern_positions = Vec::new();
    for (pos, _) in clause.match_indices(PATTERN_FIRST_PREFIX) {
        let rest = &clause[pos + PATTERN_FIRST_PREFIX.len()..];
        let issue: String = rest
            .chars()
            .take_while(|c| !is_issue_terminator(*c))
            .collect();
        if issue.is_empty() || is_suppressed(clause, pos) {
            continue;
        }
        pattern_positions.push(pos);
        found.push((pos, format!("{PATTERN_FIRST_PREFIX}{issue}")));
    }
    for trigger in NEGATIVE_TRIGGERS {
        for (pos, _) in clause.match_indices(trigger) {
            if *trigger == "不符合要求" && pattern_positions.contains(&pos) {
                continue;
            }
            if is_suppressed(clause, pos) {
                continue;
            }
            found.push((pos, (*trigger).to_string()));
        }
    }
    // Position order, then the longer trigger first at a shared position, for a stable output.
    found.sort_by(|a, b| {
        a.0.cmp(&b.0)
            .then(b.1.len().cmp(&a.1.len()))
            .then(a.1.cmp(&b.1))
    });
    let mut out: Vec<String> = Vec::new();
    for (_, trigger) in found {
        if !out.contains(&trigger) {
            out.push(trigger);
        }
    }
    out
}

/// Negated (directly after a negation prefix) or in question context.
fn is_suppressed(clause: &str, byte_pos: usize) -> bool {
    let before = &clause[..byte_pos];
    if NEGATION_PREFIXES.iter().any(|p| before.ends_with(p)) {
        return true;
    }
    let window: String = {
        let chars: Vec<char> = before.chars().collect();
        let start = chars.len().saturating_sub(QUESTION_WINDOW_CHARS);
        chars[start..].iter().collect()
    };
    QUESTION_MARKERS.iter().any(|m| window.contains(m))
}

/// Remove every `×N` object count (N ASCII or full-width digits).
pub fn strip_counts(clause: &str) -> String {
    let mut out = String::with_capacity(clause.len());
    let mut chars = clause.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '×' && chars.peek().is_some_and(|d| is_digit(*d)) {
            while chars.peek().is_some_and(|d| is_digit(*d)) {
                chars.next();
            }
            continue;
        }
        out.push(c);
    }
    out.trim().to_string()
}

/// The object a clause is about: the text before its first `/`, after dropping an
/// `image_1:` / `Image1:` / `图1:` / `1.` style prefix.
pub fn subject_of(clause: &str) -> String {
    let body = strip_item_prefix(clause);
    body.split(['/', '／'])
        .next()
        .unwrap_or("")
        .trim()
        .to_string()
}

fn strip_item_prefix(clause: &str) -> &str {
    let trimmed = clause.trim_start();
    let lower = trimmed.to_lowercase();
    // Only ASCII is lowercased in the prefixes we look for, so byte offsets line up.
    let label_len = ["image_", "image", "图片", "图"]
        .iter()
        .find(|p| lower.starts_with(*p) && trimmed.is_char_boundary(p.len()))
        .map_or(0, |p| p.len());
    let after_label = &trimmed[label_len..];
    let digits = after_label
        .chars()
        .take_while(|c| is_digit(*c))
        .map(char::len_utf8)
        .sum::<usize>();
    if digits == 0 {
        return trimmed;
    }
    let rest = &after_label[digits..];
    match rest.chars().next() {
        Some(c @ (':' | '：' | '.' | '、' | ')' | '）')) => rest[c.len_utf8()..].trim_start(),
        _ => trimmed,
    }
}

fn is_digit(c: char) -> bool {
    c.is_ascii_digit() || ('０'..='９').contains(&c)
}

fn is_issue_terminator(c: char) -> bool {
    c.is_whitespace() || matches!(c, ',' | '，' | ';' | '；' | '。' | '/' | '／' | '×')
}

fn is_separator_char(c: char) -> bool {
    c.is_whitespace()
        || c.is_ascii_punctuation()
        || matches!(
            c,
            '，' | '。'
                | '、'
                | '；'
                | '：'
                | '！'
                | '？'
                | '（'
                | '）'
                | '【'
                | '】'
                | '「'
                | '」'
                | '“'
                | '”'
                | '‘'
                | '’'
                | '《'
                | '》'
                | '／'
                | '…'
                | '—'
        )
}

/// Simplified, lowercase, whitespace-free: the form keywords and clauses are compared in.
fn fold_for_match(s: &str) -> String {
    text::to_simplified(s)
        .chars()
        .flat_map(char::to_lowercase)
        .filter(|c| !c.is_whitespace())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const G0_FIBER: &str = "至少需要检测到光纤，判断光纤是否按要求布放";
    const G0_BBU: &str = "BBU设备，BBU安装螺丝";

    fn one(summary: &str) -> Vec<(String, String)> {
        vec![("image_1".to_string(), summary.to_string())]
    }

    #[test]
    fn triggers_are_mission_independent() {
        let nouns = [
            "BBU",
            "挡风板",
            "接地线",
            "光纤",
            "螺丝",
            "标签",
            "机柜",
            "地排",
        ];
        for t in NEGATIVE_TRIGGERS {
            assert!(!t.contains('/'), "{t}");
            assert!(nouns.iter().all(|n| !t.contains(n)), "{t}");
        }
    }

    #[test]
    fn missing_fiber_is_a_relevant_hit_under_a_fiber_checklist() {
        let ev = extract_mission_evidence(&one("光纤/缺失×1"), G0_FIBER);
        assert_eq!(
            ev.relevant_hits,
            vec![SignalHit {
                image_key: "image_1".into(),
                trigger: "缺失".into(),
                clause: "光纤/缺失".into()
            }]
        );
        assert!(ev.irrelevant_hits.is_empty() && ev.pending_hits.is_empty());
    }

    #[test]
    fn negated_trigger_is_not_a_hit() {
        let ev = extract_mission_evidence(&one("光纤/无错误×1"), G0_FIBER);
        assert!(ev.is_empty(), "{ev:?}");
        let ev = extract_mission_evidence(&one("光纤/未见明显松动，螺丝/没有损坏"), G0_FIBER);
        assert!(ev.is_empty(), "{ev:?}");
    }

    #[test]
    fn question_context_is_not_a_hit() {
        let ev = extract_mission_evidence(&one("光纤/需检查是否缺失"), G0_FIBER);
        assert!(ev.is_empty(), "{ev:?}");
        let ev = extract_mission_evidence(&one("光纤/是否存在缺失"), G0_FIBER);
        assert!(ev.is_empty(), "{ev:?}");
    }

    #[test]
    fn pattern_first_hit_names_the_issue_and_replaces_the_bare_trigger() {
        let ev = extract_mission_evidence(&one("光纤/不符合要求/未来新增问题描述×1"), G0_FIBER);
        assert_eq!(ev.relevant_hits.len(), 1, "{ev:?}");
        assert_eq!(ev.relevant_hits[0].trigger, "不符合要求/未来新增问题描述");
        assert_eq!(
            ev.relevant_hits[0].clause,
            "光纤/不符合要求/未来新增问题描述"
        );
    }

    #[test]
    fn same_summary_is_relevant_or_irrelevant_depending_on_g0() {
        let s = one("光纤/缺失×1");
        let fiber = extract_mission_evidence(&s, G0_FIBER);
        let bbu = extract_mission_evidence(&s, G0_BBU);
        assert_eq!(fiber.relevant_hits.len(), 1);
        assert!(fiber.irrelevant_hits.is_empty());
        assert!(bbu.relevant_hits.is_empty());
        assert_eq!(bbu.irrelevant_hits.len(), 1);
    }

    #[test]
    fn soft_uncertainty_suppresses_negatives_and_is_pending() {
        let ev = extract_mission_evidence(
            &one("光纤/需复核,备注:无法看清，不能确认是否缺失×1"),
            G0_FIBER,
        );
        assert!(
            ev.relevant_hits.is_empty() && ev.irrelevant_hits.is_empty(),
            "{ev:?}"
        );
        assert_eq!(ev.pending_hits.len(), 1);
        assert_eq!(ev.pending_hits[0].trigger, "不能确认");
        let ev = extract_mission_evidence(&one("光纤/需复核,备注:不能确认是否缺失×1"), G0_FIBER);
        assert!(
            ev.relevant_hits.is_empty() && ev.irrelevant_hits.is_empty(),
            "{ev:?}"
        );
    }

    #[test]
    fn anchor_only_match_is_irrelevant_when_g0_has_other_terms() {
        let ev = extract_mission_evidence(&one("BBU设备/未按要求配备挡风板"), G0_BBU);
        assert!(ev.relevant_hits.is_empty(), "{ev:?}");
        assert_eq!(ev.irrelevant_hits.len(), 1);
        assert_eq!(ev.irrelevant_hits[0].trigger, "未按要求");
        // A clause about the checked part is relevant.
        let ev = extract_mission_evidence(&one("BBU安装螺丝/松动×2"), G0_BBU);
        assert_eq!(ev.relevant_hits.len(), 1, "{ev:?}");
        let ev = extract_mission_evidence(&one("螺丝/松动×2"), G0_BBU);
        assert_eq!(ev.relevant_hits.len(), 1, "{ev:?}");
    }

    #[test]
    fn anchor_only_g0_accepts_anchor_matches() {
        let ev = extract_mission_evidence(&one("BBU设备/损坏"), "BBU设备");
        assert_eq!(ev.relevant_hits.len(), 1, "{ev:?}");
    }

    #[test]
    fn regression_b1_splits_on_newline_and_semicolons_not_on_letter_n() {
        // The original split on the letter "n"; "Unknown" would have been cut into pieces.
        let ev = extract_mission_evidence(
            &one("光纤/Unknown brand\n光纤/缺失×1；螺丝/松动;标签/损坏"),
            G0_FIBER,
        );
        let clauses: Vec<&str> = ev.relevant_hits.iter().map(|h| h.clause.as_str()).collect();
        assert_eq!(clauses, vec!["光纤/缺失"]);
        let irrelevant: Vec<&str> = ev
            .irrelevant_hits
            .iter()
            .map(|h| h.clause.as_str())
            .collect();
        assert_eq!(irrelevant, vec!["螺丝/松动", "标签/损坏"]);
    }

    #[test]
    fn regression_b1_counts_are_stripped() {
        assert_eq!(strip_counts("光纤/缺失×12"), "光纤/缺失");
        assert_eq!(strip_counts("螺丝×3/符合要求×１"), "螺丝/符合要求");
        assert_eq!(strip_counts("尺寸3×"), "尺寸3×");
    }

    #[test]
    fn traditional_characters_are_normalized_before_matching() {
        let ev = extract_mission_evidence(&one("光纖/缺失×1"), G0_FIBER);
        assert_eq!(ev.relevant_hits.len(), 1, "{ev:?}");
        assert_eq!(ev.relevant_hits[0].clause, "光纤/缺失");
    }

    #[test]
    fn no_negatives_means_no_hits() {
        let ev =
            extract_mission_evidence(&one("光纤/显示完整/符合要求×2，螺丝/符合要求×3"), G0_FIBER);
        assert!(ev.is_empty(), "{ev:?}");
    }

    #[test]
    fn hits_are_deduplicated_and_ordered_by_position() {
        let ev = extract_mission_evidence(
            &[
                ("image_1".into(), "光纤/松动，光纤/缺失".into()),
                ("image_2".into(), "光纤/缺失".into()),
            ],
            G0_FIBER,
        );
        let got: Vec<(&str, &str)> = ev
            .relevant_hits
            .iter()
            .map(|h| (h.image_key.as_str(), h.trigger.as_str()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("image_1", "松动"),
                ("image_1", "缺失"),
                ("image_2", "缺失")
            ]
        );
        let ev = extract_mission_evidence(&one("光纤/缺失，光纤/缺失"), G0_FIBER);
        assert_eq!(ev.relevant_hits.len(), 1);
    }

    #[test]
    fn subject_ignores_item_prefixes() {
        assert_eq!(subject_of("image_1: 光纤/缺失"), "光纤");
        assert_eq!(subject_of("Image2：螺丝/松动"), "螺丝");
        assert_eq!(subject_of("1. 标签/可以识别"), "标签");
        assert_eq!(subject_of("光纤"), "光纤");
    }

    #[test]
    fn g0_keywords_drop_connectors_and_compliance_words() {
        let k = G0Keywords::from_g0("至少需要检测到挡风板，判断挡风板是否按要求安装方向正确");
        assert!(k.terms.contains(&"挡风板".to_string()), "{k:?}");
        assert!(!k.terms.iter().any(|t| t == "要求" || t == "符合"), "{k:?}");
        let k = G0Keywords::from_g0(G0_BBU);
        assert_eq!(k.anchors, vec!["bbu设备".to_string()]);
        assert!(k.terms.contains(&"螺丝".to_string()), "{k:?}");
    }

    #[test]
    fn empty_g0_makes_negatives_irrelevant() {
        let ev = extract_mission_evidence(&one("光纤/缺失"), "");
        assert!(ev.relevant_hits.is_empty());
        assert_eq!(ev.irrelevant_hits.len(), 1);
    }
}
