//! The device part of a model's fingerprint: what, besides the weights, the candle version and
//! the dtype, decides the bits a model computes.
//!
//! On CUDA that is the GPU itself: cuBLAS promises the same result for the same call only on
//! the same GPU model (its compute capability and its number of SMs: both choose the GEMM
//! algorithm and its split) and the same cuBLAS version. So a CUDA worker's device part names
//! them, `cuda(NVIDIA H200; cc 9.0; 132 SMs; cuBLAS 13.1.0)`, and two workers on different GPU
//! kinds present different fingerprints: rank 0 admits only the run's. On the CPU the part
//! stays the kind, `cpu`: the fast path's kernels have one fixed recipe per output element
//! whatever the machine, and a CPU fingerprint recorded before this existed still matches.

use candle_core::Device;

use crate::engine::EngineError;

/// What the fingerprint records of a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// The driver's name of the device (`NVIDIA H200`).
    pub name: String,
    /// Compute capability, major and minor (9.0 for Hopper).
    pub compute_capability: (i32, i32),
    /// Streaming multiprocessors the device has.
    pub sm_count: i32,
    /// The version of the cuBLAS library this process loaded, as cuBLAS reports it
    /// (`major * 10000 + minor * 100 + patch`, e.g. 130100 for 13.1.0).
    pub cublas_version: i32,
}

impl GpuInfo {
    /// The fingerprint's device part for this GPU: `cuda(NAME; cc M.m; N SMs; cuBLAS X.Y.Z)`.
    /// Characters that separate a fingerprint's parts (`|`) or close this one (`(`, `)`) never
    /// come from the name.
    pub fn fingerprint_device(&self) -> String {
        let name: String = self
            .name
            .trim()
            .chars()
            .map(|c| if matches!(c, '|' | '(' | ')') { '-' } else { c })
            .collect();
        let v = self.cublas_version;
        let (major, minor) = self.compute_capability;
        format!(
            "cuda({name}; cc {major}.{minor}; {} SMs; cuBLAS {}.{}.{})",
            self.sm_count,
            v / 10_000,
            v % 10_000 / 100,
            v % 100
        )
    }
}

/// The fingerprint's device part for a model loaded on `device`, whose kind is `kind` (`cpu`
/// or `cuda`): the kind on the CPU, the GPU's details on CUDA ([`GpuInfo`]).
pub fn fingerprint_device(kind: &str, device: &Device) -> Result<String, EngineError> {
    Ok(match gpu_info(device)? {
        Some(gpu) => gpu.fingerprint_device(),
        None => kind.to_string(),
    })
}

/// The device kind of a fingerprint's device part (`cuda` of `cuda(NVIDIA H200; …)`).
pub fn device_kind(device_part: &str) -> &str {
    device_part
        .split_once('(')
        .map_or(device_part, |(kind, _)| kind)
}

/// Whether `device_part` is one [`fingerprint_device`] writes: `cpu`, `cuda`, or
/// `cuda(…)` with something between the parentheses and nothing after them.
pub fn device_part_known(device_part: &str) -> bool {
    match device_part {
        "cpu" | "cuda" => true,
        _ => device_part
            .strip_prefix("cuda(")
            .and_then(|rest| rest.strip_suffix(')'))
            .is_some_and(|inner| !inner.trim().is_empty() && !inner.contains(['(', ')', '|'])),
    }
}

/// The GPU's details, `None` on the CPU.
#[cfg(feature = "cuda")]
pub fn gpu_info(device: &Device) -> Result<Option<GpuInfo>, EngineError> {
    use candle_core::cuda_backend::cudarc::cublas::sys as cublas;
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;

    let Device::Cuda(dev) = device else {
        return Ok(None);
    };
    let err = |what: &str, e: String| EngineError::Model(format!("querying the GPU's {what}: {e}"));
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    let name = ctx.name().map_err(|e| err("name", e.to_string()))?;
    let compute_capability = ctx
        .compute_capability()
        .map_err(|e| err("compute capability", e.to_string()))?;
    let sm_count = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(|e| err("SM count", e.to_string()))?;
    let blas = dev.cublas_handle();
    let mut cublas_version: std::ffi::c_int = 0;
    // SAFETY: the handle is candle's live cuBLAS handle for this device (held by `blas` for
    // the call), and the out pointer is a valid, writable c_int on this stack frame.
    let status = unsafe { cublas::cublasGetVersion_v2(*blas.handle(), &mut cublas_version) };
    if status != cublas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        return Err(err("cuBLAS version", format!("{status:?}")));
    }
    Ok(Some(GpuInfo {
        name,
        compute_capability,
        sm_count,
        cublas_version,
    }))
}

/// The GPU's details: never any in a build without CUDA.
#[cfg(not(feature = "cuda"))]
pub fn gpu_info(_device: &Device) -> Result<Option<GpuInfo>, EngineError> {
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h200() -> GpuInfo {
        GpuInfo {
            name: "NVIDIA H200".into(),
            compute_capability: (9, 0),
            sm_count: 132,
            cublas_version: 130_100,
        }
    }

    #[test]
    fn a_gpus_device_part_names_its_model_capability_sms_and_cublas_version() {
        assert_eq!(
            h200().fingerprint_device(),
            "cuda(NVIDIA H200; cc 9.0; 132 SMs; cuBLAS 13.1.0)"
        );
        let a100 = GpuInfo {
            name: "NVIDIA A100-SXM4-80GB".into(),
            compute_capability: (8, 0),
            sm_count: 108,
            cublas_version: 120_804,
        };
        assert_eq!(
            a100.fingerprint_device(),
            "cuda(NVIDIA A100-SXM4-80GB; cc 8.0; 108 SMs; cuBLAS 12.8.4)"
        );
    }

    #[test]
    fn gpus_that_differ_in_any_recorded_detail_have_different_device_parts() {
        let base = h200().fingerprint_device();
        let mut other = h200();
        other.sm_count = 114; // an H100 PCIe's count on the same architecture
        assert_ne!(other.fingerprint_device(), base);
        let mut other = h200();
        other.cublas_version = 130_000;
        assert_ne!(other.fingerprint_device(), base);
        let mut other = h200();
        other.compute_capability = (10, 0);
        assert_ne!(other.fingerprint_device(), base);
    }

    #[test]
    fn a_name_cannot_break_the_fingerprints_parts() {
        let mut odd = h200();
        odd.name = "  Weird|GPU (rev 2)  ".into();
        let part = odd.fingerprint_device();
        assert_eq!(
            part,
            "cuda(Weird-GPU -rev 2-; cc 9.0; 132 SMs; cuBLAS 13.1.0)"
        );
        assert!(device_part_known(&part), "{part}");
        assert_eq!(device_kind(&part), "cuda");
    }

    #[test]
    fn the_cpu_keeps_its_plain_kind() {
        assert_eq!(
            fingerprint_device("cpu", &Device::Cpu).unwrap(),
            "cpu",
            "a CPU fingerprint is what it was before GPUs were described"
        );
        assert_eq!(device_kind("cpu"), "cpu");
    }

    #[test]
    fn only_device_parts_this_build_writes_are_known() {
        for ok in [
            "cpu",
            "cuda",
            "cuda(NVIDIA H200; cc 9.0; 132 SMs; cuBLAS 13.1.0)",
        ] {
            assert!(device_part_known(ok), "{ok}");
        }
        for made_up in [
            "",
            "gpu",
            "cuda()",
            "cuda( )",
            "cuda(x",
            "cuda(x)y",
            "cpu(x)",
            "cuda(a(b))",
        ] {
            assert!(!device_part_known(made_up), "{made_up}");
        }
    }
}
