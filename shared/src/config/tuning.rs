//! The throughput settings whose best value depends on the device the workers compute on:
//! `--max-jobs` (jobs a worker holds at once), `runner.pipeline_steps` and
//! `runner.pipeline_cycles` (work queued ahead). None of them changes an artifact byte (a
//! worker's batch and the work queued ahead are proven not to: a job alone and in company give
//! the same bits, and an answer queued ahead is used only where the sequential loop asks for
//! exactly that job), so a value left unset takes its device's default instead of being an
//! error. This module owns the one table of those defaults ([`DeviceKind::defaults`]) and what
//! rank 0 prints and records about the values in force ([`Tuning`]).

use std::fmt;

use serde::{Deserialize, Serialize};

use super::types::RunnerConfig;

/// The kind of device a worker computes on (the ordinal changes nothing here).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    Cpu,
    Cuda,
}

/// The values an unset setting takes on one kind of device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceDefaults {
    /// `--max-jobs`.
    pub max_jobs: u32,
    /// `runner.pipeline_steps`.
    pub pipeline_steps: u32,
    /// `runner.pipeline_cycles`.
    pub pipeline_cycles: u32,
}

impl DeviceKind {
    /// The defaults of this kind of device.
    ///
    /// CPU: 8 jobs, nothing queued ahead, measured on two cores: a step's time grows with
    /// its rows there, so work queued ahead takes forward steps from the reflection call the
    /// run waits on (one step ahead ran the demo at 0.94× the speed, four cycles ahead 0.88×).
    ///
    /// CUDA: a decode step reads every weight once whatever its rows (~4.5 ms for an 8B model
    /// on an H100 against 140 ms measured for transformers at 64 rows), so rows are nearly
    /// free until compute bounds them: 16 jobs (the most a worker may hold) of 8 candidates
    /// fill the 64-row tiles the backend computes in; one step and four cycles ahead keep
    /// that capacity busy while reflection runs (the GPU check's mission runs with exactly
    /// these and compares its artifacts against one job and nothing ahead).
    pub const fn defaults(self) -> DeviceDefaults {
        match self {
            DeviceKind::Cpu => DeviceDefaults {
                max_jobs: 8,
                pipeline_steps: 0,
                pipeline_cycles: 0,
            },
            DeviceKind::Cuda => DeviceDefaults {
                max_jobs: 16,
                pipeline_steps: 1,
                pipeline_cycles: 4,
            },
        }
    }

    /// The device kind a name starts with (`cpu`, `cuda`, `cuda:1`, a fingerprint's device
    /// field with whatever detail follows it), if any.
    pub fn from_name(name: &str) -> Option<Self> {
        let head = name
            .trim()
            .split(|c: char| !c.is_ascii_alphanumeric())
            .next()
            .unwrap_or_default();
        match head {
            "cpu" => Some(DeviceKind::Cpu),
            "cuda" => Some(DeviceKind::Cuda),
            _ => None,
        }
    }
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        })
    }
}

/// Where a value in force came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Origin {
    /// The config file wrote it.
    Config,
    /// A command-line flag (or its `STAGEB_*` variable) gave it.
    Flag,
    /// Nothing set it: the device's default.
    DeviceDefault,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Origin::Config => "config",
            Origin::Flag => "flag",
            Origin::DeviceDefault => "device default",
        })
    }
}

/// A value in force and where it came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tuned {
    pub value: u32,
    pub from: Origin,
}

impl Tuned {
    /// `given` when set (from `origin`), else the device's `default`.
    pub fn pick(given: Option<u32>, origin: Origin, default: u32) -> Self {
        match given {
            Some(value) => Tuned {
                value,
                from: origin,
            },
            None => Tuned {
                value: default,
                from: Origin::DeviceDefault,
            },
        }
    }
}

/// The settings a run's rank 0 started with (printed at start, recorded in the manifest's
/// `runtime.tuning`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tuning {
    /// The device kind the defaults were chosen for; `None`: rank 0 did not know it (it runs
    /// no worker and `--worker-numerics` names no device), so the CPU's were taken.
    pub device: Option<DeviceKind>,
    /// The jobs each of rank 0's own workers holds; `None` when it runs none (a remote
    /// worker's own `--max-jobs` decides its own).
    pub max_jobs: Option<Tuned>,
    pub pipeline_steps: Tuned,
    pub pipeline_cycles: Tuned,
}

impl RunnerConfig {
    /// Give `runner.pipeline_steps` and `runner.pipeline_cycles` their `device`'s defaults
    /// where the config did not write them (`None`: the CPU's), and say what is in force, with
    /// `max_jobs` (rank 0's own workers', if it runs any).
    pub fn tune_for(&mut self, device: Option<DeviceKind>, max_jobs: Option<Tuned>) -> Tuning {
        let defaults = device.unwrap_or(DeviceKind::Cpu).defaults();
        let written = self.written;
        let steps = Tuned::pick(
            written.pipeline_steps.then_some(self.pipeline_steps),
            Origin::Config,
            defaults.pipeline_steps,
        );
        let cycles = Tuned::pick(
            written.pipeline_cycles.then_some(self.pipeline_cycles),
            Origin::Config,
            defaults.pipeline_cycles,
        );
        self.pipeline_steps = steps.value;
        self.pipeline_cycles = cycles.value;
        Tuning {
            device,
            max_jobs,
            pipeline_steps: steps,
            pipeline_cycles: cycles,
        }
    }
}

impl fmt::Display for Tuning {
    /// One line: `device cuda: --max-jobs 16 (device default), runner.pipeline_steps 1
    /// (config), runner.pipeline_cycles 4 (device default)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.device {
            Some(device) => write!(f, "device {device}: ")?,
            None => f.write_str("device unknown to rank 0, cpu defaults: ")?,
        }
        match self.max_jobs {
            Some(t) => write!(f, "--max-jobs {} ({})", t.value, t.from)?,
            None => f.write_str("--max-jobs per worker (rank 0 runs none)")?,
        }
        write!(
            f,
            ", runner.pipeline_steps {} ({}), runner.pipeline_cycles {} ({})",
            self.pipeline_steps.value,
            self.pipeline_steps.from,
            self.pipeline_cycles.value,
            self.pipeline_cycles.from
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_config;

    fn runner(extra: &str) -> RunnerConfig {
        let text = format!(
            "seed: 1\nstage_a_paths: a.jsonl\nmodel: {{model_name_or_path: m.gguf}}\n\
             guidance: {{path: g.json, retention: 2}}\noutput: {{root: r, run_name: t}}\n\
             sampler: {{samples_per_decode: 2, grid: [{{temperature: 0.5, top_p: 0.9, \
             max_new_tokens: 32}}]}}\nreflection: {{batch_size: 4}}\n\
             selection: {{policy: top_label, tie_break: temperature}}\n\
             runner: {{epochs: 1{extra}}}\n"
        );
        parse_config(&text, "t.yaml").unwrap().config.runner
    }

    #[test]
    fn on_the_cpu_an_unset_setting_keeps_the_defaults_tuned_for_two_cores() {
        let mut cfg = runner("");
        assert_eq!((cfg.pipeline_steps, cfg.pipeline_cycles), (0, 0));
        let tuning = cfg.tune_for(Some(DeviceKind::Cpu), None);
        assert_eq!((cfg.pipeline_steps, cfg.pipeline_cycles), (0, 0));
        assert_eq!(tuning.pipeline_steps.from, Origin::DeviceDefault);
        assert_eq!(DeviceKind::Cpu.defaults().max_jobs, 8);
        // Rank 0 not knowing the device is the CPU's case.
        let mut unknown = runner("");
        unknown.tune_for(None, None);
        assert_eq!(unknown, runner(""));
    }

    #[test]
    fn on_a_gpu_an_unset_setting_takes_the_gpus_default_and_a_written_one_is_kept() {
        let mut cfg = runner(", pipeline_cycles: 0");
        let max_jobs = Tuned::pick(None, Origin::Flag, DeviceKind::Cuda.defaults().max_jobs);
        let tuning = cfg.tune_for(Some(DeviceKind::Cuda), Some(max_jobs));
        assert_eq!((cfg.pipeline_steps, cfg.pipeline_cycles), (1, 0));
        assert_eq!(
            tuning.to_string(),
            "device cuda: --max-jobs 16 (device default), runner.pipeline_steps 1 (device \
             default), runner.pipeline_cycles 0 (config)"
        );
    }

    #[test]
    fn a_device_is_known_by_the_name_it_starts_with() {
        assert_eq!(DeviceKind::from_name("cuda"), Some(DeviceKind::Cuda));
        assert_eq!(DeviceKind::from_name("cuda:1"), Some(DeviceKind::Cuda));
        assert_eq!(DeviceKind::from_name("cpu"), Some(DeviceKind::Cpu));
        assert_eq!(DeviceKind::from_name("gguf-quantized"), None);
        assert_eq!(DeviceKind::from_name(""), None);
    }

    #[test]
    fn the_record_reads_back_with_each_values_origin() {
        let mut cfg = runner(", pipeline_steps: 2");
        let tuning = cfg.tune_for(None, Some(Tuned::pick(Some(4), Origin::Flag, 8)));
        let json = serde_json::to_value(tuning).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "device": null,
                "max_jobs": {"value": 4, "from": "flag"},
                "pipeline_steps": {"value": 2, "from": "config"},
                "pipeline_cycles": {"value": 0, "from": "device_default"},
            })
        );
        assert_eq!(serde_json::from_value::<Tuning>(json).unwrap(), tuning);
    }
}
