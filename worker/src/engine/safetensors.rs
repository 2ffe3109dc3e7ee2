//! Loading an HF safetensors directory (llama, qwen2, qwen3) into our [`Transformer`].
//!
//! The directory holds `config.json`, `tokenizer.json`, optionally `tokenizer_config.json`
//! (chat template, EOS) and `generation_config.json` (EOS ids), and `model.safetensors` or
//! shards `model-*.safetensors`. Weights are converted to f32 (the compute dtype of the
//! engine). HF checkpoints use the NEOX RoPE pairing. Unknown `model_type`s and RoPE scaling
//! are refused with an error naming them.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde_json::Value;

use super::EngineError;
use super::gguf::model_err;
use super::transformer::{Layer, Linear, RopeStyle, Transformer, TransformerConfig};

pub const SUPPORTED_MODEL_TYPES: &[&str] = &["llama", "qwen2", "qwen3"];

/// Weight files of a directory, in the fixed (sorted) order used for loading and hashing.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, EngineError> {
    let rd = std::fs::read_dir(dir).map_err(|e| model_err(dir, e))?;
    let mut files: Vec<PathBuf> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(model_err(
            dir,
            "no .safetensors file in the model directory",
        ));
    }
    Ok(files)
}

pub fn read_json(path: &Path) -> Result<Value, EngineError> {
    let s = std::fs::read_to_string(path).map_err(|e| model_err(path, e))?;
    serde_json::from_str(&s).map_err(|e| model_err(path, e))
}

fn get_usize(cfg: &Value, key: &str, path: &Path) -> Result<usize, EngineError> {
    cfg.get(key)
        .and_then(Value::as_u64)
        .map(|x| x as usize)
        .ok_or_else(|| model_err(path, format!("config.json: missing or invalid `{key}`")))
}

pub fn read_config(dir: &Path) -> Result<(TransformerConfig, bool), EngineError> {
    let path = dir.join("config.json");
    let cfg = read_json(&path)?;
    let model_type = cfg
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    if !SUPPORTED_MODEL_TYPES.contains(&model_type.as_str()) {
        return Err(EngineError::Model(format!(
            "{}: unsupported model_type `{model_type}` (supported: {})",
            path.display(),
            SUPPORTED_MODEL_TYPES.join(", ")
        )));
    }
    if let Some(s) = cfg.get("rope_scaling")
        && !s.is_null()
    {
        let kind = s
            .get("rope_type")
            .or_else(|| s.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("?");
        if kind != "default" {
            return Err(model_err(
                &path,
                format!("unsupported: RoPE scaling `{kind}`"),
            ));
        }
    }
    let hidden = get_usize(&cfg, "hidden_size", &path)?;
    let n_head = get_usize(&cfg, "num_attention_heads", &path)?;
    let n_kv_head = cfg
        .get("num_key_value_heads")
        .and_then(Value::as_u64)
        .map_or(n_head, |x| x as usize);
    let n_layer = get_usize(&cfg, "num_hidden_layers", &path)?;
    if n_head == 0 || n_kv_head == 0 || n_head % n_kv_head != 0 {
        return Err(model_err(
            &path,
            format!("invalid head counts {n_head}/{n_kv_head}"),
        ));
    }
    let head_dim = cfg
        .get("head_dim")
        .and_then(Value::as_u64)
        .map_or(hidden / n_head, |x| x as usize);
    let tied = cfg
        .get("tie_word_embeddings")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok((
        TransformerConfig {
            architecture: model_type,
            n_layer,
            n_head,
            n_kv_head,
            head_dim,
            hidden,
            vocab_size: get_usize(&cfg, "vocab_size", &path)?,
            rms_eps: cfg
                .get("rms_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-6),
            rope_theta: cfg
                .get("rope_theta")
                .and_then(Value::as_f64)
                .unwrap_or(10_000.0),
            rope_style: RopeStyle::Neox,
            rope_freq_factors: None,
            trained_context: cfg
                .get("max_position_embeddings")
                .and_then(Value::as_u64)
                .map(|x| x as usize),
        },
        tied,
    ))
}

struct Weights {
    map: HashMap<String, Tensor>,
    dir: PathBuf,
    device: Device,
}

impl Weights {
    fn take(&mut self, name: &str) -> Result<Tensor, EngineError> {
        let t = self
            .map
            .remove(name)
            .ok_or_else(|| model_err(&self.dir, format!("missing tensor {name}")))?;
        t.to_dtype(DType::F32)
            .and_then(|t| t.to_device(&self.device))
            .map_err(|e| model_err(&self.dir, e))
    }

    fn take_opt(&mut self, name: &str) -> Result<Option<Tensor>, EngineError> {
        if self.map.contains_key(name) {
            self.take(name).map(Some)
        } else {
            Ok(None)
        }
    }

    fn linear(&mut self, prefix: &str) -> Result<Linear, EngineError> {
        let w = self.take(&format!("{prefix}.weight"))?;
        let bias = self.take_opt(&format!("{prefix}.bias"))?;
        Linear::dense(&w, bias).map_err(|e| model_err(&self.dir, e))
    }
}

pub fn load(dir: &Path, device: &Device, max_context: usize) -> Result<Transformer, EngineError> {
    let (config, tied) = read_config(dir)?;
    let mut map = HashMap::new();
    for f in weight_files(dir)? {
        // Read to CPU first: dtype conversion happens per tensor as it is taken.
        let part =
            candle_core::safetensors::load(&f, &Device::Cpu).map_err(|e| model_err(&f, e))?;
        map.extend(part);
    }
    let mut w = Weights {
        map,
        dir: dir.to_path_buf(),
        device: device.clone(),
    };
    let embedding = w.take("model.embed_tokens.weight")?;
    let final_norm = w.take("model.norm.weight")?;
    let lm_head = match w.take_opt("lm_head.weight")? {
        Some(t) => Linear::dense(&t, None).map_err(|e| model_err(dir, e))?,
        None if tied => Linear::dense(&embedding, None).map_err(|e| model_err(dir, e))?,
        None => {
            return Err(model_err(
                dir,
                "missing tensor lm_head.weight (and tie_word_embeddings is false)",
            ));
        }
    };
    let qk_norm = config.architecture == "qwen3";
    let mut layers = Vec::with_capacity(config.n_layer);
    for i in 0..config.n_layer {
        let p = format!("model.layers.{i}");
        layers.push(Layer {
            attn_norm: w.take(&format!("{p}.input_layernorm.weight"))?,
            wq: w.linear(&format!("{p}.self_attn.q_proj"))?,
            wk: w.linear(&format!("{p}.self_attn.k_proj"))?,
            wv: w.linear(&format!("{p}.self_attn.v_proj"))?,
            wo: w.linear(&format!("{p}.self_attn.o_proj"))?,
            q_norm: if qk_norm {
                Some(w.take(&format!("{p}.self_attn.q_norm.weight"))?)
            } else {
                None
            },
            k_norm: if qk_norm {
                Some(w.take(&format!("{p}.self_attn.k_norm.weight"))?)
            } else {
                None
            },
            ffn_norm: w.take(&format!("{p}.post_attention_layernorm.weight"))?,
            w_gate: w.linear(&format!("{p}.mlp.gate_proj"))?,
            w_up: w.linear(&format!("{p}.mlp.up_proj"))?,
            w_down: w.linear(&format!("{p}.mlp.down_proj"))?,
        });
    }
    Transformer::new(
        config,
        embedding,
        layers,
        final_norm,
        lm_head,
        max_context,
        device,
    )
    .map_err(|e| model_err(dir, e))
}

/// `(chat_template, bos_token, eos_token, declared stop token strings)` from
/// `tokenizer_config.json`, when present.
pub fn tokenizer_config(dir: &Path) -> Result<(Option<String>, String, String), EngineError> {
    let path = dir.join("tokenizer_config.json");
    if !path.exists() {
        return Ok((None, String::new(), String::new()));
    }
    let v = read_json(&path)?;
    let template = match v.get("chat_template") {
        Some(Value::String(s)) => Some(s.clone()),
        // A list of named templates: take "default" (HF's rule), else the first.
        Some(Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .or_else(|| list.first())
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_string),
        _ => None,
    };
    let tok_str = |k: &str| match v.get(k) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string(),
        _ => String::new(),
    };
    Ok((template, tok_str("bos_token"), tok_str("eos_token")))
}

/// EOS ids declared in `config.json` / `generation_config.json` (int or list).
pub fn declared_eos_ids(dir: &Path) -> Vec<u32> {
    let mut ids = Vec::new();
    for f in ["config.json", "generation_config.json"] {
        if let Ok(v) = read_json(&dir.join(f)) {
            match v.get("eos_token_id") {
                Some(Value::Number(n)) => ids.extend(n.as_u64().map(|x| x as u32)),
                Some(Value::Array(a)) => {
                    ids.extend(a.iter().filter_map(Value::as_u64).map(|x| x as u32))
                }
                _ => {}
            }
        }
    }
    ids
}
