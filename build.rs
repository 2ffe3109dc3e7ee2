//! Build script of the `stageb` package: records what the binary is built for, so
//! `stageb --version` names it (`STAGEB_BUILD_BACKEND`, read by `src/cli/mod.rs`):
//! - without the `cuda` feature: `cpu; built without cuda` (nothing is run);
//! - with it: `cuda MAJOR.MINOR, sm_CC[a]` for one architecture, or
//!   `cuda MAJOR.MINOR, sm_80 sm_86 sm_89 sm_90 sm_100 + PTX compute_80` for a build that
//!   carries several. The CUDA version is found the way cudarc's build script finds the one it
//!   binds to (`CUDARC_CUDA_VERSION`, e.g. `13000`, else the `release X.Y` of a bare
//!   `nvcc --version`), the architectures the way candle's kernel build (cudaforge) finds the
//!   one it compiles for (`CUDA_COMPUTE_CAP`, e.g. `90` or `80`, else `nvidia-smi`), or, when
//!   `scripts/gpu/build-cuda.sh` builds for several through `scripts/gpu/nvcc-multiarch.sh`, from the
//!   list that wrapper reads (`STAGEB_CUDA_ARCHS`, e.g. `80 86 89 90 100`).
//!
//! Deterministic and cheap: it reruns only when this file or one of those variables changes
//! (not on every source edit, not when `PATH` changes).

use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    for var in [
        "CUDARC_CUDA_VERSION",
        "CUDA_COMPUTE_CAP",
        "STAGEB_CUDA_ARCHS",
        "CUDA_HOME",
        "CUDA_PATH",
        "CUDA_ROOT",
        "CUDA_TOOLKIT_ROOT_DIR",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let backend = if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        format!("cuda {}, {}", cuda_version(), architectures())
    } else {
        "cpu; built without cuda".to_string()
    };
    println!("cargo:rustc-env=STAGEB_BUILD_BACKEND={backend}");
}

/// `13.0` from `CUDARC_CUDA_VERSION=13000`, else from `nvcc --version`'s `release 13.0, V13.0.88`.
fn cuda_version() -> String {
    if let Ok(v) = std::env::var("CUDARC_CUDA_VERSION") {
        // cudarc's spelling: MAJOR, then MINOR, each followed by a 0 ("13000", "12080").
        if let Some(rest) = v.strip_suffix('0')
            && let Some((major, minor)) = rest.split_once('0')
        {
            return format!("{major}.{minor}");
        }
        return v;
    }
    let out = Command::new("nvcc").arg("--version").output();
    let Some(out) = out.ok().filter(|o| o.status.success()) else {
        println!("cargo:warning=stageb: `nvcc --version` failed; --version will say `cuda ?`");
        return "?".to_string();
    };
    let text = String::from_utf8_lossy(&out.stdout);
    text.split(", ")
        .find_map(|part| part.strip_prefix("release "))
        .map(|v| v.trim().to_string())
        .unwrap_or_else(|| "?".to_string())
}

/// The architectures the binary carries: with several in `STAGEB_CUDA_ARCHS`, machine code for
/// each (candle's statically linked kernels) and PTX for the lowest (every other kernel, which
/// the driver compiles for any GPU at least that new); else the one [`compute_cap`].
fn architectures() -> String {
    let list = std::env::var("STAGEB_CUDA_ARCHS").unwrap_or_default();
    let mut caps: Vec<u32> = list
        .split([' ', ','])
        .filter_map(|c| c.trim().parse().ok())
        .collect();
    caps.sort_unstable();
    caps.dedup();
    match caps.as_slice() {
        [] | [_] => compute_cap(),
        [lowest, ..] => {
            let sass: Vec<String> = caps.iter().map(|c| format!("sm_{c}")).collect();
            format!("{} + PTX compute_{lowest}", sass.join(" "))
        }
    }
}

/// The architecture candle's kernels are compiled for, spelled as cudaforge passes it to nvcc:
/// `CUDA_COMPUTE_CAP=90` is `sm_90a` (cudaforge adds `a` from 90 up to 120 and `f` above it:
/// arch-specific code, for that compute capability only), `80` is `sm_80`, `90a` stays `sm_90a`.
/// Without the variable, the first GPU `nvidia-smi --query-gpu=compute_cap` lists (`9.0`).
fn compute_cap() -> String {
    let cap = std::env::var("CUDA_COMPUTE_CAP").ok().or_else(|| {
        let out = Command::new("nvidia-smi")
            .args(["--query-gpu=compute_cap", "--format=csv,noheader"])
            .output()
            .ok()
            .filter(|o| o.status.success())?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.lines().next().map(|l| l.trim().replace('.', ""))
    });
    let Some(cap) = cap else {
        return "sm_?".to_string();
    };
    let cap = cap.trim().to_lowercase();
    let cap = cap.strip_prefix("sm_").unwrap_or(&cap);
    let (digits, suffix) = match cap.strip_suffix(['a', 'f']) {
        Some(digits) => (digits, &cap[digits.len()..]),
        None => (cap, ""),
    };
    let Ok(mut base) = digits.parse::<u32>() else {
        return format!("sm_{cap}");
    };
    if base < 20 {
        base *= 10; // "9" as in 9.0
    }
    let suffix = match (suffix, base) {
        ("", 121..) => "f",
        ("", 90..) => "a",
        (s, _) => s,
    };
    format!("sm_{base}{suffix}")
}
