//! How an engine is asked to load and run a model: the device, threads, context and weight
//! format, and the prompt-prefix cache's budget ([`EngineOptions`]), with the device choice.
//! Kept apart from the engine itself so the options every command builds are in one place.

use candle_core::Device;

use super::EngineError;
use super::cpu::model::Numerics;
use super::gguf::WeightFormat;

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    /// CPU, or `cuda:$LOCAL_RANK` when built with the `cuda` feature and a GPU exists.
    #[default]
    Auto,
    Cpu,
    Cuda(usize),
}

impl std::str::FromStr for DeviceSpec {
    type Err = EngineError;

    /// `auto`, `cpu`, `cuda` (= `cuda:0`) or `cuda:N`.
    fn from_str(s: &str) -> Result<Self, EngineError> {
        match s {
            "auto" => Ok(DeviceSpec::Auto),
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceSpec::Cuda)
                .ok_or_else(|| {
                    EngineError::InvalidRequest(format!("unknown device `{s}` (auto, cpu, cuda:N)"))
                }),
        }
    }
}

/// How to load and run a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineOptions {
    pub device: DeviceSpec,
    /// Compute threads; `None` = candle's default (RAYON_NUM_THREADS or the physical cores).
    pub threads: Option<usize>,
    /// Cap on prompt + generated tokens; `None`: the model's own context (its GGUF
    /// `*.context_length` or `config.json` `max_position_embeddings`). More than the model
    /// declares is refused.
    pub max_context: Option<usize>,
    /// GGUF only: keep the file's quantization or dequantize at load.
    pub weight_format: WeightFormat,
    /// Bytes of recent rollout prompts' KV kept for prefix reuse (CPU fast path only; 0 = off).
    pub prefix_cache_bytes: usize,
    /// The CPU fast path's matmul arithmetic (recorded in the fingerprint's dtype).
    pub numerics: Numerics,
}

/// Default [`EngineOptions::prefix_cache_bytes`]: 256 MiB, about nine 600-token prompts of
/// SmolLM2-135M (46 KiB of keys and values per position).
pub const DEFAULT_PREFIX_CACHE_BYTES: usize = 256 << 20;

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            device: DeviceSpec::Auto,
            threads: None,
            max_context: None,
            weight_format: WeightFormat::Auto,
            prefix_cache_bytes: DEFAULT_PREFIX_CACHE_BYTES,
            numerics: Numerics::default(),
        }
    }
}

pub(crate) fn select_device(spec: DeviceSpec) -> Result<Device, EngineError> {
    let cuda =
        |i: usize| Device::new_cuda(i).map_err(|e| EngineError::Model(format!("cuda:{i}: {e}")));
    match spec {
        DeviceSpec::Cpu => Ok(Device::Cpu),
        DeviceSpec::Cuda(i) => cuda(i),
        DeviceSpec::Auto => {
            if cfg!(feature = "cuda") && candle_core::utils::cuda_is_available() {
                let rank = std::env::var("LOCAL_RANK")
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(0);
                cuda(rank)
            } else {
                Ok(Device::Cpu)
            }
        }
    }
}
