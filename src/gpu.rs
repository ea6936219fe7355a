//! Opening the GPU: the device with this build's kernels, or a clear reason why not.

use anyhow::{Context, Result};
use erase_runtime::cuda::CudaDevice;

/// Opens CUDA device 0 (or `ERASE_DEVICE`) with the embedded kernels. Errors say what is
/// missing: kernels in this build, a driver, or a device.
pub fn open_device() -> Result<CudaDevice> {
    let ordinal = match std::env::var("ERASE_DEVICE") {
        Ok(v) => v
            .parse()
            .with_context(|| format!("ERASE_DEVICE={v} is not a device number"))?,
        Err(_) => 0,
    };
    open_device_ordinal(ordinal)
}

/// Opens CUDA device `ordinal` with the embedded kernels.
pub fn open_device_ordinal(ordinal: usize) -> Result<CudaDevice> {
    Ok(CudaDevice::open(crate::kernels::library(), ordinal)?)
}
