//! Loading a model into a [`ModelEngine`]: a GGUF file (the CPU fast path, or candle's
//! transformer on other devices and weight formats) or an HF safetensors directory, with its
//! tokenizer, chat template, stop tokens, context length and fingerprint (the weights' sha256),
//! and the [`Backend`](crate::engine::backend::Backend) it runs on. Split from
//! `model_engine.rs`, whose fields it sets.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device};
use sha2::{Digest, Sha256};
use tokenizers::Tokenizer;

use super::{CANDLE_VERSION, EngineOptions, ModelEngine};
use crate::engine::backend::Backend;
use crate::engine::backend::candle::CandleBackend;
use crate::engine::backend::cpu::CpuBackend;
use crate::engine::backend::readback::StepLogits;
use crate::engine::chat_template::ChatTemplate;
use crate::engine::cpu::model::CpuModel;
use crate::engine::device_info;
use crate::engine::gguf::{self, WeightFormat, model_err};
use crate::engine::options::{candle_fingerprint_dtype, select_device};
use crate::engine::prompt_text::PromptEncoder;
use crate::engine::safetensors;
use crate::engine::step_split::StepSplit;
use crate::engine::switches::EngineSwitches;
use crate::engine::transformer::Transformer;
use crate::engine::{CancelFlag, EngineError, ModelFingerprint};

/// A loaded model before it becomes a backend.
enum Loaded {
    Cpu(CpuModel),
    Candle(Transformer),
}

impl Loaded {
    fn architecture(&self) -> String {
        match self {
            Loaded::Cpu(m) => m.config.architecture.clone(),
            Loaded::Candle(t) => t.config.architecture.clone(),
        }
    }
}

/// What a model file gives an engine.
struct Parts {
    model: Loaded,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    stop_ids: Vec<u32>,
    fingerprint: ModelFingerprint,
}

/// The context a model is loaded with: `asked` when given (at most what the model declares),
/// else the model's declaration. A model that declares none needs an explicit length.
fn context_for(
    path: &Path,
    declared: Option<usize>,
    asked: Option<usize>,
) -> Result<usize, EngineError> {
    match (asked, declared) {
        (Some(a), Some(d)) if a > d => Err(model_err(
            path,
            format!("a context of {a} tokens was asked (max_model_len) but the model declares {d}"),
        )),
        (Some(a), _) => Ok(a),
        (None, Some(d)) => Ok(d),
        (None, None) => Err(model_err(
            path,
            "the model does not declare its context length; set model.max_model_len (or --max-model-len)",
        )),
    }
}

/// The context length a model file declares (GGUF `*.context_length`, `config.json`
/// `max_position_embeddings`), read without loading weights. `None` when it declares none.
pub fn declared_context(path: &Path) -> Result<Option<usize>, EngineError> {
    if path.is_dir() {
        return Ok(safetensors::read_config(path)?.0.trained_context);
    }
    let mut file = std::fs::File::open(path).map_err(|e| model_err(path, e))?;
    let ct = gguf_file::Content::read(&mut file)
        .map_err(|e| model_err(path, format!("not a readable GGUF file: {e}")))?;
    Ok(gguf::read_config(&ct, path)?.trained_context)
}

pub(crate) fn sha256_files(files: &[PathBuf]) -> Result<String, EngineError> {
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    for f in files {
        let mut file = std::fs::File::open(f).map_err(|e| model_err(f, e))?;
        loop {
            let n = file.read(&mut buf).map_err(|e| model_err(f, e))?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
    }
    Ok(hex::encode(h.finalize()))
}

impl ModelEngine {
    /// Loads a GGUF file or an HF safetensors directory.
    pub fn load(model_path: &Path, options: &EngineOptions) -> Result<ModelEngine, EngineError> {
        if options.max_context.is_some_and(|n| n < 2) {
            return Err(EngineError::InvalidRequest(
                "max_context must be at least 2".into(),
            ));
        }
        let pool = match options.threads {
            Some(n) if n > 0 => Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .build()
                    .map_err(|e| EngineError::Model(format!("thread pool: {e}")))?,
            ),
            _ => None,
        };
        let switches = match options.switches {
            Some(s) => s,
            None => EngineSwitches::from_env()
                .map_err(|e| EngineError::InvalidRequest(e.to_string()))?,
        };
        let device = select_device(options.device, &switches)?;
        let device_kind = if device.is_cuda() { "cuda" } else { "cpu" };
        let load = || -> Result<Parts, EngineError> {
            if model_path.is_dir() {
                Self::load_safetensors(model_path, &device, device_kind, options)
            } else {
                Self::load_gguf(model_path, &device, device_kind, options)
            }
        };
        let parts = match &pool {
            Some(p) => p.install(load)?,
            None => load()?,
        };
        let mut engine = Self::finish(parts, &switches)?;
        engine.pool = pool;
        engine.draft = switches.draft.unwrap_or(true);
        crate::engine::cpu::attention::set_prefetch(switches.prefetch.unwrap_or(true));
        engine.switches = switches;
        engine.set_prefix_cache_bytes(options.prefix_cache_bytes);
        Ok(engine)
    }

    fn load_gguf(
        path: &Path,
        device: &Device,
        device_kind: &str,
        options: &EngineOptions,
    ) -> Result<Parts, EngineError> {
        let is_gguf = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
        let mut file = std::fs::File::open(path).map_err(|e| model_err(path, e))?;
        let ct = gguf_file::Content::read(&mut file).map_err(|e| {
            if is_gguf {
                model_err(path, format!("not a readable GGUF file: {e}"))
            } else {
                model_err(path, format!("unsupported model file (expected a .gguf file or a safetensors directory): {e}"))
            }
        })?;
        // Check the architecture before the (more expensive) tokenizer.
        let declared = gguf::read_config(&ct, path)?.trained_context;
        let max_context = context_for(path, declared, options.max_context)?;
        let tokenizer = crate::engine::tokenizer::from_gguf(&ct, path)?;
        let template_src = gguf::md_string(&ct, "tokenizer.chat_template");
        let tok_name = |key: &str| {
            ct.metadata
                .get(key)
                .and_then(|v| v.to_u32().ok())
                .and_then(|id| tokenizer.id_to_token(id))
                .unwrap_or_default()
        };
        let template = ChatTemplate::new(
            template_src.as_deref(),
            &tok_name("tokenizer.ggml.bos_token_id"),
            &tok_name("tokenizer.ggml.eos_token_id"),
        )?;
        let stop_ids = crate::engine::tokenizer::stop_token_ids(
            &tokenizer,
            &crate::engine::tokenizer::gguf_declared_stops(&ct),
            Some(template.source()),
        );
        let fast_path = options.numerics.cpu_fast_path();
        let (model, dtype) = match fast_path {
            Some(numerics) if device.is_cpu() && options.weight_format == WeightFormat::Auto => {
                let mut m = gguf::load_cpu(path, &mut file, &ct, max_context)?;
                m.set_numerics(numerics);
                (Loaded::Cpu(m), numerics.fingerprint_dtype().to_string())
            }
            _ => {
                let compute = options.numerics.candle_dtype(device)?;
                let format = (options.weight_format, compute);
                let loaded = gguf::load(path, &mut file, &ct, device, format, max_context)?;
                let dtype = match (loaded.dequantized, compute) {
                    (_, DType::BF16) => candle_fingerprint_dtype(device, compute),
                    (true, _) => "f32-dequantized".to_string(),
                    (false, _) => "gguf-quantized".to_string(),
                };
                (Loaded::Candle(loaded.transformer), dtype)
            }
        };
        let fingerprint = ModelFingerprint {
            weights_sha256: sha256_files(&[path.to_path_buf()])?,
            candle_version: CANDLE_VERSION.to_string(),
            dtype,
            device: device_info::fingerprint_device(device_kind, device)?,
            architecture: model.architecture(),
        };
        Ok(Parts {
            model,
            tokenizer,
            template,
            stop_ids,
            fingerprint,
        })
    }

    fn load_safetensors(
        dir: &Path,
        device: &Device,
        device_kind: &str,
        options: &EngineOptions,
    ) -> Result<Parts, EngineError> {
        let declared = safetensors::read_config(dir)?.0.trained_context;
        let max_context = context_for(dir, declared, options.max_context)?;
        let tokenizer = crate::engine::tokenizer::from_file(&dir.join("tokenizer.json"))?;
        let (template_src, bos, eos) = safetensors::tokenizer_config(dir)?;
        let template = ChatTemplate::new(template_src.as_deref(), &bos, &eos)?;
        let mut declared = safetensors::declared_eos_ids(dir);
        declared.extend(tokenizer.token_to_id(&eos));
        let stop_ids = crate::engine::tokenizer::stop_token_ids(
            &tokenizer,
            &declared,
            Some(template.source()),
        );
        let files = safetensors::weight_files(dir)?;
        let compute = options.numerics.candle_dtype(device)?;
        let model = safetensors::load(dir, device, max_context, compute)?;
        let fingerprint = ModelFingerprint {
            weights_sha256: sha256_files(&files)?,
            candle_version: CANDLE_VERSION.to_string(),
            dtype: candle_fingerprint_dtype(device, compute),
            device: device_info::fingerprint_device(device_kind, device)?,
            architecture: model.config.architecture.clone(),
        };
        Ok(Parts {
            model: Loaded::Candle(model),
            tokenizer,
            template,
            stop_ids,
            fingerprint,
        })
    }

    /// The engine of `parts` on its backend. The candle backend turns the paged path on when
    /// `switches` ask for it on its device: its kernels then name themselves in the
    /// fingerprint's dtype.
    fn finish(parts: Parts, switches: &EngineSwitches) -> Result<ModelEngine, EngineError> {
        let Parts {
            model,
            tokenizer,
            template,
            stop_ids,
            mut fingerprint,
        } = parts;
        let Some(&pad) = stop_ids.first() else {
            return Err(EngineError::Model(
                "the model declares no end-of-sequence token".into(),
            ));
        };
        let backend: Box<dyn Backend> = match model {
            Loaded::Cpu(m) => Box::new(CpuBackend::new(m)),
            Loaded::Candle(t) => {
                let (b, suffix) = CandleBackend::new(t, pad, switches)?;
                if let Some(suffix) = suffix {
                    fingerprint.dtype = format!("{};{suffix}", fingerprint.dtype);
                }
                Box::new(b)
            }
        };
        let vocab = backend.config().vocab_size;
        Ok(ModelEngine {
            media_placeholders: crate::engine::tokenizer::media_placeholder_ids(&tokenizer),
            prompt_encoder: PromptEncoder::new(&tokenizer)?,
            live: Vec::new(),
            last_step: (0, 0),
            kv_budget: crate::engine::DEFAULT_KV_CACHE_BYTES,
            context_limit: backend.max_context(),
            cancel: CancelFlag::default(),
            last_kv_bytes: 0,
            backend,
            tokenizer,
            template,
            stop_ids,
            fingerprint,
            constraints: OnceLock::new(),
            pool: None,
            ignore_eos: false,
            fast_forward: true,
            draft: true,
            forced_tokens: 0,
            decode_split: (0, 0),
            switches: EngineSwitches::default(),
            split: StepSplit::default(),
            step_logits: StepLogits::new(vocab),
        })
    }
}
