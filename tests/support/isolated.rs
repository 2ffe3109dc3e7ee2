//! Running one spec alone in a child process of the test binary, for a spec that owns
//! something process-wide (the global metrics recorder) while the binary's other specs run
//! beside it in threads.

use std::process::Command;

/// The variable that tells the child which spec it runs.
const CHILD: &str = "STAGEB_TEST_IN_OWN_PROCESS";

/// In the child: `true`, run the spec's body. In the test process: run the spec named `path`
/// (`module::test_name`, as `--list` prints it) alone in a child, fail with its output if it
/// failed, and return `false`.
#[track_caller]
pub fn in_own_process(path: &str) -> bool {
    if std::env::var_os(CHILD).is_some_and(|v| v == path) {
        return true;
    }
    let out = Command::new(std::env::current_exe().expect("the test binary"))
        .args([path, "--exact", "--test-threads=1", "--nocapture"])
        .env(CHILD, path)
        .output()
        .expect("the test binary runs");
    let ran = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && ran.contains("1 passed"),
        "{path} in its own process: {}\n{ran}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    false
}

/// `module::name` for the spec `name` of the calling module (`module_path!()` starts with the
/// crate's name, which `--exact` filters do not).
pub fn spec_path(module_path: &str, name: &str) -> String {
    let module = module_path.split_once("::").map_or("", |(_, m)| m);
    if module.is_empty() {
        name.to_string()
    } else {
        format!("{module}::{name}")
    }
}
