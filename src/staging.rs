//! Host staging buffers, allocated once per process and reused across saves (fresh pinned
//! allocations cost about 0.5 s per GiB: BENCHMARKS.md, "GPU save on a node"), and the ordering
//! of saves on one rank.
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
    let total = host_memory().unwrap_or(0) as usize;
    let local_ranks = std::env::var("LOCAL_WORLD_SIZE")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(1);
    total / 2 / local_ranks
}

/// The machine's memory in bytes (`MemTotal` of `/proc/meminfo`); None where there is none.
pub fn host_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse::<u64>()
        .ok()?;
    Some(kib.saturating_mul(1024))
}

/// One staging buffer.
pub struct HostBuffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a HostBuffer is uniquely owned memory; it moves between the staging thread and writers.
unsafe impl Send for HostBuffer {}

impl HostBuffer {
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: ptr/len describe an allocation owned by the pool and lent exclusively to us.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

enum Memory {
    Pinned(Arc<CudaContext>),
    Plain,
}

/// What a pool has handed out and may still allocate.
struct Grown {
    free: Vec<HostBuffer>,
    /// Buffers allocated or being allocated.
    allocated: usize,
    /// Buffers the pool grows to: its capacity.
    target: usize,
}

/// A set of staging buffers that grows to its capacity as buffers are needed, or ahead of need in
/// a background thread ([`StagingPool::fill_in_background`], issue 27): pinning is ~0.75 s per GiB
/// on an H200 host, so a pool allocated whole before the first copy made the first async save of a
/// 16 GiB rank stall 12 s. Buffers are never freed before the pool is dropped.
pub struct StagingPool {
    grown: Mutex<Grown>,
    returned: Condvar,
    memory: Memory,
    /// (address, bytes) of every allocated buffer, for Drop.
    all: Mutex<Vec<(usize, usize)>>,
    pub(crate) buffer_size: usize,
}

/// Buffers a pool allocates when it is created: two, so that copies overlap writes from the
/// start, and so that a host that cannot pin at all fails at creation, with an error.
const FIRST_BUFFERS: usize = 2;

impl StagingPool {
    /// A pool of `budget / buffer_size` buffers (at least 2, so copies overlap writes), pinned when
    /// `pinned_device` names a CUDA device. Two buffers are allocated now, the others when a save
    /// needs them or [`StagingPool::fill_in_background`] gets to them.
    ///
    /// Errors: [`Error::Gpu`] if pinned memory cannot be allocated; [`Error::InvalidArgument`] for a
    /// budget or buffer size of 0, or a budget too large to count its buffers.
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
        let mut all = Vec::new();
        all.try_reserve_exact(count).map_err(|_| {
            Error::InvalidArgument(format!(
                "staging budget of {budget} bytes ({count} buffers of {buffer_size} bytes) cannot be allocated"
            ))
        })?;
        let pool = StagingPool {
            grown: Mutex::new(Grown {
                free: Vec::new(),
                allocated: FIRST_BUFFERS,
                target: count,
            }),
            returned: Condvar::new(),
            memory,
            all: Mutex::new(all),
            buffer_size,
        };
        for _ in 0..FIRST_BUFFERS {
            let b = pool.allocate()?;
            pool.grown.lock().unwrap().free.push(b);
        }
        Ok(pool)
    }

    /// One new buffer of `buffer_size` bytes, recorded for Drop.
    fn allocate(&self) -> Result<HostBuffer> {
        let len = self.buffer_size;
        let ptr = match &self.memory {
            Memory::Pinned(ctx) => gpu::alloc_pinned(ctx, len)?,
            Memory::Plain => {
                let layout = std::alloc::Layout::from_size_align(len, 4096).expect("valid layout");
                // SAFETY: non-zero size; freed in Drop with the same layout.
                let p = unsafe { std::alloc::alloc(layout) };
                if p.is_null() {
                    return Err(Error::InvalidArgument(format!(
                        "cannot allocate {len} bytes of staging memory"
                    )));
                }
                p
            }
        };
        self.all.lock().unwrap().push((ptr as usize, len));
        Ok(HostBuffer { ptr, len })
    }

    /// A buffer slot claimed under the lock (`allocated` counted), allocated outside it. On
    /// failure the pool stops growing: it keeps the buffers it has (at least [`FIRST_BUFFERS`]).
    fn grow_one(&self) -> Option<HostBuffer> {
        match self.allocate() {
            Ok(b) => Some(b),
            Err(e) => {
                let mut g = self.grown.lock().unwrap();
                g.allocated -= 1;
                g.target = g.allocated;
                tracing::warn!("staging pool stops at {} buffers: {e}", g.allocated);
                None
            }
        }
    }

    /// Capacity in buffers: what the pool has or will grow to.
    pub fn capacity(&self) -> usize {
        self.grown.lock().unwrap().target
    }

    /// Buffers allocated so far (at most [`StagingPool::capacity`]).
    pub fn allocated(&self) -> usize {
        self.all.lock().unwrap().len()
    }

    /// Raises the capacity to `count` buffers (never lowers it).
    pub fn grow_to(&self, count: usize) {
        let mut g = self.grown.lock().unwrap();
        g.target = g.target.max(count);
    }

    /// Takes a buffer: a free one; else a new one while the pool is below its capacity (a save
    /// that starts before a background fill finished pins what it needs itself, and never waits
    /// for the whole pool); else waits for one to be returned.
    pub fn take(&self) -> HostBuffer {
        let mut g = self.grown.lock().unwrap();
        loop {
            if let Some(b) = g.free.pop() {
                return b;
            }
            if g.allocated < g.target {
                g.allocated += 1;
                drop(g);
                if let Some(b) = self.grow_one() {
                    return b;
                }
                g = self.grown.lock().unwrap();
                continue;
            }
            g = self.returned.wait(g).unwrap();
        }
    }

    pub(crate) fn give_back(&self, b: HostBuffer) {
        self.grown.lock().unwrap().free.push(b);
        self.returned.notify_one();
    }

    /// Allocates the rest of the pool in a background thread and returns at once; buffers join
    /// the free list one by one, so a save running meanwhile uses them as they come. The thread
    /// ends when the pool is full or dropped.
    pub fn fill_in_background(self: &Arc<Self>) {
        let pool = Arc::downgrade(self);
        std::thread::spawn(move || loop {
            let Some(pool) = pool.upgrade() else {
                return;
            };
            {
                let mut g = pool.grown.lock().unwrap();
                if g.allocated >= g.target {
                    return;
                }
                g.allocated += 1;
            }
            match pool.grow_one() {
                Some(b) => pool.give_back(b),
                None => return,
            }
        });
    }
}

impl Drop for StagingPool {
    fn drop(&mut self) {
        for &(ptr, len) in self.all.get_mut().unwrap().iter() {
            match &self.memory {
                // SAFETY: allocated by alloc_pinned in allocate(); no buffer is lent out when the
                // pool drops (saves hold an Arc to it).
                Memory::Pinned(ctx) => unsafe { gpu::free_pinned(ctx, ptr as *mut u8) },
                Memory::Plain => {
                    let layout =
                        std::alloc::Layout::from_size_align(len, 4096).expect("valid layout");
                    // SAFETY: allocated in allocate() with this layout.
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

/// A staging pool for `budget` bytes. Pinned pools are the process's one pool, created on first
/// use and reused by every later save or load with the same buffer size (grown to `budget` when
/// it asks for more): pinned allocations cost ~0.75 s per GiB. Plain pools (no CUDA device) are
/// the caller's own and freed when it drops them, so a CPU load leaves no memory behind (issue
/// 27: a kept 4 x 64 MiB read pool stayed resident after every resharded CPU load).
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
        let (size, count) = pool_shape(budget, buffer_size);
        if p.buffer_size == size {
            if pinned_device.is_some() {
                p.grow_to(count);
                return Ok(p.clone());
            }
            if p.capacity() >= count {
                return Ok(p.clone()); // pinned memory already there serves a CPU caller as well
            }
        }
    }
    if pinned_device.is_none() {
        return Ok(Arc::new(StagingPool::new(budget, buffer_size, None)?));
    }
    *slot = None; // free the old pool before allocating the new one
    let p = Arc::new(StagingPool::new(budget, buffer_size, pinned_device)?);
    *slot = Some(p.clone());
    Ok(p)
}

/// Starts pinning the process's staging pool for `budget` bytes on CUDA device `device` in a
/// background thread and returns as soon as its first buffers are there (the
/// `shardwise.megatron.reserve_staging` of issue 27). A save that arrives before the pool is full
/// uses the buffers pinned so far and pins the others itself. Returns the pool's (buffer size in
/// bytes, capacity in buffers).
///
/// Errors: as [`pool`].
pub fn reserve(budget: usize, device: u32) -> Result<(usize, usize)> {
    let p = pool(budget, DEFAULT_BUFFER_BYTES, Some(device))?;
    p.fill_in_background();
    Ok((p.buffer_size, p.capacity()))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A pool starts with two buffers and grows on demand to its capacity, never beyond: a save
    /// that needs more buffers than are there allocates them itself instead of waiting for a fill.
    #[test]
    fn grows_on_demand_to_capacity() {
        let p = StagingPool::new(5 * 4096, 4096, None).unwrap();
        assert_eq!((p.capacity(), p.allocated()), (5, 2));
        let taken: Vec<_> = (0..5).map(|_| p.take()).collect();
        assert_eq!(p.allocated(), 5);
        // A sixth take waits for a buffer to come back.
        let p = Arc::new(p);
        let waiter = {
            let p = p.clone();
            std::thread::spawn(move || p.take().len)
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!waiter.is_finished(), "a full pool must wait, not allocate");
        let mut taken = taken.into_iter();
        p.give_back(taken.next().unwrap());
        assert_eq!(waiter.join().unwrap(), 4096);
        assert_eq!(p.allocated(), 5);
        taken.for_each(|b| p.give_back(b));
    }

    /// A background fill races takes: the pool ends with exactly its capacity allocated.
    #[test]
    fn background_fill_and_takes_never_exceed_capacity() {
        for _ in 0..20 {
            let p = Arc::new(StagingPool::new(64 * 4096, 4096, None).unwrap());
            p.fill_in_background();
            let taken: Vec<_> = (0..40).map(|_| p.take()).collect();
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while p.allocated() < 64 && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            assert_eq!((p.allocated(), p.capacity()), (64, 64));
            taken.into_iter().for_each(|b| p.give_back(b));
            assert_eq!(p.grown.lock().unwrap().free.len(), 64);
        }
    }

    /// Plain (host) pools belong to their caller and are freed with it: only pinned pools stay
    /// with the process (a CPU load must leave no staging memory behind).
    #[test]
    fn plain_pools_are_not_kept() {
        let a = pool(3 * 4096, 4096, None).unwrap();
        let b = pool(3 * 4096, 4096, None).unwrap();
        assert!(!Arc::ptr_eq(&a, &b));
        assert_eq!(Arc::strong_count(&a), 1);
        assert!(pool_slot().lock().unwrap().is_none());
    }
}
