//! The rule language of the scripted engine and reflector: learned rules are natural-language
//! Chinese that the ops validator accepts (no object chains, no `/`, no `×`, no third-state
//! words, ≤160 characters). The scripted reflector writes two forms and the scripted engine
//! reads exactly these two (any other rule, such as the seed `G1`, is ignored):
//! - presence: `若摘要出现“A”或“B”则判不通过；否则按其他规则判定` fails a ticket when any
//!   summary contains any quoted phrase;
//! - absence: `若所有摘要均未出现“A”则判不通过；否则按其他规则判定` fails a ticket when no
//!   summary contains the phrase.
//!
//! A ticket that no rule fails passes.

/// A learned rule the scripted engine understands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rule {
    /// Fail when any summary contains any of the phrases.
    Present(Vec<String>),
    /// Fail when no summary contains the phrase.
    Absent(String),
}

impl Rule {
    /// Parse a guidance text; `None` for anything outside the language.
    pub fn parse(text: &str) -> Option<Rule> {
        if !text.contains("则判不通过") {
            return None;
        }
        let quoted = quoted_phrases(text);
        if quoted.is_empty() {
            return None;
        }
        if text.contains("均未出现") {
            Some(Rule::Absent(quoted[0].clone()))
        } else if text.contains("出现") {
            Some(Rule::Present(quoted))
        } else {
            None
        }
    }

    /// The rule as guidance text.
    pub fn render(&self) -> String {
        match self {
            Rule::Present(phrases) => {
                let list: Vec<String> = phrases.iter().map(|p| format!("“{p}”")).collect();
                format!(
                    "若摘要出现{}则判不通过；否则按其他规则判定",
                    list.join("或")
                )
            }
            Rule::Absent(p) => {
                format!("若所有摘要均未出现“{p}”则判不通过；否则按其他规则判定")
            }
        }
    }

    /// Does the rule fail a ticket with these summaries?
    pub fn fires(&self, summaries: &[String]) -> bool {
        match self {
            Rule::Present(phrases) => phrases
                .iter()
                .any(|p| summaries.iter().any(|s| s.contains(p.as_str()))),
            Rule::Absent(p) => !summaries.iter().any(|s| s.contains(p.as_str())),
        }
    }
}

fn quoted_phrases(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find('“') {
        let after = &rest[start + '“'.len_utf8()..];
        let Some(end) = after.find('”') else { break };
        let phrase = after[..end].trim();
        if !phrase.is_empty() {
            out.push(phrase.to_string());
        }
        rest = &after[end + '”'.len_utf8()..];
    }
    out
}

/// `[K]. text` lines → `(K, text)`.
pub(super) fn rule_line(line: &str) -> Option<(String, String)> {
    let rest = line.trim().strip_prefix('[')?;
    let (key, text) = rest.split_once("]. ")?;
    Some((key.to_string(), text.to_string()))
}

/// The first learned rule (in prompt order) that fails a ticket with these summaries.
pub(super) fn firing_rule<'a>(
    rules: &'a [(String, String)],
    summaries: &[String],
) -> Option<&'a str> {
    rules
        .iter()
        .filter(|(k, _)| k.starts_with('G'))
        .find(|(_, t)| Rule::parse(t).is_some_and(|r| r.fires(summaries)))
        .map(|(k, _)| k.as_str())
}
