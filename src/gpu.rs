//! CUDA through cudarc's driver API, loaded at run time: the crate builds and imports without CUDA,
//! and every entry point reports a missing or failing driver as [`Error::Gpu`] instead of the panic
//! cudarc would raise (cudarc 0.19.10 with `dynamic-loading`: `CudaContext::new` panics when
//! `libcuda.so.1` cannot be loaded).
//!
//! What shardwise needs from CUDA: the primary context (the one torch uses), a side stream per
//! device ordered after the caller's current stream, async device-to-host copies into pinned host
//! memory, and events to know when a copy has landed.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaStream};

use crate::error::{Error, Result};

/// Runs a cudarc call, turning both its errors and its panics (missing library or symbol) into
/// [`Error::Gpu`].
fn guarded<T>(
    what: &str,
    f: impl FnOnce() -> std::result::Result<T, cudarc::driver::DriverError>,
) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(Error::Gpu(format!("{what}: {e}"))),
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
            Err(Error::Gpu(format!(
                "{what}: {}",
                msg.unwrap_or_else(|| "CUDA driver unavailable".into())
            )))
        }
    }
}

/// Whether a CUDA driver can be loaded and sees at least one device. Never panics, and creates no
/// context (retaining a primary context that nobody else holds would create and destroy one, which
/// costs a few hundred milliseconds on a device this process does not use).
pub fn available() -> bool {
    // SAFETY: only tries to dlopen libcuda.
    let present = catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false);
    present
        && guarded("count devices", || {
            result::init().and_then(|_| result::device::get_count())
        })
        .is_ok_and(|n| n > 0)
}

/// The primary context of `device`.
pub fn context(device: u32) -> Result<Arc<CudaContext>> {
    // SAFETY: only tries to dlopen libcuda.
    if !catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false) {
        return Err(Error::Gpu(
            "no CUDA driver (libcuda) on this machine".into(),
        ));
    }
    guarded("open CUDA device", || CudaContext::new(device as usize))
}

/// Allocates `bytes` of page-locked host memory usable from every context (`cuMemHostAlloc`,
/// `CU_MEMHOSTALLOC_PORTABLE`).
pub fn alloc_pinned(ctx: &Arc<CudaContext>, bytes: usize) -> Result<*mut u8> {
    guarded("allocate pinned host memory", || {
        ctx.bind_to_thread()?;
        // SAFETY: a plain driver allocation; freed with `free_pinned`.
        unsafe { result::malloc_host(bytes, sys::CU_MEMHOSTALLOC_PORTABLE) }.map(|p| p as *mut u8)
    })
}

/// Frees memory from [`alloc_pinned`].
///
/// # Safety
/// `ptr` must come from [`alloc_pinned`] and not be used afterwards.
pub unsafe fn free_pinned(ctx: &Arc<CudaContext>, ptr: *mut u8) {
    let _ = guarded("free pinned host memory", || {
        ctx.bind_to_thread()?;
        result::free_host(ptr as *mut std::ffi::c_void)
    });
}

/// Copies between one device and host memory on a side stream that starts after all work already
/// queued on the caller's stream (so kernels still using the tensors finish first).
pub struct DeviceCopier {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
}

impl DeviceCopier {
    /// `caller_stream` is the raw `CUstream` of the caller's current stream on `device`
    /// (`torch.cuda.current_stream(device).cuda_stream`; 0 is the legacy default stream).
    pub fn new(device: u32, caller_stream: u64) -> Result<DeviceCopier> {
        let ctx = context(device)?;
        let stream = guarded("create side stream", || ctx.new_stream())?;
        guarded("order side stream after the caller's stream", || {
            // SAFETY: the caller's stream belongs to this primary context and outlives this call.
            let caller = unsafe { ctx.wrap_borrowed_stream(caller_stream as sys::CUstream) };
            let ready = caller.record_event(None)?;
            stream.wait(&ready)
        })?;
        Ok(DeviceCopier { ctx, stream })
    }

    /// Queues a copy of `dst.len()` bytes from device address `src`.
    ///
    /// # Safety
    /// `src..src+dst.len()` must be device memory of this device that stays allocated and unmodified
    /// by later work until the copy completes; `dst` must stay valid until then (pinned memory makes
    /// the copy truly asynchronous).
    pub unsafe fn copy(&self, dst: &mut [u8], src: u64) -> Result<()> {
        guarded("queue device-to-host copy", || {
            self.ctx.bind_to_thread()?;
            result::memcpy_dtoh_async(dst, src as sys::CUdeviceptr, self.stream.cu_stream())
        })
    }

    /// Queues a copy of `height` rows of `width` bytes from host memory at `src` (rows `src_pitch`
    /// bytes apart) to device address `dst` (rows `dst_pitch` bytes apart); one row is a plain
    /// contiguous copy.
    ///
    /// # Safety
    /// The host rows must stay valid and unmodified until the copy completes (pinned memory makes
    /// it asynchronous); the device rows must be memory of this device that nothing else uses
    /// until then.
    pub unsafe fn upload(
        &self,
        dst: u64,
        dst_pitch: usize,
        src: *const u8,
        src_pitch: usize,
        width: usize,
        height: usize,
    ) -> Result<()> {
        guarded("queue host-to-device copy", || {
            self.ctx.bind_to_thread()?;
            let stream = self.stream.cu_stream();
            if height == 1 {
                return result::memcpy_htod_async(
                    dst as sys::CUdeviceptr,
                    std::slice::from_raw_parts(src, width),
                    stream,
                );
            }
            let p = sys::CUDA_MEMCPY2D {
                srcXInBytes: 0,
                srcY: 0,
                srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_HOST,
                srcHost: src as *const std::ffi::c_void,
                srcDevice: 0,
                srcArray: std::ptr::null_mut(),
                srcPitch: src_pitch,
                dstXInBytes: 0,
                dstY: 0,
                dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                dstHost: std::ptr::null_mut(),
                dstDevice: dst as sys::CUdeviceptr,
                dstArray: std::ptr::null_mut(),
                dstPitch: dst_pitch,
                WidthInBytes: width,
                Height: height,
            };
            sys::cuMemcpy2DAsync_v2(&p, stream).result()
        })
    }

    /// Orders the caller's stream (`caller_stream`, a raw `CUstream`) after every copy queued so
    /// far, then waits for them on this thread (host buffers they read are free to reuse after).
    pub fn finish_into(&self, caller_stream: u64) -> Result<()> {
        guarded("order the caller's stream after the copies", || {
            self.ctx.bind_to_thread()?;
            let done = self.stream.record_event(None)?;
            // SAFETY: the caller's stream belongs to this primary context and outlives this call.
            let caller = unsafe {
                self.ctx
                    .wrap_borrowed_stream(caller_stream as sys::CUstream)
            };
            caller.wait(&done)?;
            self.stream.synchronize()
        })
    }

    /// An event that completes when every copy queued so far has landed. Waiting on it blocks the
    /// thread (`CU_EVENT_BLOCKING_SYNC`) instead of spinning: several writer threads wait at once,
    /// and spinning ones slow down the thread that queues the copies.
    pub fn record(&self) -> Result<CudaEvent> {
        guarded("record event", || {
            // Timing stays enabled: cudarc's flag type cannot combine BLOCKING_SYNC with
            // DISABLE_TIMING, and the timestamp costs nothing measurable here.
            let event = self
                .ctx
                .new_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))?;
            event.record(&self.stream)?;
            Ok(event)
        })
    }
}

/// Blocks until `event` completes.
pub fn wait(event: &CudaEvent) -> Result<()> {
    guarded("wait for device-to-host copy", || event.synchronize())
}
