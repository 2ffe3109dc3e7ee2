//! The two-line contract as an llguidance Lark grammar, exactly as strict as
//! `stageb_shared::contract::parse` (together with the reason-length cap of
//! [`super::reason_cap`]).
//!
//! ```text
//! start: CONTRACT
//! CONTRACT: "Verdict: " ("通过" | "不通过") "\nReason: " REASON
//! REASON: /[^\n\r]*[^<ws>\n\r][^\n\r]*/ & ~/(?s:.*)(<banned>)(?s:.*)/
//! ```
//!
//! then end-of-sequence. The reason is one line, not whitespace only (`char::is_whitespace`,
//! what the parser's `trim` removes), and does not contain a `THIRD_STATE_ROLLOUT` word *after
//! folding*. Its length cap (1..=max characters) is enforced by [`super::reason_cap`] on top of
//! this grammar; see there for why it is not a `{1,max}` here.
//!
//! # Why the banned-word regex is exact
//!
//! `text::fold` is a per-character homomorphism: `fold(s)` is the concatenation of `fold(c)`
//! for each char (simplify one char, `char::to_lowercase`, drop whitespace/`-`/`_`). So a text
//! contains banned word `t1 t2 … tn` after folding iff it contains
//! `C(t1) S* C(t2) S* … S* C(tn)`, where `C(t)` is every char whose fold is exactly `t` and `S`
//! every char whose fold is empty. Both classes are computed by running `text::fold` itself
//! over every Unicode scalar value, so traditional variants (複), ASCII case (N), and oddities
//! like the Kelvin sign (K → k) are included by construction, not by a hand list. Chars whose
//! fold is longer than one char (only `İ` → `i̇` today) could break that picture; the builder
//! checks that none of them can overlap a banned word and refuses to build otherwise.
//!
//! llguidance's regex engine (derivre) supports `&` and `~` in Lark terminals and builds the
//! intersection/complement lazily, so the banned-word exclusion needs no hand-written
//! automaton.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::sync::OnceLock;

use stageb_shared::text;

use super::ConstraintError;

/// Characters grouped by their fold, for the characters that matter to a banned-word list.
struct FoldTable {
    /// Every char whose fold is empty (whitespace, `-`, `_`).
    separators: Vec<char>,
    /// For each single-char fold value, the chars folding to it.
    by_fold: BTreeMap<char, Vec<char>>,
    /// Chars whose fold has more than one char, with that fold.
    multi: Vec<(char, String)>,
}

fn fold_table() -> &'static FoldTable {
    static TABLE: OnceLock<FoldTable> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut separators = Vec::new();
        let mut by_fold: BTreeMap<char, Vec<char>> = BTreeMap::new();
        let mut multi = Vec::new();
        let mut buf = [0u8; 4];
        for c in (0..=0x10FFFFu32).filter_map(char::from_u32) {
            let f = text::fold(c.encode_utf8(&mut buf));
            let mut it = f.chars();
            match (it.next(), it.next()) {
                (None, _) => separators.push(c),
                (Some(t), None) => by_fold.entry(t).or_default().push(c),
                (Some(_), Some(_)) => multi.push((c, f)),
            }
        }
        FoldTable {
            separators,
            by_fold,
            multi,
        }
    })
}

/// `[…]` matching exactly `chars` (every member escaped, so any char is safe).
fn class(chars: &[char]) -> String {
    let mut s = String::from("[");
    for c in chars {
        write!(s, "\\x{{{:X}}}", *c as u32).unwrap();
    }
    s.push(']');
    s
}

/// `[^…]` matching every char but `chars`.
fn negated_class(chars: &[char]) -> String {
    let mut s = class(chars);
    s.insert(1, '^');
    s
}

/// True if `fold` (a multi-char fold of one input char) could take part in an occurrence of
/// `word` in a folded text: as a substring of it, or overlapping its start or end.
fn overlaps(fold: &str, word: &str) -> bool {
    let f: Vec<char> = fold.chars().collect();
    let w: Vec<char> = word.chars().collect();
    if word.contains(fold) {
        return true;
    }
    // A proper suffix of f is a prefix of w, or a proper prefix of f is a suffix of w.
    (1..f.len()).any(|k| w.starts_with(&f[k..]) || w.ends_with(&f[..k]))
}

/// Regex (no anchors) matching any text whose fold contains one of `words` (folded forms).
pub(crate) fn banned_regex(words: &[&str]) -> Result<String, ConstraintError> {
    let table = fold_table();
    let sep = format!("{}*", class(&table.separators));
    let mut alternatives = Vec::new();
    for w in words {
        if text::fold(w) != *w || w.is_empty() {
            return Err(ConstraintError::Build(format!(
                "banned word {w:?} is not in folded form"
            )));
        }
        if let Some((c, f)) = table.multi.iter().find(|(_, f)| overlaps(f, w)) {
            return Err(ConstraintError::Build(format!(
                "char U+{:04X} folds to {f:?}, which can overlap banned word {w:?}; the \
                 character-class construction would be inexact",
                *c as u32
            )));
        }
        let parts = w
            .chars()
            .map(|t| match table.by_fold.get(&t) {
                Some(chars) => Ok(class(chars)),
                None => Err(ConstraintError::Build(format!(
                    "no char folds to {t:?} in {w:?}"
                ))),
            })
            .collect::<Result<Vec<String>, _>>()?;
        alternatives.push(parts.join(&sep));
    }
    Ok(format!("(?:{})", alternatives.join("|")))
}

/// The Lark grammar of the contract *without* the length cap (see [`super::reason_cap`] for why
/// the cap is applied outside llguidance).
pub(crate) fn contract_lark() -> Result<String, ConstraintError> {
    static GRAMMAR: OnceLock<Result<String, String>> = OnceLock::new();
    GRAMMAR
        .get_or_init(|| {
            let mut ws_or_newline: BTreeSet<char> = (0..=0x10FFFFu32)
                .filter_map(char::from_u32)
                .filter(|c| c.is_whitespace())
                .collect();
            ws_or_newline.extend(['\n', '\r']);
            let not_ws = negated_class(&ws_or_newline.into_iter().collect::<Vec<_>>());
            let banned = banned_regex(text::THIRD_STATE_ROLLOUT).map_err(|e| e.to_string())?;
            Ok(format!(
                r#"start: CONTRACT
CONTRACT: "Verdict: " ("通过" | "不通过") "\nReason: " REASON
REASON: /[^\n\r]*{not_ws}[^\n\r]*/ & ~/(?s:.*){banned}(?s:.*)/
"#
            ))
        })
        .clone()
        .map_err(ConstraintError::Build)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fold_classes_include_variants_found_by_fold_itself() {
        let t = fold_table();
        assert!(t.by_fold[&'复'].contains(&'複'));
        assert!(
            t.by_fold[&'k'].contains(&'\u{212A}'),
            "Kelvin sign folds to k"
        );
        assert!(t.by_fold[&'n'].contains(&'N'));
        for c in [' ', '\t', '\u{3000}', '-', '_', '\u{00A0}'] {
            assert!(t.separators.contains(&c), "{c:?} folds to nothing");
        }
        assert!(
            !t.separators.contains(&'，'),
            "punctuation is not a separator"
        );
    }

    #[test]
    fn multi_char_folds_cannot_touch_the_rollout_list() {
        // Regression guard: if text::fold or Unicode changes, the exactness argument above
        // must be revisited (banned_regex refuses to build).
        assert!(banned_regex(text::THIRD_STATE_ROLLOUT).is_ok());
        assert!(overlaps("i\u{307}", "xi"), "a fold ending a word overlaps");
        assert!(!overlaps("i\u{307}", "review"));
    }
}
