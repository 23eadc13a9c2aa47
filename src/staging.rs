//! Host staging buffers, allocated once per process and reused across saves (fresh pinned
//! allocations cost seconds per GiB, anchors.md §3b), and the ordering of saves on one rank.
//!
//! The pool holds `count` buffers of `buffer_size` bytes: pinned (page-locked) when a CUDA driver is
//! there, so device-to-host copies run at full speed, plain memory otherwise. A save takes buffers
//! as it stages and returns them once written; when all are taken, staging waits for a write to
//! finish: explicit back-pressure instead of unbounded memory.

use std::sync::{Arc, Condvar, Mutex, OnceLock};

use cudarc::driver::CudaContext;

use crate::error::{Error, Result};
use crate::gpu;

/// Default bytes per staging buffer.
pub const DEFAULT_BUFFER_BYTES: usize = 64 << 20;
/// Smallest default host staging budget in bytes (see [`default_budget`]).
pub const DEFAULT_BUDGET_BYTES: usize = 4 << 30;

/// Staging budget in bytes when the caller gives none: the rank's bytes plus one buffer, so an
/// async save stages every byte without waiting for a write (its stall is the copy alone), at
/// least [`DEFAULT_BUDGET_BYTES`] and at most [`host_bound`]. Measured on an H200 (BENCHMARKS.md):
/// a 16 GiB rank stalls 3.4 s with a 4 GiB budget and 0.33 s with one that holds the whole rank.
pub fn default_budget(rank_bytes: u64) -> usize {
    let want = (rank_bytes as usize).saturating_add(DEFAULT_BUFFER_BYTES);
    want.max(DEFAULT_BUDGET_BYTES)
        .min(host_bound().max(DEFAULT_BUDGET_BYTES))
}

/// The most host memory a default budget takes, in bytes: half of the machine's memory
/// (`MemTotal`), shared by the ranks of this node (`LOCAL_WORLD_SIZE`, set by torchrun; 1 when
/// unset). `SHARDWISE_STAGING_MAX_BYTES` overrides it.
pub fn host_bound() -> usize {
    if let Some(b) = std::env::var("SHARDWISE_STAGING_MAX_BYTES")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
    {
        return b;
    }
    let total_kib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
        })
        .unwrap_or(0);
    let local_ranks = std::env::var("LOCAL_WORLD_SIZE")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(1);
    total_kib.saturating_mul(1024) / 2 / local_ranks
}

/// One staging buffer.
pub struct HostBuffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a HostBuffer is uniquely owned memory; it moves between the staging thread and writers.
unsafe impl Send for HostBuffer {}

impl HostBuffer {
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: ptr/len describe an allocation owned by the pool and lent exclusively to us.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

enum Memory {
    Pinned(Arc<CudaContext>),
    Plain,
}

/// A fixed set of staging buffers.
pub struct StagingPool {
    free: Mutex<Vec<HostBuffer>>,
    returned: Condvar,
    memory: Memory,
    all: Vec<(usize, usize)>,
    pub buffer_size: usize,
}

impl StagingPool {
    /// Allocates `budget / buffer_size` buffers (at least 2, so copies overlap writes), pinned when
    /// `pinned_device` names a CUDA device.
    ///
    /// Errors: [`Error::Gpu`] if pinned memory cannot be allocated; [`Error::InvalidArgument`] for a
    /// budget or buffer size of 0.
    pub fn new(
        budget: usize,
        buffer_size: usize,
        pinned_device: Option<u32>,
    ) -> Result<StagingPool> {
        if budget == 0 || buffer_size == 0 {
            return Err(Error::InvalidArgument(
                "staging budget and buffer size must be > 0 bytes".into(),
            ));
        }
        let (buffer_size, count) = pool_shape(budget, buffer_size);
        let memory = match pinned_device {
            Some(d) => Memory::Pinned(gpu::context(d)?),
            None => Memory::Plain,
        };
        // A budget of absurd size (staging_budget_bytes=1 << 62) asks for billions of buffers:
        // refuse it as an error instead of aborting the process on the bookkeeping allocation.
        let too_large = |_| {
            Error::InvalidArgument(format!(
                "staging budget of {budget} bytes ({count} buffers of {buffer_size} bytes) cannot be allocated"
            ))
        };
        let mut free = Vec::new();
        free.try_reserve_exact(count).map_err(too_large)?;
        let mut all = Vec::new();
        all.try_reserve_exact(count).map_err(too_large)?;
        for _ in 0..count {
            let ptr = match &memory {
                Memory::Pinned(ctx) => gpu::alloc_pinned(ctx, buffer_size)?,
                Memory::Plain => {
                    let layout = std::alloc::Layout::from_size_align(buffer_size, 4096)
                        .expect("valid layout");
                    // SAFETY: non-zero size; freed in Drop with the same layout.
                    let p = unsafe { std::alloc::alloc(layout) };
                    if p.is_null() {
                        return Err(Error::InvalidArgument(format!(
                            "cannot allocate {buffer_size} bytes of staging memory"
                        )));
                    }
                    p
                }
            };
            all.push((ptr as usize, buffer_size));
            free.push(HostBuffer {
                ptr,
                len: buffer_size,
            });
        }
        Ok(StagingPool {
            free: Mutex::new(free),
            returned: Condvar::new(),
            memory,
            all,
            buffer_size,
        })
    }

    /// Number of buffers.
    pub fn capacity(&self) -> usize {
        self.all.len()
    }

    pub fn is_pinned(&self) -> bool {
        matches!(self.memory, Memory::Pinned(_))
    }

    /// Takes a buffer, waiting for one to be returned when all are in use.
    pub fn take(&self) -> HostBuffer {
        let mut free = self.free.lock().unwrap();
        loop {
            if let Some(b) = free.pop() {
                return b;
            }
            free = self.returned.wait(free).unwrap();
        }
    }

    pub fn give_back(&self, b: HostBuffer) {
        self.free.lock().unwrap().push(b);
        self.returned.notify_one();
    }
}

impl Drop for StagingPool {
    fn drop(&mut self) {
        for &(ptr, len) in &self.all {
            match &self.memory {
                // SAFETY: allocated by alloc_pinned in new(); no buffer is lent out when the pool drops
                // (saves hold an Arc to it).
                Memory::Pinned(ctx) => unsafe { gpu::free_pinned(ctx, ptr as *mut u8) },
                Memory::Plain => {
                    let layout =
                        std::alloc::Layout::from_size_align(len, 4096).expect("valid layout");
                    // SAFETY: allocated in new() with this layout.
                    unsafe { std::alloc::dealloc(ptr as *mut u8, layout) }
                }
            }
        }
    }
}

fn pool_slot() -> &'static Mutex<Option<Arc<StagingPool>>> {
    static POOL: OnceLock<Mutex<Option<Arc<StagingPool>>>> = OnceLock::new();
    POOL.get_or_init(|| Mutex::new(None))
}

/// The process's staging pool for `budget` bytes, created on first use and reused by every later
/// save that fits in it (same buffer size, at least as many buffers, pinned when needed).
///
/// Errors: [`Error::InvalidArgument`] for a budget or buffer size of 0; [`Error::Gpu`].
pub fn pool(
    budget: usize,
    buffer_size: usize,
    pinned_device: Option<u32>,
) -> Result<Arc<StagingPool>> {
    if budget == 0 || buffer_size == 0 {
        return Err(Error::InvalidArgument(
            "staging budget and buffer size must be > 0 bytes".into(),
        ));
    }
    let mut slot = pool_slot().lock().unwrap();
    if let Some(p) = slot.as_ref() {
        // A pool at least as large is reused: pinned allocations cost seconds per GiB.
        let (size, count) = pool_shape(budget, buffer_size);
        if p.buffer_size == size
            && p.all.len() >= count
            && (p.is_pinned() || pinned_device.is_none())
        {
            return Ok(p.clone());
        }
    }
    *slot = None; // free the old pool before allocating the new one
    let p = Arc::new(StagingPool::new(budget, buffer_size, pinned_device)?);
    *slot = Some(p.clone());
    Ok(p)
}

/// (buffer size, buffer count) for a budget: buffers no larger than half the budget, at least two
/// of them so that staging overlaps writing, and at least one page each.
fn pool_shape(budget: usize, buffer_size: usize) -> (usize, usize) {
    let size = buffer_size.min(budget.div_ceil(2)).max(4096);
    (size, (budget / size).max(2))
}

/// Serialises saves on this rank: a save holds the ticket from its first staged byte until its data
/// is durable and its part published, so a second save (sync or async) waits for the first one's
/// writes instead of interleaving with them and the staging pool. The ticket is `Send`, so an async
/// save's background thread can hold it.
pub struct SaveTicket(());

fn ticket_state() -> &'static (Mutex<bool>, Condvar) {
    static T: OnceLock<(Mutex<bool>, Condvar)> = OnceLock::new();
    T.get_or_init(|| (Mutex::new(false), Condvar::new()))
}

impl SaveTicket {
    /// Waits until no other save of this process is in flight.
    pub fn acquire() -> SaveTicket {
        let (m, c) = ticket_state();
        let mut busy = m.lock().unwrap();
        while *busy {
            busy = c.wait(busy).unwrap();
        }
        *busy = true;
        SaveTicket(())
    }
}

impl Drop for SaveTicket {
    fn drop(&mut self) {
        let (m, c) = ticket_state();
        *m.lock().unwrap() = false;
        c.notify_one();
    }
}
