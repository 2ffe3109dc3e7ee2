//! Loading a GGUF file (llama, qwen2, qwen3) into our [`Transformer`].
//!
//! Reads the hyper-parameters from the `{arch}.*` metadata, the tensors by their llama.cpp
//! names, and decides per [`WeightFormat`] whether the block-quantized matrices stay quantized
//! (`QMatMul`) or are dequantized once to f32 (exact; candle's f32 matmul is much faster on CPU
//! than its Q4_1 kernel, which has no SIMD path in 0.11.1). Anything else (another architecture,
//! mixture-of-experts, partial RoPE) is refused with an error naming it; a bad file is an error,
//! never a panic.

use std::fs::File;
use std::path::Path;

use candle_core::quantized::{QMatMul, QTensor, gguf_file};
use candle_core::{DType, Device, Tensor};

use super::EngineError;
use super::cpu::model::{self as cpu_model, CpuLayer, CpuModel};
use super::cpu::weights::PackedMatrix;
use super::transformer::{
    Layer, Linear, LinearWeight, Projections, RopeStyle, Transformer, TransformerConfig,
};

/// How the linear layers' weights are held in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightFormat {
    /// CPU: dequantize to f32 when that takes at most [`AUTO_DEQUANTIZE_MAX_BYTES`]; otherwise
    /// (and on CUDA) keep the file's quantization.
    #[default]
    Auto,
    /// Keep quantized blocks; matmuls use candle's quantized kernels.
    Quantized,
    /// Dequantize every matrix to f32 at load (exact).
    Dequantized,
}

/// Above this many f32 bytes `Auto` keeps the weights quantized (memory over speed).
pub const AUTO_DEQUANTIZE_MAX_BYTES: u64 = 4 << 30;

pub(crate) fn model_err(path: &Path, e: impl std::fmt::Display) -> EngineError {
    EngineError::Model(format!("{}: {e}", path.display()))
}

/// Architectures whose GGUF tensors and metadata this loader understands.
pub const SUPPORTED_GGUF_ARCHITECTURES: &[&str] = &["llama", "qwen2", "qwen3"];

pub struct GgufModel {
    pub transformer: Transformer,
    /// Whether the linear layers ended up dequantized (part of the fingerprint's dtype).
    pub dequantized: bool,
}

fn md<'a>(ct: &'a gguf_file::Content, key: &str) -> Option<&'a gguf_file::Value> {
    ct.metadata.get(key)
}

fn md_u32(ct: &gguf_file::Content, path: &Path, key: &str) -> Result<usize, EngineError> {
    match md(ct, key) {
        Some(v) => v
            .to_u32()
            .map(|x| x as usize)
            .map_err(|e| model_err(path, format!("metadata {key}: {e}"))),
        None => Err(model_err(path, format!("missing metadata {key}"))),
    }
}

fn md_u32_opt(ct: &gguf_file::Content, key: &str) -> Option<usize> {
    md(ct, key)
        .and_then(|v| v.to_u32().ok())
        .map(|x| x as usize)
}

fn md_f32_opt(ct: &gguf_file::Content, key: &str) -> Option<f32> {
    md(ct, key).and_then(|v| v.to_f32().ok())
}

pub fn md_string(ct: &gguf_file::Content, key: &str) -> Option<String> {
    md(ct, key).and_then(|v| v.to_string().ok()).cloned()
}

/// The `general.architecture` of a GGUF file.
pub fn architecture(ct: &gguf_file::Content) -> String {
    md_string(ct, "general.architecture").unwrap_or_default()
}

/// Reads and validates the hyper-parameters of a supported architecture.
pub fn read_config(ct: &gguf_file::Content, path: &Path) -> Result<TransformerConfig, EngineError> {
    let arch = architecture(ct);
    if !SUPPORTED_GGUF_ARCHITECTURES.contains(&arch.as_str()) {
        return Err(EngineError::Model(format!(
            "{}: unsupported GGUF architecture `{arch}` (supported: {})",
            path.display(),
            SUPPORTED_GGUF_ARCHITECTURES.join(", ")
        )));
    }
    let key = |k: &str| format!("{arch}.{k}");
    if md_u32_opt(ct, &key("expert_count")).unwrap_or(0) > 1 {
        return Err(model_err(
            path,
            format!("unsupported: mixture-of-experts `{arch}` model"),
        ));
    }
    let n_head = md_u32(ct, path, &key("attention.head_count"))?;
    let n_kv_head = md_u32_opt(ct, &key("attention.head_count_kv")).unwrap_or(n_head);
    let hidden = md_u32(ct, path, &key("embedding_length"))?;
    let n_layer = md_u32(ct, path, &key("block_count"))?;
    if n_head == 0 || n_kv_head == 0 || n_head % n_kv_head != 0 || n_layer == 0 {
        return Err(model_err(
            path,
            format!("invalid head counts {n_head}/{n_kv_head} or {n_layer} layers"),
        ));
    }
    let head_dim = md_u32_opt(ct, &key("attention.key_length")).unwrap_or(hidden / n_head);
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(model_err(
            path,
            format!("invalid head dimension {head_dim}"),
        ));
    }
    if let Some(rot) = md_u32_opt(ct, &key("rope.dimension_count"))
        && rot != head_dim
    {
        return Err(model_err(
            path,
            format!("unsupported: partial RoPE ({rot} of {head_dim} dims)"),
        ));
    }
    let rms_eps = md_f32_opt(ct, &key("attention.layer_norm_rms_epsilon")).unwrap_or(1e-6) as f64;
    let rope_theta = md_f32_opt(ct, &key("rope.freq_base")).unwrap_or(10_000.0) as f64;
    if let Some(kind) = md_string(ct, &key("rope.scaling.type"))
        && kind != "none"
    {
        return Err(model_err(
            path,
            format!("unsupported: RoPE scaling `{kind}`"),
        ));
    }
    let vocab_size = match ct.tensor_infos.get("token_embd.weight") {
        Some(info) => info.shape.dims().first().copied().unwrap_or(0),
        None => return Err(model_err(path, "missing tensor token_embd.weight")),
    };
    Ok(TransformerConfig {
        rope_style: if arch == "llama" {
            RopeStyle::Interleaved
        } else {
            RopeStyle::Neox
        },
        architecture: arch.clone(),
        n_layer,
        n_head,
        n_kv_head,
        head_dim,
        hidden,
        vocab_size,
        rms_eps,
        rope_theta,
        rope_freq_factors: None,
        trained_context: md_u32_opt(ct, &key("context_length")),
    })
}

struct Reader<'a> {
    ct: &'a gguf_file::Content,
    file: &'a mut File,
    path: &'a Path,
    device: &'a Device,
    dequantize: bool,
    /// The dtype dense projections and the embedding are converted to (norms stay f32).
    dtype: DType,
}

impl Reader<'_> {
    fn has(&self, name: &str) -> bool {
        self.ct.tensor_infos.contains_key(name)
    }

    fn qtensor(&mut self, name: &str) -> Result<QTensor, EngineError> {
        if !self.has(name) {
            return Err(model_err(self.path, format!("missing tensor {name}")));
        }
        self.ct
            .tensor(self.file, name, self.device)
            .map_err(|e| model_err(self.path, format!("tensor {name}: {e}")))
    }

    fn dense(&mut self, name: &str) -> Result<Tensor, EngineError> {
        let q = self.qtensor(name)?;
        q.dequantize(self.device)
            .and_then(|t| t.to_dtype(DType::F32))
            .map_err(|e| model_err(self.path, format!("tensor {name}: {e}")))
    }

    /// A dense tensor in the compute dtype (the embedding, a bias, a dequantized matrix).
    fn compute(&mut self, name: &str) -> Result<Tensor, EngineError> {
        let dtype = self.dtype;
        self.dense(name)?
            .to_dtype(dtype)
            .map_err(|e| model_err(self.path, format!("tensor {name}: {e}")))
    }

    fn linear(&mut self, name: &str, bias: Option<&str>) -> Result<Linear, EngineError> {
        let transposed = |t: Tensor, path: &Path| {
            t.t()
                .and_then(|t| t.contiguous())
                .map_err(|e| model_err(path, format!("tensor {name}: {e}")))
        };
        let weight = if self.dequantize {
            LinearWeight::Dense(transposed(self.compute(name)?, self.path)?)
        } else {
            // Built directly (not `QMatMul::from_qtensor`) so the CANDLE_DEQUANTIZE_ALL env
            // variables cannot silently change the numerics behind the fingerprint.
            let q = self.qtensor(name)?;
            match q.dtype() {
                candle_core::quantized::GgmlDType::F32
                | candle_core::quantized::GgmlDType::F16
                | candle_core::quantized::GgmlDType::BF16 => LinearWeight::Dense(transposed(
                    q.dequantize(self.device)
                        .and_then(|t| t.to_dtype(DType::F32))
                        .map_err(|e| model_err(self.path, format!("tensor {name}: {e}")))?,
                    self.path,
                )?),
                _ => LinearWeight::Quantized(QMatMul::QTensor(std::sync::Arc::new(q))),
            }
        };
        let bias = match bias {
            Some(b) if self.has(b) => Some(self.compute(b)?),
            _ => None,
        };
        Ok(Linear { weight, bias })
    }
}

/// Bytes the linear layers and embedding take once dequantized to f32.
fn dequantized_bytes(ct: &gguf_file::Content) -> u64 {
    ct.tensor_infos
        .values()
        .map(|i| i.shape.elem_count() as u64 * 4)
        .sum()
}

/// Loads a GGUF file into candle's transformer computing in `dtype`. Quantized matrices
/// compute with f32 activations, so a bf16 model dequantizes them (a `quantized` format with
/// bf16 is refused).
pub fn load(
    path: &Path,
    file: &mut File,
    ct: &gguf_file::Content,
    device: &Device,
    (format, dtype): (WeightFormat, DType),
    max_context: usize,
) -> Result<GgufModel, EngineError> {
    let mut config = read_config(ct, path)?;
    let dequantize = match format {
        WeightFormat::Dequantized => true,
        WeightFormat::Quantized if dtype != DType::F32 => {
            return Err(EngineError::InvalidRequest(format!(
                "quantized GGUF weights compute with f32 activations, not {dtype:?}: use the dequantized weight format or f32 numerics"
            )));
        }
        WeightFormat::Quantized => false,
        WeightFormat::Auto if dtype != DType::F32 => true,
        WeightFormat::Auto => device.is_cpu() && dequantized_bytes(ct) <= AUTO_DEQUANTIZE_MAX_BYTES,
    };
    let mut r = Reader {
        ct,
        file,
        path,
        device,
        dequantize,
        dtype,
    };
    if r.has("rope_freqs.weight") {
        let f = r.dense("rope_freqs.weight")?;
        config.rope_freq_factors = Some(
            f.flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(|e| model_err(path, e))?,
        );
    }
    let embedding = r.compute("token_embd.weight")?;
    let final_norm = r.dense("output_norm.weight")?;
    let lm_head = if r.has("output.weight") {
        r.linear("output.weight", None)?
    } else if dequantize {
        // Tied embeddings: the head is the embedding matrix (a transposed copy, see `Linear`).
        Linear::dense(&embedding, None).map_err(|e| model_err(path, e))?
    } else {
        r.linear("token_embd.weight", None)?
    };
    let qk_norm = config.architecture == "qwen3";
    let mut layers = Vec::with_capacity(config.n_layer);
    for i in 0..config.n_layer {
        let p = format!("blk.{i}");
        let t = |s: &str| format!("{p}.{s}");
        layers.push(Layer {
            attn_norm: r.dense(&t("attn_norm.weight"))?,
            qkv: Projections::Separate([
                r.linear(&t("attn_q.weight"), Some(&t("attn_q.bias")))?,
                r.linear(&t("attn_k.weight"), Some(&t("attn_k.bias")))?,
                r.linear(&t("attn_v.weight"), Some(&t("attn_v.bias")))?,
            ]),
            wo: r.linear(&t("attn_output.weight"), None)?,
            q_norm: if qk_norm {
                Some(r.dense(&t("attn_q_norm.weight"))?)
            } else {
                None
            },
            k_norm: if qk_norm {
                Some(r.dense(&t("attn_k_norm.weight"))?)
            } else {
                None
            },
            ffn_norm: r.dense(&t("ffn_norm.weight"))?,
            gate_up: Projections::Separate([
                r.linear(&t("ffn_gate.weight"), None)?,
                r.linear(&t("ffn_up.weight"), None)?,
            ]),
            w_down: r.linear(&t("ffn_down.weight"), None)?,
        });
    }
    let transformer = Transformer::new(
        config,
        embedding,
        layers,
        final_norm,
        lm_head,
        max_context,
        device,
    )
    .map_err(|e| model_err(path, e))?;
    Ok(GgufModel {
        transformer,
        dequantized: dequantize,
    })
}

/// Loads a GGUF file for the CPU fast path ([`CpuModel`]): Q4_1/Q8_0 matrices stay in their
/// blocks, everything else is dequantized to f32 (exact); q|k|v and gate|up are stacked.
pub fn load_cpu(
    path: &Path,
    file: &mut File,
    ct: &gguf_file::Content,
    max_context: usize,
) -> Result<CpuModel, EngineError> {
    let mut config = read_config(ct, path)?;
    let device = Device::Cpu;
    let mut r = Reader {
        ct,
        file,
        path,
        device: &device,
        dequantize: false,
        dtype: DType::F32,
    };
    let vec = |r: &mut Reader, name: &str| -> Result<Vec<f32>, EngineError> {
        r.dense(name)?
            .flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(|e| model_err(path, format!("tensor {name}: {e}")))
    };
    let packed = |r: &mut Reader, name: &str| -> Result<PackedMatrix, EngineError> {
        let q = r.qtensor(name)?;
        cpu_model::pack(&q).map_err(|e| model_err(path, format!("tensor {name}: {e}")))
    };
    if r.has("rope_freqs.weight") {
        config.rope_freq_factors = Some(vec(&mut r, "rope_freqs.weight")?);
    }
    let embedding = packed(&mut r, "token_embd.weight")?;
    let lm_head = if r.has("output.weight") {
        Some(packed(&mut r, "output.weight")?)
    } else {
        None
    };
    let final_norm = vec(&mut r, "output_norm.weight")?;
    let qk_norm = config.architecture == "qwen3";
    let stack = |parts: &[&PackedMatrix], what: &str| {
        PackedMatrix::concat(parts).ok_or_else(|| model_err(path, format!("{what}: shapes differ")))
    };
    let mut layers = Vec::with_capacity(config.n_layer);
    for i in 0..config.n_layer {
        let t = |s: &str| format!("blk.{i}.{s}");
        let (wq, wk, wv) = (
            packed(&mut r, &t("attn_q.weight"))?,
            packed(&mut r, &t("attn_k.weight"))?,
            packed(&mut r, &t("attn_v.weight"))?,
        );
        let biases = ["attn_q.bias", "attn_k.bias", "attn_v.bias"];
        let qkv_bias = if biases.iter().any(|b| r.has(&t(b))) {
            let mut all = Vec::new();
            for (b, w) in biases.iter().zip([&wq, &wk, &wv]) {
                if r.has(&t(b)) {
                    all.extend(vec(&mut r, &t(b))?);
                } else {
                    all.extend(std::iter::repeat_n(0.0, w.rows()));
                }
            }
            Some(all)
        } else {
            None
        };
        let (gate, up) = (
            packed(&mut r, &t("ffn_gate.weight"))?,
            packed(&mut r, &t("ffn_up.weight"))?,
        );
        layers.push(CpuLayer {
            attn_norm: vec(&mut r, &t("attn_norm.weight"))?,
            qkv: stack(&[&wq, &wk, &wv], &t("attn_qkv"))?,
            qkv_bias,
            wo: packed(&mut r, &t("attn_output.weight"))?,
            q_norm: if qk_norm {
                Some(vec(&mut r, &t("attn_q_norm.weight"))?)
            } else {
                None
            },
            k_norm: if qk_norm {
                Some(vec(&mut r, &t("attn_k_norm.weight"))?)
            } else {
                None
            },
            ffn_norm: vec(&mut r, &t("ffn_norm.weight"))?,
            gate_up: stack(&[&gate, &up], &t("ffn_gate_up"))?,
            down: packed(&mut r, &t("ffn_down.weight"))?,
        });
    }
    CpuModel::new(config, embedding, lm_head, layers, final_norm, max_context)
        .map_err(|e| model_err(path, e))
}
