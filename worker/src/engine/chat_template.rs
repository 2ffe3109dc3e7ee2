//! Rendering chat messages into a prompt with the model's own Jinja chat template.
//!
//! The template comes from the model (`tokenizer.chat_template` in GGUF metadata, or
//! `chat_template.jinja`, `chat_template.json` or `chat_template` in `tokenizer_config.json`
//! in that order). A model without one is refused at load: guessing a format (ChatML, say)
//! would prompt it in a language it was not trained on, silently.
//! Rendering follows HF `apply_chat_template`: `trim_blocks` and `lstrip_blocks` on,
//! `add_generation_prompt = true`, `enable_thinking = false` (as the Python original called
//! it), `bos_token`/`eos_token` in the context, Python string methods
//! through minijinja-contrib's `pycompat` (Qwen templates call `startswith`, `strip`, …).
//! Nothing is stripped from the result: the prompt is exactly what the template writes.

use minijinja::{Environment, ErrorKind, context};
use stageb_shared::domain::ChatMessage;

use super::EngineError;

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .finish_non_exhaustive()
    }
}

fn raise_exception(msg: String) -> Result<String, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

impl ChatTemplate {
    /// Compiles `source`, the model's template; `None` (the model has none) is an error.
    pub fn new(
        source: Option<&str>,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<Self, EngineError> {
        let source = source
            .ok_or_else(|| {
                EngineError::Model(
                    "the model has no chat template (GGUF `tokenizer.chat_template`; for a safetensors directory `chat_template.jinja`, `chat_template.json` or `chat_template` in `tokenizer_config.json`): stageb renders prompts only with the model's own template".into(),
                )
            })?
            .to_string();
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned("chat", source.clone())
            .map_err(|e| EngineError::Model(format!("chat template does not compile: {e}")))?;
        Ok(ChatTemplate {
            env,
            source,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// The prompt for `messages`, ending with the assistant turn's opening.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, EngineError> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| EngineError::Model(format!("chat template: {e}")))?;
        let msgs: Vec<_> = messages
            .iter()
            .map(|m| context! { role => m.role, content => m.content })
            .collect();
        tmpl.render(context! {
            messages => msgs,
            add_generation_prompt => true,
            // As the Python original rendered its prompts: Qwen3 templates then open the
            // answer with an empty think block instead of letting the model reason first.
            enable_thinking => false,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
        .map_err(|e| EngineError::InvalidRequest(format!("chat template failed to render: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The switch Qwen3's template reads (abridged from its end).
    const THINKING_SWITCH: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
        {% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}";

    #[test]
    fn templates_are_rendered_with_thinking_off_as_the_original_did() {
        let t = ChatTemplate::new(Some(THINKING_SWITCH), "", "<|im_end|>").unwrap();
        let prompt = t.render(&[ChatMessage::user("q")]).unwrap();
        assert!(
            prompt.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"),
            "{prompt:?}"
        );
    }

    #[test]
    fn a_model_without_a_chat_template_is_refused_never_given_chatml() {
        let err = ChatTemplate::new(None, "<s>", "</s>")
            .unwrap_err()
            .to_string();
        assert!(err.contains("the model has no chat template"), "{err}");
        assert!(err.contains("chat_template.jinja"), "{err}");
    }
}
