//! The model's vocabulary as exact bytes, and the `toktrie` environment built over it.
//!
//! Constrained decoding works on bytes, not decoded strings: in a byte-level BPE vocabulary a
//! Chinese character is often split across two tokens, each of which decodes alone to U+FFFD
//! (SmolLM2 has 314 such tokens). So every token id is mapped to the exact bytes it
//! contributes to the output:
//!
//! - **byte-level BPE** (GPT-2's byte↔unicode table: SmolLM2, Qwen, Llama-3): every character
//!   of the token string stands for one byte;
//! - **SentencePiece with byte fallback** (Llama-2 style): `<0xNN>` is byte `NN`, `▁` is a space,
//!   everything else is its UTF-8;
//! - **special / added tokens** (`<|im_end|>`, `<s>`, …) have no bytes: they never appear in
//!   constrained text. In the trie they are spelled `0xFF` + name, llguidance's convention, so
//!   they cannot collide with text (0xFF never occurs in UTF-8).
//!
//! The style is read from the tokenizer's decoder, pre-tokenizer and model configuration,
//! never guessed from individual tokens. We implement [`toktrie::TokenizerEnv`] ourselves
//! instead of using `toktrie_hf_tokenizers`, which pins `tokenizers` 0.21 (we use 0.23).

use std::collections::HashMap;
use std::sync::Arc;

use tokenizers::Tokenizer;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::ModelWrapper;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use toktrie::{TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use super::ConstraintError;

/// How token strings map to bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VocabStyle {
    /// GPT-2 byte-level BPE: each char of a token string is one byte.
    ByteLevel,
    /// SentencePiece: `▁` is a space, `<0xNN>` byte-fallback tokens are single bytes.
    SentencePiece,
}

/// Every token id's exact output bytes (`None` for special tokens), plus the end-of-sequence
/// ids. Cheap to clone (shared).
#[derive(Clone)]
pub struct Vocabulary {
    inner: Arc<VocabInner>,
}

struct VocabInner {
    /// `None`: special/added token (or an id hole): never part of constrained text.
    bytes: Vec<Option<Vec<u8>>>,
    /// Names of special tokens, for llguidance's `<name>` syntax and debugging.
    special_names: HashMap<u32, String>,
    eos: Vec<u32>,
    style: VocabStyle,
    tokenizer: Option<Tokenizer>,
}

impl std::fmt::Debug for Vocabulary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocabulary")
            .field("len", &self.len())
            .field("style", &self.inner.style)
            .field("special", &self.inner.special_names.len())
            .field("eos", &self.inner.eos)
            .finish()
    }
}

impl Vocabulary {
    /// Reads the exact bytes of every token id of `tok`. `eos_token_ids` are the ids that end a
    /// generation (e.g. `<|im_end|>` for ChatML models); they must be special tokens.
    pub fn from_tokenizer(
        tok: &Tokenizer,
        eos_token_ids: &[u32],
    ) -> Result<Vocabulary, ConstraintError> {
        let style = detect_style(tok)?;
        let n = tok.get_vocab_size(true);
        let added = tok.get_added_tokens_decoder();
        let byte_of = match style {
            VocabStyle::ByteLevel => Some(unicode_to_byte()),
            VocabStyle::SentencePiece => None,
        };
        let mut bytes = Vec::with_capacity(n);
        let mut special_names = HashMap::new();
        let mut unmappable = Vec::new();
        for id in 0..n as u32 {
            if let Some(t) = added.get(&id) {
                special_names.insert(id, t.content.clone());
                bytes.push(None);
                continue;
            }
            let Some(piece) = tok.id_to_token(id) else {
                bytes.push(None); // a hole in the id space: never allowed
                continue;
            };
            let mapped = match &byte_of {
                Some(map) => piece
                    .chars()
                    .map(|c| map.get(&c).copied())
                    .collect::<Option<Vec<u8>>>(),
                None => Some(sentencepiece_bytes(&piece)),
            };
            match mapped {
                Some(b) if !b.is_empty() => bytes.push(Some(b)),
                _ => {
                    // Not expressible as bytes (a control token the tokenizer did not register
                    // as added): treat it as special so it is never generated under a constraint.
                    unmappable.push(id);
                    special_names.insert(id, piece);
                    bytes.push(None);
                }
            }
        }
        // A real byte-level vocabulary has every regular token mappable; many failures mean the
        // style detection is wrong, and guessing on would build a wrong constraint.
        if unmappable.len() > 64.max(n / 100) {
            return Err(ConstraintError::Build(format!(
                "{} of {n} tokens are not {style:?} byte strings (e.g. id {}); unsupported tokenizer",
                unmappable.len(),
                unmappable[0]
            )));
        }
        if eos_token_ids.is_empty() {
            return Err(ConstraintError::Build(
                "no end-of-sequence token id given".into(),
            ));
        }
        for &e in eos_token_ids {
            if e as usize >= n {
                return Err(ConstraintError::Build(format!(
                    "eos id {e} outside the vocabulary of {n}"
                )));
            }
            if bytes[e as usize].is_some() {
                // An EOS that is also text would make "end" and "this text" indistinguishable.
                return Err(ConstraintError::Build(format!(
                    "eos id {e} is a regular text token"
                )));
            }
        }
        Ok(Vocabulary {
            inner: Arc::new(VocabInner {
                bytes,
                special_names,
                eos: eos_token_ids.to_vec(),
                style,
                tokenizer: Some(tok.clone()),
            }),
        })
    }

    /// A vocabulary from explicit parts (tests, models without a `tokenizers` tokenizer).
    /// `tokenize_bytes` falls back to greedy trie tokenization.
    pub fn from_parts(
        bytes: Vec<Option<Vec<u8>>>,
        special_names: HashMap<u32, String>,
        eos_token_ids: Vec<u32>,
        style: VocabStyle,
    ) -> Result<Vocabulary, ConstraintError> {
        if eos_token_ids.is_empty() || eos_token_ids.iter().any(|&e| e as usize >= bytes.len()) {
            return Err(ConstraintError::Build("invalid end-of-sequence ids".into()));
        }
        Ok(Vocabulary {
            inner: Arc::new(VocabInner {
                bytes,
                special_names,
                eos: eos_token_ids,
                style,
                tokenizer: None,
            }),
        })
    }

    /// The same vocabulary extended with never-allowed ids up to `len` (models whose embedding
    /// matrix is padded beyond the tokenizer, e.g. Qwen). Masks then have the logits' length.
    pub fn padded_to(&self, len: usize) -> Vocabulary {
        if len <= self.len() {
            return self.clone();
        }
        let mut bytes = self.inner.bytes.clone();
        bytes.resize(len, None);
        Vocabulary {
            inner: Arc::new(VocabInner {
                bytes,
                special_names: self.inner.special_names.clone(),
                eos: self.inner.eos.clone(),
                style: self.inner.style,
                tokenizer: self.inner.tokenizer.clone(),
            }),
        }
    }

    /// Number of token ids (the mask length).
    pub fn len(&self) -> usize {
        self.inner.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.inner.bytes.is_empty()
    }

    pub fn style(&self) -> VocabStyle {
        self.inner.style
    }

    /// The exact output bytes of `id`; `None` for special tokens and unknown ids.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.inner.bytes.get(id as usize).and_then(|b| b.as_deref())
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.inner.special_names.contains_key(&id)
    }

    /// The name of a special token (`<|im_end|>`).
    pub fn special_name(&self, id: u32) -> Option<&str> {
        self.inner.special_names.get(&id).map(String::as_str)
    }

    pub fn eos_token_ids(&self) -> &[u32] {
        &self.inner.eos
    }

    /// The exact bytes of a token sequence, special tokens skipped: the text a constrained
    /// generation produced.
    pub fn decode_bytes(&self, ids: &[u32]) -> Vec<u8> {
        ids.iter()
            .filter_map(|&id| self.token_bytes(id))
            .flatten()
            .copied()
            .collect()
    }

    /// The `toktrie` environment llguidance compiles grammars against.
    pub fn tok_env(&self) -> toktrie::TokEnv {
        Arc::new(VocabEnv::new(self))
    }
}

/// [`TokenizerEnv`] over a [`Vocabulary`]: the byte trie plus the real tokenizer for
/// canonical tokenization of forced text.
pub struct VocabEnv {
    trie: TokTrie,
    tokenizer: Option<Tokenizer>,
}

impl VocabEnv {
    pub fn new(vocab: &Vocabulary) -> Self {
        let words: Vec<Vec<u8>> = (0..vocab.len() as u32)
            .map(|id| match (vocab.token_bytes(id), vocab.special_name(id)) {
                (Some(b), _) => b.to_vec(),
                (None, Some(name)) => {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(name.as_bytes());
                    w
                }
                (None, None) => Vec::new(),
            })
            .collect();
        let eos = vocab.eos_token_ids();
        let info = TokRxInfo::new(words.len() as u32, eos[0]);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
        VocabEnv {
            trie,
            tokenizer: vocab.inner.tokenizer.clone(),
        }
    }
}

impl TokenizerEnv for VocabEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Real tokenization for valid UTF-8 (what the model saw in training), greedy trie
    /// tokenization for invalid stretches (a forced partial character).
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        match &self.tokenizer {
            Some(tok) => self.trie.tokenize_with_greedy_fallback(s, |text| {
                tok.encode_fast(text, false)
                    .map(|e| e.get_ids().to_vec())
                    .unwrap_or_else(|_| self.trie.greedy_tokenize(text.as_bytes()))
            }),
            None => self.trie.greedy_tokenize(s),
        }
    }
}

/// Reads the byte mapping from the tokenizer's configuration: the decoder first (it is what
/// turns tokens into text), then the pre-tokenizer, then the model's byte-fallback flag.
fn detect_style(tok: &Tokenizer) -> Result<VocabStyle, ConstraintError> {
    fn decoder_style(d: &DecoderWrapper) -> Option<VocabStyle> {
        match d {
            DecoderWrapper::ByteLevel(_) => Some(VocabStyle::ByteLevel),
            DecoderWrapper::ByteFallback(_) | DecoderWrapper::Metaspace(_) => {
                Some(VocabStyle::SentencePiece)
            }
            DecoderWrapper::Sequence(s) => {
                let styles: Vec<VocabStyle> =
                    s.get_decoders().iter().filter_map(decoder_style).collect();
                styles.first().copied()
            }
            _ => None,
        }
    }
    fn pre_style(p: &PreTokenizerWrapper) -> Option<VocabStyle> {
        match p {
            PreTokenizerWrapper::ByteLevel(_) => Some(VocabStyle::ByteLevel),
            PreTokenizerWrapper::Metaspace(_) => Some(VocabStyle::SentencePiece),
            PreTokenizerWrapper::Sequence(s) => s.as_ref().iter().find_map(pre_style),
            _ => None,
        }
    }
    if let Some(s) = tok.get_decoder().and_then(decoder_style) {
        return Ok(s);
    }
    if let Some(s) = tok.get_pre_tokenizer().and_then(pre_style) {
        return Ok(s);
    }
    match tok.get_model() {
        ModelWrapper::BPE(bpe) if bpe.byte_fallback => Ok(VocabStyle::SentencePiece),
        ModelWrapper::Unigram(_) => Ok(VocabStyle::SentencePiece),
        _ => Err(ConstraintError::Build(
            "cannot tell how this tokenizer maps tokens to bytes (no ByteLevel or \
             SentencePiece decoder, pre-tokenizer or byte fallback)"
                .into(),
        )),
    }
}

/// GPT-2's `bytes_to_unicode`, inverted: the printable stand-in character of each byte.
fn unicode_to_byte() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut map = HashMap::with_capacity(256);
    let mut shifted = 0u32;
    for b in 0..=255u8 {
        let c = if printable(b) {
            char::from(b)
        } else {
            shifted += 1;
            char::from_u32(255 + shifted).expect("below U+0200")
        };
        map.insert(c, b);
    }
    map
}

/// SentencePiece piece → bytes: `<0xNN>` is one byte, `▁` is a space.
fn sentencepiece_bytes(piece: &str) -> Vec<u8> {
    if let Some(hex) = piece.strip_prefix("<0x").and_then(|r| r.strip_suffix('>'))
        && hex.len() == 2
        && let Ok(b) = u8::from_str_radix(hex, 16)
    {
        return vec![b];
    }
    piece.replace('\u{2581}', " ").into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_byte_map_is_a_bijection_with_known_points() {
        let m = unicode_to_byte();
        assert_eq!(m.len(), 256);
        assert_eq!(m[&'Ġ'], b' ');
        assert_eq!(m[&'Ċ'], b'\n');
        assert_eq!(m[&'A'], b'A');
        let mut bytes: Vec<u8> = m.values().copied().collect();
        bytes.sort();
        bytes.dedup();
        assert_eq!(bytes.len(), 256);
    }

    #[test]
    fn sentencepiece_pieces_map_to_bytes() {
        assert_eq!(sentencepiece_bytes("<0x0A>"), b"\n");
        assert_eq!(sentencepiece_bytes("▁hello"), b" hello");
        assert_eq!(sentencepiece_bytes("<0x0>"), b"<0x0>");
        assert_eq!(sentencepiece_bytes("通过"), "通过".as_bytes());
    }
}
