//! How an engine is asked to load and run a model: the device, threads, context and weight
//! format, and the prompt-prefix cache's budget ([`EngineOptions`]), with the device choice.
//! Kept apart from the engine itself so the options every command builds are in one place.

use candle_core::{DType, Device};

use stageb_shared::placement::{
    LOCAL_RANK_VARS, Placement, PlacementError, PlacementInput, bound_per_task, cuda_placement,
};

use super::EngineError;
use super::cpu::model::CpuNumerics;
use super::gguf::WeightFormat;
use super::switches::EngineSwitches;

/// The arithmetic a model runs with (`--numerics`). Part of the fingerprint: workers that
/// differ in it compute different logits and never serve one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Numerics {
    /// Per path: the CPU fast path's `int8`; candle's transformer in `bf16` on CUDA and
    /// `f32` on the CPU (where bf16 has no fast kernels).
    #[default]
    Auto,
    /// CPU fast path only: activations rounded to 8 bits per block, integer dot products.
    Int8,
    /// Exact weights, f32 activations (and KV cache).
    F32,
    /// Candle's transformer with bf16 weights, activations and KV cache; norm statistics,
    /// softmax and logits in f32. On the CPU it runs through candle too, slowly, so CI checks
    /// the same arithmetic a GPU runs.
    Bf16,
}

impl std::str::FromStr for Numerics {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Numerics::Auto),
            "int8" => Ok(Numerics::Int8),
            "f32" => Ok(Numerics::F32),
            "bf16" => Ok(Numerics::Bf16),
            _ => Err(format!("unknown numerics `{s}` (auto, int8, f32, bf16)")),
        }
    }
}

impl Numerics {
    /// The CPU fast path's arithmetic, when this choice runs a GGUF on it (`None`: bf16 runs
    /// candle's transformer instead).
    pub fn cpu_fast_path(self) -> Option<CpuNumerics> {
        match self {
            Numerics::Auto | Numerics::Int8 => Some(CpuNumerics::Int8),
            Numerics::F32 => Some(CpuNumerics::F32),
            Numerics::Bf16 => None,
        }
    }

    /// The compute dtype of candle's transformer on `device`; `int8` has none (it is the CPU
    /// fast path's arithmetic).
    pub fn candle_dtype(self, device: &Device) -> Result<DType, EngineError> {
        match self {
            Numerics::Auto if device.is_cuda() => Ok(DType::BF16),
            Numerics::Auto | Numerics::F32 => Ok(DType::F32),
            Numerics::Bf16 => Ok(DType::BF16),
            Numerics::Int8 => Err(EngineError::InvalidRequest(
                "--numerics int8 is the CPU fast path's arithmetic: it needs a GGUF model on the CPU (use f32 or bf16 here)".into(),
            )),
        }
    }
}

/// The fingerprint's dtype for candle's transformer: the device kind and the compute dtype
/// (`cuda-bf16`, `cpu-f32`, …), so a run never mixes devices' numerics.
pub fn candle_fingerprint_dtype(device: &Device, dtype: DType) -> String {
    let kind = if device.is_cuda() { "cuda" } else { "cpu" };
    let d = match dtype {
        DType::BF16 => "bf16",
        _ => "f32",
    };
    format!("{kind}-{d}")
}

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    /// CPU in a build without the `cuda` feature; else the GPU the placement rule gives
    /// ([`place`]).
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
    /// Bytes of recent rollout prompts' KV kept for prefix reuse, and twice as many of recent
    /// reflection prompts' (0 = off; the candle backend reuses whole prefill chunks only).
    pub prefix_cache_bytes: usize,
    /// The arithmetic ([`Numerics`]; recorded in the fingerprint's dtype).
    pub numerics: Numerics,
    /// The engine's run-time switches; `None`: read from the environment at load
    /// ([`EngineSwitches::from_env`]).
    pub switches: Option<EngineSwitches>,
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
            switches: None,
        }
    }
}

/// CUDA devices this process can see (after `CUDA_VISIBLE_DEVICES`); 0 in a build without
/// the `cuda` feature or when the driver cannot be initialised (no GPU, no driver).
pub fn cuda_device_count() -> u32 {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::CudaContext;
        CudaContext::device_count().map_or(0, |n| n.max(0) as u32)
    }
    #[cfg(not(feature = "cuda"))]
    0
}

/// Where `spec` puts a process's worker `local_worker` of `workers_per_process`, by the one
/// rule of [`stageb_shared::placement`] (the local rank, GPU binding and
/// `CUDA_VISIBLE_DEVICES` read from the environment): `Cpu` stays, `cuda:N` must exist,
/// `Auto` is the CPU in a build without `cuda` and the rule's GPU otherwise. The placement
/// comes back with the device when a GPU was chosen, for the caller to log and warn on.
pub fn place(
    spec: DeviceSpec,
    local_worker: u32,
    workers_per_process: u32,
) -> Result<(DeviceSpec, Option<Placement>), PlacementError> {
    let explicit = match spec {
        DeviceSpec::Cpu => return Ok((DeviceSpec::Cpu, None)),
        DeviceSpec::Auto if !cfg!(feature = "cuda") => return Ok((DeviceSpec::Cpu, None)),
        DeviceSpec::Auto => None,
        DeviceSpec::Cuda(n) if !cfg!(feature = "cuda") => {
            return Err(PlacementError::NotBuiltWithCuda { asked: n as u32 });
        }
        DeviceSpec::Cuda(n) => Some(n as u32),
    };
    let env = |k: &str| std::env::var(k).ok();
    let local_rank = LOCAL_RANK_VARS
        .iter()
        .find_map(|k| env(k).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0);
    let input = PlacementInput {
        local_rank,
        local_worker,
        workers_per_process,
        bound_per_task: bound_per_task(env),
        visible_devices: env("CUDA_VISIBLE_DEVICES"),
        device_count: cuda_device_count(),
        explicit,
    };
    let placement = cuda_placement(&input)?;
    Ok((
        DeviceSpec::Cuda(placement.ordinal as usize),
        Some(placement),
    ))
}

/// Opens the device `spec` names (`Auto` placed as a process's only worker, see [`place`]).
/// A GPU is opened as `switches.events` says ([`open_cuda`]).
pub(crate) fn select_device(
    spec: DeviceSpec,
    switches: &EngineSwitches,
) -> Result<Device, EngineError> {
    let (spec, _) = place(spec, 0, 1).map_err(|e| EngineError::InvalidRequest(e.to_string()))?;
    match spec {
        DeviceSpec::Cuda(i) => {
            open_cuda(i, switches.events).map_err(|e| EngineError::Model(format!("cuda:{i}: {e}")))
        }
        DeviceSpec::Cpu | DeviceSpec::Auto => Ok(Device::Cpu),
    }
}

/// GPU `ordinal` with cudarc's event tracking on (candle's default: the per-thread stream,
/// two events recorded for every tensor allocated), or off: one explicit stream of its own,
/// tracking disabled before any tensor exists. Every tensor, kernel, cuBLAS call and copy of
/// the engine then runs in order on that one stream, which is what the events would otherwise
/// enforce across streams, so no tensor is freed or read before the work writing it is done.
fn open_cuda(ordinal: usize, events: bool) -> candle_core::Result<Device> {
    if events {
        return Device::new_cuda(ordinal);
    }
    let device = Device::new_cuda_with_stream(ordinal)?;
    #[cfg(feature = "cuda")]
    {
        if let Device::Cuda(d) = &device {
            // SAFETY: no tensor exists on this device yet, and everything the engine does on
            // it goes to its one stream (see above): nothing needs cross-stream events.
            unsafe { d.disable_event_tracking() };
        }
    }
    Ok(device)
}
