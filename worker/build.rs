//! Compiles the worker's CUDA kernels (`kernels/*.cu`) to PTX with nvcc when the `cuda` feature
//! is on; a CPU build runs nothing and needs no toolkit. The PTX targets `compute_80` (set
//! `STAGEB_PTX_ARCH` to change it): the driver compiles it at load for the GPU it runs on
//! (8.0, 8.6, 8.9, 9.0, 10.0, ...), provided the driver knows the PTX version the toolkit
//! wrote. nvcc is `$NVCC`, else `$CUDA_HOME/bin/nvcc`, else `nvcc` on the `PATH`.

use std::path::PathBuf;
use std::process::Command;

const KERNELS: [&str; 2] = ["paged_attention", "fused"];

fn main() {
    println!("cargo:rerun-if-changed=kernels");
    for var in ["NVCC", "CUDA_HOME", "STAGEB_PTX_ARCH", "CARGO_FEATURE_CUDA"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let nvcc = std::env::var_os("NVCC")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("CUDA_HOME").map(|h| PathBuf::from(h).join("bin/nvcc")))
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let arch = std::env::var("STAGEB_PTX_ARCH").unwrap_or_else(|_| "compute_80".into());
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    for name in KERNELS {
        let src = PathBuf::from("kernels").join(format!("{name}.cu"));
        let ptx = out.join(format!("{name}.ptx"));
        let status = Command::new(&nvcc)
            .args(["-ptx", &format!("-arch={arch}"), "-O3", "-Ikernels", "-o"])
            .arg(&ptx)
            .arg(&src)
            .status()
            .unwrap_or_else(|e| {
                panic!("cannot run {} ({e}): set NVCC or CUDA_HOME", nvcc.display())
            });
        if !status.success() {
            panic!("nvcc failed on {} ({status})", src.display());
        }
    }
}
