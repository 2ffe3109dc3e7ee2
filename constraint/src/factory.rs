//! Compiling [`ConstraintSpec`]s with llguidance and running them as [`TokenConstraint`]s.
//!
//! The [`ConstraintFactory`] owns llguidance's `ParserFactory` (token trie plus precomputed
//! slices over the whole vocabulary: built once per model, the expensive part) and a small
//! cache of compiled start states, so grammar compilation is paid once per spec and every
//! constraint starts as a `deep_clone`. The per-sequence state is an `llguidance::Matcher`;
//! for the contract it is wrapped with the reason-length cap ([`super::reason_cap`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use llguidance::api::{StopReason, TopLevelGrammar};
use llguidance::{Matcher, ParserFactory};

use super::contract_grammar::contract_lark;
use super::reason_cap::{ReasonCap, char_starts};
use super::vocab::Vocabulary;
use super::{AllowedTokens, ConstraintError, ConstraintSpec, TokenConstraint};

/// Compiled start states kept per spec; specs are few (the contract and one or two schemas),
/// the bound only protects against a caller sending a new schema every time.
const MAX_CACHED_SPECS: usize = 32;

/// Builds constraints for one model's vocabulary. Create once per model (expensive) and share.
pub struct ConstraintFactory {
    parser_factory: Arc<ParserFactory>,
    vocab: Vocabulary,
    /// Characters each token starts (its non-continuation bytes), for the reason cap.
    token_starts: Arc<Vec<u32>>,
    max_token_starts: usize,
    templates: Mutex<HashMap<String, Matcher>>,
}

impl std::fmt::Debug for ConstraintFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConstraintFactory")
            .field("vocab", &self.vocab)
            .finish_non_exhaustive()
    }
}

impl ConstraintFactory {
    /// Builds llguidance's parser factory over `vocab` (walks the whole token trie).
    pub fn new(vocab: Vocabulary) -> Result<Self, ConstraintError> {
        let env = vocab.tok_env();
        let mut pf =
            ParserFactory::new_simple(&env).map_err(|e| ConstraintError::Build(e.to_string()))?;
        // Errors come back as values; llguidance's own stderr logging would only duplicate them.
        pf.quiet();
        let token_starts: Vec<u32> = (0..vocab.len() as u32)
            .map(|id| vocab.token_bytes(id).map_or(0, |b| char_starts(b) as u32))
            .collect();
        let max_token_starts = token_starts.iter().copied().max().unwrap_or(0) as usize;
        let factory = ConstraintFactory {
            parser_factory: Arc::new(pf),
            vocab,
            token_starts: Arc::new(token_starts),
            max_token_starts,
            templates: Mutex::new(HashMap::new()),
        };
        // Compile the contract now (~1 s: folding every Unicode scalar value for the banned-word
        // classes, then llguidance's compile) so the first rollout does not pay for it.
        factory.build(&ConstraintSpec::Contract {
            max_reason_chars: 1,
        })?;
        Ok(factory)
    }

    pub fn vocabulary(&self) -> &Vocabulary {
        &self.vocab
    }

    /// The Lark grammar the contract compiles to (the length cap is applied on top of it).
    pub fn contract_grammar() -> Result<String, ConstraintError> {
        contract_lark()
    }

    /// A fresh constraint at the start of `spec`'s language.
    pub fn build(
        &self,
        spec: &ConstraintSpec,
    ) -> Result<Box<dyn TokenConstraint>, ConstraintError> {
        match spec {
            ConstraintSpec::Contract { max_reason_chars } => {
                if *max_reason_chars == 0 {
                    return Err(ConstraintError::Build(
                        "max_reason_chars must be at least 1".into(),
                    ));
                }
                let inner = self.llg("contract".into(), || {
                    Ok(TopLevelGrammar::from_lark(contract_lark()?))
                })?;
                Ok(Box::new(ContractConstraint {
                    inner,
                    cap: ReasonCap::new(*max_reason_chars),
                    token_starts: self.token_starts.clone(),
                    max_token_starts: self.max_token_starts,
                }))
            }
            ConstraintSpec::JsonSchema(schema) => {
                Ok(Box::new(self.llg(format!("json:{schema}"), || {
                    Ok(TopLevelGrammar::from_json_schema(schema.clone()))
                })?))
            }
        }
    }

    /// An llguidance constraint at the start of the grammar cached under `key`.
    fn llg(
        &self,
        key: String,
        grammar: impl FnOnce() -> Result<TopLevelGrammar, ConstraintError>,
    ) -> Result<LlgConstraint, ConstraintError> {
        let mut templates = self
            .templates
            .lock()
            .map_err(|_| ConstraintError::Internal("poisoned cache".into()))?;
        let matcher = match templates.get(&key) {
            Some(m) => m.deep_clone(),
            None => {
                let grammar = grammar()?;
                let parser = self
                    .parser_factory
                    .create_parser(grammar)
                    .map_err(|e| ConstraintError::Build(e.to_string()))?;
                let m = Matcher::new(Ok(parser));
                if let Some(e) = m.get_error() {
                    return Err(ConstraintError::Build(e));
                }
                if templates.len() >= MAX_CACHED_SPECS {
                    templates.clear();
                }
                templates.insert(key, m.deep_clone());
                m
            }
        };
        Ok(LlgConstraint {
            matcher,
            vocab: self.vocab.clone(),
            eos_consumed: false,
        })
    }
}

/// A [`TokenConstraint`] over an llguidance [`Matcher`].
struct LlgConstraint {
    matcher: Matcher,
    vocab: Vocabulary,
    /// The matcher stops by itself once nothing can follow (a JSON object's closing brace); an
    /// EOS the engine samples after that is recorded here instead of being fed to the stopped
    /// matcher.
    eos_consumed: bool,
}

impl LlgConstraint {
    fn stopped_ok(&self) -> bool {
        matches!(
            self.matcher.stop_reason(),
            StopReason::NoExtension | StopReason::EndOfSentence
        )
    }

    fn eos_only(&self) -> AllowedTokens {
        let mut a = AllowedTokens::none(self.vocab.len());
        for &e in self.vocab.eos_token_ids() {
            a.allow(e);
        }
        a
    }

    fn error(&self, context: &str) -> ConstraintError {
        ConstraintError::Internal(format!(
            "{context}: {}",
            self.matcher
                .get_error()
                .unwrap_or_else(|| format!("{:?}", self.matcher.stop_reason()))
        ))
    }
}

impl TokenConstraint for LlgConstraint {
    fn allowed(&mut self) -> Result<AllowedTokens, ConstraintError> {
        if self.eos_consumed || self.matcher.stop_reason() == StopReason::EndOfSentence {
            return Ok(AllowedTokens::none(self.vocab.len()));
        }
        if self.matcher.is_stopped() {
            return if self.stopped_ok() {
                Ok(self.eos_only())
            } else {
                Err(self.error("constraint stopped"))
            };
        }
        let mask = self
            .matcher
            .compute_mask()
            .map_err(|e| ConstraintError::Internal(e.to_string()))?;
        let len = self.vocab.len();
        let mut words = mask.as_slice()[..len.div_ceil(32)].to_vec();
        if !len.is_multiple_of(32)
            && let Some(last) = words.last_mut()
        {
            *last &= (1u32 << (len % 32)) - 1;
        }
        Ok(AllowedTokens::from_words(words, len))
    }

    fn consume(&mut self, token: u32) -> Result<(), ConstraintError> {
        let is_eos = self.vocab.eos_token_ids().contains(&token);
        if self.matcher.is_stopped() {
            // Stopped by itself (nothing can follow): the engine's EOS is the end, once.
            if is_eos && self.matcher.stop_reason() == StopReason::NoExtension && !self.eos_consumed
            {
                self.eos_consumed = true;
                return Ok(());
            }
            return Err(ConstraintError::Rejected {
                token,
                detail: "the constraint is finished".into(),
            });
        }
        // try_consume validates first, so a rejected token leaves the state usable.
        match self.matcher.try_consume_tokens(&[token]) {
            Ok(1) => Ok(()),
            Ok(_) => Err(ConstraintError::Rejected {
                token,
                detail: "not allowed in this state".into(),
            }),
            Err(e) => Err(ConstraintError::Rejected {
                token,
                detail: e.to_string(),
            }),
        }
    }

    fn forced(&mut self) -> Vec<u32> {
        if self.matcher.is_stopped() {
            return Vec::new();
        }
        self.matcher.compute_ff_tokens()
    }

    fn is_finished(&self) -> bool {
        self.eos_consumed || (self.matcher.is_stopped() && self.stopped_ok())
    }

    fn fork(&self) -> Box<dyn TokenConstraint> {
        Box::new(self.deep_clone())
    }
}

impl LlgConstraint {
    fn deep_clone(&self) -> Self {
        LlgConstraint {
            matcher: self.matcher.deep_clone(),
            vocab: self.vocab.clone(),
            eos_consumed: self.eos_consumed,
        }
    }
}

/// The contract: the llguidance grammar plus the reason-length cap.
struct ContractConstraint {
    inner: LlgConstraint,
    cap: ReasonCap,
    token_starts: Arc<Vec<u32>>,
    max_token_starts: usize,
}

impl ContractConstraint {
    fn cap_allows(&self, token: u32) -> bool {
        match self.inner.vocab.token_bytes(token) {
            Some(b) => self
                .cap
                .allows(b, self.token_starts[token as usize] as usize),
            None => true, // EOS/special: the grammar decides
        }
    }
}

impl TokenConstraint for ContractConstraint {
    fn allowed(&mut self) -> Result<AllowedTokens, ConstraintError> {
        let mut allowed = self.inner.allowed()?;
        if !self.cap.is_slack(self.max_token_starts) {
            for id in 0..allowed.len() as u32 {
                if allowed.is_allowed(id) && !self.cap_allows(id) {
                    allowed.disallow(id);
                }
            }
        }
        Ok(allowed)
    }

    fn consume(&mut self, token: u32) -> Result<(), ConstraintError> {
        if !self.cap_allows(token) {
            return Err(ConstraintError::Rejected {
                token,
                detail: "reason would exceed its length cap".into(),
            });
        }
        self.inner.consume(token)?;
        if let Some(b) = self.inner.vocab.token_bytes(token) {
            self.cap
                .consume(b, self.token_starts[token as usize] as usize);
        }
        Ok(())
    }

    fn forced(&mut self) -> Vec<u32> {
        // Forced tokens only come from the fixed parts, but check them against the cap anyway
        // (a tiny cap could make one invalid): stop at the first one the cap refuses.
        let mut cap = self.cap.clone();
        let mut out = Vec::new();
        for t in self.inner.forced() {
            let Some(b) = self.inner.vocab.token_bytes(t) else {
                break;
            };
            let starts = self.token_starts[t as usize] as usize;
            if !cap.allows(b, starts) {
                break;
            }
            cap.consume(b, starts);
            out.push(t);
        }
        out
    }

    fn is_finished(&self) -> bool {
        self.inner.is_finished()
    }

    fn fork(&self) -> Box<dyn TokenConstraint> {
        Box::new(ContractConstraint {
            inner: self.inner.deep_clone(),
            cap: self.cap.clone(),
            token_starts: self.token_starts.clone(),
            max_token_starts: self.max_token_starts,
        })
    }
}
