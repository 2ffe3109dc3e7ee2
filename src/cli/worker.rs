//! A worker's flags: [`ModelArgs`] (in `run`, `worker`, `launch` and `generate`: how the model
//! is loaded and computed) and TLS toward rank 0 (`worker`, and `launch`, whose ranks both
//! serve and dial).

use std::path::{Path, PathBuf};

use anyhow::{Result, anyhow};
use clap::Args;
use stageb::roles;
use stageb_shared::config::{DeviceKind, Origin, Tuned};
use stageb_shared::tls::ClientTls;
use stageb_shared::wire::MAX_JOBS_PER_LEASE;
use stageb_worker::client::JobLimits;
use stageb_worker::engine::{DeviceSpec, EngineOptions, KernelChoice, ModelEngine, Numerics};

use super::ServerTlsArgs;

/// How a worker loads and computes the model.
#[derive(Args, Clone)]
pub(crate) struct ModelArgs {
    /// Device: auto (CUDA at LOCAL_RANK when built with `cuda`, else CPU), cpu, cuda:N.
    #[arg(long, env = "STAGEB_DEVICE", default_value = "auto")]
    pub(crate) device: String,
    /// Compute threads per worker (default: all cores).
    #[arg(long, env = "STAGEB_THREADS")]
    pub(crate) threads: Option<usize>,
    /// Context length in tokens (prompt + generated) this worker holds; default: what the model
    /// declares (GGUF `*.context_length`, `config.json` `max_position_embeddings`). Rank 0
    /// refuses a worker that holds less than the run plans with.
    #[arg(long, env = "STAGEB_MAX_MODEL_LEN")]
    pub(crate) max_model_len: Option<u32>,
    /// Arithmetic: auto (int8 on the CPU fast path, bf16 on CUDA, f32 for a safetensors model
    /// on the CPU), int8 (GGUF on the CPU: activations rounded to 8 bits per block of 32,
    /// integer dot products; fast), f32 (exact weights, f32 activations and KV) or bf16 (bf16
    /// weights, activations and KV; norms, softmax and logits in f32; on the CPU it runs
    /// through candle, slowly). Part of the model fingerprint: every worker of a run must use
    /// the same.
    #[arg(long, env = "STAGEB_NUMERICS", default_value = "auto")]
    pub(crate) numerics: Numerics,
    /// CPU kernels: auto (the best this CPU has) or at most avx512vnni, avx512bw, avx2 or
    /// scalar. Every choice computes the same bits; for benchmarks and diagnosis.
    #[arg(long, env = "STAGEB_KERNELS", default_value = "auto")]
    pub(crate) kernels: KernelChoice,
    /// MiB of recent rollout prompts' KV a worker keeps, so the next ticket's prefill starts
    /// after the system prompt and guidance they share (0 = off; on a GPU whole 512-token
    /// chunks of it). Reflection prompts, several times as long, have a second store of twice
    /// this size, so a worker keeps up to three times this in all. Results are the same bits
    /// either way.
    #[arg(long, env = "STAGEB_PREFIX_CACHE_MIB", default_value_t = 256)]
    pub(crate) prefix_cache_mib: usize,
    /// Jobs a worker holds at once, run in one continuous batch: rollouts and reflection
    /// calls decode together, each joining at the next step (1 = one job at a time, the old
    /// behaviour). Results are the same bits either way. Default by device: 8 on the CPU, 16
    /// on a GPU.
    #[arg(long, env = "STAGEB_MAX_JOBS",
          value_parser = clap::value_parser!(u64).range(1..=u64::from(MAX_JOBS_PER_LEASE)))]
    pub(crate) max_jobs: Option<u64>,
    /// MiB of KV cache the jobs a worker holds may take together (each job counted at its
    /// peak, bounded from above): no job is leased past it, except one when none is in hand.
    /// Default: 2048 on the CPU; on a GPU 60% of the memory free after the model is loaded,
    /// less the two prefix stores (three times `--prefix-cache-mib` together).
    #[arg(long, env = "STAGEB_KV_CACHE_MIB")]
    pub(crate) kv_cache_mib: Option<u64>,
}

impl ModelArgs {
    /// The jobs a worker on `device` holds at once, and where that came from: `--max-jobs`,
    /// else the device's default.
    pub(crate) fn max_jobs(&self, device: &DeviceSpec) -> Tuned {
        let given = self.max_jobs.map(|n| u32::try_from(n).unwrap_or(u32::MAX));
        Tuned::pick(given, Origin::Flag, device_kind(device).defaults().max_jobs)
    }

    /// How many jobs each worker on `device` holds at once (`--max-jobs`, else the device's
    /// default; `--kv-cache-mib`).
    pub(crate) fn job_limits(&self, device: &DeviceSpec) -> JobLimits {
        JobLimits {
            max_jobs: self.max_jobs(device).value as usize,
            kv_cache_bytes: self.kv_cache_mib.map(|m| m.saturating_mul(1 << 20)),
        }
    }

    /// The engine options of a process's only worker ([`ModelArgs::engine_options_for`]).
    pub(crate) fn engine_options(&self) -> Result<EngineOptions> {
        self.engine_options_for(0, 1)
    }

    /// The engine options of worker `local_worker` of the `per_process` this process runs:
    /// its device placed by the one rule ([`roles::place_device`]: an ordinal that does not
    /// exist is an error here, before any lease), the CPU kernels chosen process-wide.
    pub(crate) fn engine_options_for(
        &self,
        local_worker: u32,
        per_process: u32,
    ) -> Result<EngineOptions> {
        let asked: DeviceSpec = self.device.parse().map_err(|e| anyhow!("{e}"))?;
        let device = roles::place_device(asked, local_worker, per_process)?;
        stageb_worker::engine::int8::choose(self.kernels);
        Ok(EngineOptions {
            device,
            threads: self.threads,
            max_context: self.max_model_len.map(|n| n as usize),
            numerics: self.numerics,
            prefix_cache_bytes: self.prefix_cache_mib.saturating_mul(1 << 20),
            ..EngineOptions::default()
        })
    }

    /// Load the model at `model` with these flags ([`roles::load_model`]: a missing or
    /// unreadable file is bad input).
    pub(crate) fn load(&self, model: &Path) -> Result<ModelEngine> {
        let options = self.engine_options()?;
        Ok(roles::load_model(model, &options)?)
    }
}

/// The kind of device a placed worker opens (`auto` is placed before this is asked).
pub(crate) fn device_kind(device: &DeviceSpec) -> DeviceKind {
    match device {
        DeviceSpec::Cuda(_) => DeviceKind::Cuda,
        DeviceSpec::Cpu | DeviceSpec::Auto => DeviceKind::Cpu,
    }
}

/// TLS toward the coordinator, as a worker.
#[derive(Args, Clone)]
pub(crate) struct WorkerTlsArgs {
    /// CA to verify the coordinator's certificate with (PEM): the worker dials TLS.
    #[arg(long, env = "STAGEB_TLS_CA")]
    pub(crate) tls_ca: Option<PathBuf>,
    /// This worker's certificate for mutual TLS (PEM).
    #[arg(long, env = "STAGEB_TLS_CERT")]
    pub(crate) tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "STAGEB_TLS_KEY")]
    pub(crate) tls_key: Option<PathBuf>,
    /// Name expected in the coordinator's certificate (default: the host dialed).
    #[arg(long, env = "STAGEB_TLS_SERVER_NAME")]
    pub(crate) tls_server_name: Option<String>,
}

impl WorkerTlsArgs {
    pub(crate) fn load(&self) -> Result<Option<ClientTls>> {
        Ok(ClientTls::from_files(
            self.tls_ca.as_deref(),
            self.tls_cert.as_deref(),
            self.tls_key.as_deref(),
            self.tls_server_name.as_deref(),
        )?)
    }
}

/// TLS for `launch`: rank 0 serves with the certificate and key; every rank (rank 0's local
/// worker too) dials with them as its client certificate.
#[derive(Args, Clone)]
pub(crate) struct LaunchTlsArgs {
    #[command(flatten)]
    pub(crate) server: ServerTlsArgs,
    /// CA to verify the coordinator with (default: --tls-client-ca).
    #[arg(long, env = "STAGEB_TLS_CA")]
    pub(crate) tls_ca: Option<PathBuf>,
    /// Name expected in the coordinator's certificate (default: the host dialed).
    #[arg(long, env = "STAGEB_TLS_SERVER_NAME")]
    pub(crate) tls_server_name: Option<String>,
}

impl LaunchTlsArgs {
    pub(crate) fn client(&self) -> Result<Option<ClientTls>> {
        WorkerTlsArgs {
            tls_ca: self
                .tls_ca
                .clone()
                .or_else(|| self.server.tls_client_ca.clone()),
            tls_cert: self.server.tls_cert.clone(),
            tls_key: self.server.tls_key.clone(),
            tls_server_name: self.tls_server_name.clone(),
        }
        .load()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        model: ModelArgs,
    }

    fn max_jobs(args: &[&str], device: DeviceSpec) -> Tuned {
        let flags =
            Flags::try_parse_from(std::iter::once("stageb").chain(args.iter().copied())).unwrap();
        flags.model.max_jobs(&device)
    }

    #[test]
    fn max_jobs_defaults_by_the_placed_device_unless_given() {
        let default = |value| Tuned {
            value,
            from: Origin::DeviceDefault,
        };
        assert_eq!(max_jobs(&[], DeviceSpec::Cpu), default(8));
        assert_eq!(max_jobs(&[], DeviceSpec::Cuda(1)), default(16));
        let given = Tuned {
            value: 4,
            from: Origin::Flag,
        };
        assert_eq!(max_jobs(&["--max-jobs", "4"], DeviceSpec::Cuda(0)), given);
        assert!(Flags::try_parse_from(["stageb", "--max-jobs", "17"]).is_err());
    }
}
