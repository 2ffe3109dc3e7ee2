//! The hyper-parameters of a loaded model ([`TransformerConfig`]) and its RoPE pairing: what
//! the loaders (`gguf`, `safetensors`) read from a checkpoint and both backends (the candle
//! transformer, the CPU fast path) compute with. Kept apart from either backend.

/// Which RoPE pairing the checkpoint expects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Pairs (2i, 2i+1): GGUF llama (the converter permutes q/k into this layout).
    Interleaved,
    /// Pairs (i, i+d/2): HF checkpoints and GGUF qwen2/qwen3.
    Neox,
}

/// Hyper-parameters of one loaded model.
#[derive(Debug, Clone, PartialEq)]
pub struct TransformerConfig {
    pub architecture: String,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub hidden: usize,
    pub vocab_size: usize,
    pub rms_eps: f64,
    pub rope_theta: f64,
    pub rope_style: RopeStyle,
    /// Per-frequency divisors (llama-3 style scaling baked into GGUF `rope_freqs.weight`).
    pub rope_freq_factors: Option<Vec<f32>>,
    /// The model's trained context (metadata), before our own cap.
    pub trained_context: Option<usize>,
}
