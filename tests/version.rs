//! `stageb --version` names the backend the binary was built for (`build.rs`): the launchers
//! (`scripts/stage_b.sh`, `deploy/slurm/stageb.sbatch`) look for `(cpu` in it to warn when GPUs
//! are given to a CPU-only build, and a GPU node's operator reads the CUDA version and the
//! compute capability from it.

use std::process::Command;

#[test]
fn version_names_the_backend() {
    let out = Command::new(env!("CARGO_BIN_EXE_stageb"))
        .arg("--version")
        .output()
        .expect("run stageb --version");
    assert!(out.status.success(), "{out:?}");
    let version = String::from_utf8(out.stdout).expect("utf-8");
    let prefix = concat!("stageb ", env!("CARGO_PKG_VERSION"), " (");
    if cfg!(feature = "cuda") {
        // e.g. "stageb 0.1.0 (cuda 13.0, sm_90)"
        let backend = version
            .strip_prefix(prefix)
            .and_then(|rest| rest.strip_suffix(")\n"))
            .unwrap_or_else(|| panic!("unexpected --version: {version:?}"));
        let (cuda, cap) = backend.split_once(", ").expect("cuda X.Y, sm_NN");
        assert!(cuda.starts_with("cuda 1"), "{version:?}");
        assert!(cap.starts_with("sm_"), "{version:?}");
    } else {
        assert_eq!(version, format!("{prefix}cpu; built without cuda)\n"));
    }
}
