//! `stageb-constraint`: constrained decoding, which tokens may come next.
//!
//! The worker's engine asks a [`TokenConstraint`] for the allowed set before every sampled token and
//! tells it which token was chosen. Two constraints exist: the two-line verdict contract and
//! JSON-schema mode for reflection outputs, both compiled by llguidance over a
//! [`Vocabulary`] (every token id's exact bytes), so multi-byte characters split across
//! tokens are handled at the byte level.
//!
//! # Layout
//! - [`vocab`]: [`Vocabulary`] (exact bytes per token id, byte-level BPE or SentencePiece) and
//!   the `toktrie` environment over it.
//! - `contract_grammar`: the contract as a Lark grammar, exactly as strict as
//!   `stageb_shared::contract::parse` (banned words via regex `&`/`~`).
//! - `reason_cap`: the reason-length cap applied on top of that grammar (measured: counting
//!   inside the llguidance regex made masks ~20× slower).
//! - `factory`: [`ConstraintFactory`] (llguidance's parser factory, built once per model) and
//!   the llguidance-backed [`TokenConstraint`]s.
//!
//! It depends on no inference code (no candle), so `stageb-worker` re-exports it as
//! `stageb_worker::constraint` and the fuzz targets build it alone.

use std::fmt;

mod contract_grammar;
mod factory;
mod reason_cap;
pub mod vocab;

pub use factory::ConstraintFactory;
pub use vocab::{VocabStyle, Vocabulary};

/// The set of token ids allowed at one step (a bitset over the vocabulary).
#[derive(Clone, PartialEq, Eq)]
pub struct AllowedTokens {
    words: Vec<u32>,
    len: usize,
}

impl AllowedTokens {
    pub fn none(len: usize) -> Self {
        AllowedTokens {
            words: vec![0; len.div_ceil(32)],
            len,
        }
    }

    pub fn all(len: usize) -> Self {
        let mut a = Self::none(len);
        for i in 0..len {
            a.allow(i as u32);
        }
        a
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|w| *w == 0)
    }

    pub fn allow(&mut self, id: u32) {
        let i = id as usize;
        if i < self.len {
            self.words[i / 32] |= 1 << (i % 32);
        }
    }

    pub fn disallow(&mut self, id: u32) {
        let i = id as usize;
        if i < self.len {
            self.words[i / 32] &= !(1 << (i % 32));
        }
    }

    pub fn is_allowed(&self, id: u32) -> bool {
        let i = id as usize;
        i < self.len && self.words[i / 32] & (1 << (i % 32)) != 0
    }

    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// The allowed id when exactly one is allowed (the grammar forces it).
    pub fn only(&self) -> Option<u32> {
        let mut found = None;
        for (i, w) in self.words.iter().enumerate() {
            if *w == 0 {
                continue;
            }
            if found.is_some() || w.count_ones() != 1 {
                return None;
            }
            let id = i * 32 + w.trailing_zeros() as usize;
            found = (id < self.len).then_some(id as u32);
        }
        found
    }

    /// The bitset: token `i` is bit `i % 32` of word `i / 32` (the sampler skips empty words).
    pub fn words(&self) -> &[u32] {
        &self.words
    }

    pub fn from_words(words: Vec<u32>, len: usize) -> Self {
        AllowedTokens { words, len }
    }
}

impl fmt::Debug for AllowedTokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AllowedTokens({} of {})", self.count(), self.len)
    }
}

/// What to constrain a generation to.
#[derive(Debug, Clone, PartialEq)]
pub enum ConstraintSpec {
    /// `Verdict: 通过|不通过` `\n` `Reason: <one line, no third-state word>` then end.
    Contract {
        /// Cap on the reason's length in characters.
        max_reason_chars: usize,
    },
    /// A JSON value matching this schema, then end.
    JsonSchema(serde_json::Value),
}

#[derive(Debug, thiserror::Error)]
pub enum ConstraintError {
    #[error("constraint grammar could not be built: {0}")]
    Build(String),
    #[error("token {token} rejected by the constraint: {detail}")]
    Rejected { token: u32, detail: String },
    #[error("constraint error: {0}")]
    Internal(String),
}

/// The per-sequence state of a constraint. `Sync` because the rows of a decode step are
/// sampled on several threads while the engine holding them is shared.
pub trait TokenConstraint: Send + Sync {
    /// Tokens allowed next. When the constraint is complete this contains only end-of-sequence
    /// ids (or is empty once stopped).
    fn allowed(&mut self) -> Result<AllowedTokens, ConstraintError>;
    /// Advance by the chosen token.
    fn consume(&mut self, token: u32) -> Result<(), ConstraintError>;
    /// Tokens the grammar forces next regardless of the model (may be empty); consuming them
    /// without sampling is an optimization, never a change of the language.
    fn forced(&mut self) -> Vec<u32>;
    /// True once the output is complete: the engine stops (after EOS, or without it).
    fn is_finished(&self) -> bool;
    /// An independent copy in the same state (one per candidate after a shared prefix).
    fn fork(&self) -> Box<dyn TokenConstraint>;
}
