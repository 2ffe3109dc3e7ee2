//! The strict two-line rollout contract: the parser every candidate passes on rank 0.
//!
//! A candidate is exactly
//!
//! ```text
//! Verdict: 通过|不通过
//! Reason: <one line>
//! ```
//!
//! The constrained decoder (the `stageb-constraint` crate) generates this language by
//! construction; this parser is still the rubric of record, because constraints can be off
//! (unsupported tokenizer, `constrained: false`) and because rank 0 never trusts worker output.
//! A violation is reported with a stable [`ViolationCode`] and the candidate is dropped from
//! the vote (`failure_malformed.jsonl`). Nothing is ever "salvaged": the original repaired
//! malformed answers into verdicts, which hid the model's failures.
//!
//! # Decisions (the language, exactly)
//!
//! - **Trailing whitespace at the very end is ignored** (`str::trim_end`): models often emit a
//!   final newline before EOS and it carries no meaning. It is the only tolerance.
//! - **No leading whitespace** (`LEADING_WHITESPACE`), **no `\r` anywhere**
//!   (`CARRIAGE_RETURN`): CRLF or a leading blank line means the model is not following the
//!   format; the original tolerated both and that tolerance is what let echoes through.
//! - **Exactly two lines** separated by one `\n` (`LINE_COUNT`): a blank line between them, a
//!   third line (echo, "assistant" turn, code fence) or a missing reason line is malformed. The
//!   original dropped blank lines and stripped each line; we do not.
//! - **Line 1 is byte-exact** `Verdict: 通过` or `Verdict: 不通过`. A different prefix (lowercase,
//!   full-width colon, no space, leading "assistant") is `VERDICT_PREFIX`; anything else after
//!   the prefix (English `pass`, `需复核`, `通过。`, trailing spaces) is `VERDICT_VALUE`. The
//!   verdict is a closed set, so a third-state verdict is a value error, not `THIRD_STATE`.
//! - **Line 2 starts with** `Reason: ` (ASCII colon, one space; `REASON_PREFIX`). A line that
//!   is exactly `Reason:` (its space eaten by the trailing-whitespace rule) or whose reason is
//!   whitespace only is `REASON_EMPTY`.
//! - **Length cap** [`MAX_REASON_CHARS`] counts `char`s of the reason *as written* (after
//!   `Reason: `, before trimming its own leading whitespace): the constrained decoder caps the
//!   same thing, so the two agree on every output without trailing whitespace.
//! - **No third-state word** from [`text::THIRD_STATE_ROLLOUT`] in the reason after
//!   [`text::fold`] (traditional→simplified, lowercase, whitespace/`-`/`_` removed):
//!   "需複核", "Need-Review", "need review", "needs_review" are all `THIRD_STATE`. Only the
//!   reason is checked: the fixed first line and prefixes cannot contain one.
//! - "assistant" inside a reason is ordinary text (regression for the original's stop-string
//!   bug B6, which truncated it).
//! - The returned reason is trimmed; the raw text is kept by the caller for auditing.
//!
//! Checks run in the order above and the first failure is reported, so a given text always
//! gets the same code.

use serde::Serialize;

use crate::domain::Verdict;
use crate::text;

/// Cap on the reason's length in characters (the reason as written, see the module docs).
pub const MAX_REASON_CHARS: usize = 240;

/// The fixed start of line 1.
pub const VERDICT_PREFIX: &str = "Verdict: ";
/// The fixed start of line 2.
pub const REASON_PREFIX: &str = "Reason: ";

/// A candidate that satisfies the contract.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ParsedCandidate {
    pub verdict: Verdict,
    /// The reason, trimmed.
    pub reason: String,
}

/// Why a text is not a valid candidate. Codes are stable: they are written to
/// `failure_malformed.jsonl` and counted in metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ViolationCode {
    /// Nothing but whitespace.
    Empty,
    /// The text starts with whitespace (a leading space or blank line).
    LeadingWhitespace,
    /// A `\r` before the trailing whitespace (CRLF line ends, stray carriage return).
    CarriageReturn,
    /// Not exactly two `\n`-separated lines.
    LineCount,
    /// Line 1 does not start with `Verdict: `.
    VerdictPrefix,
    /// Line 1 is not exactly `Verdict: 通过` or `Verdict: 不通过`.
    VerdictValue,
    /// Line 2 does not start with `Reason: `.
    ReasonPrefix,
    /// The reason is empty or whitespace only.
    ReasonEmpty,
    /// The reason is longer than [`MAX_REASON_CHARS`] characters.
    ReasonTooLong,
    /// The reason contains a third-state word after folding.
    ThirdState,
}

impl ViolationCode {
    /// The stable string code.
    pub fn code(self) -> &'static str {
        match self {
            ViolationCode::Empty => "EMPTY",
            ViolationCode::LeadingWhitespace => "LEADING_WHITESPACE",
            ViolationCode::CarriageReturn => "CARRIAGE_RETURN",
            ViolationCode::LineCount => "LINE_COUNT",
            ViolationCode::VerdictPrefix => "VERDICT_PREFIX",
            ViolationCode::VerdictValue => "VERDICT_VALUE",
            ViolationCode::ReasonPrefix => "REASON_PREFIX",
            ViolationCode::ReasonEmpty => "REASON_EMPTY",
            ViolationCode::ReasonTooLong => "REASON_TOO_LONG",
            ViolationCode::ThirdState => "THIRD_STATE",
        }
    }

    /// Every code, in check order.
    pub const ALL: [ViolationCode; 10] = [
        ViolationCode::Empty,
        ViolationCode::LeadingWhitespace,
        ViolationCode::CarriageReturn,
        ViolationCode::LineCount,
        ViolationCode::VerdictPrefix,
        ViolationCode::VerdictValue,
        ViolationCode::ReasonPrefix,
        ViolationCode::ReasonEmpty,
        ViolationCode::ReasonTooLong,
        ViolationCode::ThirdState,
    ];

    /// The code for a stable string, if it is one.
    pub fn from_code(code: &str) -> Option<ViolationCode> {
        Self::ALL.into_iter().find(|c| c.code() == code)
    }
}

impl std::fmt::Display for ViolationCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.code())
    }
}

/// A contract violation: the code plus a human-readable detail (never the whole text, which
/// the caller logs separately).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, thiserror::Error)]
#[error("two-line contract violated ({code}): {detail}")]
pub struct ContractViolation {
    pub code: ViolationCode,
    pub detail: String,
}

impl ContractViolation {
    fn new(code: ViolationCode, detail: impl Into<String>) -> Self {
        ContractViolation {
            code,
            detail: detail.into(),
        }
    }
}

/// Parse a candidate under the strict two-line contract (see the module docs for the exact
/// language). Pure, total and panic-free on any input.
pub fn parse(text: &str) -> Result<ParsedCandidate, ContractViolation> {
    use ViolationCode as C;

    let body = text.trim_end();
    if body.is_empty() {
        return Err(ContractViolation::new(C::Empty, "no text"));
    }
    if body.starts_with(char::is_whitespace) {
        return Err(ContractViolation::new(
            C::LeadingWhitespace,
            "text starts with whitespace",
        ));
    }
    if let Some(pos) = body.find('\r') {
        return Err(ContractViolation::new(
            C::CarriageReturn,
            format!("carriage return at byte {pos}; lines end with \\n only"),
        ));
    }
    let lines: Vec<&str> = body.split('\n').collect();
    if lines.len() != 2 {
        return Err(ContractViolation::new(
            C::LineCount,
            format!("expected exactly 2 lines, found {}", lines.len()),
        ));
    }
    let (line1, line2) = (lines[0], lines[1]);

    let Some(value) = line1.strip_prefix(VERDICT_PREFIX) else {
        return Err(ContractViolation::new(
            C::VerdictPrefix,
            format!(
                "line 1 must start with {VERDICT_PREFIX:?}, got {:?}",
                excerpt(line1)
            ),
        ));
    };
    let verdict = match value {
        "通过" => Verdict::Pass,
        "不通过" => Verdict::Fail,
        other => {
            return Err(ContractViolation::new(
                C::VerdictValue,
                format!("verdict must be 通过 or 不通过, got {:?}", excerpt(other)),
            ));
        }
    };

    if line2 == REASON_PREFIX.trim_end() {
        return Err(ContractViolation::new(C::ReasonEmpty, "reason is empty"));
    }
    let Some(raw_reason) = line2.strip_prefix(REASON_PREFIX) else {
        return Err(ContractViolation::new(
            C::ReasonPrefix,
            format!(
                "line 2 must start with {REASON_PREFIX:?}, got {:?}",
                excerpt(line2)
            ),
        ));
    };
    let reason = raw_reason.trim();
    if reason.is_empty() {
        return Err(ContractViolation::new(
            C::ReasonEmpty,
            "reason is whitespace only",
        ));
    }
    let chars = raw_reason.chars().count();
    if chars > MAX_REASON_CHARS {
        return Err(ContractViolation::new(
            C::ReasonTooLong,
            format!("reason has {chars} characters, the cap is {MAX_REASON_CHARS}"),
        ));
    }
    if let Some(word) = text::find_third_state(raw_reason, text::THIRD_STATE_ROLLOUT) {
        return Err(ContractViolation::new(
            C::ThirdState,
            format!("reason contains third-state wording (folded form {word:?})"),
        ));
    }
    Ok(ParsedCandidate {
        verdict,
        reason: reason.to_string(),
    })
}

/// At most 40 characters of `s`, for error details.
fn excerpt(s: &str) -> String {
    const MAX: usize = 40;
    if s.chars().count() <= MAX {
        s.to_string()
    } else {
        let mut out: String = s.chars().take(MAX).collect();
        out.push('…');
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_verdicts_parse_and_reason_is_trimmed() {
        let p = parse("Verdict: 通过\nReason:  挡风板安装到位 \n").unwrap();
        assert_eq!(
            p,
            ParsedCandidate {
                verdict: Verdict::Pass,
                reason: "挡风板安装到位".into()
            }
        );
        let p = parse("Verdict: 不通过\nReason: 缺少螺丝").unwrap();
        assert_eq!(p.verdict, Verdict::Fail);
    }

    #[test]
    fn codes_round_trip_through_their_strings() {
        for c in ViolationCode::ALL {
            assert_eq!(ViolationCode::from_code(c.code()), Some(c));
            let json = serde_json::to_string(&c).unwrap();
            assert_eq!(json, format!("\"{}\"", c.code()));
        }
    }

    #[test]
    fn length_cap_is_inclusive() {
        let ok = format!("Verdict: 通过\nReason: {}", "好".repeat(MAX_REASON_CHARS));
        assert!(parse(&ok).is_ok());
        let long = format!(
            "Verdict: 通过\nReason: {}",
            "好".repeat(MAX_REASON_CHARS + 1)
        );
        assert_eq!(parse(&long).unwrap_err().code, ViolationCode::ReasonTooLong);
    }
}
