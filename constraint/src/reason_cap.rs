//! The contract's reason-length cap, applied on top of the llguidance contract grammar.
//!
//! # Why not `{1,max}` in the grammar
//!
//! llguidance can express the cap (`/[^\n\r]{1,240}/ & … & ~banned`), and that was the first
//! version. Measured on SmolLM2's 49k-token vocabulary (2 CPU cores): the counter multiplies the
//! regex state space (position × banned-word progress × UTF-8 partial states), so every new
//! reason position builds fresh derivative states. With default limits the first reason mask
//! exhausted llguidance's per-step lexer fuel ("too many expressions constructed"); with the
//! fuel raised, masks cost mean 7.5 ms with a ~480 ms spike per fresh constraint. Without the
//! counter the grammar's states are few and cached after the first steps: mean 0.33 ms, p50
//! 18 µs on the same text. So the grammar keeps everything hard (structure, the verdict choice,
//! the folded banned-word exclusion, not-whitespace-only) and this module adds the count.
//!
//! # Why this is exact
//!
//! The reason's length in chars equals the number of non-continuation bytes in its bytes (a
//! character is counted at its leading byte). llguidance only allows tokens after which the
//! text is still a viable prefix of the uncapped language L'. For such a prefix with `n`
//! counted characters, a completion within `n` characters exists when the reason already has
//! a complete non-whitespace character or ends inside a character (finishing that character
//! adds no count; every partial UTF-8 sequence can finish as a non-whitespace, non-newline
//! character that cannot complete a banned word, because a single character after only
//! separators folds to at most `i̇`). Otherwise (only whitespace so far) it needs one more
//! character. So a token is allowed iff llguidance allows it and `n ≤ max` — and `n + 1 ≤ max`
//! when the reason is whitespace only and ends on a character boundary. Nothing in the capped
//! language is excluded, nothing outside it can be generated, and the walk never dead-ends.

/// The marker after which the reason starts (the verdict line contains no `\n`).
const REASON_MARKER: &[u8] = b"\nReason: ";

/// What the cap needs to know about the reason so far.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ReasonStats {
    /// Characters counted (non-continuation bytes).
    chars: usize,
    /// A complete non-whitespace character has been seen.
    non_ws: bool,
    /// Bytes of an unfinished character at the end (at most 3).
    pending: Vec<u8>,
}

impl ReasonStats {
    fn empty() -> Self {
        ReasonStats {
            chars: 0,
            non_ws: false,
            pending: Vec::new(),
        }
    }

    /// The stats after appending `bytes` (a continuation llguidance accepted, so valid UTF-8
    /// except possibly an unfinished character at the end).
    fn extended(&self, bytes: &[u8], starts: usize) -> ReasonStats {
        let mut out = ReasonStats {
            chars: self.chars + starts,
            non_ws: self.non_ws,
            pending: Vec::new(),
        };
        if out.non_ws {
            // Only the pending tail matters from here on; keep it exact for later checks.
            out.pending = pending_tail(&self.pending, bytes);
            return out;
        }
        let mut buf = self.pending.clone();
        buf.extend_from_slice(bytes);
        let valid = match std::str::from_utf8(&buf) {
            Ok(s) => s,
            Err(e) => {
                out.pending = buf[e.valid_up_to()..].to_vec();
                std::str::from_utf8(&buf[..e.valid_up_to()]).unwrap_or("")
            }
        };
        out.non_ws = valid.chars().any(|c| !c.is_whitespace());
        out
    }

    /// Can a reason with these stats still be completed within `max` characters?
    fn within(&self, max: usize) -> bool {
        if self.non_ws || !self.pending.is_empty() {
            self.chars <= max
        } else {
            self.chars < max
        }
    }
}

/// The unfinished-character bytes at the end of `pending ++ bytes`.
fn pending_tail(pending: &[u8], bytes: &[u8]) -> Vec<u8> {
    let mut buf = pending.to_vec();
    buf.extend_from_slice(bytes);
    let start = buf.len().saturating_sub(4);
    // The last leading byte and what follows it, if that sequence is unfinished.
    for i in (start..buf.len()).rev() {
        let b = buf[i];
        if b & 0xC0 != 0x80 {
            let need = match b {
                0x00..=0x7F => 1,
                0xC0..=0xDF => 2,
                0xE0..=0xEF => 3,
                _ => 4,
            };
            return if buf.len() - i < need {
                buf[i..].to_vec()
            } else {
                Vec::new()
            };
        }
    }
    Vec::new()
}

/// Number of characters a byte string starts (its non-continuation bytes).
pub(crate) fn char_starts(bytes: &[u8]) -> usize {
    bytes.iter().filter(|&&b| b & 0xC0 != 0x80).count()
}

/// The per-sequence cap state.
#[derive(Debug, Clone)]
pub(crate) struct ReasonCap {
    max: usize,
    /// Bytes consumed before the reason started (short: the fixed first line and prefix).
    head: Vec<u8>,
    /// `Some` once the marker has been consumed.
    reason: Option<ReasonStats>,
}

impl ReasonCap {
    pub(crate) fn new(max: usize) -> Self {
        ReasonCap {
            max,
            head: Vec::new(),
            reason: None,
        }
    }

    /// Stats after appending `bytes`, or `None` while the reason has not started.
    fn after(&self, bytes: &[u8], starts: usize) -> Option<ReasonStats> {
        match &self.reason {
            Some(r) => Some(r.extended(bytes, starts)),
            None => {
                let mut buf = self.head.clone();
                buf.extend_from_slice(bytes);
                let pos = buf
                    .windows(REASON_MARKER.len())
                    .position(|w| w == REASON_MARKER)?;
                let tail = &buf[pos + REASON_MARKER.len()..];
                Some(ReasonStats::empty().extended(tail, char_starts(tail)))
            }
        }
    }

    /// Whether appending a token with these bytes (and precomputed `char_starts`) keeps the
    /// reason completable within the cap.
    pub(crate) fn allows(&self, bytes: &[u8], starts: usize) -> bool {
        match &self.reason {
            // Fast path for mask filtering: only the count can still fail.
            Some(r) if r.non_ws => r.chars + starts <= self.max,
            _ => self.after(bytes, starts).is_none_or(|r| r.within(self.max)),
        }
    }

    /// True when no token can break the cap here, so the mask needs no filtering: every token
    /// adds at most `max_token_starts` characters.
    pub(crate) fn is_slack(&self, max_token_starts: usize) -> bool {
        let used = self.reason.as_ref().map_or(0, |r| r.chars);
        used + max_token_starts < self.max
    }

    /// Advance by a consumed token's bytes.
    pub(crate) fn consume(&mut self, bytes: &[u8], starts: usize) {
        match self.after(bytes, starts) {
            Some(r) => {
                self.reason = Some(r);
                self.head.clear();
            }
            None => self.head.extend_from_slice(bytes),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cap_after(max: usize, text: &[u8]) -> ReasonCap {
        let mut c = ReasonCap::new(max);
        c.consume(text, char_starts(text));
        c
    }

    #[test]
    fn every_partial_utf8_sequence_can_finish_as_a_non_whitespace_char() {
        // The exactness argument in the module docs relies on this.
        use std::collections::HashMap;
        let mut finishes_non_ws: HashMap<Vec<u8>, bool> = HashMap::new();
        let mut buf = [0u8; 4];
        for c in (0x80..=0x10FFFFu32).filter_map(char::from_u32) {
            let enc = c.encode_utf8(&mut buf).as_bytes().to_vec();
            for k in 1..enc.len() {
                let e = finishes_non_ws.entry(enc[..k].to_vec()).or_default();
                *e |= !c.is_whitespace() && c != '\n' && c != '\r';
            }
        }
        let bad: Vec<_> = finishes_non_ws
            .iter()
            .filter(|(_, ok)| !**ok)
            .map(|(p, _)| p)
            .collect();
        assert!(
            bad.is_empty(),
            "partial sequences that only finish as whitespace: {bad:x?}"
        );
    }

    #[test]
    fn counts_characters_not_bytes_across_token_boundaries() {
        let prefix = "Verdict: 通过\nReason: ".as_bytes();
        let c = cap_after(3, prefix);
        assert!(c.allows("好好好".as_bytes(), 3));
        assert!(!c.allows("好好好好".as_bytes(), 4));
        // A character split across tokens is counted once, at its leading byte.
        let hao = "好".as_bytes();
        let mut c = cap_after(3, prefix);
        c.consume("好好".as_bytes(), 2);
        c.consume(&hao[..1], 1);
        assert!(c.allows(&hao[1..], 0), "finishing the third character");
        assert!(!c.allows(&[hao[1], hao[2], b'x'], 1), "a fourth character");
    }

    #[test]
    fn whitespace_only_reason_keeps_room_for_one_real_character() {
        let prefix = "Verdict: 不通过\nReason: ".as_bytes();
        let c = cap_after(3, prefix);
        assert!(c.allows(b"  ", 2));
        assert!(
            !c.allows(b"   ", 3),
            "three spaces leave no room for a non-space"
        );
        assert!(c.allows(b"  x", 3));
        // A pending multi-byte character can still become non-whitespace.
        let ideo = "\u{3000}".as_bytes(); // ideographic space, itself whitespace
        assert!(c.allows(&[b' ', b' ', ideo[0]], 3));
    }

    #[test]
    fn tokens_crossing_into_the_reason_are_counted_from_the_marker() {
        let c = cap_after(2, "Verdict: 通过\nReason".as_bytes());
        assert!(c.allows(b": ab", 4));
        assert!(!c.allows(b": abc", 5));
        assert!(c.is_slack(1), "one-char tokens cannot break a cap of 2 yet");
        assert!(!c.is_slack(2));
    }
}
