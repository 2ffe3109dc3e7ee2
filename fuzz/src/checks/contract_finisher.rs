//! The constrained-decoding finisher (`stageb_constraint`, the contract spec) walked by the
//! fuzzer's bytes over a small synthetic vocabulary.
//!
//! The vocabulary is a byte-level BPE tokenizer built with `tokenizers` (read back by
//! `Vocabulary::from_tokenizer`, as a model's is): the 256 single bytes, the contract's fixed
//! parts whole and cut inside a character or across the line break, Chinese characters and
//! pieces of them, third-state words with their variants and separators, long tokens that test
//! the reason cap, and three specials (`<|endoftext|>` and `<|im_end|>` end a generation,
//! `<|im_start|>` does not).
//!
//! Input: byte 0 picks the reason cap (1 to 40, or `MAX_REASON_CHARS`). Then each step reads
//! an op byte: take the grammar's forced tokens, offer a token outside the mask, fork, or pick
//! a token the constraint allows (two bytes index the allowed set; an end token when one is
//! allowed and the op says so). The walk stops at the end, when the bytes run out, or after
//! `STEP_CAP` tokens.
//!
//! Invariants, at every step before the end: the constraint allows something (no dead end),
//! only text tokens and end tokens; the text so far can still become a valid verdict within
//! the cap (a prefix of a header, or a header and a one-line reason without a third-state word
//! whose length leaves room); an end token is allowed exactly when the text is a complete
//! verdict within the cap, and such a text `contract::parse`s. A forced token is allowed. A
//! token outside the mask is accepted only where the language allows it (where the grammar
//! forces text, llguidance's mask holds only its canonical tokens), and a rejected one leaves
//! the state as it was. After an end token the constraint is finished, allows nothing, and its
//! text parses with a reason within the cap. The same tokens replayed on a fresh constraint,
//! and on a fork from the middle, give the same masks.

use std::collections::HashSet;
use std::str::FromStr;
use std::sync::OnceLock;

use stageb_constraint::{
    AllowedTokens, ConstraintFactory, ConstraintSpec, TokenConstraint, Vocabulary,
};
use stageb_shared::contract::{MAX_REASON_CHARS, parse};
use stageb_shared::text::{THIRD_STATE_ROLLOUT, find_third_state};
use tokenizers::Tokenizer;

/// Consumed tokens at most per input (a capped reason of 40 three-byte characters, one byte a
/// token, plus the header, fits).
const STEP_CAP: usize = 200;

/// The specials, after every text token: two end tokens and one that ends nothing.
const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// The two headers a reason follows.
const HEADERS: [&str; 2] = ["Verdict: 通过\nReason: ", "Verdict: 不通过\nReason: "];

/// Text tokens beside the single bytes.
const WORDS: &[&str] = &[
    "Verdict",
    "Verdict: ",
    "Ver",
    ":",
    ": ",
    " ",
    "通过",
    "不通过",
    "通",
    "过",
    "不",
    "\n",
    "\nReason: ",
    "Reason",
    "Reason:",
    "Reason: ",
    "通过\nReason: ",
    "过\nRe",
    "ason: 好",
    "好",
    "证据",
    "充分",
    "。",
    "，",
    "the",
    " evidence",
    " is",
    " clear",
    "abcdefghijklmnop",
    "通过通过通过通过",
    "          ",
    "  ",
    "\u{3000}",
    "\u{3000}\u{3000}\u{3000}",
    "\t",
    "\u{a0}",
    "\r",
    "\r\n",
    "a\nb",
    "。\n",
    "复核",
    "复",
    "核",
    "複",
    "需",
    "待定",
    "待",
    "定",
    "证据不足",
    "不足",
    "need",
    "needs",
    "review",
    "Review",
    "Need-Review",
    "needs_review",
    "NEED",
    " review",
    "-",
    "_",
    "N",
    "\u{212A}",
    "\u{130}",
    "ｎｅｅｄ",
];

/// Tokens cut at a byte inside a character: both pieces are tokens.
const CUTS: &[(&str, usize)] = &[
    ("通过", 1),
    ("通过", 4),
    ("不通过", 5),
    ("复核", 2),
    ("好", 1),
    ("\u{3000}x", 2),
    ("待定", 4),
];

/// The factory over the synthetic vocabulary, built once per process (compiling the contract
/// folds every Unicode scalar value: seconds under the sanitizer, so the libFuzzer entry calls
/// this at initialization, outside any input's time limit).
pub fn factory() -> &'static ConstraintFactory {
    static FACTORY: OnceLock<ConstraintFactory> = OnceLock::new();
    FACTORY.get_or_init(|| {
        let tokenizer = Tokenizer::from_str(&tokenizer_json()).expect("the synthetic tokenizer");
        let id = |name: &str| tokenizer.token_to_id(name).expect("a special token");
        let eos = [id(SPECIALS[0]), id(SPECIALS[2])];
        let vocab = Vocabulary::from_tokenizer(&tokenizer, &eos).expect("the synthetic vocabulary");
        ConstraintFactory::new(vocab).expect("the contract compiles")
    })
}

/// GPT-2's byte-level alphabet: the printable stand-in character of each byte.
fn byte_chars() -> Vec<char> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut shifted = 0u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                char::from(b)
            } else {
                shifted += 1;
                char::from_u32(255 + shifted).expect("below U+0200")
            }
        })
        .collect()
}

/// Every text token's bytes: the words and both pieces of each cut.
fn text_tokens() -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = WORDS.iter().map(|w| w.as_bytes().to_vec()).collect();
    for (word, at) in CUTS {
        let (head, tail) = word.as_bytes().split_at(*at);
        out.extend([head.to_vec(), tail.to_vec()]);
    }
    out
}

/// The tokenizer's JSON: a byte-level BPE whose merges build each token from its prefix, so
/// every prefix of a token is a token too.
fn tokenizer_json() -> String {
    let chars = byte_chars();
    let mut vocab: Vec<String> = chars.iter().map(char::to_string).collect();
    let mut seen: HashSet<String> = vocab.iter().cloned().collect();
    let mut merges: Vec<[String; 2]> = Vec::new();
    for token in text_tokens() {
        let mut prefix = chars[token[0] as usize].to_string();
        for &b in &token[1..] {
            let c = chars[b as usize].to_string();
            let next = format!("{prefix}{c}");
            if seen.insert(next.clone()) {
                merges.push([prefix.clone(), c]);
                vocab.push(next.clone());
            }
            prefix = next;
        }
    }
    let ids: serde_json::Map<String, serde_json::Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i.into()))
        .collect();
    let added: Vec<serde_json::Value> = SPECIALS
        .iter()
        .enumerate()
        .map(|(i, name)| {
            serde_json::json!({"id": vocab.len() + i, "content": name, "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let byte_level = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false,
        "trim_offsets": true, "use_regex": true});
    serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": byte_level, "post_processor": null,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
            "byte_fallback": false, "ignore_merges": false, "vocab": ids, "merges": merges},
    })
    .to_string()
}

/// The fuzzer's bytes, read one at a time.
struct Input<'a> {
    data: &'a [u8],
    pos: usize,
}

impl Input<'_> {
    fn byte(&mut self) -> Option<u8> {
        let b = self.data.get(self.pos).copied();
        self.pos += 1;
        b
    }

    /// An index below `n` (> 0) from the next two bytes.
    fn index(&mut self, n: usize) -> Option<usize> {
        let hi = self.byte()? as usize;
        let lo = self.byte()? as usize;
        Some(((hi << 8) | lo) % n)
    }
}

/// What a walk did: each consumed token with the mask it was chosen from, a fork taken at a
/// step of that trace, and whether it ended.
struct Walk {
    trace: Vec<(AllowedTokens, u32)>,
    fork: Option<(usize, Box<dyn TokenConstraint>)>,
    finished: bool,
}

/// Runs one input; panics where an invariant does not hold.
pub fn check(data: &[u8]) {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let cap = if first >= 250 {
        MAX_REASON_CHARS
    } else {
        1 + first as usize % 40
    };
    let factory = factory();
    let vocab = factory.vocabulary();
    let spec = ConstraintSpec::Contract {
        max_reason_chars: cap,
    };
    let mut constraint = factory.build(&spec).expect("a contract constraint");
    let walk = walk(
        vocab,
        constraint.as_mut(),
        Input { data: rest, pos: 0 },
        cap,
    );
    let text = vocab.decode_bytes(&tokens(&walk.trace));
    if walk.finished {
        let text = std::str::from_utf8(&text).expect("a finished output is UTF-8");
        let verdict = parse(text).unwrap_or_else(|v| panic!("{text:?} does not parse: {v:?}"));
        assert!(verdict.reason.chars().count() <= cap, "{text:?}: cap {cap}");
    }
    // The same tokens on a fresh constraint give the same masks and the same end.
    let mut fresh = factory.build(&spec).expect("a contract constraint");
    replay(fresh.as_mut(), &walk.trace, walk.finished);
    if let Some((at, mut fork)) = walk.fork {
        replay(fork.as_mut(), &walk.trace[at..], walk.finished);
    }
}

fn tokens(trace: &[(AllowedTokens, u32)]) -> Vec<u32> {
    trace.iter().map(|(_, t)| *t).collect()
}

/// Feeds `trace` to `c`, asserting each mask is the recorded one.
fn replay(c: &mut dyn TokenConstraint, trace: &[(AllowedTokens, u32)], finished: bool) {
    for (step, (mask, token)) in trace.iter().enumerate() {
        let now = c.allowed().expect("allowed() on replay");
        assert!(now == *mask, "step {step}: the mask differs on replay");
        c.consume(*token).expect("a replayed token is accepted");
    }
    assert_eq!(c.is_finished(), finished, "the replay ends differently");
}

/// Walks the constraint as the input directs, checking every step.
fn walk(vocab: &Vocabulary, c: &mut dyn TokenConstraint, mut input: Input<'_>, cap: usize) -> Walk {
    let mut trace: Vec<(AllowedTokens, u32)> = Vec::new();
    let mut fork = None;
    while trace.len() < STEP_CAP {
        let allowed = c.allowed().expect("allowed() while unfinished");
        let text = vocab.decode_bytes(&tokens(&trace));
        check_step(vocab, &text, &allowed, cap);
        let Some(op) = input.byte() else { break };
        match op % 8 {
            7 => {
                for t in c.forced() {
                    let now = c.allowed().expect("allowed() while forced");
                    assert!(now.is_allowed(t), "forced token {t} is not allowed");
                    c.consume(t).expect("a forced token is accepted");
                    trace.push((now, t));
                }
            }
            6 => {
                let mut refused = AllowedTokens::none(allowed.len());
                for id in (0..allowed.len() as u32).filter(|&id| !allowed.is_allowed(id)) {
                    refused.allow(id);
                }
                let Some(i) = input.index(vocab.len()) else {
                    break;
                };
                let Some(t) = nth_allowed(&refused, i) else {
                    continue;
                };
                if offer_refused(vocab, c, &text, t, &allowed, cap) {
                    trace.push((allowed, t));
                }
            }
            5 if fork.is_none() => fork = Some((trace.len(), c.fork())),
            _ => {
                let eos: Vec<u32> = vocab.eos_token_ids().to_vec();
                let ends: Vec<u32> = eos.into_iter().filter(|&e| allowed.is_allowed(e)).collect();
                let t = if !ends.is_empty() && op < 96 {
                    ends[op as usize % ends.len()]
                } else {
                    let Some(i) = input.index(allowed.count()) else {
                        break;
                    };
                    nth_allowed(&allowed, i).expect("an allowed token")
                };
                c.consume(t).expect("an allowed token is accepted");
                trace.push((allowed, t));
            }
        }
        if c.is_finished() {
            let last = trace.last().map(|(_, t)| *t);
            assert!(last.is_some_and(|t| vocab.eos_token_ids().contains(&t)));
            let after = c.allowed().expect("allowed() after the end");
            assert!(after.is_empty(), "tokens allowed after the end");
            return Walk {
                trace,
                fork,
                finished: true,
            };
        }
    }
    Walk {
        trace,
        fork,
        finished: false,
    }
}

/// Offers `t`, a token outside the mask `allowed`, and returns whether it was accepted. The
/// mask may be narrower than the language (where the grammar forces text, llguidance allows
/// only its canonical tokens), so a token of the language may be accepted; anything else is
/// rejected and leaves the state as it was.
fn offer_refused(
    vocab: &Vocabulary,
    c: &mut dyn TokenConstraint,
    text: &[u8],
    t: u32,
    allowed: &AllowedTokens,
    cap: usize,
) -> bool {
    let in_language = match vocab.token_bytes(t) {
        Some(piece) => viable(&[text, piece].concat(), cap),
        None => vocab.eos_token_ids().contains(&t) && complete(text, cap),
    };
    let piece = vocab.token_bytes(t).map(lossy);
    if c.consume(t).is_ok() {
        assert!(
            in_language,
            "token {t} ({piece:?}) accepted after {:?}",
            lossy(text)
        );
        return true;
    }
    let now = c.allowed().expect("allowed() after a refusal");
    assert!(now == *allowed, "a refused token changed the state");
    false
}

/// The `i`-th allowed id (wrapping), if any is allowed.
fn nth_allowed(allowed: &AllowedTokens, i: usize) -> Option<u32> {
    let count = allowed.count();
    if count == 0 {
        return None;
    }
    (0..allowed.len() as u32)
        .filter(|&id| allowed.is_allowed(id))
        .nth(i % count)
}

/// The invariants of one step before the end, on the text so far and the mask.
fn check_step(vocab: &Vocabulary, text: &[u8], allowed: &AllowedTokens, cap: usize) {
    assert!(!allowed.is_empty(), "dead end after {text:?}");
    let eos = vocab.eos_token_ids();
    for id in (0..allowed.len() as u32).filter(|&id| allowed.is_allowed(id)) {
        assert!(
            vocab.token_bytes(id).is_some() || eos.contains(&id),
            "special token {id} allowed"
        );
    }
    assert!(
        viable(text, cap),
        "{:?} cannot become a verdict",
        lossy(text)
    );
    let complete = complete(text, cap);
    if complete {
        let s = std::str::from_utf8(text).expect("checked by complete");
        assert!(parse(s).is_ok(), "{s:?} is complete but does not parse");
    }
    let end_allowed = eos.iter().any(|&e| allowed.is_allowed(e));
    assert_eq!(end_allowed, complete, "end allowed after {:?}", lossy(text));
}

fn lossy(text: &[u8]) -> String {
    String::from_utf8_lossy(text).into_owned()
}

/// The reason after a full header, or `None` while the header is unfinished.
fn reason(text: &[u8]) -> Option<&[u8]> {
    HEADERS.iter().find_map(|h| text.strip_prefix(h.as_bytes()))
}

/// Can `text` still become a complete verdict within `cap` characters of reason?
fn viable(text: &[u8], cap: usize) -> bool {
    let Some(reason) = reason(text) else {
        return HEADERS.iter().any(|h| h.as_bytes().starts_with(text));
    };
    if reason.contains(&b'\n') || reason.contains(&b'\r') {
        return false;
    }
    let (whole, pending) = match std::str::from_utf8(reason) {
        Ok(s) => (s, false),
        Err(e) if e.error_len().is_none() => {
            let s = std::str::from_utf8(&reason[..e.valid_up_to()]).expect("valid up to");
            (s, true)
        }
        Err(_) => return false,
    };
    let chars = reason.iter().filter(|&&b| b & 0xC0 != 0x80).count();
    let needs_one_more = !pending && whole.chars().all(char::is_whitespace);
    chars + usize::from(needs_one_more) <= cap
        && find_third_state(whole, THIRD_STATE_ROLLOUT).is_none()
}

/// Is `text` a complete verdict within `cap` (one line of reason, not whitespace only, no
/// third-state word)?
fn complete(text: &[u8], cap: usize) -> bool {
    let Some(reason) = reason(text) else {
        return false;
    };
    let Ok(reason) = std::str::from_utf8(reason) else {
        return false;
    };
    !reason.contains(['\n', '\r'])
        && !reason.chars().all(char::is_whitespace)
        && reason.chars().count() <= cap
        && find_third_state(reason, THIRD_STATE_ROLLOUT).is_none()
}
