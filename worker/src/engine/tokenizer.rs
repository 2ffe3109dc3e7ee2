//! The model's tokenizer, built from GGUF metadata or a `tokenizer.json`, and its stop tokens.
//!
//! candle's `TokenizerFromGguf` maps `tokenizer.ggml.pre` values it does not know (SmolLM2's
//! `smollm`, StarCoder's `starcoder`) to the GPT-2 default with `add_prefix_space = true`, which
//! inserts a space before the first word and after every special token: chat prompts become
//! out-of-distribution. We replace the pre-tokenizer with the one HF ships for those models
//! (and llama.cpp implements for `smollm`): `Sequence[Digits(individual), ByteLevel(no prefix
//! space, trim offsets, GPT-2 regex)]`.

use std::collections::BTreeSet;
use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::quantized::tokenizer::TokenizerFromGguf;
use tokenizers::Tokenizer;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;

use super::EngineError;
use super::gguf::{md_string, model_err};

/// End-of-turn tokens of the common chat formats; one of them counts as EOS when the chat
/// template writes it (ChatML's `<|im_end|>`, Llama-3's `<|eot_id|>`, Gemma's `<end_of_turn>`).
const END_OF_TURN_TOKENS: &[&str] = &[
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
];

/// Builds the tokenizer of a GGUF file (byte-level BPE, `tokenizer.ggml.model = gpt2`).
pub fn from_gguf(ct: &gguf_file::Content, path: &Path) -> Result<Tokenizer, EngineError> {
    let mut tok =
        Tokenizer::from_gguf(ct).map_err(|e| model_err(path, format!("tokenizer: {e}")))?;
    let pre = md_string(ct, "tokenizer.ggml.pre").unwrap_or_default();
    if pre == "smollm" || pre == "starcoder" {
        let seq = Sequence::new(vec![
            Digits::new(true).into(),
            ByteLevel::new(false, true, true).into(),
        ]);
        tok.with_pre_tokenizer(Some(seq));
    }
    Ok(tok)
}

/// Loads `tokenizer.json`.
pub fn from_file(path: &Path) -> Result<Tokenizer, EngineError> {
    Tokenizer::from_file(path).map_err(|e| model_err(path, format!("tokenizer: {e}")))
}

/// The ids that end a generation: the declared EOS / end-of-turn ids plus every known
/// end-of-turn token the chat template emits. Sorted, deduplicated.
pub fn stop_token_ids(tok: &Tokenizer, declared: &[u32], chat_template: Option<&str>) -> Vec<u32> {
    let mut ids: BTreeSet<u32> = declared.iter().copied().collect();
    if let Some(t) = chat_template {
        for name in END_OF_TURN_TOKENS {
            if t.contains(name)
                && let Some(id) = tok.token_to_id(name)
            {
                ids.insert(id);
            }
        }
    }
    ids.into_iter().collect()
}

/// The declared EOS-like ids in GGUF metadata.
pub fn gguf_declared_stops(ct: &gguf_file::Content) -> Vec<u32> {
    [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ]
    .iter()
    .filter_map(|k| ct.metadata.get(*k).and_then(|v| v.to_u32().ok()))
    .collect()
}

/// Special tokens that stand for an image or video in multimodal chat templates (Qwen-VL,
/// LLaVA-style). stageb runs a model's text tower only, with 1-D positions: a prompt holding
/// one would be computed as text and silently wrong, so it is refused.
pub const MEDIA_PLACEHOLDERS: &[&str] = &[
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image|>",
    "<|video|>",
    "<image>",
    "<video>",
];

/// The ids of this tokenizer's added (special) tokens that are [`MEDIA_PLACEHOLDERS`], with
/// their text.
pub fn media_placeholder_ids(tok: &Tokenizer) -> Vec<(u32, String)> {
    let mut ids: Vec<(u32, String)> = tok
        .get_added_tokens_decoder()
        .into_iter()
        .filter(|(_, t)| MEDIA_PLACEHOLDERS.contains(&t.content.as_str()))
        .map(|(id, t)| (id, t.content))
        .collect();
    ids.sort();
    ids
}

#[cfg(test)]
mod tests {
    use tokenizers::models::wordlevel::WordLevel;
    use tokenizers::{AddedToken, Tokenizer};

    use super::media_placeholder_ids;

    #[test]
    fn media_placeholders_are_found_among_added_tokens_only() {
        let vocab = [("<image>".to_string(), 0u32), ("a".to_string(), 1)]
            .into_iter()
            .collect();
        let model = WordLevel::builder().vocab(vocab).build().unwrap();
        let mut tok = Tokenizer::new(model);
        tok.add_special_tokens(
            ["<|im_start|>", "<|image_pad|>", "<|vision_start|>"]
                .map(|t| AddedToken::from(t, true)),
        )
        .unwrap();
        let names: Vec<String> = media_placeholder_ids(&tok)
            .into_iter()
            .map(|(_, n)| n)
            .collect();
        // `<image>` is an ordinary vocabulary entry here, not an added token: text, not media.
        assert_eq!(names, ["<|image_pad|>", "<|vision_start|>"]);
    }
}
