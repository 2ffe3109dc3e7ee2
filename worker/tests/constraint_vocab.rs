//! Vocabulary extraction and the constraints on a small SentencePiece-style (Llama-2) tokenizer
//! built in the test: no model file needed, so this runs everywhere.
//!
//! The SmolLM2 tests cover byte-level BPE; this covers the other style the worker supports:
//! `<0xNN>` byte-fallback tokens are single bytes, `▁` is a space, added tokens are special.

use std::str::FromStr;

use stageb_shared::contract;
use stageb_worker::constraint::{
    ConstraintError, ConstraintFactory, ConstraintSpec, VocabStyle, Vocabulary,
};
use tokenizers::Tokenizer;

/// A Llama-2-shaped tokenizer.json: BPE with byte fallback, the Replace/ByteFallback/Fuse/Strip
/// decoder, three added special tokens, all 256 byte tokens and a few word pieces.
fn llama2_style_tokenizer() -> Tokenizer {
    let mut vocab = serde_json::Map::new();
    for (i, t) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
        vocab.insert((*t).into(), i.into());
    }
    for b in 0..=255u32 {
        vocab.insert(format!("<0x{b:02X}>"), (3 + b).into());
    }
    let pieces = [
        "▁",
        "Verdict",
        ":",
        "▁通过",
        "▁不通过",
        "Reason",
        "▁需",
        "复",
        "核",
        "▁ok",
        "▁need",
        "review",
    ];
    for (i, p) in pieces.iter().enumerate() {
        vocab.insert((*p).into(), (259 + i).into());
    }
    let added: Vec<serde_json::Value> = ["<unk>", "<s>", "</s>"]
        .iter()
        .enumerate()
        .map(|(i, t)| {
            serde_json::json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": true,
            "byte_fallback": true, "ignore_merges": false,
            "vocab": vocab, "merges": []}
    });
    Tokenizer::from_str(&json.to_string()).expect("synthetic tokenizer")
}

#[test]
fn sentencepiece_style_is_detected_from_the_decoder_and_mapped_to_bytes() {
    let tok = llama2_style_tokenizer();
    let v = Vocabulary::from_tokenizer(&tok, &[2]).unwrap();
    assert_eq!(v.style(), VocabStyle::SentencePiece);
    assert_eq!(v.len(), 259 + 12);
    assert_eq!(
        v.token_bytes(3 + 0x0A),
        Some(&b"\n"[..]),
        "<0x0A> is a newline byte"
    );
    assert_eq!(
        v.token_bytes(3 + 0xE5),
        Some(&[0xE5u8][..]),
        "<0xE5> is a lone UTF-8 lead byte"
    );
    assert_eq!(v.token_bytes(259), Some(&b" "[..]), "▁ is a space");
    assert_eq!(v.token_bytes(262), Some(" 通过".as_bytes()));
    for id in 0..3 {
        assert!(v.is_special(id) && v.token_bytes(id).is_none());
    }
    assert_eq!(v.special_name(2), Some("</s>"));
    assert_eq!(
        v.decode_bytes(&[1, 260, 261, 262, 2]),
        "Verdict: 通过".as_bytes()
    );
}

#[test]
fn eos_must_be_a_special_token_and_padding_adds_dead_ids() {
    let tok = llama2_style_tokenizer();
    assert!(matches!(
        Vocabulary::from_tokenizer(&tok, &[260]),
        Err(ConstraintError::Build(_))
    ));
    assert!(matches!(
        Vocabulary::from_tokenizer(&tok, &[]),
        Err(ConstraintError::Build(_))
    ));
    let v = Vocabulary::from_tokenizer(&tok, &[2])
        .unwrap()
        .padded_to(300);
    assert_eq!(v.len(), 300);
    assert!(v.token_bytes(299).is_none() && !v.is_special(299));
}

#[test]
fn a_tokenizer_with_no_byte_mapping_is_refused_not_guessed() {
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1}, "unk_token": "[UNK]"}
    });
    let tok = Tokenizer::from_str(&json.to_string()).unwrap();
    let err = Vocabulary::from_tokenizer(&tok, &[0]).unwrap_err();
    assert!(err.to_string().contains("cannot tell"), "{err}");
}

/// Random walks over a byte-fallback vocabulary: characters are spelled byte by byte, so every
/// multi-byte character crosses token boundaries; outputs still always parse.
#[test]
fn contract_walks_over_a_byte_fallback_vocabulary_parse() {
    let tok = llama2_style_tokenizer();
    let vocab = Vocabulary::from_tokenizer(&tok, &[2]).unwrap();
    let factory = ConstraintFactory::new(vocab.clone()).unwrap();
    let spec = ConstraintSpec::Contract {
        max_reason_chars: 12,
    };
    let mut state = 0x1234_5678_9abc_def0u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    // Pieces that press on the banned words (需, 复, 核, need, review, space) half of the time.
    let bait: Vec<u32> = vec![259, 265, 266, 267, 269, 270];
    for walk in 0..40 {
        let mut c = factory.build(&spec).unwrap();
        let mut ids = Vec::new();
        while !c.is_finished() && ids.len() < 400 {
            let a = c.allowed().unwrap();
            let all: Vec<u32> = (0..a.len() as u32).filter(|&i| a.is_allowed(i)).collect();
            assert!(!all.is_empty(), "walk {walk}: dead end");
            let baited: Vec<u32> = bait.iter().copied().filter(|&i| a.is_allowed(i)).collect();
            let r = next();
            let pick = if a.is_allowed(2) && r % 8 == 0 {
                2
            } else if !baited.is_empty() && r % 2 == 1 {
                baited[(r >> 8) as usize % baited.len()]
            } else {
                all[(r >> 8) as usize % all.len()]
            };
            c.consume(pick).unwrap();
            ids.push(pick);
        }
        assert!(c.is_finished(), "walk {walk} did not finish");
        let text = String::from_utf8(vocab.decode_bytes(&ids)).unwrap();
        let p = contract::parse(&text).unwrap_or_else(|v| panic!("walk {walk}: {v}: {text:?}"));
        assert!(
            text.split_once("\nReason: ").unwrap().1.chars().count() <= 12,
            "{p:?}"
        );
    }
}

#[test]
fn invalid_json_schema_is_a_build_error() {
    let tok = llama2_style_tokenizer();
    let factory = ConstraintFactory::new(Vocabulary::from_tokenizer(&tok, &[2]).unwrap()).unwrap();
    let bad = serde_json::json!({"type": "object", "properties": {"a": {"type": "no-such-type"}}});
    assert!(matches!(
        factory.build(&ConstraintSpec::JsonSchema(bad)),
        Err(ConstraintError::Build(_))
    ));
    assert!(matches!(
        factory.build(&ConstraintSpec::Contract {
            max_reason_chars: 0
        }),
        Err(ConstraintError::Build(_))
    ));
}
