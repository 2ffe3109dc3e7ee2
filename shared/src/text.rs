//! Chinese text normalization and the canonical third-state vocabulary.
//!
//! Third-state wording (需复核, 待定, 证据不足, need-review, …) must never survive into a verdict,
//! a selected reason or a guidance rule. The Python original had three inconsistent lists and a
//! case-sensitive, traditional-character-blind check ("Need-Review" and "需複核" slipped
//! through). Here there is one list per layer, chosen on purpose, and every check runs on the
//! *folded* form: traditional→simplified (character by character, context-free, so the
//! constrained decoder can invert it exactly), lowercase, and with whitespace, `-` and `_`
//! removed.

use std::collections::BTreeSet;
use std::sync::OnceLock;

/// Banned in rollout reasons and in the final selected reason (folded forms). `复核` covers
/// 需复核, 需要复核, 需人工复核, 人工复核, 待复核 and 通过但需复核.
pub const THIRD_STATE_ROLLOUT: &[&str] = &["复核", "待定", "证据不足", "needreview", "needsreview"];

/// Banned in guidance rule text and op rationales (folded forms): the rollout list plus the
/// hedging phrases that turned rules into third-state instructions in the original.
pub const THIRD_STATE_REFLECTION: &[&str] = &[
    "复核",
    "待定",
    "证据不足",
    "needreview",
    "needsreview",
    "不应直接",
    "不建议直接",
    "不得直接",
    "佐证",
    "需进一步",
    "需要进一步",
    "进一步确认",
    "不写不通过",
    "不应判定为",
    "不应判断为",
    "不应判为",
    "不建议判定为",
    "不建议判断为",
    "不建议判为",
    "不要判定为",
    "不要判断为",
    "不得判定为",
    "不得判断为",
];

/// At most `max` characters of `s`, with `…` when something was cut (for prompts and logs
/// that must stay bounded whatever a model wrote).
pub fn truncate_chars(s: &str, max: usize) -> std::borrow::Cow<'_, str> {
    match s.char_indices().nth(max) {
        None => std::borrow::Cow::Borrowed(s),
        Some((cut, _)) => std::borrow::Cow::Owned(format!("{}…", &s[..cut])),
    }
}

/// Traditional→simplified for one character, ignoring context. Context-free on purpose: the
/// constrained decoder bans every character whose simplification lands in a banned word, which
/// is only exact if the parser simplifies the same way.
pub fn simplify_char(c: char) -> char {
    if c.len_utf8() != 3 {
        return c;
    }
    let mut buf = [0u8; 4];
    fast2s::convert(c.encode_utf8(&mut buf))
        .chars()
        .next()
        .unwrap_or(c)
}

/// Traditional→simplified, character by character.
pub fn to_simplified(s: &str) -> String {
    s.chars().map(simplify_char).collect()
}

/// CJK ideographs and CJK/full-width punctuation: characters between which a space is noise.
pub fn is_cjk(c: char) -> bool {
    matches!(c as u32,
        0x3000..=0x303F | 0x3400..=0x4DBF | 0x4E00..=0x9FFF | 0xF900..=0xFAFF | 0xFF00..=0xFFEF)
}

/// Collapse whitespace runs to one space, drop spaces between two CJK characters (or CJK
/// punctuation), and trim.
pub fn normalize_spaces(s: &str) -> String {
    let collapsed: Vec<char> = {
        let mut out = Vec::with_capacity(s.len());
        let mut in_space = false;
        for c in s.chars() {
            if c.is_whitespace() {
                if !in_space {
                    out.push(' ');
                }
                in_space = true;
            } else {
                out.push(c);
                in_space = false;
            }
        }
        out
    };
    let mut out = String::with_capacity(s.len());
    for (i, &c) in collapsed.iter().enumerate() {
        if c == ' ' {
            let prev = i.checked_sub(1).map(|j| collapsed[j]);
            let next = collapsed.get(i + 1).copied();
            if matches!((prev, next), (Some(p), Some(n)) if is_cjk(p) && is_cjk(n)) {
                continue;
            }
        }
        out.push(c);
    }
    out.trim().to_string()
}

/// Simplified and space-normalized: the form stored where the original stored normalized text.
pub fn normalize(s: &str) -> String {
    normalize_spaces(&to_simplified(s))
}

/// Full-width ASCII forms (`Ｎ`, `－`, `＿`) as their ASCII letters, so `ＮＥＥＤ－ＲＥＶＩＥＷ`
/// folds like `need-review`. The ideographic space is already whitespace.
pub fn halfwidth_char(c: char) -> char {
    match c as u32 {
        0xFF01..=0xFF5E => char::from_u32(c as u32 - 0xFF01 + 0x21).unwrap_or(c),
        _ => c,
    }
}

/// The matching form: full-width ASCII narrowed, simplified, lowercase, without whitespace, `-`
/// or `_`.
pub fn fold(s: &str) -> String {
    s.chars()
        .map(halfwidth_char)
        .map(simplify_char)
        .flat_map(char::to_lowercase)
        .filter(|c| !c.is_whitespace() && *c != '-' && *c != '_')
        .collect()
}

/// The first banned phrase of `list` found in `text` (after folding), if any.
pub fn find_third_state(text: &str, list: &'static [&'static str]) -> Option<&'static str> {
    let folded = fold(text);
    list.iter().copied().find(|w| folded.contains(w))
}

/// Every character whose [`simplify_char`] is `c` (including `c` itself), sorted. Used to
/// build decoding constraints that are exactly as strict as the parser.
pub fn traditional_variants(c: char) -> Vec<char> {
    static INVERSE: OnceLock<std::collections::HashMap<char, BTreeSet<char>>> = OnceLock::new();
    let inverse = INVERSE.get_or_init(|| {
        let mut map: std::collections::HashMap<char, BTreeSet<char>> =
            std::collections::HashMap::new();
        for range in [0x3400u32..=0x4DBF, 0x4E00..=0x9FFF, 0xF900..=0xFAFF] {
            for cp in range {
                if let Some(t) = char::from_u32(cp) {
                    let s = simplify_char(t);
                    if s != t {
                        map.entry(s).or_default().insert(t);
                    }
                }
            }
        }
        map
    });
    let mut out: BTreeSet<char> = inverse.get(&c).cloned().unwrap_or_default();
    out.insert(c);
    out.into_iter().collect()
}

/// Stage-A markers of undecided state, removed from summaries (longest first so a longer
/// phrase is never half-removed).
const SUMMARY_THIRD_STATE_MARKERS: &[&str] = &["需人工复核", "需要复核", "待复核", "需复核"];

/// Sanitize one Stage-A summary for a model prompt (rollouts and reflection alike): normalized,
/// and Stage-A's own third-state markers removed so the model is never shown the words it
/// must not write.
pub fn sanitize_summary(summary: &str) -> String {
    let mut s = normalize(summary);
    for sep in [
        "需复核,备注:",
        "需复核，备注:",
        "需复核,备注：",
        "需复核，备注：",
    ] {
        s = s.replace(sep, "备注:");
    }
    for marker in SUMMARY_THIRD_STATE_MARKERS {
        s = s.replace(marker, "");
    }
    normalize_spaces(&s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traditional_and_case_variants_are_caught() {
        // Regression for the original's B11: case-sensitive, traditional-blind checks.
        assert_eq!(
            find_third_state("需複核", THIRD_STATE_ROLLOUT),
            Some("复核")
        );
        assert_eq!(
            find_third_state("結論：Need-Review", THIRD_STATE_ROLLOUT),
            Some("needreview")
        );
        assert_eq!(
            find_third_state("needs_review later", THIRD_STATE_ROLLOUT),
            Some("needsreview")
        );
        assert_eq!(
            find_third_state("證據不足", THIRD_STATE_ROLLOUT),
            Some("证据不足")
        );
        assert_eq!(
            find_third_state("挡风板安装正确", THIRD_STATE_ROLLOUT),
            None
        );
    }

    #[test]
    fn spaces_between_cjk_are_dropped_but_not_between_words() {
        assert_eq!(
            normalize_spaces("  挡 风板  安装 ， ok  fine "),
            "挡风板安装， ok fine"
        );
        assert_eq!(normalize("擋風板"), "挡风板");
    }

    #[test]
    fn inverse_simplification_covers_known_variants() {
        let v = traditional_variants('复');
        assert!(v.contains(&'复') && v.contains(&'複'), "{v:?}");
        assert!(traditional_variants('证').contains(&'證'));
        assert_eq!(traditional_variants('a'), vec!['a']);
    }

    #[test]
    fn third_state_markers_never_reach_the_prompt() {
        let s = sanitize_summary("挡风板/显示完整,需复核,备注: 角度不清×1，需複核");
        assert!(!s.contains("复核") && !s.contains("複核"), "{s}");
        assert!(s.contains("备注:"), "{s}");
    }
}
