//! Loads regions of many tensors of an open [`Checkpoint`] in one call, straight into the
//! caller's memory (host, or CUDA through a reused pinned staging pool): the native side of
//! `shardwise.megatron.load` (contract: notes/helpers/load-contract.md).
//!
//! [`load`] runs these steps in order, each a function with a typed input and output, bounded and
//! done once per call:
//! 1. **Validate** ([`validate`], [`cuda_device`]) every request before any byte is read: the key
//!    exists and is a tensor, the region lies in its global shape, the destination has
//!    `prod(sizes) * itemsize` bytes, and the saved chunks cover the region (found through a
//!    per-tensor [`plan::ChunkIndex`]); the requests name at most one CUDA device, usable here.
//!    Validation returns each request's [`Tensor`] (its entry's dtype, global shape and chunks)
//!    with the [`Piece`]s that cover the requests ([`Validated`]), carried to the later steps.
//! 2. **Items** ([`items`]): the saved chunks the pieces need, each once, with their data files and
//!    which save-time CRC-32s this load checks ([`Items`]); [`open`] opens every data file and
//!    checks every item lies inside it ([`Source`]).
//! 3. **Buffers and threads** ([`resources`]): the staging pool and the read threads
//!    ([`Resources`]; sizes chosen by [`buffer_bytes`] and [`read_threads`]).
//! 4. **Locate** ([`locate_all`]) each needed item's tensor data in its data file from the item's
//!    first and last bytes (torch.save zip headers and central directory; a few KiB per item), so
//!    that only the needed bytes are read ([`Layout`]).
//! 5. **Plan** ([`plan_load`], pure: [`box_copies`], [`checks`], [`group_reads`] over
//!    [`plan::reads`]): one strided box copy per (chunk, request), byte ranges coalesced into reads
//!    of at most one staging buffer (holes under [`GAP_BYTES`] read through); large contiguous host
//!    copies are read straight into the destination ([`Plan`]).
//! 6. **Read** ([`Exec::run`]) in parallel (`pread`, or ranged GETs bounded by `timeout` on object
//!    stores), copy out of each buffer (memcpy, or host-to-device copies on a side stream while the
//!    next reads fill other buffers), and check CRC-32s as the bytes pass. A [`Kept`] guard holds
//!    the buffers whose host-to-device copies may still run: finished or dropped, it waits for the
//!    copies and only then returns the buffers to the pool.
//! 7. **Report** ([`report`]): the [`LoadStats`].
//!
//! Integrity: where the save recorded CRC-32s, every item one request needs whole is checked: its
//! bytes are hashed as they land (in the buffer, or in the destination of a direct read), per
//! piece, and the pieces are combined in file order once the reads are done; no byte is read
//! twice. An item of which each request needs only a part (a resharded load that takes some rows
//! or columns of a chunk) is read only in part: where the save also recorded block CRC-32s of the
//! item's tensor data ([`crate::blockcrc`], 1 MiB blocks), each contiguous range read from it is
//! widened to whole blocks (at most one block of extra bytes at each end, planned with the other
//! reads so that coalescing still applies), and every block touched is checked the same way.
//! Without block CRCs (saves of shardwise before them) such an item cannot be checked without
//! reading it whole, which would multiply the bytes a resharded load reads by the TP ratio: the
//! stats count it (`items_unchecked`). Without a save-time record of an item (no sidecar: torch or
//! Megatron saves, a copy without hidden directories), an item read whole has its tensor data
//! checked against the CRC-32 its own torch.save archive records for its data record (the zip CRC
//! `verify` checks), hashed the same way; read in part, it is not checked (that CRC covers all of
//! the tensor data). On a CRC error the destinations may hold the damaged bytes.

mod plan;

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use cudarc::driver::CudaEvent;
use rayon::prelude::*;

use crate::error::{Error, Result, Stopped};
use crate::format::archive::{stored_tensor_in, HeadTail, Record};
use crate::format::dtype::DType;
use crate::format::metadata::{volume, Chunk, Entry};
use crate::gpu::{self, DeviceCopier};
use crate::reader::{Checkpoint, Recorded};
use crate::staging::{self, HostBuffer, StagingPool, DEFAULT_BUFFER_BYTES};
use crate::storage::DataSource;

use crate::format::METADATA_FILE;
use plan::copy_box;
pub use plan::{intersect, BoxCopy, ChunkIndex, Piece};

/// Holes between needed byte ranges smaller than this are read through: one 1 MiB longer read
/// costs less than a second request (NVMe: ~0.1 ms at 7 GB/s vs a request's latency; object
/// stores: far less than a GET).
pub const GAP_BYTES: u64 = 1 << 20;
/// Smallest contiguous copy read straight into a host destination; smaller ones are coalesced
/// with their neighbours through a buffer (one large read beats many small ones).
pub const DIRECT_MIN_BYTES: u64 = 1 << 20;
/// Buffer size of a load into host memory only (see [`buffer_bytes`]).
pub const HOST_BUFFER_BYTES: usize = 4 << 20;
/// Default staging budget of a load: 32 buffers of 64 MiB (2 GiB), enough reads in flight to keep
/// an NVMe device or the page cache busy while the previous buffers are copied out: a load into
/// CUDA memory makes up to 24 reads at once, and buffers whose host-to-device copies are still
/// queued wait beside them. A save's default staging pool is larger (4 GiB of the same buffers),
/// and a load reuses it. Host loads take their smaller buffers only as reads need them.
pub const DEFAULT_LOAD_BUDGET_BYTES: usize = 32 * DEFAULT_BUFFER_BYTES;
/// Bytes of one `pread` from a local file: each step is CRC-checked right after it lands, while
/// it is still in the CPU's cache, instead of after the whole 64 MiB read, when it has gone to
/// memory and must be read back (16.9 GB into CUDA tensors on an H100 host: 0.605 s with whole
/// reads, 0.473 s in 512 KiB steps; BENCHMARKS.md, "GPU load closer to the copy floor"). Cold
/// loads, from the disk, kept their speed there (7.06 s against 7.03 s).
pub const READ_STEP_BYTES: usize = 512 << 10;
/// Item head and tail read first to locate an item's tensor data (torch.save puts `data.pkl` and
/// the storage record's local header at the start and the central directory at the end; both are
/// well under a KiB for a tensor item). Larger windows are tried when they do not suffice.
const PROBE_BYTES: [u64; 2] = [4 << 10, 1 << 20];

/// One region to load: `sizes` elements at `offsets` of tensor `key`, into `nbytes` bytes of
/// C-contiguous memory at `ptr` in the checkpoint's dtype: host memory, or CUDA memory of
/// `device`.
#[derive(Clone, Debug)]
pub struct Request {
    /// The tensor's key.
    pub key: String,
    /// Global offsets of the region in elements.
    pub offsets: Vec<u64>,
    /// Shape of the region in elements.
    pub sizes: Vec<u64>,
    /// Address of the destination memory (host, or CUDA memory of `device`).
    pub ptr: u64,
    /// Size of the destination in bytes: `prod(sizes) * itemsize`.
    pub nbytes: u64,
    /// CUDA device of the destination; `None` for host memory.
    pub device: Option<u32>,
}

/// Options of [`load`].
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Host staging memory in bytes (None: [`DEFAULT_LOAD_BUDGET_BYTES`]); pinned when a request
    /// is on a CUDA device. The process's staging pool is reused when it is large enough.
    pub staging_budget: Option<usize>,
    /// The caller's `CUstream` (0: legacy default stream), ordered after every host-to-device copy.
    pub cuda_stream: u64,
    /// Check items against the CRC-32s recorded at save time, where there are some.
    pub check_crc: bool,
    /// Bound of each object-store request (None: the store's own retry timeout).
    pub timeout: Option<Duration>,
    /// Reads in flight (None: from the core count: 4 to 16, or 4 to 24 into CUDA memory).
    pub threads: Option<usize>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            staging_budget: None,
            cuda_stream: 0,
            check_crc: true,
            timeout: None,
            threads: None,
        }
    }
}

/// What a load did (`Checkpoint.load_into` returns its fields as a dict).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct LoadStats {
    /// Bytes read from storage (item probes included).
    pub bytes_read: u64,
    /// Read operations (planned reads, probes included): one GET each from an object store, a
    /// loop of [`READ_STEP_BYTES`] `pread`s from a local file.
    pub read_ops: u64,
    pub(crate) requests: usize,
    /// Wall time of the whole call, in seconds.
    pub seconds: f64,
    /// Wall time of validation, item location and planning, in seconds.
    pub plan_seconds: f64,
    /// Items whose bytes read were checked against save-time CRC-32s: read whole and checked
    /// whole, or read in part and checked by the blocks of their tensor data that were read.
    pub items_checked: u64,
    /// Items with a recorded CRC-32 but no block CRC-32s (older saves) that were only partly
    /// needed, so not read whole nor checked.
    pub items_unchecked: u64,
}

/// A request's tensor as validation found it: its entry's key, dtype, global shape and chunks
/// (by reference into the checkpoint's metadata).
#[derive(Clone, Copy, Debug)]
pub struct Tensor<'a> {
    /// The tensor's key.
    pub key: &'a str,
    /// Its dtype in the checkpoint.
    pub dtype: DType,
    /// Its global shape in elements.
    pub global_shape: &'a [u64],
    pub(crate) chunks: &'a [Chunk],
}

/// Validated requests ([`validate`]): the tensor of each request (by request index), and the
/// pieces that cover the requests, in request order.
#[derive(Debug)]
pub struct Validated<'a> {
    /// The tensor of each request, by request index.
    pub tensors: Vec<Tensor<'a>>,
    pub(crate) pieces: Vec<Piece>,
}

/// A needed item: chunk `index` of the tensor `key`.
struct Item<'a> {
    key: &'a str,
    dtype: DType,
    chunk: &'a Chunk,
    /// The chunk's index in its entry's chunk list.
    index: usize,
    file: usize,
    /// A request needs the whole chunk (the item is then read whole, and can be checked).
    whole: bool,
    /// Stored with a transform (`stream.zstd/1`): decoded whole by the reader instead.
    transformed: bool,
    /// Save-time record, when its CRC-32 is checked by this load (the item is read whole).
    check: Option<&'a Recorded>,
    /// Save-time record, when the blocks of its payload that this load reads are checked against
    /// their block CRC-32s (the item is read in part; [`crate::blockcrc`]).
    blocks: Option<&'a Recorded>,
    /// No save-time record (no sidecar), and the item is read whole: its payload is checked
    /// against the CRC-32 its torch.save archive records for it.
    zip: bool,
}

/// The items a load needs ([`items`]), each once, and their data files.
struct Items<'a> {
    items: Vec<Item<'a>>,
    /// The item (index into `items`) of each piece.
    of_piece: Vec<usize>,
    /// The data files by index ([`Item::file`]): their `relative_path` in `.metadata`.
    files: Vec<&'a str>,
    /// Items with a recorded CRC-32 but no block CRC-32s that are only partly needed: not checked.
    unchecked: u64,
}

/// Bytes of a data file whose CRC-32 this load checks: a whole item, one block of an item's
/// payload, or an item's whole payload.
struct Check<'a> {
    item: usize,
    range: Range<u64>,
    want: Want<'a>,
}

/// The CRC-32 a checked range is compared with.
enum Want<'a> {
    /// The item's, recorded at save time.
    Item(&'a Recorded),
    /// Block `.1` of the item's payload, recorded at save time.
    Block(&'a Recorded, u64),
    /// The payload's, as the item's own torch.save archive records it for its data record: the
    /// check of an item without a save-time record (no sidecar).
    Record(Record),
}

/// Where an item's tensor data lies: file byte of element 0, strides in elements, and the file
/// bytes of its storage (the payload a save's block CRC-32s cover), with the archive's record of
/// that storage (its name and zip CRC-32).
struct Layout {
    base: u64,
    strides: Vec<u64>,
    payload: Range<u64>,
    record: Record,
}

/// The data files of one load, open for positioned reads, by index.
struct Source<'a> {
    ck: &'a Checkpoint,
    rels: &'a [&'a str],
    files: Vec<DataSource>,
}

impl Source<'_> {
    /// Fills `buf` from byte `off` of file `file`.
    ///
    /// Errors: [`Error::Corrupt`] naming `what`, the file and the offset when the file ends first;
    /// [`Error::Io`] / [`Error::Remote`].
    fn read_exact(
        &self,
        file: usize,
        off: u64,
        buf: &mut [u8],
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        let n = self.files[file].read_at(off, buf)?;
        if n < buf.len() {
            let end = off + buf.len() as u64;
            return Err(corrupt(
                self.ck.dir().join(self.rels[file]),
                format!(
                    "{}: the file ends at byte {}, inside bytes {off}..{end} being read (truncated)",
                    what(),
                    off + n as u64
                ),
            ));
        }
        Ok(())
    }
}

/// The staging pool and the read threads of one load ([`resources`]).
struct Resources {
    pool: Arc<StagingPool>,
    readers: Arc<rayon::ThreadPool>,
}

/// The box copies of a load ([`box_copies`]).
struct Copies<'a> {
    copies: Vec<plan::Copy>,
    /// The item of each copy.
    copy_item: Vec<usize>,
    /// The pieces of transformed items, each with its item: decoded by the reader, not read in
    /// place.
    transformed: Vec<(&'a Piece, usize)>,
}

/// The copies and reads of a load ([`plan_load`]), and the ranges whose CRC-32s it checks.
struct Plan<'a> {
    /// As [`Copies`], with the direct ones marked.
    copies: Vec<plan::Copy>,
    copy_item: Vec<usize>,
    transformed: Vec<(&'a Piece, usize)>,
    /// Sorted by file, then offset.
    checks: Vec<Check<'a>>,
    /// The indices in `checks` of each file's checks.
    checks_by_file: Vec<Range<usize>>,
    reads: Vec<plan::Read>,
}

/// Where one request's bytes go: host memory at an address, or CUDA memory at an address, written
/// through the load's copier.
#[derive(Clone, Copy)]
enum Dest<'a> {
    Host(u64),
    Device(&'a DeviceCopier, u64),
}

fn corrupt(path: std::path::PathBuf, reason: String) -> Error {
    Error::Corrupt { path, reason }
}

/// Item of `key` chunk `c` in words, for messages.
fn item_name(key: &str, c: &Chunk) -> String {
    format!(
        "{key} chunk {:?} (item at offset {}, {} bytes)",
        c.offsets, c.storage.offset, c.storage.length
    )
}

/// Validates `reqs` against the checkpoint and returns each one's tensor with their pieces.
///
/// Errors: [`Error::MissingKey`]; [`Error::InvalidArgument`] for a byte object, a region outside
/// the global shape or a wrong byte count; [`Error::Validation`] for a region the chunks do not
/// cover.
pub fn validate<'a>(ck: &'a Checkpoint, reqs: &[Request]) -> Result<Validated<'a>> {
    let mut indexes: HashMap<&str, ChunkIndex> = HashMap::new();
    let mut out = Validated {
        tensors: Vec::with_capacity(reqs.len()),
        pieces: Vec::new(),
    };
    for (r, q) in reqs.iter().enumerate() {
        let t = tensor_of(ck, &q.key)?;
        check_request(&t, q)?;
        let index = indexes
            .entry(t.key)
            .or_insert_with(|| ChunkIndex::new(t.chunks, t.global_shape.len()));
        plan::pieces_of(
            t.key,
            r,
            t.chunks,
            index,
            &q.offsets,
            &q.sizes,
            &mut out.pieces,
        )?;
        out.tensors.push(t);
    }
    Ok(out)
}

/// The tensor of `key`.
///
/// Errors: [`Error::MissingKey`]; [`Error::InvalidArgument`] for a byte object.
fn tensor_of<'a>(ck: &'a Checkpoint, key: &str) -> Result<Tensor<'a>> {
    let Some((key, entry)) = ck.metadata.entries.get_key_value(key) else {
        return Err(Error::MissingKey {
            key: key.to_string(),
            dir: ck.dir().to_path_buf(),
        });
    };
    match entry {
        Entry::Tensor {
            dtype,
            global_shape,
            chunks,
        } => Ok(Tensor {
            key,
            dtype: *dtype,
            global_shape,
            chunks,
        }),
        Entry::Bytes { .. } => Err(Error::InvalidArgument(format!(
            "{key} is a byte object, not a tensor"
        ))),
    }
}

/// Checks request `q` of tensor `t`: its region lies in the global shape, its destination has the
/// region's bytes and is not null. Pure.
///
/// Errors: [`Error::InvalidArgument`].
fn check_request(t: &Tensor, q: &Request) -> Result<()> {
    let key = t.key;
    let n = t.global_shape.len();
    let inside = q.offsets.len() == n
        && q.sizes.len() == n
        && (0..n).all(|d| {
            q.offsets[d]
                .checked_add(q.sizes[d])
                .is_some_and(|e| e <= t.global_shape[d])
        });
    if !inside {
        return Err(Error::InvalidArgument(format!(
            "{key}: region {:?}+{:?} is outside the global shape {:?}",
            q.offsets, q.sizes, t.global_shape
        )));
    }
    let want = volume(&q.sizes).and_then(|v| v.checked_mul(t.dtype.itemsize()));
    if want != Some(q.nbytes) {
        return Err(Error::InvalidArgument(format!(
            "{key}: region {:?} of {} needs {} bytes, the destination has {}",
            q.sizes,
            t.dtype.torch_name(),
            want.map_or("too many".into(), |w| w.to_string()),
            q.nbytes
        )));
    }
    if q.nbytes > 0 && q.ptr == 0 {
        return Err(Error::InvalidArgument(format!(
            "{key}: null destination pointer"
        )));
    }
    Ok(())
}

/// Checks that the region `offsets`/`sizes` (elements) of tensor `key` can be read: inside the
/// global shape and covered by the saved chunks, with no overlap. Pure planning, before the
/// caller allocates the destination: a hostile `.metadata` claiming `[3, 4e11]` then gives this
/// error, not an allocation of 1.2e12 elements.
///
/// Errors: as [`validate`] ([`Error::MissingKey`], [`Error::InvalidArgument`],
/// [`Error::Validation`] for a region not covered).
pub fn check_region(ck: &Checkpoint, key: &str, offsets: &[u64], sizes: &[u64]) -> Result<()> {
    let itemsize = match ck.entry(key)? {
        Entry::Tensor { dtype, .. } => dtype.itemsize(),
        Entry::Bytes { .. } => 1, // validate names it a byte object
    };
    let request = Request {
        key: key.to_string(),
        offsets: offsets.to_vec(),
        sizes: sizes.to_vec(),
        // The size the destination would have, and a non-null address that planning never
        // dereferences (it only computes which chunk boxes to copy).
        nbytes: volume(sizes)
            .and_then(|v| v.checked_mul(itemsize))
            .unwrap_or(u64::MAX),
        ptr: 1,
        device: None,
    };
    validate(ck, std::slice::from_ref(&request)).map(|_| ())
}

/// Reads the region `offsets`/`sizes` (elements) of tensor `key` into `out` (C order,
/// `prod(sizes) * itemsize` bytes), assembled from every chunk that overlaps it, through the
/// reader's mapped files (each item checked once per open checkpoint): a one-request load on the
/// calling thread, without staging, for tools (`diff`, `to-hf`, `Checkpoint.read`). The request is
/// validated, and its chunks found, by [`validate`] before any byte is read.
///
/// Errors: [`Error::MissingKey`]; [`Error::InvalidArgument`] for a byte object, a region outside
/// the global shape or a wrong `out` length; [`Error::Validation`] naming a part of the region
/// that no saved chunk covers; item errors as [`Checkpoint::chunk`].
pub fn read_region(
    ck: &Checkpoint,
    key: &str,
    offsets: &[u64],
    sizes: &[u64],
    out: &mut [u8],
) -> Result<()> {
    let request = Request {
        key: key.to_string(),
        offsets: offsets.to_vec(),
        sizes: sizes.to_vec(),
        ptr: out.as_mut_ptr() as u64,
        nbytes: out.len() as u64,
        device: None,
    };
    let valid = validate(ck, std::slice::from_ref(&request))?;
    let tensor = valid.tensors[0];
    let item = tensor.dtype.itemsize();
    for p in valid.pieces {
        let chunk = &tensor.chunks[p.chunk];
        // Without a save-time CRC-32 (no sidecar), a piece that is the whole chunk has its payload
        // checked against the CRC-32 its archive records, alongside the copy (a partial piece is
        // not: its other bytes are not read).
        let unrecorded = is_whole(&p, chunk)
            && ck
                .placed_record(key, Some(&chunk.offsets), &chunk.storage)?
                .is_none();
        ck.with_chunk(key, p.chunk, |data, c| {
            let t = &data.tensor;
            let mut copy = || {
                copy_box(
                    data.storage(),
                    t.storage_offset,
                    &t.strides,
                    &c.offsets,
                    offsets,
                    sizes,
                    &p.lo,
                    &p.hi,
                    item,
                    out,
                )
            };
            if !unrecorded || !t.storage.has_crc() {
                copy();
                return Ok(());
            }
            let (got, ()) = rayon::join(|| crate::reader::crc32(data.storage()), copy);
            check_record_crc(ck, key, c, &t.storage, got)
        })??;
    }
    Ok(())
}

/// The rayon pool of the loader's reads (created once; reads block in `pread`, so it is not the
/// global pool whose threads compute).
fn read_pool(threads: usize) -> Result<Arc<rayon::ThreadPool>> {
    static POOLS: OnceLock<Mutex<HashMap<usize, Arc<rayon::ThreadPool>>>> = OnceLock::new();
    let mut pools = POOLS.get_or_init(Default::default).lock().unwrap();
    if let Some(p) = pools.get(&threads) {
        return Ok(p.clone());
    }
    let p = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("shardwise-load-{i}"))
        .build()
        .map_err(|e| Error::InvalidArgument(format!("cannot start {threads} read threads: {e}")))?;
    let p = Arc::new(p);
    pools.insert(threads, p.clone());
    Ok(p)
}

/// Loads every request (see the module docs for its steps). Returns when every host destination
/// is filled and every host-to-device copy has completed and is ordered before
/// `opts.cuda_stream`.
///
/// # Safety
/// Every request's `ptr..ptr+nbytes` must be memory the caller owns (host, or CUDA memory of
/// `device`), stays allocated, and that nothing else reads or writes until this returns.
///
/// Errors: those of [`validate`]; [`Error::Gpu`] when a CUDA destination is given without a
/// usable CUDA driver, or requests name several devices; [`Error::Corrupt`] naming key, file and
/// offset for a missing or truncated data file, an undecodable item or a CRC-32 mismatch;
/// [`Error::Io`] / [`Error::Remote`].
pub unsafe fn load(ck: &Checkpoint, reqs: &[Request], opts: &LoadOptions) -> Result<LoadStats> {
    let t0 = Instant::now();
    let valid = validate(ck, reqs)?;
    let device = cuda_device(reqs)?;
    let found = items(ck, &valid, opts.check_crc)?;
    let source = open(ck, &found, opts.timeout)?;
    let res = resources(opts, device)?;
    let counters = Counters::default();
    let layouts = locate_all(ck, &source, &found.items, &res.readers, &counters)?;
    let max_read = res.pool.buffer_size as u64;
    let plan = plan_load(ck, reqs, &valid.pieces, &found, &layouts, max_read)?;
    let plan_seconds = t0.elapsed().as_secs_f64();

    let copier = match device {
        Some(d) => Some(DeviceCopier::new(d, opts.cuda_stream)?),
        None => None,
    };
    let kept = Kept {
        pool: &res.pool,
        copier: copier.as_ref(),
        stream: opts.cuda_stream,
        buffers: Mutex::new(VecDeque::new()),
    };
    let dests = destinations(reqs, copier.as_ref());
    let exec = Exec {
        ck,
        reqs,
        dests: &dests,
        items: &found.items,
        source: &source,
        plan: &plan,
        pool: &res.pool,
        kept: &kept,
        counters: &counters,
    };
    let outcome = exec.run(&res.readers);
    let finished = kept.finish();
    outcome?;
    finished?;
    Ok(report(reqs.len(), &found, &counters, plan_seconds, t0))
}

/// The one CUDA device the requests name, if any, checked usable here.
///
/// Errors: [`Error::InvalidArgument`] when they name several; [`Error::Gpu`] when no CUDA driver
/// or device is usable.
fn cuda_device(reqs: &[Request]) -> Result<Option<u32>> {
    let device = one_device(reqs)?;
    if let Some(d) = device {
        if !gpu::available() {
            return Err(Error::Gpu(format!(
                "a destination is on CUDA device {d}, but no CUDA driver or device is usable here"
            )));
        }
    }
    Ok(device)
}

/// The one CUDA device the requests name, if any. Pure.
///
/// Errors: [`Error::InvalidArgument`] when they name several.
fn one_device(reqs: &[Request]) -> Result<Option<u32>> {
    let mut devices: Vec<u32> = reqs.iter().filter_map(|r| r.device).collect();
    devices.sort_unstable();
    devices.dedup();
    if devices.len() > 1 {
        return Err(Error::InvalidArgument(format!(
            "requests name CUDA devices {devices:?}; one call loads into one device (and the host)"
        )));
    }
    Ok(devices.first().copied())
}

/// The items the pieces of `valid` need, with their data files, and which save-time CRC-32s this
/// load checks (none unless `check_crc`): an item read whole by its CRC-32; an item read in part
/// by the block CRC-32s of the blocks it reads, where the save recorded some; else, when only part
/// of it is needed, it is counted unchecked. An item with no save-time record (no sidecar) read
/// whole is checked by the zip CRC-32 of its tensor data ([`Item::zip`]); read in part, it is not.
///
/// Errors: [`Error::Corrupt`] when the checksum sidecar places an item elsewhere than `.metadata`.
fn items<'a>(ck: &'a Checkpoint, valid: &Validated<'a>, check_crc: bool) -> Result<Items<'a>> {
    let mut found = collect_items(valid, &ck.metadata.transforms);
    for it in found.items.iter_mut() {
        let rec = ck.placed_record(it.key, Some(&it.chunk.offsets), &it.chunk.storage)?;
        match rec {
            Some(rec) if check_crc && it.whole && !it.transformed => it.check = Some(rec),
            Some(rec)
                if check_crc
                    && !it.transformed
                    && ck.block_bytes().is_some()
                    && !rec.blocks.is_empty() =>
            {
                it.blocks = Some(rec)
            }
            Some(_) if check_crc && !it.whole => found.unchecked += 1,
            None if check_crc && it.whole && !it.transformed => it.zip = true,
            _ => {}
        }
    }
    Ok(found)
}

/// The items of `valid`'s pieces, each once, in the order first needed, with their data files in
/// the same order; an item is transformed when `transforms` (`.metadata`'s, keyed by key and chunk
/// offsets) names it. No CRC-32 is chosen yet. Pure.
fn collect_items<'a>(
    valid: &Validated<'a>,
    transforms: &HashMap<(String, Option<Vec<u64>>), Vec<String>>,
) -> Items<'a> {
    let mut found = Items {
        items: Vec::new(),
        of_piece: Vec::with_capacity(valid.pieces.len()),
        files: Vec::new(),
        unchecked: 0,
    };
    let mut item_of: HashMap<(&str, usize), usize> = HashMap::new();
    let mut file_of: HashMap<&str, usize> = HashMap::new();
    for p in &valid.pieces {
        let t = &valid.tensors[p.req];
        let id = *item_of.entry((t.key, p.chunk)).or_insert_with(|| {
            let chunk = &t.chunks[p.chunk];
            let rel = chunk.storage.relative_path.as_str();
            let nf = found.files.len();
            let file = *file_of.entry(rel).or_insert(nf);
            if file == nf {
                found.files.push(rel);
            }
            found.items.push(Item {
                key: t.key,
                dtype: t.dtype,
                chunk,
                index: p.chunk,
                file,
                whole: false,
                transformed: transforms
                    .contains_key(&(t.key.to_string(), Some(chunk.offsets.clone()))),
                check: None,
                blocks: None,
                zip: false,
            });
            found.items.len() - 1
        });
        let it = &mut found.items[id];
        it.whole |= is_whole(p, it.chunk);
        found.of_piece.push(id);
    }
    found
}

/// Whether piece `p` is all of chunk `c`.
fn is_whole(p: &Piece, c: &Chunk) -> bool {
    p.lo == c.offsets
        && p.hi
            .iter()
            .zip(&c.offsets)
            .zip(&c.sizes)
            .all(|((&h, &o), &n)| h == o + n)
}

/// Opens every data file of `found` for positioned reads (each object-store request bounded by
/// `timeout`) and checks every item lies inside its file, before anything is read.
///
/// Errors: [`Error::Corrupt`] naming the first item of a file that has no `storage_data` entry, is
/// missing or cannot be opened, and as [`check_inside`]; [`Error::Remote`].
fn open<'a>(
    ck: &'a Checkpoint,
    found: &'a Items<'a>,
    timeout: Option<Duration>,
) -> Result<Source<'a>> {
    let first_item_in = |f: usize| {
        found
            .items
            .iter()
            .find(|i| i.file == f)
            .expect("file of an item")
    };
    let mut handles = Vec::with_capacity(found.files.len());
    for (f, rel) in found.files.iter().enumerate() {
        let it = first_item_in(f);
        if rel.is_empty() {
            return Err(corrupt(
                ck.dir().join(METADATA_FILE),
                format!(
                    "{}: chunk has no storage_data entry",
                    item_name(it.key, it.chunk)
                ),
            ));
        }
        let file = ck.open_data(rel).map_err(|e| match e {
            Error::Io { path, source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                corrupt(
                    path,
                    format!(
                        "{}: cannot open the data file: it is missing",
                        item_name(it.key, it.chunk)
                    ),
                )
            }
            Error::Io { path, source, .. } => corrupt(
                path,
                format!(
                    "{}: cannot open the data file: {source}",
                    item_name(it.key, it.chunk)
                ),
            ),
            other => other,
        })?;
        handles.push(file.with_timeout(timeout));
    }
    let sizes: Vec<u64> = handles.iter().map(DataSource::len).collect();
    check_inside(ck, &found.items, &sizes)?;
    Ok(Source {
        ck,
        rels: &found.files,
        files: handles,
    })
}

/// Checks that every item lies inside its data file, of `sizes[file]` bytes. Pure.
///
/// Errors: [`Error::Corrupt`] naming the item and the file's size (truncated).
fn check_inside(ck: &Checkpoint, items: &[Item], sizes: &[u64]) -> Result<()> {
    for it in items {
        let s = &it.chunk.storage;
        if s.offset
            .checked_add(s.length)
            .is_none_or(|e| e > sizes[it.file])
        {
            return Err(corrupt(
                ck.dir().join(&s.relative_path),
                format!(
                    "{}: passes the end of the file ({} bytes; truncated)",
                    item_name(it.key, it.chunk),
                    sizes[it.file]
                ),
            ));
        }
    }
    Ok(())
}

/// The staging pool (`opts.staging_budget`, in buffers of [`buffer_bytes`], pinned for `device`)
/// and the read threads ([`read_threads`]) of a load.
///
/// Errors: [`Error::InvalidArgument`] for a budget of 0 or read threads that cannot start;
/// [`Error::Gpu`] as [`staging::pool`].
fn resources(opts: &LoadOptions, device: Option<u32>) -> Result<Resources> {
    let budget = opts.staging_budget.unwrap_or(DEFAULT_LOAD_BUDGET_BYTES);
    if budget == 0 {
        return Err(Error::InvalidArgument(
            "staging_budget_bytes must be > 0 (None: the default)".into(),
        ));
    }
    let pool = staging::pool(budget, buffer_bytes(device), device)?;
    let cores = std::thread::available_parallelism().map_or(8, |n| n.get());
    let threads = read_threads(opts.threads, device, cores, pool.capacity());
    let readers = read_pool(threads)?;
    Ok(Resources { pool, readers })
}

/// The staging buffer size of a load into host memory only (`device` None), or into CUDA memory
/// of `device` and host memory. Pure.
fn buffer_bytes(device: Option<u32>) -> usize {
    // Host destinations take large contiguous pieces in place (DIRECT_MIN_BYTES); the buffers
    // only carry strided boxes (a resharded TP slice) and coalesced small reads, so small ones
    // keep a CPU load's extra memory a few percent of what it reads (64 MiB buffers made a
    // resharded CPU load peak 0.27x above the bytes it requested; Megatron's own is 0.07x).
    // CUDA destinations keep large pinned buffers: host-to-device copies want large transfers.
    match device {
        Some(_) => DEFAULT_BUFFER_BYTES,
        None => HOST_BUFFER_BYTES,
    }
}

/// Reads in flight: `requested` (None: from the host's `cores`), at most the staging pool's
/// `buffers`, at least 1. Pure.
fn read_threads(
    requested: Option<usize>,
    device: Option<u32>,
    cores: usize,
    buffers: usize,
) -> usize {
    // Reads in flight: enough to keep NVMe queues and the page cache's copy busy (16 on a 16-core
    // H200 host reached the disk's sequential ceiling cold and 27 GB/s warm, BENCHMARKS.md), and
    // no more than the pool's buffers, which each read holds (see `Exec::buffer`). A read into
    // CUDA memory also waits for its buffer's earlier host-to-device copy, so there more reads
    // than cores keep the cores copying: 24 on a 16-core H100 host loaded 16.9 GB in 0.459 s
    // against 0.473 s with 16 (BENCHMARKS.md, "GPU load closer to the copy floor").
    let default_threads = match device {
        Some(_) => (cores * 3 / 2).clamp(4, 24),
        None => cores.clamp(4, 16),
    };
    requested.unwrap_or(default_threads).min(buffers).max(1)
}

/// The layout of every item read in place (None for a transformed one, which the reader decodes
/// whole), located on `readers` in parallel.
///
/// Errors: as [`locate`].
fn locate_all(
    ck: &Checkpoint,
    source: &Source,
    items: &[Item],
    readers: &rayon::ThreadPool,
    counters: &Counters,
) -> Result<Vec<Option<Layout>>> {
    readers.install(|| {
        items
            .par_iter()
            .map(|it| {
                if it.transformed {
                    return Ok(None);
                }
                locate(ck, source, it, counters).map(Some)
            })
            .collect::<Result<_>>()
    })
}

/// The plan of a load: the box copies of `pieces` (cut to `max_read`), the ranges whose CRC-32s it
/// checks, and the reads that bring both.
///
/// Errors: as [`checks`].
fn plan_load<'a>(
    ck: &Checkpoint,
    reqs: &[Request],
    pieces: &'a [Piece],
    found: &Items<'a>,
    layouts: &[Option<Layout>],
    max_read: u64,
) -> Result<Plan<'a>> {
    let Copies {
        mut copies,
        copy_item,
        transformed,
    } = box_copies(reqs, pieces, found, layouts, max_read);
    let checks = checks(ck, &found.items, layouts, &copies, &copy_item)?;
    let (reads, checks_by_file) = group_reads(
        &mut copies,
        &checks,
        &found.items,
        reqs,
        found.files.len(),
        max_read,
    );
    Ok(Plan {
        copies,
        copy_item,
        transformed,
        checks,
        checks_by_file,
        reads,
    })
}

/// The box copies of the pieces of items read in place, each cut into copies whose span is at
/// most `max_read` bytes, with the item of each; and the pieces of transformed items, with theirs.
/// Pure.
fn box_copies<'p>(
    reqs: &[Request],
    pieces: &'p [Piece],
    found: &Items,
    layouts: &[Option<Layout>],
    max_read: u64,
) -> Copies<'p> {
    let mut copies: Vec<plan::Copy> = Vec::new();
    let mut copy_item: Vec<usize> = Vec::new();
    let mut transformed = Vec::new();
    for (p, &id) in pieces.iter().zip(&found.of_piece) {
        let it = &found.items[id];
        let Some(layout) = &layouts[id] else {
            transformed.push((p, id));
            continue;
        };
        let q = &reqs[p.req];
        let bc = BoxCopy::new(
            layout.base,
            &layout.strides,
            &it.chunk.offsets,
            &q.offsets,
            &q.sizes,
            &p.lo,
            &p.hi,
            it.dtype.itemsize(),
        );
        let mut parts = Vec::new();
        bc.split(max_read, &mut parts);
        for copy in parts {
            copies.push(plan::Copy {
                file: it.file,
                req: p.req,
                copy,
                direct: false,
            });
            copy_item.push(id);
        }
    }
    Copies {
        copies,
        copy_item,
        transformed,
    }
}

/// The reads of a load ([`plan::reads`], which also marks the direct copies): of the copies'
/// bytes and of the checked ranges, which are read too (whole items, and partial reads widened to
/// whole blocks); and, for each of the `nfiles` files, the range of its checks in `checks` (sorted
/// by file, then offset), so that a read hashes the parts of those it overlaps. Pure.
fn group_reads(
    copies: &mut [plan::Copy],
    checks: &[Check],
    items: &[Item],
    reqs: &[Request],
    nfiles: usize,
    max_read: u64,
) -> (Vec<plan::Read>, Vec<Range<usize>>) {
    let extra: Vec<(usize, Range<u64>)> = checks
        .iter()
        .map(|c| (items[c.item].file, c.range.clone()))
        .collect();
    let host: Vec<bool> = reqs.iter().map(|r| r.device.is_none()).collect();
    let reads = plan::reads(
        copies,
        &extra,
        &host,
        plan::ReadShape {
            max_read,
            gap: GAP_BYTES,
            direct_min: DIRECT_MIN_BYTES,
        },
    );
    let file_of = |c: &Check| items[c.item].file;
    let checks_by_file = (0..nfiles)
        .map(|f| {
            checks.partition_point(|c| file_of(c) < f)..checks.partition_point(|c| file_of(c) <= f)
        })
        .collect();
    (reads, checks_by_file)
}

/// Each request's destination. `copier` is the copier of the one CUDA device the requests name
/// ([`cuda_device`]), None when they name none: the one place where a device request meets it.
fn destinations<'a>(reqs: &[Request], copier: Option<&'a DeviceCopier>) -> Vec<Dest<'a>> {
    reqs.iter()
        .map(|q| match (q.device, copier) {
            (None, _) => Dest::Host(q.ptr),
            (Some(_), Some(c)) => Dest::Device(c, q.ptr),
            (Some(_), None) => unreachable!("a copier exists for device requests"),
        })
        .collect()
}

/// What a load did: its `requests`, the bytes and reads `counters` counted, the items `found`
/// checks and leaves unchecked, and its times since `t0`.
fn report(
    requests: usize,
    found: &Items,
    counters: &Counters,
    plan_seconds: f64,
    t0: Instant,
) -> LoadStats {
    use std::sync::atomic::Ordering::Relaxed;
    let items_checked = found
        .items
        .iter()
        .filter(|it| it.check.is_some() || it.blocks.is_some() || it.zip)
        .count() as u64;
    LoadStats {
        bytes_read: counters.bytes.load(Relaxed),
        read_ops: counters.ops.load(Relaxed),
        requests,
        plan_seconds,
        items_checked,
        items_unchecked: found.unchecked,
        seconds: t0.elapsed().as_secs_f64(),
    }
}

#[derive(Default)]
struct Counters {
    bytes: std::sync::atomic::AtomicU64,
    ops: std::sync::atomic::AtomicU64,
}

impl Counters {
    fn add(&self, bytes: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        self.bytes.fetch_add(bytes, Relaxed);
        self.ops.fetch_add(1, Relaxed);
    }
}

/// Reads an item's head and tail and decodes where its tensor data lies, checking the item holds
/// a tensor of the chunk's shape and the key's dtype.
///
/// Errors: [`Error::Corrupt`] naming key, file and offset.
fn locate(ck: &Checkpoint, source: &Source, it: &Item, counters: &Counters) -> Result<Layout> {
    let s = &it.chunk.storage;
    let dtype = it.dtype;
    let what = || item_name(it.key, it.chunk);
    let mut last_err = String::new();
    for window in PROBE_BYTES {
        let (head_len, tail_len) = if s.length <= 2 * window {
            (s.length, 0)
        } else {
            (window, window)
        };
        let mut head = vec![0u8; head_len as usize];
        source.read_exact(it.file, s.offset, &mut head, &what)?;
        counters.add(head_len);
        let mut tail = vec![0u8; tail_len as usize];
        if tail_len > 0 {
            source.read_exact(it.file, s.offset + s.length - tail_len, &mut tail, &what)?;
            counters.add(tail_len);
        }
        let blob = HeadTail {
            size: s.length as usize,
            head: &head,
            tail: &tail,
        };
        let t = match stored_tensor_in(&blob) {
            Ok(t) => t,
            Err(e) => {
                last_err = e.0;
                if tail_len == 0 {
                    break; // the whole item was there
                }
                continue;
            }
        };
        let reason = if t.dtype != dtype {
            Some(format!(
                "item holds {} but .metadata says {}",
                t.dtype.torch_name(),
                dtype.torch_name()
            ))
        } else if t.shape != it.chunk.sizes {
            Some(format!(
                "item has shape {:?} but the chunk is {:?}",
                t.shape, it.chunk.sizes
            ))
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err(corrupt(
                ck.dir().join(&s.relative_path),
                format!("{}: {reason}", what()),
            ));
        }
        let payload = s.offset + t.storage.start as u64;
        return Ok(Layout {
            base: payload + t.storage_offset * dtype.itemsize(),
            strides: t.strides,
            payload: payload..payload + t.storage.len as u64,
            record: t.storage,
        });
    }
    Err(corrupt(
        ck.dir().join(&s.relative_path),
        format!("{}: not a tensor item: {last_err}", what()),
    ))
}

/// The ranges a load checks, sorted by file and offset: each item it reads whole, and each block
/// of an item's payload that a partial read touches (so a read of part of a block is widened to
/// the whole block: at most one block of extra bytes at each end of each contiguous range).
///
/// Errors: [`Error::Corrupt`] naming key and file when the sidecar's block CRCs do not cover the
/// item's tensor data.
fn checks<'a>(
    ck: &Checkpoint,
    items: &[Item<'a>],
    layouts: &[Option<Layout>],
    copies: &[plan::Copy],
    copy_item: &[usize],
) -> Result<Vec<Check<'a>>> {
    let mut out = Vec::new();
    let mut needed: Vec<Vec<u64>> = vec![Vec::new(); items.len()];
    if let Some(block) = ck.block_bytes() {
        for (c, &id) in copies.iter().zip(copy_item) {
            if let (Some(_), Some(l)) = (items[id].blocks, &layouts[id]) {
                let at = c.copy.src - l.payload.start;
                needed[id].extend(crate::blockcrc::covering(&(at..at + c.copy.span()), block));
            }
        }
    }
    for (id, it) in items.iter().enumerate() {
        if let Some(rec) = it.check {
            let s = &it.chunk.storage;
            out.push(Check {
                item: id,
                range: s.offset..s.offset + s.length,
                want: Want::Item(rec),
            });
        }
        if let (true, Some(l)) = (it.zip, &layouts[id]) {
            if l.record.has_crc() {
                out.push(Check {
                    item: id,
                    range: l.payload.clone(),
                    want: Want::Record(l.record.clone()),
                });
            }
        }
        let (Some(rec), Some(l), Some(block)) = (it.blocks, &layouts[id], ck.block_bytes()) else {
            continue;
        };
        let len = l.payload.end - l.payload.start;
        if crate::blockcrc::count(len, block) != rec.blocks.len() as u64 {
            return Err(corrupt(
                ck.dir().join(&it.chunk.storage.relative_path),
                format!(
                    "{}: the checksum sidecar records {} block CRC-32s of {block} bytes, but the \
                     item's tensor data is {len} bytes",
                    item_name(it.key, it.chunk),
                    rec.blocks.len()
                ),
            ));
        }
        let blocks = &mut needed[id];
        blocks.sort_unstable();
        blocks.dedup();
        for &b in blocks.iter() {
            let r = crate::blockcrc::span(b, len, block);
            out.push(Check {
                item: id,
                range: l.payload.start + r.start..l.payload.start + r.end,
                want: Want::Block(rec, b),
            });
        }
    }
    out.sort_by_key(|c| (items[c.item].file, c.range.start));
    Ok(out)
}

/// A CRC-32 of bytes `offset..offset+len` of the file of check `check`.
struct Segment {
    check: usize,
    offset: u64,
    len: u64,
    crc: crc32fast::Hasher,
}

/// The state shared by the reads of one load.
struct Exec<'a> {
    ck: &'a Checkpoint,
    reqs: &'a [Request],
    /// The destination of each request.
    dests: &'a [Dest<'a>],
    items: &'a [Item<'a>],
    source: &'a Source<'a>,
    plan: &'a Plan<'a>,
    pool: &'a StagingPool,
    kept: &'a Kept<'a>,
    counters: &'a Counters,
}

/// Staging buffers whose host-to-device copies may still run, oldest first, each with the event
/// that completes after them: kept out of the pool until the end of the load. A guard: finished
/// ([`Kept::finish`]) or dropped (a read panicked), it waits for every copy of the load, ordered
/// before the caller's `stream`, and only then gives the buffers back to the pool, so that no
/// other user of the process's pool overwrites one under a copy.
struct Kept<'a> {
    pool: &'a StagingPool,
    /// Taken once the copies were waited for.
    copier: Option<&'a DeviceCopier>,
    stream: u64,
    buffers: Mutex<VecDeque<(HostBuffer, CudaEvent)>>,
}

impl Kept<'_> {
    /// Waits for the load's copies and gives the kept buffers back to the pool.
    ///
    /// Errors: [`Error::Gpu`] as [`DeviceCopier::finish_into`]; the buffers go back either way.
    fn finish(mut self) -> Result<()> {
        // Copies still in flight read staging buffers and write destinations: always wait for
        // them (the drop that follows gives the buffers back).
        match self.copier.take() {
            Some(c) => c.finish_into(self.stream),
            None => Ok(()),
        }
    }
}

impl Drop for Kept<'_> {
    fn drop(&mut self) {
        if let Some(c) = self.copier.take() {
            let _ = c.finish_into(self.stream);
        }
        // Buffers kept for their copies go back to the pool only now that the copies are done (or
        // failed).
        let buffers = self
            .buffers
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        for (b, _) in buffers.drain(..) {
            self.pool.give_back(b);
        }
    }
}

/// A staging buffer taken for one read: the pool's, or a one-off one for a read longer than the
/// pool's buffers (overlapping copies that cannot be cut apart).
enum Buf<'p> {
    Pooled(&'p StagingPool, Option<HostBuffer>),
    Owned(Vec<u8>),
}

impl Buf<'_> {
    fn bytes(&mut self) -> &mut [u8] {
        match self {
            Buf::Pooled(_, b) => b.as_mut().expect("held").as_mut_slice(),
            Buf::Owned(v) => v,
        }
    }
}

impl Drop for Buf<'_> {
    fn drop(&mut self) {
        if let Buf::Pooled(pool, b) = self {
            if let Some(b) = b.take() {
                pool.give_back(b);
            }
        }
    }
}

impl Exec<'_> {
    /// Runs the plan's reads on `readers`, then loads the pieces of transformed items, then checks
    /// the CRC-32s of what was read ([`Exec::verify`]).
    ///
    /// Errors: [`Error::Interrupted`] on Ctrl-C; as [`Exec::read`], [`Exec::transformed`] and
    /// [`Exec::verify`].
    fn run(&self, readers: &rayon::ThreadPool) -> Result<()> {
        // The reads run on the pool while this thread watches for Ctrl-C (a load of hundreds of GB
        // must stop within a read, not at its end): reads not yet started then fail as
        // Interrupted. A Ctrl-C already seen (during planning) stops the load before its first
        // read.
        let (outcome, _) = crate::interrupt::watching(|cancel| {
            readers.install(|| {
                self.plan
                    .reads
                    .par_iter()
                    .with_max_len(1)
                    .map(|r| {
                        if cancel.load(std::sync::atomic::Ordering::Relaxed) {
                            return Err(Error::Interrupted(Stopped::Load));
                        }
                        self.read(r)
                    })
                    .collect::<Result<Vec<Vec<Segment>>>>()
            })
        });
        let segments = outcome?;
        for (p, id) in &self.plan.transformed {
            self.transformed(p, *id)?;
        }
        self.verify(segments.into_iter().flatten().collect())
    }

    /// Runs one read and its copy-outs; returns the CRC-32 segments it hashed.
    fn read(&self, r: &plan::Read) -> Result<Vec<Segment>> {
        let len = (r.range.end - r.range.start) as usize;
        // Names the first item the read serves, for a truncation found while reading.
        let what = || match r.copies.first() {
            Some(&c) => {
                let it = &self.items[self.plan.copy_item[c]];
                item_name(it.key, it.chunk)
            }
            None => format!("bytes {}..{} of checked items", r.range.start, r.range.end),
        };
        let mut segments = Vec::new();
        if let Some(ci) = r.direct {
            let c = &self.plan.copies[ci];
            let q = &self.reqs[c.req];
            // SAFETY: validated: the copy lies inside the request's destination, which the caller
            // lends us exclusively (load's contract); direct copies go to host memory only.
            let dst =
                unsafe { std::slice::from_raw_parts_mut((q.ptr + c.copy.dst) as *mut u8, len) };
            self.read_hashed(r, dst, &what, &mut segments)?;
            return Ok(segments);
        }
        let mut buf = if len <= self.pool.buffer_size {
            self.buffer()?
        } else {
            Buf::Owned(vec![0u8; len])
        };
        let bytes = &mut buf.bytes()[..len];
        self.read_hashed(r, bytes, &what, &mut segments)?;
        let mut uploaded = None;
        for &ci in &r.copies {
            let c = &self.plan.copies[ci];
            let src = &bytes[(c.copy.src - r.range.start) as usize..];
            // SAFETY: as above; the copy lies inside both the read and the destination.
            unsafe {
                match self.dests[c.req] {
                    Dest::Host(ptr) => copy_host(&c.copy, src.as_ptr(), ptr as *mut u8),
                    Dest::Device(copier, ptr) => {
                        upload(copier, &c.copy, src.as_ptr(), ptr)?;
                        uploaded = Some(copier);
                    }
                }
            }
        }
        if let Some(copier) = uploaded {
            let ev = copier.record()?;
            match &mut buf {
                Buf::Pooled(_, b) => {
                    let b = b.take().expect("held");
                    self.kept.buffers.lock().unwrap().push_back((b, ev));
                }
                // A one-off buffer is freed on return: its copies must be done by then.
                Buf::Owned(_) => gpu::wait(&ev)?,
            }
        }
        Ok(segments)
    }

    /// Reads `r` into `bytes` (its `len` bytes) and hashes the parts of checked ranges it brings:
    /// from a local file in steps of [`READ_STEP_BYTES`], each hashed right after it lands, while
    /// it is still in the CPU's cache; from an object store in one ranged GET.
    ///
    /// Errors: as [`Source::read_exact`].
    fn read_hashed(
        &self,
        r: &plan::Read,
        bytes: &mut [u8],
        what: &dyn Fn() -> String,
        out: &mut Vec<Segment>,
    ) -> Result<()> {
        let step = if self.source.files[r.file].is_local() {
            READ_STEP_BYTES
        } else {
            bytes.len()
        };
        self.counters.add(bytes.len() as u64);
        let mut at = 0;
        while at < bytes.len() {
            let end = (at + step).min(bytes.len());
            let range = r.range.start + at as u64..r.range.start + end as u64;
            let part = &mut bytes[at..end];
            self.source.read_exact(r.file, range.start, part, what)?;
            self.hash(r.file, &range, part, out);
            at = end;
        }
        Ok(())
    }

    /// A staging buffer: the oldest one still kept for its host-to-device copies (waiting for
    /// them; by then they are usually done), else a free one of the pool. A read takes from the
    /// pool only when this load keeps none, so the load holds at most as many buffers as it has
    /// reads in flight, which is at most the pool's capacity: `take` cannot wait forever on
    /// buffers this load keeps.
    fn buffer(&self) -> Result<Buf<'_>> {
        let kept = self.kept.buffers.lock().unwrap().pop_front();
        Ok(match kept {
            Some((b, ev)) => {
                let held = Buf::Pooled(self.pool, Some(b));
                gpu::wait(&ev)?;
                held
            }
            None => Buf::Pooled(self.pool, Some(self.pool.take())),
        })
    }

    /// Hashes the parts of checked ranges that a read of bytes `range` of file `file` brought
    /// into `bytes`.
    fn hash(&self, file: usize, range: &Range<u64>, bytes: &[u8], out: &mut Vec<Segment>) {
        let ids = self.plan.checks_by_file[file].clone();
        let checks = &self.plan.checks[ids.clone()];
        let first = checks.partition_point(|c| c.range.end <= range.start);
        for (k, c) in checks.iter().enumerate().skip(first) {
            if c.range.start >= range.end {
                break;
            }
            let a = c.range.start.max(range.start);
            let b = c.range.end.min(range.end);
            let mut crc = crc32fast::Hasher::new();
            crc.update(&bytes[(a - range.start) as usize..(b - range.start) as usize]);
            out.push(Segment {
                check: ids.start + k,
                offset: a,
                len: b - a,
                crc,
            });
        }
    }

    /// Loads a piece of an item stored with a stream transform: the reader decodes (and checks)
    /// the whole item, and the piece is copied out of it.
    fn transformed(&self, p: &Piece, id: usize) -> Result<()> {
        let it = &self.items[id];
        let q = &self.reqs[p.req];
        let (data, c) = self.ck.chunk(it.key, it.index)?;
        let item = it.dtype.itemsize();
        let shape: Vec<u64> = p.lo.iter().zip(&p.hi).map(|(a, b)| b - a).collect();
        let mut boxed = vec![0u8; (volume(&shape).unwrap_or(0) * item) as usize];
        copy_box(
            data.storage(),
            data.tensor.storage_offset,
            &data.tensor.strides,
            &c.offsets,
            &p.lo,
            &shape,
            &p.lo,
            &p.hi,
            item,
            &mut boxed,
        );
        // From the contiguous box into the destination, like any other copy.
        let mut strides = vec![1u64; shape.len()];
        for d in (0..shape.len().saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * shape[d + 1];
        }
        let bc = BoxCopy::new(0, &strides, &p.lo, &q.offsets, &q.sizes, &p.lo, &p.hi, item);
        // SAFETY: the box lies inside `boxed` and the destination (validated).
        unsafe {
            match self.dests[p.req] {
                Dest::Device(copier, ptr) => {
                    upload(copier, &bc, boxed.as_ptr(), ptr)?;
                    gpu::wait(&copier.record()?)?; // `boxed` is freed on return
                }
                Dest::Host(ptr) => copy_host(&bc, boxed.as_ptr(), ptr as *mut u8),
            }
        }
        Ok(())
    }

    /// Combines each checked range's segments in file order and compares with its recorded
    /// CRC-32 (of the item, or of the block).
    ///
    /// Errors: [`Error::Corrupt`] naming key, file and offset on a mismatch.
    fn verify(&self, mut segments: Vec<Segment>) -> Result<()> {
        segments.sort_by_key(|s| (s.check, s.offset));
        let mut at = 0;
        for (k, c) in self.plan.checks.iter().enumerate() {
            let mut crc = crc32fast::Hasher::new();
            let mut next = c.range.start;
            while at < segments.len() && segments[at].check == k {
                let seg = &segments[at];
                // Reads tile each checked range by construction; a hole would be a planning bug.
                assert_eq!(
                    seg.offset, next,
                    "CRC segments tile {}",
                    self.items[c.item].key
                );
                crc.combine(&seg.crc);
                next += seg.len;
                at += 1;
            }
            let it = &self.items[c.item];
            assert_eq!(next, c.range.end, "CRC segments tile {}", it.key);
            match &c.want {
                Want::Item(rec) => self.ck.check_crc(rec, crc.finalize())?,
                Want::Block(rec, b) => {
                    self.ck
                        .check_block_crc(rec, *b, c.range.clone(), crc.finalize())?
                }
                Want::Record(r) => check_record_crc(self.ck, it.key, it.chunk, r, crc.finalize())?,
            }
        }
        Ok(())
    }
}

/// Compares `got`, the CRC-32 of the payload of `key`'s chunk `c`, with the one its archive's
/// record `r` holds (an item without a save-time CRC-32).
///
/// Errors: [`Error::Corrupt`] naming key, chunk, file and the item's offset, as a save-time
/// CRC-32 mismatch does.
fn check_record_crc(ck: &Checkpoint, key: &str, c: &Chunk, r: &Record, got: u32) -> Result<()> {
    match r.crc_mismatch(got) {
        None => Ok(()),
        Some(m) => Err(corrupt(
            ck.dir().join(&c.storage.relative_path),
            format!("{}: {m}", item_name(key, c)),
        )),
    }
}

/// Calls `f(src_offset, dst_offset)` for every run of a box copy (offsets relative to its start).
fn for_each_run(c: &BoxCopy, inner: usize, mut f: impl FnMut(u64, u64)) {
    let outer = &c.dims[..c.dims.len() - inner];
    let mut idx = vec![0u64; outer.len()];
    loop {
        let (mut s, mut d) = (0, 0);
        for (k, &(_, ss, ds)) in outer.iter().enumerate() {
            s += idx[k] * ss;
            d += idx[k] * ds;
        }
        f(s, d);
        // Odometer over the outer dimensions.
        let mut k = outer.len();
        loop {
            if k == 0 {
                return;
            }
            k -= 1;
            idx[k] += 1;
            if idx[k] < outer[k].0 {
                break;
            }
            idx[k] = 0;
        }
    }
}

/// Copies box `c` from `src` (its first source byte) into host memory at `dst` (the request's
/// destination; `c.dst` is added).
///
/// # Safety
/// Both sides must hold every byte the box touches, and not overlap.
unsafe fn copy_host(c: &BoxCopy, src: *const u8, dst: *mut u8) {
    let dst = dst.add(c.dst as usize);
    let run = c.run as usize;
    for_each_run(c, 0, |s, d| {
        std::ptr::copy_nonoverlapping(src.add(s as usize), dst.add(d as usize), run)
    });
}

/// Queues box `c` from host `src` (its first source byte) to device memory at `dst` (the
/// request's destination; `c.dst` is added): one 2-d copy per innermost row set.
///
/// # Safety
/// As [`DeviceCopier::upload`], for every byte the box touches.
unsafe fn upload(copier: &DeviceCopier, c: &BoxCopy, src: *const u8, dst: u64) -> Result<()> {
    let dst = dst + c.dst;
    let (height, src_pitch, dst_pitch, inner) = match c.dims.last() {
        Some(&(count, s, d)) => (count as usize, s as usize, d as usize, 1),
        None => (1, c.run as usize, c.run as usize, 0),
    };
    let mut res = Ok(());
    for_each_run(c, inner, |s, d| {
        if res.is_ok() {
            res = copier.upload(
                dst + d,
                dst_pitch,
                src.add(s as usize),
                src_pitch,
                c.run as usize,
                height,
            );
        }
    });
    res
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::save::{save_rank, SaveOptions};
    use crate::storage::Location;
    use crate::writer::{Payload, TensorChunk};

    /// Element (i, j) of the `[8, 6]` uint8 tensor `w`.
    fn w(i: u64, j: u64) -> u8 {
        (i * 6 + j) as u8
    }

    /// A committed checkpoint of 2 ranks, each saving 4 rows of `w`, in a fresh directory.
    fn saved() -> (tempfile::TempDir, Checkpoint) {
        let dir = tempfile::tempdir().unwrap();
        let loc = Location::local(dir.path());
        for rank in [1u32, 0] {
            let rows: Vec<u8> = (4 * rank as u64..4 * rank as u64 + 4)
                .flat_map(|i| (0..6).map(move |j| w(i, j)))
                .collect();
            let chunk = TensorChunk {
                fqn: "w".into(),
                dtype: DType::from_torch_name("torch.uint8").unwrap(),
                global_shape: vec![8, 6],
                offsets: vec![4 * rank as u64, 0],
                sizes: vec![4, 6],
                data: Payload::Host(&rows),
            };
            let opts = SaveOptions {
                location: loc.clone(),
                rank,
                world_size: 2,
                save_id: "s".into(),
                megatron: false,
                merge_rank: Some(0),
                timeout: Duration::from_secs(20),
                wait_for_commit: false,
                overwrite: false,
                derived_save_id: false,
                integrity: false,
            };
            save_rank(&opts, &[chunk], &[], None, None).unwrap();
        }
        let ck = Checkpoint::open(&loc).unwrap();
        (dir, ck)
    }

    /// Load options with a 1 MiB staging pool (the default one is 2 GiB).
    fn small() -> LoadOptions {
        LoadOptions {
            staging_budget: Some(1 << 20),
            ..Default::default()
        }
    }

    fn request(key: &str, offsets: [u64; 2], sizes: [u64; 2], out: &mut [u8]) -> Request {
        Request {
            key: key.into(),
            offsets: offsets.to_vec(),
            sizes: sizes.to_vec(),
            ptr: out.as_mut_ptr() as u64,
            nbytes: out.len() as u64,
            device: None,
        }
    }

    /// Regions across chunk borders and of part of the columns land in C order, in one call;
    /// every item read is checked (whole, or by the blocks read).
    #[test]
    fn regions_across_chunks_load_in_one_call() {
        let (_dir, ck) = saved();
        let mut all = vec![0u8; 48];
        let mut middle = vec![0u8; 4 * 2];
        let mut one = vec![0u8; 1];
        let reqs = [
            request("w", [0, 0], [8, 6], &mut all),
            request("w", [2, 1], [4, 2], &mut middle),
            request("w", [7, 5], [1, 1], &mut one),
        ];
        // SAFETY: the destinations are the Vecs above, alive and untouched until load returns.
        let stats = unsafe { load(&ck, &reqs, &small()) }.unwrap();
        let want = |o: [u64; 2], s: [u64; 2]| -> Vec<u8> {
            (o[0]..o[0] + s[0])
                .flat_map(|i| (o[1]..o[1] + s[1]).map(move |j| w(i, j)))
                .collect()
        };
        assert_eq!(all, want([0, 0], [8, 6]));
        assert_eq!(middle, want([2, 1], [4, 2]));
        assert_eq!(one, vec![w(7, 5)]);
        assert_eq!(
            (stats.requests, stats.items_checked, stats.items_unchecked),
            (3, 2, 0)
        );
        // read_region is a one-request load of the same bytes.
        let mut again = vec![0u8; 8];
        read_region(&ck, "w", &[2, 1], &[4, 2], &mut again).unwrap();
        assert_eq!(again, middle);
    }

    /// Every request is validated before any byte is read, each with its own error.
    #[test]
    fn bad_requests_are_refused_before_reading() {
        let (_dir, ck) = saved();
        let mut buf = [0u8; 48];
        let run = |r: Request| unsafe { load(&ck, &[r], &small()) };
        let e = run(request("nope", [0, 0], [1, 1], &mut buf[..1])).unwrap_err();
        assert!(
            matches!(&e, Error::MissingKey { key, .. } if key == "nope"),
            "{e}"
        );
        let e = run(request("w", [4, 0], [5, 6], &mut buf[..30])).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains("outside the global shape [8, 6]")),
            "{e}"
        );
        let e = run(request("w", [0, 0], [2, 6], &mut buf[..11])).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains("needs 12 bytes, the destination has 11")),
            "{e}"
        );
        let mut null = request("w", [0, 0], [1, 1], &mut buf[..1]);
        null.ptr = 0;
        let e = run(null).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains("null destination")),
            "{e}"
        );
        let opts = LoadOptions {
            staging_budget: Some(0),
            ..Default::default()
        };
        let r = request("w", [0, 0], [1, 1], &mut buf[..1]);
        let e = unsafe { load(&ck, &[r], &opts) }.unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains("staging_budget_bytes")),
            "{e}"
        );
    }

    /// A flipped payload byte fails the item's CRC-32, naming key, chunk, file and offset; without
    /// the check the damaged byte is loaded as is.
    #[test]
    fn a_flipped_byte_is_a_crc_error_naming_the_item() {
        let (dir, ck) = saved();
        let path = dir.path().join("__1_0.distcp");
        let mut bytes = std::fs::read(&path).unwrap();
        let at = bytes
            .windows(6)
            .position(|x| x == [w(5, 0), w(5, 1), w(5, 2), w(5, 3), w(5, 4), w(5, 5)])
            .unwrap();
        bytes[at] ^= 0x40;
        std::fs::write(&path, &bytes).unwrap();
        let mut out = vec![0u8; 48];
        let reqs = [request("w", [0, 0], [8, 6], &mut out)];
        let e = unsafe { load(&ck, &reqs, &small()) }.unwrap_err();
        assert!(
            matches!(&e, Error::Corrupt { path, reason } if path.ends_with("__1_0.distcp")
                && reason.contains("w chunk [4, 0]") && reason.contains("CRC-32")),
            "{e}"
        );
        let unchecked = LoadOptions {
            check_crc: false,
            ..small()
        };
        let reqs = [request("w", [0, 0], [8, 6], &mut out)];
        unsafe { load(&ck, &reqs, &unchecked) }.unwrap();
        assert_eq!(out[30], w(5, 0) ^ 0x40);
    }

    /// Without the checksum sidecar (a copy without hidden directories), an item read whole fails
    /// the CRC-32 its archive records for its tensor data, naming key, chunk, file and offset,
    /// through `load` and `read_region`; a part of it is read unchecked.
    #[test]
    fn without_the_sidecar_a_flipped_byte_fails_the_zip_crc() {
        let (dir, _) = saved();
        std::fs::remove_dir_all(dir.path().join(".shardwise")).unwrap();
        let path = dir.path().join("__1_0.distcp");
        let mut bytes = std::fs::read(&path).unwrap();
        let at = bytes
            .windows(6)
            .position(|x| x == [w(5, 0), w(5, 1), w(5, 2), w(5, 3), w(5, 4), w(5, 5)])
            .unwrap();
        bytes[at] ^= 0x40;
        std::fs::write(&path, &bytes).unwrap();
        let ck = Checkpoint::open(&Location::local(dir.path())).unwrap();
        assert!(!ck.has_checksums());
        let names_item = |e: &Error| {
            matches!(e, Error::Corrupt { path, reason } if path.ends_with("__1_0.distcp")
                && reason.starts_with("w chunk [4, 0] (item at offset")
                && reason.contains("fails its zip CRC-32"))
        };
        let mut out = vec![0u8; 48];
        let reqs = [request("w", [0, 0], [8, 6], &mut out)];
        let e = unsafe { load(&ck, &reqs, &small()) }.unwrap_err();
        assert!(names_item(&e), "{e}");
        let e = read_region(&ck, "w", &[0, 0], &[8, 6], &mut out).unwrap_err();
        assert!(names_item(&e), "{e}");
        // The intact chunk loads, checked; part of the damaged one loads as it is.
        let reqs = [request("w", [0, 0], [4, 6], &mut out[..24])];
        let stats = unsafe { load(&ck, &reqs, &small()) }.unwrap();
        assert_eq!((stats.items_checked, stats.items_unchecked), (1, 0));
        read_region(&ck, "w", &[0, 0], &[4, 6], &mut out[..24]).unwrap();
        let reqs = [request("w", [5, 0], [1, 6], &mut out[..6])];
        unsafe { load(&ck, &reqs, &small()) }.unwrap();
        assert_eq!(out[0], w(5, 0) ^ 0x40);
    }

    /// Ctrl-C stops a load with load wording (not a save's "nothing committed"); the check runs
    /// on the calling thread, so this test's flag stops only its own load.
    #[test]
    fn an_interrupted_load_says_it_is_a_load() {
        thread_local!(static STOP: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });
        crate::interrupt::set_interrupt_check(|| STOP.with(|s| s.get()));
        let (_dir, ck) = saved();
        let mut out = vec![0u8; 48];
        let reqs = [request("w", [0, 0], [8, 6], &mut out)];
        STOP.with(|s| s.set(true));
        let e = unsafe { load(&ck, &reqs, &small()) }.unwrap_err();
        STOP.with(|s| s.set(false));
        assert!(matches!(e, Error::Interrupted(Stopped::Load)), "{e}");
        assert_eq!(
            e.to_string(),
            "interrupted; the load stopped before it finished (the destinations may hold part of the data)"
        );
    }

    /// A data file cut short is found before any read, naming the item and the file's size.
    #[test]
    fn a_truncated_data_file_is_refused_before_reading() {
        let (dir, ck) = saved();
        let path = dir.path().join("__0_0.distcp");
        let len = std::fs::metadata(&path).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(len - 100)
            .unwrap();
        let mut out = vec![0u8; 6];
        let reqs = [request("w", [0, 0], [1, 6], &mut out)];
        let e = unsafe { load(&ck, &reqs, &small()) }.unwrap_err();
        assert!(
            matches!(&e, Error::Corrupt { reason, .. } if reason.contains("w chunk [0, 0]")
                && reason.contains(&format!("passes the end of the file ({} bytes; truncated)", len - 100))),
            "{e}"
        );
    }

    fn uint8() -> DType {
        DType::from_torch_name("torch.uint8").unwrap()
    }

    /// A chunk at `offsets` of `sizes` stored at bytes `at..at+len` of data file `rel`.
    fn chunk(rel: &str, at: u64, len: u64, offsets: &[u64], sizes: &[u64]) -> Chunk {
        Chunk {
            offsets: offsets.to_vec(),
            sizes: sizes.to_vec(),
            storage: crate::format::metadata::StorageInfo {
                relative_path: rel.into(),
                offset: at,
                length: len,
            },
        }
    }

    fn piece(req: usize, chunk: usize, lo: [u64; 2], hi: [u64; 2]) -> Piece {
        Piece {
            req,
            chunk,
            lo: lo.to_vec(),
            hi: hi.to_vec(),
        }
    }

    /// A host request for `ptr` (never dereferenced by the pure steps).
    fn request_at(key: &str, offsets: [u64; 2], sizes: [u64; 2], ptr: u64) -> Request {
        Request {
            key: key.into(),
            offsets: offsets.to_vec(),
            sizes: sizes.to_vec(),
            ptr,
            nbytes: sizes.iter().product(),
            device: None,
        }
    }

    /// An item of chunk `index` of `key`, read in place, nothing checked yet.
    fn item<'a>(key: &'a str, c: &'a Chunk, index: usize, file: usize) -> Item<'a> {
        Item {
            key,
            dtype: uint8(),
            chunk: c,
            index,
            file,
            whole: false,
            transformed: false,
            check: None,
            blocks: None,
            zip: false,
        }
    }

    /// Validation returns each request's tensor by reference into `.metadata`, and the pieces
    /// that cover each request, split at the chunks' border.
    #[test]
    fn validate_carries_each_requests_tensor_and_its_pieces() {
        let (_dir, ck) = saved();
        let reqs = [
            request_at("w", [3, 0], [2, 6], 8),
            request_at("w", [0, 2], [4, 1], 8),
        ];
        let v = validate(&ck, &reqs).unwrap();
        let Entry::Tensor {
            global_shape,
            chunks,
            ..
        } = ck.entry("w").unwrap()
        else {
            panic!("w is a tensor")
        };
        assert_eq!(v.tensors.len(), 2);
        for t in &v.tensors {
            assert_eq!((t.key, t.dtype), ("w", uint8()));
            assert!(std::ptr::eq(t.chunks, chunks.as_slice()));
            assert!(std::ptr::eq(t.global_shape, global_shape.as_slice()));
        }
        let mut got: Vec<_> = v
            .pieces
            .iter()
            .map(|p| {
                (
                    p.req,
                    chunks[p.chunk].offsets.clone(),
                    p.lo.clone(),
                    p.hi.clone(),
                )
            })
            .collect();
        got.sort();
        assert_eq!(
            got,
            vec![
                (0, vec![0, 0], vec![3, 0], vec![4, 6]),
                (0, vec![4, 0], vec![4, 0], vec![5, 6]),
                (1, vec![0, 0], vec![0, 2], vec![4, 3]),
            ]
        );
    }

    /// A request is checked against its tensor alone: region, byte count, pointer.
    #[test]
    fn check_request_refuses_each_bad_request() {
        let chunks = [chunk("f", 0, 0, &[0, 0], &[8, 6])];
        let t = Tensor {
            key: "w",
            dtype: DType::from_torch_name("torch.bfloat16").unwrap(),
            global_shape: &[8, 6],
            chunks: &chunks,
        };
        let mut q = request_at("w", [7, 0], [1, 6], 8);
        q.nbytes = 12;
        check_request(&t, &q).unwrap();
        let refused = |q: &Request, want: &str| {
            let e = check_request(&t, q).unwrap_err();
            assert!(
                matches!(&e, Error::InvalidArgument(m) if m.contains(want)),
                "{want}: {e}"
            );
        };
        let mut outside = q.clone();
        outside.offsets = vec![8, 0];
        refused(
            &outside,
            "w: region [8, 0]+[1, 6] is outside the global shape [8, 6]",
        );
        let mut huge = q.clone();
        huge.offsets = vec![u64::MAX, 0];
        refused(&huge, "is outside the global shape");
        let mut short = q.clone();
        short.nbytes = 6;
        refused(
            &short,
            "w: region [1, 6] of bfloat16 needs 12 bytes, the destination has 6",
        );
        let mut null = q.clone();
        null.ptr = 0;
        refused(&null, "w: null destination pointer");
        // An empty region needs no memory.
        let empty = Request {
            sizes: vec![0, 6],
            nbytes: 0,
            ptr: 0,
            ..q
        };
        check_request(&t, &empty).unwrap();
    }

    #[test]
    fn one_device_per_load() {
        let mut reqs = vec![request_at("w", [0, 0], [1, 1], 8); 3];
        assert_eq!(one_device(&reqs).unwrap(), None);
        reqs[0].device = Some(1);
        reqs[2].device = Some(1);
        assert_eq!(one_device(&reqs).unwrap(), Some(1));
        reqs[1].device = Some(0);
        let e = one_device(&reqs).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains("requests name CUDA devices [0, 1]; one call loads into one device")),
            "{e}"
        );
    }

    /// Each item once, in the order first needed, with its files once; an item is whole when
    /// some piece is all of it, and transformed when `.metadata` names a transform for it.
    #[test]
    fn collect_items_finds_each_item_and_file_once() {
        let chunks = [
            chunk("a", 0, 100, &[0, 0], &[4, 6]),
            chunk("b", 0, 100, &[4, 0], &[4, 6]),
            chunk("a", 100, 100, &[8, 0], &[4, 6]),
        ];
        let t = Tensor {
            key: "w",
            dtype: uint8(),
            global_shape: &[12, 6],
            chunks: &chunks,
        };
        let valid = Validated {
            tensors: vec![t, t],
            pieces: vec![
                piece(0, 1, [5, 0], [6, 6]),
                piece(0, 0, [0, 0], [4, 6]),
                piece(1, 1, [4, 0], [5, 6]),
                piece(1, 2, [8, 0], [12, 6]),
            ],
        };
        let mut transforms = HashMap::new();
        transforms.insert(
            ("w".to_string(), Some(vec![8, 0])),
            vec!["stream.zstd/1".to_string()],
        );
        let found = collect_items(&valid, &transforms);
        assert_eq!(found.of_piece, [0, 1, 0, 2]);
        assert_eq!(found.files, ["b", "a"]);
        let got: Vec<_> = found
            .items
            .iter()
            .map(|it| (it.key, it.index, it.file, it.whole, it.transformed))
            .collect();
        assert_eq!(
            got,
            [
                ("w", 1, 0, false, false),
                ("w", 0, 1, true, false),
                ("w", 2, 1, true, true),
            ]
        );
        assert!(found
            .items
            .iter()
            .all(|it| it.check.is_none() && it.blocks.is_none()));
        assert!(std::ptr::eq(found.items[2].chunk, &chunks[2]));
    }

    /// An item read whole is checked by its CRC-32, one read in part by its block CRC-32s; without
    /// the sidecar, one read whole by its archive's zip CRC-32; with `check_crc` off nothing is.
    #[test]
    fn items_choose_what_each_item_is_checked_by() {
        let (dir, ck) = saved();
        assert!(
            ck.block_bytes().is_some(),
            "this save records block CRC-32s"
        );
        let whole = [request_at("w", [0, 0], [8, 6], 8)];
        let part = [request_at("w", [2, 1], [4, 2], 8)];
        let checked = |ck: &Checkpoint, reqs: &[Request], check_crc: bool| {
            let valid = validate(ck, reqs).unwrap();
            let found = items(ck, &valid, check_crc).unwrap();
            let by: Vec<(bool, bool, bool)> = found
                .items
                .iter()
                .map(|it| (it.check.is_some(), it.blocks.is_some(), it.zip))
                .collect();
            (by, found.unchecked)
        };
        assert_eq!(
            checked(&ck, &whole, true),
            (vec![(true, false, false); 2], 0)
        );
        assert_eq!(
            checked(&ck, &part, true),
            (vec![(false, true, false); 2], 0)
        );
        assert_eq!(
            checked(&ck, &part, false),
            (vec![(false, false, false); 2], 0)
        );
        // Without the sidecar: an item read whole by its archive's zip CRC-32, a part unchecked.
        std::fs::remove_dir_all(dir.path().join(".shardwise")).unwrap();
        let bare = Checkpoint::open(&Location::local(dir.path())).unwrap();
        assert_eq!(
            checked(&bare, &whole, true),
            (vec![(false, false, true); 2], 0)
        );
        assert_eq!(
            checked(&bare, &whole, false),
            (vec![(false, false, false); 2], 0)
        );
        assert_eq!(
            checked(&bare, &part, true),
            (vec![(false, false, false); 2], 0)
        );
    }

    #[test]
    fn check_inside_names_an_item_past_the_end_of_its_file() {
        let (_dir, ck) = saved();
        let chunks = [
            chunk("a", 0, 100, &[0, 0], &[4, 6]),
            chunk("b", 50, 100, &[4, 0], &[4, 6]),
        ];
        let items = [item("w", &chunks[0], 0, 0), item("w", &chunks[1], 1, 1)];
        check_inside(&ck, &items, &[100, 150]).unwrap();
        let e = check_inside(&ck, &items, &[100, 149]).unwrap_err();
        assert!(
            matches!(&e, Error::Corrupt { path, reason } if path.ends_with("b")
                && reason.contains("w chunk [4, 0] (item at offset 50, 100 bytes): passes the end of the file (149 bytes; truncated)")),
            "{e}"
        );
    }

    #[test]
    fn buffers_and_threads_follow_the_destinations() {
        assert_eq!(buffer_bytes(None), HOST_BUFFER_BYTES);
        assert_eq!(buffer_bytes(Some(0)), DEFAULT_BUFFER_BYTES);
        // From the cores: 4 to 16 into host memory, 1.5 per core (4 to 24) into CUDA memory.
        assert_eq!(read_threads(None, None, 2, 32), 4);
        assert_eq!(read_threads(None, None, 12, 32), 12);
        assert_eq!(read_threads(None, None, 64, 32), 16);
        assert_eq!(read_threads(None, Some(0), 12, 32), 18);
        assert_eq!(read_threads(None, Some(0), 64, 32), 24);
        // Never more than the pool's buffers, never none; as asked otherwise.
        assert_eq!(read_threads(None, Some(0), 64, 8), 8);
        assert_eq!(read_threads(Some(40), None, 4, 32), 32);
        assert_eq!(read_threads(Some(0), None, 4, 32), 1);
        assert_eq!(read_threads(Some(3), None, 64, 32), 3);
    }

    /// Pieces of items read in place become box copies cut to the largest read, each with its
    /// item; pieces of transformed items are left to the reader.
    #[test]
    fn box_copies_cut_pieces_and_set_aside_transformed_ones() {
        let chunks = [
            chunk("a", 0, 100, &[0, 0], &[4, 6]),
            chunk("a", 100, 100, &[4, 0], &[4, 6]),
        ];
        let mut items = vec![item("w", &chunks[0], 0, 0), item("w", &chunks[1], 1, 0)];
        items[1].transformed = true;
        let found = Items {
            items,
            of_piece: vec![0, 1],
            files: vec!["a"],
            unchecked: 0,
        };
        let layouts = [
            Some(Layout {
                base: 60,
                strides: vec![6, 1],
                payload: 60..84,
                record: Record {
                    name: "archive/data/0".into(),
                    start: 60,
                    len: 24,
                    crc: 0,
                },
            }),
            None,
        ];
        let pieces = [piece(0, 0, [0, 0], [4, 6]), piece(0, 1, [4, 0], [5, 6])];
        let reqs = [request_at("w", [0, 0], [5, 6], 8)];
        let c = box_copies(&reqs, &pieces, &found, &layouts, 10);
        let got: Vec<(u64, u64, u64, usize)> = c
            .copies
            .iter()
            .map(|c| (c.copy.src, c.copy.dst, c.copy.run, c.file))
            .collect();
        assert_eq!(got, [(60, 0, 10, 0), (70, 10, 10, 0), (80, 20, 4, 0)]);
        assert_eq!(c.copy_item, [0, 0, 0]);
        assert_eq!(c.transformed.len(), 1);
        assert!(std::ptr::eq(c.transformed[0].0, &pieces[1]) && c.transformed[0].1 == 1);
    }

    /// Checked ranges are read too, and each file's checks are found by range.
    #[test]
    fn group_reads_reads_checked_ranges_and_indexes_them_by_file() {
        let chunks = [
            chunk("a", 0, 100, &[0, 0], &[4, 6]),
            chunk("b", 0, 100, &[0, 6], &[4, 6]),
        ];
        let items = [item("w", &chunks[0], 0, 0), item("w", &chunks[1], 1, 1)];
        let rec = Recorded {
            fqn: "w".into(),
            offsets: Some(vec![0, 0]),
            relative_path: "a".into(),
            offset: 0,
            length: 100,
            crc32: 0,
            blocks: vec![],
        };
        let check = |item: usize, range: Range<u64>| Check {
            item,
            range,
            want: Want::Item(&rec),
        };
        // Sorted by file, then offset: none in file 0, two in file 1.
        let checks = [check(1, 0..40), check(1, 60..100)];
        let mut copies = vec![plan::Copy {
            file: 0,
            req: 0,
            copy: BoxCopy {
                src: 10,
                dst: 0,
                run: 20,
                dims: vec![],
            },
            direct: false,
        }];
        let reqs = [request_at("w", [0, 0], [4, 12], 8)];
        let (reads, by_file) = group_reads(&mut copies, &checks, &items, &reqs, 2, 1000);
        assert_eq!(by_file, [0..0, 0..2]);
        let got: Vec<(usize, Range<u64>, Vec<usize>)> = reads
            .into_iter()
            .map(|r| (r.file, r.range, r.copies))
            .collect();
        // The hole of 20 bytes between the checked ranges is read through (GAP_BYTES).
        assert_eq!(got, [(0, 10..30, vec![0]), (1, 0..100, vec![])]);
    }

    /// The report counts what was read and which items were checked.
    #[test]
    fn report_counts_reads_and_checked_items() {
        let chunks = [chunk("a", 0, 100, &[0, 0], &[4, 6])];
        let rec = Recorded {
            fqn: "w".into(),
            offsets: Some(vec![0, 0]),
            relative_path: "a".into(),
            offset: 0,
            length: 100,
            crc32: 0,
            blocks: vec![],
        };
        let mut items: Vec<Item> = (0..3).map(|k| item("w", &chunks[0], k, 0)).collect();
        items[0].check = Some(&rec);
        items[1].zip = true;
        items[2].blocks = Some(&rec);
        let found = Items {
            items,
            of_piece: vec![],
            files: vec!["a"],
            unchecked: 4,
        };
        let counters = Counters::default();
        counters.add(100);
        counters.add(28);
        let t0 = Instant::now();
        let r = report(5, &found, &counters, 0.25, t0);
        assert_eq!(
            (r.bytes_read, r.read_ops, r.requests, r.plan_seconds),
            (128, 2, 5, 0.25)
        );
        assert_eq!((r.items_checked, r.items_unchecked), (3, 4));
        assert!(r.seconds >= 0.0);
    }
}
