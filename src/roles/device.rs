//! Which device a worker of this process opens: the one placement rule
//! ([`stageb_shared::placement`], applied to this process's environment by
//! [`stageb_worker::engine::options::place`]) with what a person needs to see: the device each
//! worker got, in the log, a warning when workers share a GPU, and an ordinal that does not
//! exist as bad input (`E_INVALID_DEVICE`, exit 2) before any lease.

use stageb_shared::error::InputError;
use stageb_worker::engine::DeviceSpec;
use stageb_worker::engine::options::place;

/// The device worker `local_worker` of the `per_process` this process runs opens, for the
/// `asked` device (`--device`).
pub fn place_device(
    asked: DeviceSpec,
    local_worker: u32,
    per_process: u32,
) -> Result<DeviceSpec, InputError> {
    let (device, placement) = place(asked, local_worker, per_process)
        .map_err(|e| InputError::new(e.code(), "--device", None, e.to_string()))?;
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "<unset>".into());
    match (&device, placement) {
        (DeviceSpec::Cuda(ordinal), Some(p)) => {
            tracing::info!(worker = local_worker, device = %format!("cuda:{ordinal}"), slot = p.slot,
                           cuda_visible_devices = %visible, "worker device");
            if p.shared {
                tracing::warn!(worker = local_worker, device = %format!("cuda:{ordinal}"),
                               "workers outnumber the visible GPUs: this worker shares its GPU with another one (each holds its own weights and KV cache; slower)");
            }
        }
        _ => tracing::info!(worker = local_worker, device = %"cpu", "worker device"),
    }
    Ok(device)
}
