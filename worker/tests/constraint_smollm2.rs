//! Constrained decoding over the real SmolLM2-135M vocabulary (read from the test GGUF).
//!
//! What is specified here:
//! - the vocabulary's bytes agree with llguidance's own tokenizer.json reader;
//! - random walks through the contract constraint (biased toward third-state characters and
//!   words, half of the picks) always end in text that `contract::parse` accepts: the
//!   constraint's language is inside the parser's, including the folded banned-word rule;
//! - specific states: no token completes 复核/複核 after 需, no `review` variant after `need`,
//!   no newline inside the reason, EOS only once the contract is complete;
//! - random walks through the reflection JSON schemas end in text `parse_decision` /
//!   `parse_ops` accept;
//! - the time per `allowed()` call (mask computation) is measured and printed.
//!
//! The model file comes from `scripts/fetch-model.sh` (`STAGEB_TEST_MODEL` overrides the path).

use crate::common;
use common::model_path;

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use candle_core::quantized::gguf_file;
use candle_core::quantized::tokenizer::TokenizerFromGguf;
use stageb_shared::contract::{self, MAX_REASON_CHARS};
use stageb_shared::reflection_schema::{
    self, ANALYSIS_MAX_CHARS, RATIONALE_MAX_CHARS, RULE_TEXT_MAX_CHARS, TICKET_KEY_MAX_CHARS,
};
use stageb_shared::text::{self, THIRD_STATE_ROLLOUT};
use stageb_worker::constraint::{
    AllowedTokens, ConstraintFactory, ConstraintSpec, TokenConstraint, VocabStyle, Vocabulary,
};
use tokenizers::Tokenizer;
use tokenizers::pre_tokenizers::{byte_level::ByteLevel, digits::Digits, sequence::Sequence};

struct Setup {
    tokenizer: Tokenizer,
    vocab: Vocabulary,
    factory: ConstraintFactory,
}

fn setup() -> &'static Setup {
    static SETUP: OnceLock<Setup> = OnceLock::new();
    SETUP.get_or_init(|| {
        let path = model_path();
        let mut file = std::fs::File::open(&path).unwrap_or_else(|e| {
            panic!(
                "test model {} missing ({e}); run scripts/fetch-model.sh",
                path.display()
            )
        });
        let content = gguf_file::Content::read(&mut file).expect("read gguf");
        let mut tokenizer = Tokenizer::from_gguf(&content).expect("tokenizer from gguf");
        let pre = content
            .metadata
            .get("tokenizer.ggml.pre")
            .and_then(|v| v.to_string().ok());
        // candle maps `smollm` to the GPT-2 default (prefix space, no digit split); the byte
        // map is unaffected, but canonical tokenization of forced text needs the real one.
        if pre.map(String::as_str) == Some("smollm") {
            tokenizer.with_pre_tokenizer(Some(Sequence::new(vec![
                Digits::new(true).into(),
                ByteLevel::new(false, true, true).into(),
            ])));
        }
        let eos = content.metadata["tokenizer.ggml.eos_token_id"]
            .to_u32()
            .unwrap();
        let vocab = Vocabulary::from_tokenizer(&tokenizer, &[eos]).expect("vocabulary");
        let t = Instant::now();
        let factory = ConstraintFactory::new(vocab.clone()).expect("factory");
        eprintln!(
            "ConstraintFactory::new over {} tokens: {:?}",
            vocab.len(),
            t.elapsed()
        );
        Setup {
            tokenizer,
            vocab,
            factory,
        }
    })
}

fn contract_spec() -> ConstraintSpec {
    ConstraintSpec::Contract {
        max_reason_chars: MAX_REASON_CHARS,
    }
}

/// Deterministic generator (SplitMix64): walks are reproducible from their seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

fn allowed_ids(a: &AllowedTokens) -> Vec<u32> {
    (0..a.len() as u32).filter(|&id| a.is_allowed(id)).collect()
}

/// Bytes of the exact canonical tokenization of `text` (asserts it round-trips).
fn encode(text: &str) -> Vec<u32> {
    let s = setup();
    let ids = s.tokenizer.encode(text, false).unwrap().get_ids().to_vec();
    assert_eq!(
        s.vocab.decode_bytes(&ids),
        text.as_bytes(),
        "tokenization of {text:?} round-trips"
    );
    ids
}

/// A constraint advanced through `prefix` (which must be allowed token by token).
fn constraint_after(spec: &ConstraintSpec, prefix: &str) -> Box<dyn TokenConstraint> {
    let mut c = setup().factory.build(spec).unwrap();
    for id in encode(prefix) {
        assert!(
            c.allowed().unwrap().is_allowed(id),
            "prefix {prefix:?}: token {id} not allowed"
        );
        c.consume(id).unwrap();
    }
    c
}

/// The reason part of a (possibly unfinished) contract text, complete characters only.
fn reason_of(bytes: &[u8]) -> String {
    let valid = match std::str::from_utf8(bytes) {
        Ok(s) => s,
        Err(e) => std::str::from_utf8(&bytes[..e.valid_up_to()]).unwrap(),
    };
    valid
        .split_once("\nReason: ")
        .map(|(_, r)| r.to_string())
        .unwrap_or_default()
}

/// Every allowed token at `c`, appended to `prefix`, keeps the reason free of third-state words
/// and newlines. Returns the number of allowed tokens checked.
fn assert_every_allowed_token_keeps_reason_clean(
    c: &mut Box<dyn TokenConstraint>,
    prefix: &str,
) -> usize {
    let s = setup();
    let allowed = allowed_ids(&c.allowed().unwrap());
    for &id in &allowed {
        let Some(tb) = s.vocab.token_bytes(id) else {
            continue;
        };
        let mut bytes = prefix.as_bytes().to_vec();
        bytes.extend_from_slice(tb);
        let reason = reason_of(&bytes);
        assert!(
            text::find_third_state(&reason, THIRD_STATE_ROLLOUT).is_none(),
            "after {prefix:?}, token {id} ({:?}) is allowed and completes a third-state word: {reason:?}",
            String::from_utf8_lossy(tb)
        );
        assert!(
            !tb.contains(&b'\n') && !tb.contains(&b'\r'),
            "newline token {id} allowed in the reason"
        );
    }
    allowed.len()
}

/// The converse of [`assert_every_allowed_token_keeps_reason_clean`]: every token masked in a
/// reason state must have a reason to be masked. Returns the masked tokens that have none:
/// those that, appended, leave complete UTF-8 without `\n`/`\r`, within the cap, completable
/// (a non-space character or room for one) and with no third-state word after folding. Such
/// a token would show the constraint is stricter than the parser.
fn unexplained_masked_tokens(
    prefix: &[u8],
    allowed: &AllowedTokens,
    candidates: impl Iterator<Item = u32>,
    max: usize,
) -> Vec<u32> {
    let s = setup();
    let mut out = Vec::new();
    for id in candidates {
        if allowed.is_allowed(id) {
            continue;
        }
        let Some(tb) = s.vocab.token_bytes(id) else {
            continue;
        };
        if tb.contains(&b'\n') || tb.contains(&b'\r') {
            continue;
        }
        let mut bytes = prefix.to_vec();
        bytes.extend_from_slice(tb);
        let Ok(text) = std::str::from_utf8(&bytes) else {
            continue;
        }; // partial or invalid
        let Some((_, reason)) = text.split_once("\nReason: ") else {
            continue;
        };
        let n = reason.chars().count();
        let completable = if reason.trim().is_empty() {
            n < max
        } else {
            n <= max
        };
        if completable && text::find_third_state(reason, THIRD_STATE_ROLLOUT).is_none() {
            out.push(id);
        }
    }
    out
}

/// Tokens whose bytes overlap third-state material: the characters of the banned words and
/// their traditional variants (also partial UTF-8 pieces of them), `need`/`review` pieces, and
/// pure separator tokens. Walks pick from these half of the time to press on the exclusion.
fn third_state_bait(vocab: &Vocabulary) -> Vec<bool> {
    let mut targets: Vec<Vec<u8>> = Vec::new();
    for w in THIRD_STATE_ROLLOUT {
        for c in w.chars().filter(|c| !c.is_ascii()) {
            for v in text::traditional_variants(c) {
                targets.push(v.to_string().into_bytes());
            }
        }
    }
    for w in [
        "need", "needs", "review", "Need", "Review", "NEED", "REVIEW", "nee", "rev", "iew", "view",
    ] {
        targets.push(w.as_bytes().to_vec());
    }
    let contains = |hay: &[u8], needle: &[u8]| {
        needle.len() <= hay.len() && hay.windows(needle.len()).any(|w| w == needle)
    };
    (0..vocab.len() as u32)
        .map(|id| match vocab.token_bytes(id) {
            None => false,
            Some(tb) => {
                tb.iter().all(|b| matches!(b, b' ' | b'-' | b'_' | b'\t'))
                    || targets.iter().any(|t| {
                        contains(tb, t) || (t.len() > 1 && !t.is_ascii() && contains(t, tb))
                    })
            }
        })
        .collect()
}

#[derive(Default)]
struct MaskTimer {
    samples: Vec<Duration>,
}

impl MaskTimer {
    fn allowed(&mut self, c: &mut Box<dyn TokenConstraint>) -> AllowedTokens {
        let t = Instant::now();
        let a = c.allowed().unwrap();
        self.samples.push(t.elapsed());
        a
    }

    fn report(&mut self, what: &str) {
        self.samples.sort();
        let n = self.samples.len();
        let total: Duration = self.samples.iter().sum();
        eprintln!(
            "{what}: {n} allowed() calls, mean {:?}, p50 {:?}, p95 {:?}, max {:?}",
            total / n as u32,
            self.samples[n / 2],
            self.samples[n * 95 / 100],
            self.samples[n - 1]
        );
    }
}

#[test]
fn vocabulary_bytes_match_llguidance_tokenizer_json_reader() {
    let s = setup();
    assert_eq!(s.vocab.style(), VocabStyle::ByteLevel);
    assert_eq!(s.vocab.len(), 49152);
    let json: serde_json::Value =
        serde_json::from_str(&s.tokenizer.to_string(false).unwrap()).unwrap();
    let reference = llguidance::token_bytes_from_tokenizer_json(&json).unwrap();
    let mut mismatches = Vec::new();
    for id in 0..s.vocab.len() as u32 {
        let ours = s.vocab.token_bytes(id);
        let theirs = &reference[id as usize];
        let special = !theirs.is_empty() && theirs[0] == 0xFF;
        match ours {
            Some(b) if !special && b == theirs.as_slice() => {}
            None if special => assert!(s.vocab.is_special(id)),
            _ => mismatches.push(id),
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} mismatching ids, first {:?}",
        mismatches.len(),
        &mismatches[..mismatches.len().min(10)]
    );
    // Facts the constraint relies on (inference-notes: a byte-level vocabulary has tokens that
    // are partial UTF-8, and `<|im_end|>` is token 2).
    let partial = (0..s.vocab.len() as u32)
        .filter(|&id| {
            s.vocab
                .token_bytes(id)
                .is_some_and(|b| std::str::from_utf8(b).is_err())
        })
        .count();
    assert!(
        partial > 100,
        "byte-level vocab has partial-UTF-8 tokens ({partial})"
    );
    assert_eq!(s.vocab.special_name(2), Some("<|im_end|>"));
}

/// (a) The constraint's language is inside `contract::parse`'s: ≥200 seeded random walks,
/// half of the picks biased toward third-state bait, all finish as valid contracts.
#[test]
fn random_walks_through_the_contract_always_parse() {
    let s = setup();
    let bait = third_state_bait(&s.vocab);
    let spec = contract_spec();
    let root = s.factory.build(&spec).unwrap();
    let eos = s.vocab.eos_token_ids()[0];
    let mut timer = MaskTimer::default();
    let (walks, mut finished, mut bait_picks) = (220, 0, 0usize);
    let mut rejected_bait = 0usize;
    let mut near_misses = 0usize;
    for walk in 0..walks {
        let mut rng = Rng(0x5EED_0000 + walk);
        let mut c = root.fork();
        let mut ids = Vec::new();
        for _ in 0..300 {
            if c.is_finished() {
                break;
            }
            let allowed = timer.allowed(&mut c);
            let ids_allowed = allowed_ids(&allowed);
            assert!(
                !ids_allowed.is_empty(),
                "walk {walk}: dead end after {:?}",
                String::from_utf8_lossy(&s.vocab.decode_bytes(&ids))
            );
            let so_far = s.vocab.decode_bytes(&ids);
            let in_reason = reason_started(&so_far);
            if in_reason {
                // Exactness, the other direction: every bait token turned away has a reason.
                let bait_ids = (0..s.vocab.len() as u32).filter(|&i| bait[i as usize]);
                let masked = bait_ids.clone().filter(|&i| !allowed.is_allowed(i)).count();
                rejected_bait += masked;
                let unexplained =
                    unexplained_masked_tokens(&so_far, &allowed, bait_ids, MAX_REASON_CHARS);
                assert!(
                    unexplained.is_empty(),
                    "walk {walk}: after {:?} the constraint masks {:?} for no reason",
                    String::from_utf8_lossy(&so_far),
                    unexplained
                        .iter()
                        .map(
                            |&i| String::from_utf8_lossy(s.vocab.token_bytes(i).unwrap())
                                .into_owned()
                        )
                        .collect::<Vec<_>>()
                );
            }
            let bait_allowed: Vec<u32> = ids_allowed
                .iter()
                .copied()
                .filter(|&i| bait[i as usize])
                .collect();
            let pick = if allowed.is_allowed(eos) && rng.chance(4) {
                eos
            } else if !bait_allowed.is_empty() && rng.chance(50) {
                bait_picks += 1;
                bait_allowed[rng.below(bait_allowed.len())]
            } else {
                ids_allowed[rng.below(ids_allowed.len())]
            };
            for &id in &ids_allowed {
                if let Some(b) = s.vocab.token_bytes(id) {
                    assert!(
                        !(in_reason && b.contains(&b'\n')),
                        "walk {walk}: newline allowed in the reason"
                    );
                }
            }
            c.consume(pick).unwrap();
            ids.push(pick);
        }
        let text =
            String::from_utf8(s.vocab.decode_bytes(&ids)).expect("constrained text is UTF-8");
        if c.is_finished() {
            finished += 1;
            match contract::parse(&text) {
                Ok(p) => {
                    let folded = text::fold(&p.reason);
                    if ["复", "待", "证据", "need"]
                        .iter()
                        .any(|w| folded.contains(w))
                    {
                        near_misses += 1;
                    }
                }
                Err(v) => {
                    panic!("walk {walk}: constrained output rejected by the parser: {v}\n{text:?}")
                }
            }
        } else {
            assert!(text.starts_with("Verdict: "), "walk {walk}: {text:?}");
        }
    }
    timer.report("contract random walks");
    eprintln!(
        "{finished}/{walks} walks finished, {bait_picks} bait picks, {rejected_bait} bait tokens masked \
         in reason states (each explained), {near_misses} valid reasons holding part of a banned word"
    );
    assert!(
        finished >= 200,
        "only {finished} of {walks} walks finished within 300 steps"
    );
    assert!(
        near_misses >= 20,
        "the bias must press on the exclusion ({near_misses} near misses)"
    );
}

fn reason_started(bytes: &[u8]) -> bool {
    bytes
        .windows(b"\nReason: ".len())
        .any(|w| w == b"\nReason: ")
}

/// (b) After 需, no token may complete 复核 or 複核 (simplified or traditional).
#[test]
fn no_token_completes_fuhe_after_xu() {
    let s = setup();
    for prefix in [
        "Verdict: 通过\nReason: 需",
        "Verdict: 通过\nReason: 需复",
        "Verdict: 不通过\nReason: 需複",
        "Verdict: 通过\nReason: 需 复 ",
    ] {
        let mut c = constraint_after(&contract_spec(), prefix);
        let n = assert_every_allowed_token_keeps_reason_clean(&mut c, prefix);
        assert!(n > 1000, "{prefix:?}: the reason can go on ({n} tokens)");
    }
    // Not over-strict anywhere in the vocabulary: every masked token has a reason.
    for prefix in [
        "Verdict: 通过\nReason: 需",
        "Verdict: 通过\nReason: 需复",
        "Verdict: 通过\nReason: need",
        "Verdict: 通过\nReason: need ",
    ] {
        let mut c = constraint_after(&contract_spec(), prefix);
        let a = c.allowed().unwrap();
        let bad = unexplained_masked_tokens(
            prefix.as_bytes(),
            &a,
            0..s.vocab.len() as u32,
            MAX_REASON_CHARS,
        );
        assert!(
            bad.is_empty(),
            "{prefix:?}: {} tokens masked for no reason, e.g. {:?}",
            bad.len(),
            &bad[..bad.len().min(5)]
        );
    }
    // The concrete completions exist in the vocabulary and are masked.
    let mut c = constraint_after(&contract_spec(), "Verdict: 通过\nReason: 需复");
    let allowed = c.allowed().unwrap();
    // 核 is split across tokens in this vocabulary: its leading piece is allowed (other
    // characters share it), the piece that would complete 核 is not.
    for fu in ["复", "複"] {
        let he = encode("核");
        assert!(he.len() > 1, "核 is several byte-level tokens in SmolLM2");
        let mut c = constraint_after(&contract_spec(), &format!("Verdict: 通过\nReason: 需{fu}"));
        for &t in &he[..he.len() - 1] {
            assert!(
                c.allowed().unwrap().is_allowed(t),
                "the shared leading piece is allowed"
            );
            c.consume(t).unwrap();
        }
        let last = *he.last().unwrap();
        assert!(
            !c.allowed().unwrap().is_allowed(last),
            "the piece completing 需{fu}核 is masked"
        );
        assert!(c.consume(last).is_err());
    }
    for id in 0..s.vocab.len() as u32 {
        if s.vocab
            .token_bytes(id)
            .is_some_and(|b| b.starts_with("核".as_bytes()))
        {
            assert!(
                !allowed.is_allowed(id),
                "token {id} starting with 核 allowed after 需复"
            );
        }
    }
    // Not over-strict: 复 followed by a different character is fine.
    let mut c = constraint_after(&contract_spec(), "Verdict: 通过\nReason: 需复");
    let ok = encode("查");
    assert!(c.allowed().unwrap().is_allowed(ok[0]));
}

/// (b) After `need`, neither `review` nor its separator/case variants may follow.
#[test]
fn no_review_variant_after_need() {
    let s = setup();
    for prefix in [
        "Verdict: 通过\nReason: need",
        "Verdict: 不通过\nReason: Need",
        "Verdict: 通过\nReason: it needs",
        "Verdict: 通过\nReason: need-",
        "Verdict: 通过\nReason: need ",
    ] {
        let mut c = constraint_after(&contract_spec(), prefix);
        assert_every_allowed_token_keeps_reason_clean(&mut c, prefix);
        let allowed = c.allowed().unwrap();
        for variant in [
            "review",
            " review",
            "-review",
            " Review",
            "Review",
            "_review",
            "REVIEW",
            "revie\u{212A}",
        ] {
            if let Ok(enc) = s.tokenizer.encode(variant, false) {
                let first = enc.get_ids()[0];
                let whole = s.vocab.token_bytes(first) == Some(variant.as_bytes());
                assert!(
                    !(whole && allowed.is_allowed(first)),
                    "{prefix:?} + {variant:?} (one token {first}) allowed"
                );
            }
        }
    }
    // `need` itself and `review` alone are fine.
    let mut c = constraint_after(&contract_spec(), "Verdict: 通过\nReason: need");
    assert!(
        c.allowed().unwrap().is_allowed(encode("ed")[0]),
        "needed is not banned"
    );
    constraint_after(&contract_spec(), "Verdict: 通过\nReason: review of image 1");
}

/// (b) EOS only when the contract is complete; the reason never takes a newline.
#[test]
fn eos_only_when_complete_and_never_a_newline_in_the_reason() {
    let s = setup();
    let eos = s.vocab.eos_token_ids()[0];
    for incomplete in [
        "",
        "Verdict: ",
        "Verdict: 通",
        "Verdict: 通过",
        "Verdict: 通过\n",
        "Verdict: 通过\nReason:",
        "Verdict: 通过\nReason: ",
        "Verdict: 通过\nReason:   ",
    ] {
        let mut c = if incomplete.is_empty() {
            s.factory.build(&contract_spec()).unwrap()
        } else {
            constraint_after(&contract_spec(), incomplete)
        };
        assert!(
            !c.allowed().unwrap().is_allowed(eos),
            "EOS allowed after {incomplete:?}"
        );
        assert!(!c.is_finished());
    }
    let mut c = constraint_after(&contract_spec(), "Verdict: 通过\nReason: ok");
    let a = c.allowed().unwrap();
    assert!(a.is_allowed(eos));
    for id in allowed_ids(&a) {
        if let Some(b) = s.vocab.token_bytes(id) {
            assert!(
                !b.contains(&b'\n') && !b.contains(&b'\r'),
                "token {id} with a newline allowed"
            );
        }
    }
    c.consume(eos).unwrap();
    assert!(c.is_finished());
    assert_eq!(c.allowed().unwrap().count(), 0, "nothing after EOS");
    assert!(c.consume(eos).is_err());

    // The verdict is a choice between exactly two words.
    let mut c = constraint_after(&contract_spec(), "Verdict: ");
    for id in allowed_ids(&c.allowed().unwrap()) {
        let b = s.vocab.token_bytes(id).unwrap();
        assert!(
            "通过".as_bytes().starts_with(b) || "不通过".as_bytes().starts_with(b),
            "{:?}",
            String::from_utf8_lossy(b)
        );
    }

    // At the cap only EOS remains, and the matcher may already have stopped by itself.
    let full = format!("Verdict: 通过\nReason: {}", "a".repeat(MAX_REASON_CHARS));
    let mut c = constraint_after(&contract_spec(), &full);
    let a = c.allowed().unwrap();
    assert_eq!(
        allowed_ids(&a),
        vec![eos],
        "only EOS after {MAX_REASON_CHARS} chars"
    );
    assert!(contract::parse(&full).is_ok());
}

/// A disallowed token is rejected with a typed error and leaves the state usable; forced
/// tokens spell the fixed prefix; forks are independent.
#[test]
fn rejection_forcing_and_forks() {
    let s = setup();
    let eos = s.vocab.eos_token_ids()[0];
    let mut c = s.factory.build(&contract_spec()).unwrap();
    let bad = encode("Reason")[0];
    assert!(!c.allowed().unwrap().is_allowed(bad));
    assert!(matches!(
        c.consume(bad),
        Err(stageb_worker::constraint::ConstraintError::Rejected { .. })
    ));
    let forced = c.forced();
    assert!(!forced.is_empty(), "`Verdict: ` is forced");
    let fb = s.vocab.decode_bytes(&forced);
    assert!(
        b"Verdict: ".starts_with(&fb),
        "forced {:?}",
        String::from_utf8_lossy(&fb)
    );
    // Still usable after the rejection: the forced prefix is accepted.
    for &t in &forced {
        c.consume(t).unwrap();
    }

    // The fixed second-line prefix is forced once the verdict is chosen.
    let mut c = constraint_after(&contract_spec(), "Verdict: 通过");
    let fb = s.vocab.decode_bytes(&c.forced());
    assert!(
        !fb.is_empty() && b"\nReason: ".starts_with(&fb),
        "forced {:?}",
        String::from_utf8_lossy(&fb)
    );

    // Forks from one state diverge independently (one per candidate after a shared prefix).
    let base = constraint_after(&contract_spec(), "Verdict: ");
    let (mut a, mut b) = (base.fork(), base.fork());
    for id in encode("通过\nReason: 好") {
        a.consume(id).unwrap();
    }
    for id in encode("不通过\nReason: 差") {
        b.consume(id).unwrap();
    }
    assert!(a.allowed().unwrap().is_allowed(eos) && b.allowed().unwrap().is_allowed(eos));
    let mut base = base;
    assert!(
        !base.allowed().unwrap().is_allowed(eos),
        "the parent is untouched by its forks"
    );
}

/// The mask cost on this vocabulary at representative contract states.
#[test]
fn contract_mask_timing() {
    let s = setup();
    let t = Instant::now();
    let c0 = s
        .factory
        .build(&ConstraintSpec::Contract {
            max_reason_chars: 200,
        })
        .unwrap();
    eprintln!(
        "first build of a contract constraint (grammar compile): {:?}",
        t.elapsed()
    );
    let t = Instant::now();
    let _c1 = s
        .factory
        .build(&ConstraintSpec::Contract {
            max_reason_chars: 200,
        })
        .unwrap();
    eprintln!(
        "cached build (deep clone of the start state): {:?}",
        t.elapsed()
    );
    drop(c0);
    let mut timer = MaskTimer::default();
    let text = "Verdict: 不通过\nReason: 图片2中挡风板缺失，螺丝松动，need more bolts; 安装不到位 and the cover is open on the left side";
    let ids = encode(text);
    for round in 0..3 {
        let mut c = s.factory.build(&contract_spec()).unwrap();
        for &id in &ids {
            let a = timer.allowed(&mut c);
            assert!(a.is_allowed(id), "round {round}");
            c.consume(id).unwrap();
        }
    }
    timer.report("contract mask along a realistic reason (3 rounds)");
}

/// Tiny caps stress the length rule the cap module adds on top of the grammar: walks biased
/// toward whitespace and multi-byte pieces never dead-end, never exceed the cap, and finish as
/// valid contracts.
#[test]
fn random_walks_with_tiny_caps_respect_the_cap_exactly() {
    let s = setup();
    let eos = s.vocab.eos_token_ids()[0];
    let spacey: Vec<bool> = (0..s.vocab.len() as u32)
        .map(|id| {
            s.vocab
                .token_bytes(id)
                .is_some_and(|b| b.iter().any(|&x| x == b' ' || x >= 0x80))
        })
        .collect();
    for max in [1usize, 2, 3, 5] {
        let spec = ConstraintSpec::Contract {
            max_reason_chars: max,
        };
        let root = s.factory.build(&spec).unwrap();
        for walk in 0..25u64 {
            let mut rng = Rng(max as u64 * 1000 + walk);
            let mut c = root.fork();
            let mut ids = Vec::new();
            while !c.is_finished() && ids.len() < 300 {
                let allowed = c.allowed().unwrap();
                let all = allowed_ids(&allowed);
                assert!(
                    !all.is_empty(),
                    "cap {max} walk {walk}: dead end after {:?}",
                    String::from_utf8_lossy(&s.vocab.decode_bytes(&ids))
                );
                let sp: Vec<u32> = all
                    .iter()
                    .copied()
                    .filter(|&i| spacey[i as usize])
                    .collect();
                let pick = if allowed.is_allowed(eos) && rng.chance(30) {
                    eos
                } else if !sp.is_empty() && rng.chance(70) {
                    sp[rng.below(sp.len())]
                } else {
                    all[rng.below(all.len())]
                };
                c.consume(pick).unwrap();
                ids.push(pick);
            }
            let text = String::from_utf8(s.vocab.decode_bytes(&ids)).unwrap();
            assert!(
                c.is_finished(),
                "cap {max} walk {walk} did not finish: {text:?}"
            );
            let reason = text.split_once("\nReason: ").unwrap().1;
            assert!(
                reason.chars().count() <= max,
                "cap {max}: reason {reason:?} too long"
            );
            contract::parse(&text)
                .unwrap_or_else(|v| panic!("cap {max} walk {walk}: {v}: {text:?}"));
        }
    }
}

/// Tokens made only of JSON structure (quotes, brackets, commas, colons, spaces): picking them
/// often makes strings and lists close, so random walks finish.
fn json_structure_tokens(vocab: &Vocabulary) -> Vec<bool> {
    (0..vocab.len() as u32)
        .map(|id| {
            vocab
                .token_bytes(id)
                .is_some_and(|b| b.iter().all(|x| b"\"]},:[{ \n".contains(x)))
        })
        .collect()
}

fn json_walk(
    spec: &ConstraintSpec,
    seed: u64,
    max_steps: usize,
    timer: &mut MaskTimer,
) -> Option<String> {
    let s = setup();
    let structure = json_structure_tokens(&s.vocab);
    let mut rng = Rng(seed);
    let mut c = s.factory.build(spec).unwrap();
    let mut ids = Vec::new();
    while !c.is_finished() && ids.len() < max_steps {
        let allowed = timer.allowed(&mut c);
        let all = allowed_ids(&allowed);
        assert!(
            !all.is_empty(),
            "seed {seed}: dead end after {:?}",
            String::from_utf8_lossy(&s.vocab.decode_bytes(&ids))
        );
        let st: Vec<u32> = all
            .iter()
            .copied()
            .filter(|&i| structure[i as usize])
            .collect();
        let pick = if !st.is_empty() && rng.chance(40) {
            st[rng.below(st.len())]
        } else {
            all[rng.below(all.len())]
        };
        c.consume(pick).unwrap();
        ids.push(pick);
    }
    let text = String::from_utf8(s.vocab.decode_bytes(&ids)).expect("JSON output is UTF-8");
    c.is_finished().then_some(text)
}

fn is_ticket_key(k: &str) -> bool {
    (k.ends_with("::pass") || k.ends_with("::fail")) && k.chars().count() <= TICKET_KEY_MAX_CHARS
}

/// (c) Random walks through the decision schema end in text `parse_decision` accepts, within
/// the schema's bounds.
#[test]
fn random_walks_through_the_decision_schema_parse() {
    let spec = ConstraintSpec::JsonSchema(reflection_schema::decision_json_schema());
    let mut timer = MaskTimer::default();
    let (walks, mut finished) = (25, 0);
    for seed in 0..walks {
        let Some(text) = json_walk(&spec, 0xDEC0 + seed, 3000, &mut timer) else {
            continue;
        };
        finished += 1;
        let d = reflection_schema::parse_decision(&text)
            .unwrap_or_else(|e| panic!("seed {seed}: {e}\n{text}"));
        assert!(d.decision_analysis.chars().count() <= ANALYSIS_MAX_CHARS);
        assert!(
            d.no_evidence_group_ids.iter().all(|k| is_ticket_key(k)),
            "{text}"
        );
    }
    timer.report("decision schema random walks");
    assert!(
        finished * 10 >= walks * 8,
        "only {finished}/{walks} decision walks finished"
    );
}

/// (c) Random walks through the ops schema (≤ 3 ops) end in text `parse_ops` accepts, with
/// every op shaped as its kind requires.
#[test]
fn random_walks_through_the_ops_schema_parse() {
    let spec = ConstraintSpec::JsonSchema(reflection_schema::ops_json_schema(3));
    let mut timer = MaskTimer::default();
    let (walks, mut finished, mut ops_seen) = (25, 0, 0);
    let mut kinds = std::collections::BTreeMap::<String, usize>::new();
    let mut lengths = std::collections::BTreeSet::new();
    for seed in 0..walks {
        let Some(text) = json_walk(&spec, 0x0125 + seed, 3000, &mut timer) else {
            continue;
        };
        finished += 1;
        let o = reflection_schema::parse_ops(&text)
            .unwrap_or_else(|e| panic!("seed {seed}: {e}\n{text}"));
        assert!(
            o.operations.len() <= 3 && o.evidence_analysis.chars().count() <= ANALYSIS_MAX_CHARS
        );
        lengths.insert(o.operations.len());
        for op in &o.operations {
            ops_seen += 1;
            *kinds.entry(op.op.clone()).or_default() += 1;
            assert!(
                !op.evidence.is_empty() && op.evidence.iter().all(|k| is_ticket_key(k)),
                "{text}"
            );
            let key_ok = op.key.as_deref().is_some_and(|k| k.starts_with('G'));
            let text_ok = op
                .text
                .as_deref()
                .is_some_and(|t| !t.is_empty() && t.chars().count() <= RULE_TEXT_MAX_CHARS);
            assert!(
                op.rationale
                    .as_deref()
                    .is_some_and(|r| r.chars().count() <= RATIONALE_MAX_CHARS)
            );
            match op.op.as_str() {
                "add" => assert!(op.key.is_none() && text_ok && op.merged_from.is_none()),
                "update" => assert!(key_ok && text_ok && op.merged_from.is_none()),
                "delete" => assert!(key_ok && op.text.is_none() && op.merged_from.is_none()),
                "merge" => assert!(
                    key_ok && text_ok && op.merged_from.as_ref().is_some_and(|m| !m.is_empty())
                ),
                other => panic!("op kind {other:?} outside the schema's enum"),
            }
        }
    }
    timer.report("ops schema random walks");
    eprintln!(
        "{finished}/{walks} ops walks finished with {ops_seen} operations: {kinds:?}, list lengths {lengths:?}"
    );
    assert!(
        finished * 10 >= walks * 8,
        "only {finished}/{walks} ops walks finished"
    );
    assert_eq!(
        kinds.len(),
        4,
        "every op kind generated at least once: {kinds:?}"
    );
}

/// llguidance tokenizes forced text through our environment: the real tokenizer for UTF-8
/// (canonical tokens, what the model saw in training), greedy trie tokens for a partial
/// character.
#[test]
fn tok_env_uses_the_real_tokenizer_and_falls_back_greedily() {
    let s = setup();
    let env = s.vocab.tok_env();
    let text = "Verdict: 通过\nReason: 12345 ok";
    assert_eq!(
        env.tokenize_bytes(text.as_bytes()),
        s.tokenizer.encode(text, false).unwrap().get_ids()
    );
    let mut partial = "需".as_bytes().to_vec();
    partial.extend_from_slice(&"复".as_bytes()[..2]);
    let ids = env.tokenize_bytes(&partial);
    assert_eq!(s.vocab.decode_bytes(&ids), partial);
    assert_eq!(env.tok_trie().eos_tokens(), s.vocab.eos_token_ids());
}
