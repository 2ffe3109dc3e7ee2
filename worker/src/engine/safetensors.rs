//! Loading an HF safetensors directory (llama, qwen2, qwen3, and the text tower of qwen3_vl)
//! into our [`Transformer`].
//!
//! The directory holds `config.json`, `tokenizer.json`, optionally `tokenizer_config.json`
//! (chat template, EOS) and `generation_config.json` (EOS ids), and `model.safetensors` or
//! shards (the ones `model.safetensors.index.json` names, when it is there). The files are
//! memory-mapped and each tensor is read, checked and converted to the compute dtype (f32 or
//! bf16; norm weights f32) on the device as it is taken, so the host never holds a second copy of the checkpoint and
//! tensors the language model does not use are never read. HF checkpoints use the NEOX RoPE
//! pairing. Unknown `model_type`s, RoPE scaling and a missing `rope_theta` are refused with an
//! error naming the file and the key.

use std::path::{Path, PathBuf};

use candle_core::safetensors::{Load, MmapedSafetensors};
use candle_core::{DType, Device, Tensor};
use serde_json::Value;

use super::EngineError;
use super::gguf::model_err;
use super::transformer::{Layer, Linear, Projections, RopeStyle, Transformer, TransformerConfig};

pub const SUPPORTED_MODEL_TYPES: &[&str] = &["llama", "qwen2", "qwen3", "qwen3_vl"];

/// Weight files of a directory, in the fixed (sorted) order used for loading and hashing:
/// the shards `model.safetensors.index.json` names when it is there (each must exist), else
/// every `*.safetensors` file.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, EngineError> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        return indexed_files(dir, &index);
    }
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

/// The shards an index's `weight_map` names, sorted and once each.
fn indexed_files(dir: &Path, index: &Path) -> Result<Vec<PathBuf>, EngineError> {
    let json = read_json(index)?;
    let map = json
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| model_err(index, "missing or invalid `weight_map`"))?;
    let mut names = std::collections::BTreeSet::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .filter(|f| !f.contains(['/', '\\']))
            .ok_or_else(|| model_err(index, format!("`weight_map.{tensor}` is not a file name")))?;
        names.insert(file.to_string());
    }
    if names.is_empty() {
        return Err(model_err(index, "`weight_map` names no shard"));
    }
    names
        .into_iter()
        .map(|name| {
            let path = dir.join(&name);
            match path.is_file() {
                true => Ok(path),
                false => Err(model_err(
                    index,
                    format!("shard `{name}` is named in `weight_map` but missing"),
                )),
            }
        })
        .collect()
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

/// What a checkpoint's `config.json` says about its language model, and where its tensors are.
#[derive(Debug, Clone)]
pub struct HfConfig {
    pub config: TransformerConfig,
    /// `tie_word_embeddings`: the output head is the embedding when `lm_head.weight` is absent.
    pub tied: bool,
    /// The language model's tensor names start with this (`model.` or, for Qwen3-VL,
    /// `model.language_model.`); `lm_head.weight` is at the top level in both.
    pub prefix: &'static str,
}

/// The language model's settings: the top level of `config.json`, or its `text_config` for
/// a multimodal checkpoint (Qwen3-VL), whose text tower is a Qwen3 decoder.
///
/// Qwen3-VL rotates queries and keys with a multimodal RoPE whose position ids are
/// (temporal, height, width) triples, and `mrope_section` splits each head's frequencies
/// among the three. For text, transformers gives every token the same three ids (its text
/// position), so each frequency band rotates by that position whatever section it is in:
/// the interleaved or sectioned layout then equals ordinary 1-D RoPE (NEOX pairing) with the
/// same theta. `qwen3_vl_text_tower_equals_qwen3` in the architecture tests checks it. Image
/// or video placeholder tokens would need the 3-D ids, which this loader does not build.
pub fn read_hf_config(dir: &Path) -> Result<HfConfig, EngineError> {
    let path = dir.join("config.json");
    let top = read_json(&path)?;
    let model_type = top
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
    let (cfg, architecture, prefix) = if model_type == "qwen3_vl" {
        let text = top
            .get("text_config")
            .filter(|t| t.is_object())
            .ok_or_else(|| {
                model_err(&path, "model_type `qwen3_vl` needs an object `text_config`")
            })?;
        (text, "qwen3".to_string(), "model.language_model.")
    } else {
        (&top, model_type, "model.")
    };
    let rope_theta = rope_theta(cfg, &path)?;
    refuse_unsupported_settings(cfg, &path)?;
    let config = transformer_config(cfg, architecture, rope_theta, &path)?;
    let tied = cfg
        .get("tie_word_embeddings")
        .or_else(|| top.get("tie_word_embeddings"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok(HfConfig {
        config,
        tied,
        prefix,
    })
}

/// `(config, tie_word_embeddings)`; see [`read_hf_config`].
pub fn read_config(dir: &Path) -> Result<(TransformerConfig, bool), EngineError> {
    read_hf_config(dir).map(|c| (c.config, c.tied))
}

/// RoPE's base: `rope_theta` at the config's top level (transformers 4) or inside
/// `rope_parameters` (transformers 5). Missing is an error: a silent 10,000 is a different
/// model. Scaling other than `default` (`rope_scaling` or `rope_parameters.rope_type`) is
/// refused by name.
fn rope_theta(cfg: &Value, path: &Path) -> Result<f64, EngineError> {
    for key in ["rope_scaling", "rope_parameters"] {
        let Some(s) = cfg.get(key).filter(|s| !s.is_null()) else {
            continue;
        };
        let kind = s
            .get("rope_type")
            .or_else(|| s.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("<no rope_type>");
        if kind != "default" {
            return Err(model_err(
                path,
                format!("unsupported: RoPE scaling `{kind}` (`{key}.rope_type`)"),
            ));
        }
    }
    cfg.get("rope_theta")
        .or_else(|| cfg.get("rope_parameters").and_then(|p| p.get("rope_theta")))
        .and_then(Value::as_f64)
        .filter(|t| t.is_finite() && *t > 0.0)
        .ok_or_else(|| {
            model_err(
                path,
                "config.json: missing or invalid `rope_theta` (looked at the top level and in `rope_parameters`)",
            )
        })
}

/// Settings that change the model's maths and that the transformer does not implement: an
/// activation other than SiLU, sliding-window attention. Refused by key, never ignored.
fn refuse_unsupported_settings(cfg: &Value, path: &Path) -> Result<(), EngineError> {
    let act = cfg
        .get("hidden_act")
        .and_then(Value::as_str)
        .unwrap_or("silu");
    if act != "silu" {
        return Err(model_err(
            path,
            format!("unsupported: `hidden_act` is `{act}` (the transformer implements silu)"),
        ));
    }
    if cfg.get("use_sliding_window").and_then(Value::as_bool) == Some(true) {
        return Err(model_err(
            path,
            "unsupported: `use_sliding_window` is true (the transformer attends over the whole context)",
        ));
    }
    Ok(())
}

fn transformer_config(
    cfg: &Value,
    architecture: String,
    rope_theta: f64,
    path: &Path,
) -> Result<TransformerConfig, EngineError> {
    let hidden = get_usize(cfg, "hidden_size", path)?;
    let n_head = get_usize(cfg, "num_attention_heads", path)?;
    let n_kv_head = cfg
        .get("num_key_value_heads")
        .and_then(Value::as_u64)
        .map_or(n_head, |x| x as usize);
    let n_layer = get_usize(cfg, "num_hidden_layers", path)?;
    if n_head == 0 || n_kv_head == 0 || n_head % n_kv_head != 0 {
        return Err(model_err(
            path,
            format!("invalid head counts {n_head}/{n_kv_head}"),
        ));
    }
    let head_dim = cfg
        .get("head_dim")
        .and_then(Value::as_u64)
        .map_or(hidden / n_head, |x| x as usize);
    Ok(TransformerConfig {
        architecture,
        n_layer,
        n_head,
        n_kv_head,
        head_dim,
        hidden,
        vocab_size: get_usize(cfg, "vocab_size", path)?,
        rms_eps: cfg
            .get("rms_norm_eps")
            .and_then(Value::as_f64)
            .unwrap_or(1e-6),
        rope_theta,
        rope_style: RopeStyle::Neox,
        rope_freq_factors: None,
        trained_context: cfg
            .get("max_position_embeddings")
            .and_then(Value::as_u64)
            .map(|x| x as usize),
    })
}

/// The checkpoint's tensors, memory-mapped: a tensor is read, checked (shape, a float dtype)
/// and converted on the device when it is taken (to the compute dtype, or f32 for norm
/// weights), so the host never holds more than the tensor being taken, and tensors never taken
/// (a Qwen3-VL vision tower) are never read.
struct Weights {
    files: MmapedSafetensors,
    dir: PathBuf,
    device: Device,
    dtype: DType,
}

impl Weights {
    fn open(dir: &Path, device: &Device, dtype: DType) -> Result<Self, EngineError> {
        let files = weight_files(dir)?;
        // SAFETY: the mapping is read-only; stageb never writes model files, and a checkpoint
        // changed under a running worker is outside what any loader can guard against (the
        // fingerprint was computed from the same files).
        let files = unsafe { MmapedSafetensors::multi(&files) }.map_err(|e| model_err(dir, e))?;
        Ok(Weights {
            files,
            dir: dir.to_path_buf(),
            device: device.clone(),
            dtype,
        })
    }

    /// The tensor `name`, which must have `shape`, in `dtype`.
    fn take(&self, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor, EngineError> {
        self.take_opt(name, shape, dtype)?
            .ok_or_else(|| model_err(&self.dir, format!("missing tensor {name}")))
    }

    fn take_opt(
        &self,
        name: &str,
        shape: &[usize],
        dtype: DType,
    ) -> Result<Option<Tensor>, EngineError> {
        let Ok(view) = self.files.get(name) else {
            return Ok(None);
        };
        let bad = |what: String| model_err(&self.dir, format!("tensor {name}: {what}"));
        if view.shape() != shape {
            return Err(bad(format!(
                "shape {:?}, expected {shape:?} from config.json",
                view.shape()
            )));
        }
        let t = view.load(&self.device).map_err(|e| bad(e.to_string()))?;
        release_pages(view.data());
        if !matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16) {
            return Err(bad(format!(
                "dtype {:?}, expected F32, F16 or BF16",
                t.dtype()
            )));
        }
        t.to_dtype(dtype).map(Some).map_err(|e| bad(e.to_string()))
    }

    /// A norm weight: `(n,)`, kept in f32.
    fn norm(&self, name: &str, n: usize) -> Result<Tensor, EngineError> {
        self.take(name, &[n], DType::F32)
    }

    /// A projection `prefix.weight` of `(out, inp)`, with its `(out,)` bias when present.
    fn linear(&self, prefix: &str, out: usize, inp: usize) -> Result<Linear, EngineError> {
        let w = self.take(&format!("{prefix}.weight"), &[out, inp], self.dtype)?;
        let bias = self.take_opt(&format!("{prefix}.bias"), &[out], self.dtype)?;
        Linear::dense(&w, bias).map_err(|e| model_err(&self.dir, e))
    }

    /// The first dimension of `name` (the MLP's width, which the loader does not take from
    /// `config.json`), or an error naming the missing tensor.
    fn rows_of(&self, name: &str) -> Result<usize, EngineError> {
        let view = self
            .files
            .get(name)
            .map_err(|_| model_err(&self.dir, format!("missing tensor {name}")))?;
        Ok(view.shape().first().copied().unwrap_or(0))
    }
}

/// Drops the mapped pages of `bytes` (a tensor already copied out of the file) from this
/// process's resident set, so loading holds one tensor of the checkpoint at a time, not all
/// of it: the host keeps only what the model itself is made of (nothing, on a GPU). The
/// mapping stays valid: a later read faults the pages back in from the file.
fn release_pages(bytes: &[u8]) {
    #[cfg(target_os = "linux")]
    {
        const PAGE: usize = 4096;
        let start = (bytes.as_ptr() as usize).div_ceil(PAGE) * PAGE;
        let end = (bytes.as_ptr() as usize + bytes.len()) / PAGE * PAGE;
        if end > start {
            // SAFETY: [start, end) lies inside a read-only file mapping that outlives this
            // call; MADV_DONTNEED on it discards no data (the pages are clean and are read
            // from the file again on the next access). Pages shared with a neighbouring
            // tensor (the unaligned ends) are left alone. Failure only means they stay.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = bytes;
}

/// Loads the language model of an HF directory to compute in `dtype` (f32 or bf16; see
/// [`Transformer`]'s module docs for what stays f32). Every tensor is checked against the
/// shape `config.json` implies.
pub fn load(
    dir: &Path,
    device: &Device,
    max_context: usize,
    dtype: DType,
) -> Result<Transformer, EngineError> {
    let HfConfig {
        config,
        tied,
        prefix,
    } = read_hf_config(dir)?;
    let w = Weights::open(dir, device, dtype)?;
    let (hidden, vocab) = (config.hidden, config.vocab_size);
    let embedding = w.take(
        &format!("{prefix}embed_tokens.weight"),
        &[vocab, hidden],
        dtype,
    )?;
    let final_norm = w.norm(&format!("{prefix}norm.weight"), hidden)?;
    let lm_head = match w.take_opt("lm_head.weight", &[vocab, hidden], dtype)? {
        Some(t) => Linear::dense(&t, None).map_err(|e| model_err(dir, e))?,
        None if tied => Linear::dense(&embedding, None).map_err(|e| model_err(dir, e))?,
        None => {
            return Err(model_err(
                dir,
                "missing tensor lm_head.weight (and tie_word_embeddings is false)",
            ));
        }
    };
    let mut layers = Vec::with_capacity(config.n_layer);
    for i in 0..config.n_layer {
        layers.push(load_layer(&w, &config, &format!("{prefix}layers.{i}"))?);
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

/// Decoder block `p` (`model.layers.N` or `model.language_model.layers.N`).
fn load_layer(w: &Weights, config: &TransformerConfig, p: &str) -> Result<Layer, EngineError> {
    let (hidden, d) = (config.hidden, config.head_dim);
    let (q_out, kv_out) = (config.n_head * d, config.n_kv_head * d);
    let inter = w.rows_of(&format!("{p}.mlp.gate_proj.weight"))?;
    let qk_norm = config.architecture == "qwen3";
    let head_norm = |which: &str| -> Result<Option<Tensor>, EngineError> {
        match qk_norm {
            true => w
                .norm(&format!("{p}.self_attn.{which}.weight"), d)
                .map(Some),
            false => Ok(None),
        }
    };
    Ok(Layer {
        attn_norm: w.norm(&format!("{p}.input_layernorm.weight"), hidden)?,
        qkv: Projections::Separate([
            w.linear(&format!("{p}.self_attn.q_proj"), q_out, hidden)?,
            w.linear(&format!("{p}.self_attn.k_proj"), kv_out, hidden)?,
            w.linear(&format!("{p}.self_attn.v_proj"), kv_out, hidden)?,
        ]),
        wo: w.linear(&format!("{p}.self_attn.o_proj"), hidden, q_out)?,
        q_norm: head_norm("q_norm")?,
        k_norm: head_norm("k_norm")?,
        ffn_norm: w.norm(&format!("{p}.post_attention_layernorm.weight"), hidden)?,
        gate_up: Projections::Separate([
            w.linear(&format!("{p}.mlp.gate_proj"), inter, hidden)?,
            w.linear(&format!("{p}.mlp.up_proj"), inter, hidden)?,
        ]),
        w_down: w.linear(&format!("{p}.mlp.down_proj"), hidden, inter)?,
    })
}

/// `(chat_template, bos_token, eos_token, declared stop token strings)` from
/// `tokenizer_config.json`, when present.
pub fn tokenizer_config(dir: &Path) -> Result<(Option<String>, String, String), EngineError> {
    let path = dir.join("tokenizer_config.json");
    let v = if path.exists() {
        read_json(&path)?
    } else {
        Value::Null
    };
    let template = match separate_template(dir)? {
        Some(t) => Some(t),
        None => template_of(v.get("chat_template")),
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

/// A template saved beside the tokenizer, as transformers 5 does: `chat_template.jinja`, else
/// `chat_template.json` (`{"chat_template": …}`). transformers prefers it to the one in
/// `tokenizer_config.json`, and so does stageb.
fn separate_template(dir: &Path) -> Result<Option<String>, EngineError> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.exists() {
        return std::fs::read_to_string(&jinja)
            .map(Some)
            .map_err(|e| model_err(&jinja, e));
    }
    let json = dir.join("chat_template.json");
    if json.exists() {
        let v = read_json(&json)?;
        return template_of(v.get("chat_template"))
            .map(Some)
            .ok_or_else(|| model_err(&json, "missing or invalid `chat_template`"));
    }
    Ok(None)
}

/// A `chat_template` value: a string, or a list of named templates ("default" by HF's rule,
/// else the first).
fn template_of(value: Option<&Value>) -> Option<String> {
    match value {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .or_else(|| list.first())
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_string),
        _ => None,
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_with(config: serde_json::Value) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
        dir
    }

    fn qwen3(extra: serde_json::Value) -> serde_json::Value {
        let mut c = serde_json::json!({
            "model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 100,
            "rms_norm_eps": 1e-6,
        });
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        c
    }

    fn error_of(config: serde_json::Value) -> String {
        let dir = dir_with(config);
        read_hf_config(dir.path()).unwrap_err().to_string()
    }

    #[test]
    fn rope_theta_is_read_from_the_top_level_or_from_rope_parameters() {
        let top = dir_with(qwen3(serde_json::json!({"rope_theta": 1e6})));
        assert_eq!(read_hf_config(top.path()).unwrap().config.rope_theta, 1e6);
        let t5 = dir_with(qwen3(serde_json::json!(
            {"rope_parameters": {"rope_type": "default", "rope_theta": 5e6}})));
        assert_eq!(read_hf_config(t5.path()).unwrap().config.rope_theta, 5e6);
    }

    #[test]
    fn a_missing_rope_theta_is_an_error_never_ten_thousand() {
        let err = error_of(qwen3(
            serde_json::json!({"rope_parameters": {"rope_type": "default"}}),
        ));
        assert!(
            err.contains("config.json") && err.contains("`rope_theta`"),
            "{err}"
        );
    }

    #[test]
    fn rope_scaling_other_than_default_is_refused_by_name() {
        let err = error_of(qwen3(serde_json::json!(
            {"rope_theta": 1e6, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})));
        assert!(
            err.contains("`yarn`") && err.contains("rope_scaling"),
            "{err}"
        );
        let err = error_of(qwen3(serde_json::json!(
            {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}})));
        assert!(
            err.contains("`llama3`") && err.contains("rope_parameters"),
            "{err}"
        );
    }

    /// The error of loading `config` with one tensor, the embedding, given as `embedding`.
    fn load_error_with_embedding(embedding: Tensor) -> String {
        let dir = dir_with(qwen3(serde_json::json!({"rope_theta": 1e6})));
        let tensors = [("model.embed_tokens.weight", embedding)];
        candle_core::safetensors::save(
            &tensors.into_iter().collect(),
            dir.path().join("model.safetensors"),
        )
        .unwrap();
        load(dir.path(), &Device::Cpu, 64, DType::F32)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn a_tensor_of_the_wrong_shape_or_dtype_is_refused_by_name() {
        let err =
            load_error_with_embedding(Tensor::zeros((100, 63), DType::F32, &Device::Cpu).unwrap());
        assert!(
            err.contains("tensor model.embed_tokens.weight: shape [100, 63], expected [100, 64]"),
            "{err}"
        );
        let err =
            load_error_with_embedding(Tensor::zeros((100, 64), DType::U32, &Device::Cpu).unwrap());
        assert!(
            err.contains("tensor model.embed_tokens.weight: dtype U32, expected F32, F16 or BF16"),
            "{err}"
        );
    }

    #[test]
    fn settings_that_change_the_maths_are_refused_by_key_never_ignored() {
        let err = error_of(qwen3(
            serde_json::json!({"rope_theta": 1e6, "hidden_act": "gelu"}),
        ));
        assert!(err.contains("`hidden_act` is `gelu`"), "{err}");
        let err = error_of(qwen3(
            serde_json::json!({"rope_theta": 1e6, "use_sliding_window": true}),
        ));
        assert!(err.contains("`use_sliding_window`"), "{err}");
        // Their defaults (and an explicit silu / false) are what the transformer computes.
        let dir = dir_with(qwen3(serde_json::json!(
            {"rope_theta": 1e6, "hidden_act": "silu", "use_sliding_window": false})));
        assert!(read_hf_config(dir.path()).is_ok());
    }

    #[test]
    fn qwen3_vl_reads_its_text_config_and_names_its_tensors_under_language_model() {
        let text = qwen3(
            serde_json::json!({"model_type": "qwen3_vl_text", "rope_theta": 5e6,
            "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20]}}),
        );
        let dir = dir_with(serde_json::json!(
            {"model_type": "qwen3_vl", "text_config": text, "tie_word_embeddings": false}));
        let hf = read_hf_config(dir.path()).unwrap();
        assert_eq!(hf.config.architecture, "qwen3");
        assert_eq!((hf.config.hidden, hf.config.n_layer), (64, 2));
        assert_eq!(hf.prefix, "model.language_model.");
        assert!(!hf.tied);
        let err = error_of(serde_json::json!({"model_type": "qwen3_vl"}));
        assert!(err.contains("text_config"), "{err}");
    }

    #[test]
    fn an_unknown_model_type_is_refused_with_the_supported_list() {
        let err = error_of(serde_json::json!({"model_type": "gemma3"}));
        assert!(
            err.contains("`gemma3`") && err.contains("qwen3_vl"),
            "{err}"
        );
    }

    #[test]
    fn a_shard_named_in_the_index_must_exist() {
        let dir = tempfile::tempdir().unwrap();
        let index = serde_json::json!({"weight_map": {
            "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}});
        std::fs::write(
            dir.path().join("model.safetensors.index.json"),
            index.to_string(),
        )
        .unwrap();
        std::fs::write(dir.path().join("model-00001-of-00002.safetensors"), b"").unwrap();
        let err = weight_files(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("model-00002-of-00002.safetensors") && err.contains("missing"),
            "{err}"
        );
        std::fs::write(dir.path().join("model-00002-of-00002.safetensors"), b"").unwrap();
        std::fs::write(dir.path().join("stray.safetensors"), b"").unwrap();
        let files = weight_files(dir.path()).unwrap();
        assert_eq!(files.len(), 2, "only the indexed shards: {files:?}");
    }

    #[test]
    fn a_chat_template_jinja_beside_the_tokenizer_wins_over_tokenizer_config() {
        let dir = tempfile::tempdir().unwrap();
        let config = serde_json::json!({"chat_template": "old", "eos_token": "<|im_end|>"});
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        let (template, _, eos) = tokenizer_config(dir.path()).unwrap();
        assert_eq!(
            (template.as_deref(), eos.as_str()),
            (Some("old"), "<|im_end|>")
        );
        std::fs::write(
            dir.path().join("chat_template.json"),
            r#"{"chat_template": "json"}"#,
        )
        .unwrap();
        assert_eq!(
            tokenizer_config(dir.path()).unwrap().0.as_deref(),
            Some("json")
        );
        std::fs::write(dir.path().join("chat_template.jinja"), "jinja").unwrap();
        assert_eq!(
            tokenizer_config(dir.path()).unwrap().0.as_deref(),
            Some("jinja")
        );
    }
}
