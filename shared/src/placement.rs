//! Which GPU a worker runs on: one pure rule for every way stageb starts workers (`run
//! --workers N`, `launch` under torchrun, Slurm or Kubernetes, a plain `worker`).
//!
//! The CUDA runtime numbers the devices a process can see `0..count`, after
//! `CUDA_VISIBLE_DEVICES` has filtered them. A launcher gives each process a local rank, and
//! a process may run several workers (`run --workers N`). The rule:
//!
//! 1. An explicit `--device cuda:N` is taken as asked, and must exist (`N < count`).
//! 2. Otherwise the worker's *slot* on the node is `local_rank × workers_per_process +
//!    local_worker`, unless the launcher bound GPUs to each task (Slurm `--gpus-per-task`,
//!    which sets `SLURM_GPUS_PER_TASK`; a Kubernetes pod sees only its own GPUs and has local
//!    rank 0): then the process's GPUs are its own and the slot is `local_worker`.
//! 3. The ordinal is `slot mod count`. A slot past `count` wraps: that worker shares a GPU
//!    with another one, which works (each holds its own weights and KV) but is slower, so the
//!    caller warns.
//! 4. No visible device is an error before any lease, never a silent fall-back to the CPU.
//!
//! Torchrun with 8 processes on 8 GPUs: rank r → cuda:r. Slurm with `--gpus-per-task=1`: every
//! task sees one GPU as cuda:0 → cuda:0 (the old `cuda:$SLURM_LOCALID` failed on ranks 1–7).
//! `run --workers 4` on 2 GPUs: workers 0..3 → cuda:0, 1, 0, 1, with a warning.

use crate::error::ErrorCode;

/// What decides a worker's GPU, read from the process environment and the CUDA runtime.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlacementInput {
    /// The process's rank on its node (`LOCAL_RANK`, `SLURM_LOCALID`, …; 0 without a launcher).
    pub local_rank: u32,
    /// This worker's index among the workers its process runs (`run --workers N`: 0..N).
    pub local_worker: u32,
    /// How many workers the process runs (1 for `worker` and `launch`).
    pub workers_per_process: u32,
    /// Whether the launcher bound GPUs to each task (Slurm `--gpus-per-task`).
    pub bound_per_task: bool,
    /// `CUDA_VISIBLE_DEVICES` as the process found it (`None`: unset).
    pub visible_devices: Option<String>,
    /// Devices the CUDA runtime reports to this process.
    pub device_count: u32,
    /// An explicit ordinal (`--device cuda:N`), taken as asked.
    pub explicit: Option<u32>,
}

/// Where a worker runs and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The CUDA ordinal the worker opens.
    pub ordinal: u32,
    /// The worker's slot on the node (see the module docs); `ordinal = slot mod count`.
    pub slot: u32,
    /// Another worker of this node gets the same ordinal (slots outnumber GPUs).
    pub shared: bool,
}

/// Why no GPU can be chosen: the process cannot run the worker it was asked to.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error(
        "--device cuda:{asked} asks for a GPU, but this stageb was built without the `cuda` feature (scripts/gpu/build-cuda.sh builds one); pass --device cpu or auto"
    )]
    NotBuiltWithCuda { asked: u32 },
    #[error(
        "no CUDA device is visible to this process (CUDA_VISIBLE_DEVICES={visible}); run on a GPU node, fix CUDA_VISIBLE_DEVICES, or pass --device cpu"
    )]
    NoDevice { visible: String },
    #[error(
        "--device cuda:{asked} does not exist: this process sees {count} CUDA device(s) (CUDA_VISIBLE_DEVICES={visible})"
    )]
    NoSuchDevice {
        asked: u32,
        count: u32,
        visible: String,
    },
}

impl PlacementError {
    /// The stable code (exit 2: the invocation, not the run, is wrong).
    pub fn code(&self) -> ErrorCode {
        ErrorCode::InvalidDevice
    }
}

/// The variables that hold a process's rank on its node, first found wins (`launch` reads
/// its local rank from them).
pub const LOCAL_RANK_VARS: [&str; 4] = [
    "STAGEB_LOCAL_RANK",
    "LOCAL_RANK",
    "SLURM_LOCALID",
    "OMPI_COMM_WORLD_LOCAL_RANK",
];

/// Whether the environment says GPUs were bound to each task (Slurm `--gpus-per-task`).
pub fn bound_per_task(env: impl Fn(&str) -> Option<String>) -> bool {
    env("SLURM_GPUS_PER_TASK").is_some_and(|v| !v.trim().is_empty())
}

/// The rule of the module docs.
pub fn cuda_placement(input: &PlacementInput) -> Result<Placement, PlacementError> {
    let visible = || {
        input
            .visible_devices
            .clone()
            .unwrap_or_else(|| "<unset>".into())
    };
    let count = input.device_count;
    if count == 0 {
        return Err(PlacementError::NoDevice { visible: visible() });
    }
    if let Some(asked) = input.explicit {
        if asked >= count {
            return Err(PlacementError::NoSuchDevice {
                asked,
                count,
                visible: visible(),
            });
        }
        return Ok(Placement {
            ordinal: asked,
            slot: asked,
            shared: false,
        });
    }
    let per_process = input.workers_per_process.max(1);
    let slot = if input.bound_per_task {
        input.local_worker
    } else {
        input.local_rank * per_process + input.local_worker
    };
    // Workers of this process that land on the same ordinal, or workers of other processes
    // on the node when the GPUs are the node's (slot wrapped past the count).
    let shared = slot >= count || per_process > count;
    Ok(Placement {
        ordinal: slot % count,
        slot,
        shared,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One launcher environment: (name, local rank, worker, workers per process, bound,
    /// CUDA_VISIBLE_DEVICES, device count) → expected ordinal and sharing.
    struct Case {
        name: &'static str,
        local_rank: u32,
        worker: u32,
        per_process: u32,
        bound: bool,
        visible: Option<&'static str>,
        count: u32,
        ordinal: u32,
        shared: bool,
    }

    const fn case(
        name: &'static str,
        (local_rank, worker, per_process): (u32, u32, u32),
        bound: bool,
        visible: Option<&'static str>,
        count: u32,
        (ordinal, shared): (u32, bool),
    ) -> Case {
        Case {
            name,
            local_rank,
            worker,
            per_process,
            bound,
            visible,
            count,
            ordinal,
            shared,
        }
    }

    const TABLE: &[Case] = &[
        case(
            "torchrun 8 procs, 8 GPUs, rank 0",
            (0, 0, 1),
            false,
            None,
            8,
            (0, false),
        ),
        case(
            "torchrun 8 procs, 8 GPUs, rank 7",
            (7, 0, 1),
            false,
            None,
            8,
            (7, false),
        ),
        case(
            "torchrun 4 procs, CUDA_VISIBLE_DEVICES=4,5,6,7, rank 2",
            (2, 0, 1),
            false,
            Some("4,5,6,7"),
            4,
            (2, false),
        ),
        case(
            "slurm --gpus-per-task=1, task 0",
            (0, 0, 1),
            true,
            Some("0"),
            1,
            (0, false),
        ),
        case(
            "slurm --gpus-per-task=1, task 5 (sees its GPU as cuda:0)",
            (5, 0, 1),
            true,
            Some("5"),
            1,
            (0, false),
        ),
        case(
            "slurm --gpus-per-task=2, task 3",
            (3, 0, 1),
            true,
            Some("6,7"),
            2,
            (0, false),
        ),
        case(
            "slurm --gres=gpu:8 unbound, task 6",
            (6, 0, 1),
            false,
            Some("0,1,2,3,4,5,6,7"),
            8,
            (6, false),
        ),
        case(
            "slurm unbound, 1 GPU per task by cgroup, task 3",
            (3, 0, 1),
            false,
            Some("0"),
            1,
            (0, true),
        ),
        case(
            "kubernetes pod with one GPU",
            (0, 0, 1),
            false,
            Some("GPU-3f2a"),
            1,
            (0, false),
        ),
        case(
            "run --workers 4 on 4 GPUs, worker 3",
            (0, 3, 4),
            false,
            None,
            4,
            (3, false),
        ),
        case(
            "run --workers 4 on 2 GPUs, worker 2",
            (0, 2, 4),
            false,
            None,
            2,
            (0, true),
        ),
        case(
            "run --workers 4 on 2 GPUs, worker 3",
            (0, 3, 4),
            false,
            None,
            2,
            (1, true),
        ),
        case(
            "run --workers 2, CUDA_VISIBLE_DEVICES=1,3, worker 1",
            (0, 1, 2),
            false,
            Some("1,3"),
            2,
            (1, false),
        ),
        case(
            "run --workers 3 on 1 GPU, worker 0",
            (0, 0, 3),
            false,
            Some("2"),
            1,
            (0, true),
        ),
        case(
            "plain worker, one GPU",
            (0, 0, 1),
            false,
            None,
            1,
            (0, false),
        ),
    ];

    #[test]
    fn every_launcher_environment_gets_the_gpu_the_rule_names() {
        for c in TABLE {
            let input = PlacementInput {
                local_rank: c.local_rank,
                local_worker: c.worker,
                workers_per_process: c.per_process,
                bound_per_task: c.bound,
                visible_devices: c.visible.map(str::to_string),
                device_count: c.count,
                explicit: None,
            };
            let got = cuda_placement(&input).unwrap_or_else(|e| panic!("{}: {e}", c.name));
            assert_eq!(
                (got.ordinal, got.shared),
                (c.ordinal, c.shared),
                "{}",
                c.name
            );
            assert!(got.ordinal < c.count, "{}: ordinal exists", c.name);
        }
    }

    fn input(count: u32, explicit: Option<u32>) -> PlacementInput {
        PlacementInput {
            local_rank: 3,
            local_worker: 0,
            workers_per_process: 1,
            bound_per_task: false,
            visible_devices: Some("0,1".into()),
            device_count: count,
            explicit,
        }
    }

    #[test]
    fn an_explicit_device_is_taken_as_asked_when_it_exists() {
        let got = cuda_placement(&input(2, Some(1))).unwrap();
        assert_eq!((got.ordinal, got.shared), (1, false));
    }

    #[test]
    fn an_explicit_device_that_does_not_exist_is_refused_with_a_code() {
        let err = cuda_placement(&input(2, Some(5))).unwrap_err();
        assert_eq!(err.code().code(), "E_INVALID_DEVICE");
        assert!(err.to_string().contains("cuda:5 does not exist"), "{err}");
        assert!(err.to_string().contains("sees 2 CUDA device(s)"), "{err}");
    }

    #[test]
    fn no_visible_device_is_an_error_never_a_silent_cpu() {
        let mut i = input(0, None);
        i.visible_devices = Some(String::new());
        let err = cuda_placement(&i).unwrap_err();
        assert!(matches!(err, PlacementError::NoDevice { .. }));
        assert!(err.to_string().contains("--device cpu"), "{err}");
    }

    #[test]
    fn per_task_binding_is_read_from_slurm_gpus_per_task() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert!(bound_per_task(env(&[("SLURM_GPUS_PER_TASK", "1")])));
        assert!(!bound_per_task(env(&[("SLURM_LOCALID", "1")])));
    }
}
