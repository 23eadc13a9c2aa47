//! Loads regions of many tensors of an open [`Checkpoint`] in one call, straight into the
//! caller's memory (host, or CUDA through a reused pinned staging pool): the native side of
//! `shardwise.megatron.load` (contract: notes/helpers/load-contract.md).
//!
//! Steps, each bounded and done once per call:
//! 1. **Validate** every request before any byte is read: the key exists and is a tensor, the
//!    region lies in its global shape, the destination has `prod(sizes) * itemsize` bytes, and the
//!    saved chunks cover the region (found through a per-tensor [`plan::ChunkIndex`]).
//! 2. **Locate** each needed item's tensor data in its data file from the item's first and last
//!    bytes (torch.save zip headers and central directory; a few KiB per item), so that only the
//!    needed bytes are read.
//! 3. **Plan** ([`plan::reads`]): one strided box copy per (chunk, request), byte ranges coalesced
//!    into reads of at most one staging buffer (holes under [`GAP_BYTES`] read through); large
//!    contiguous host copies are read straight into the destination.
//! 4. **Read** in parallel (`pread`, or ranged GETs bounded by `timeout` on object stores), copy
//!    out of each buffer (memcpy, or host-to-device copies on a side stream while the next reads
//!    fill other buffers), and check CRC-32s as the bytes pass.
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
//! stats count it (`items_unchecked`). On a CRC error the destinations may hold the damaged bytes.

mod plan;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::CudaEvent;
use rayon::prelude::*;

use crate::error::{Error, Result, Stopped};
use crate::format::archive::{stored_tensor_in, HeadTail};
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
/// Buffer size of a load into host memory only (see [`load`]'s choice of buffers).
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
    pub key: String,
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
    pub ptr: u64,
    pub nbytes: u64,
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
    pub requests: usize,
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

/// A needed item: chunk `chunk` of the entry of `key`.
struct Item<'a> {
    key: &'a str,
    chunk: &'a Chunk,
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
}

/// Bytes of a data file whose CRC-32 this load checks: a whole item, or one block of an item's
/// payload.
struct Check<'a> {
    item: usize,
    rec: &'a Recorded,
    range: std::ops::Range<u64>,
    /// The block's index in its payload; None for a whole item.
    block: Option<u64>,
}

/// Where an item's tensor data lies: file byte of element 0, strides in elements, and the file
/// bytes of its storage (the payload a save's block CRC-32s cover).
struct Layout {
    base: u64,
    strides: Vec<u64>,
    payload: std::ops::Range<u64>,
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

/// Validates `reqs` against the checkpoint and returns their pieces.
///
/// Errors: [`Error::MissingKey`]; [`Error::InvalidArgument`] for a byte object, a region outside
/// the global shape or a wrong byte count; [`Error::Validation`] for a region the chunks do not
/// cover.
pub fn plan_pieces(ck: &Checkpoint, reqs: &[Request]) -> Result<Vec<Piece>> {
    let mut indexes: HashMap<&str, ChunkIndex> = HashMap::new();
    let mut pieces = Vec::new();
    for (r, q) in reqs.iter().enumerate() {
        let key = q.key.as_str();
        let Some(entry) = ck.metadata.entries.get(key) else {
            return Err(Error::MissingKey {
                key: key.to_string(),
                dir: ck.dir().to_path_buf(),
            });
        };
        let Entry::Tensor {
            dtype,
            global_shape,
            chunks,
        } = entry
        else {
            return Err(Error::InvalidArgument(format!(
                "{key} is a byte object, not a tensor"
            )));
        };
        let n = global_shape.len();
        let inside = q.offsets.len() == n
            && q.sizes.len() == n
            && (0..n).all(|d| {
                q.offsets[d]
                    .checked_add(q.sizes[d])
                    .is_some_and(|e| e <= global_shape[d])
            });
        if !inside {
            return Err(Error::InvalidArgument(format!(
                "{key}: region {:?}+{:?} is outside the global shape {global_shape:?}",
                q.offsets, q.sizes
            )));
        }
        let want = volume(&q.sizes).and_then(|v| v.checked_mul(dtype.itemsize()));
        if want != Some(q.nbytes) {
            return Err(Error::InvalidArgument(format!(
                "{key}: region {:?} of {} needs {} bytes, the destination has {}",
                q.sizes,
                dtype.torch_name(),
                want.map_or("too many".into(), |w| w.to_string()),
                q.nbytes
            )));
        }
        if q.nbytes > 0 && q.ptr == 0 {
            return Err(Error::InvalidArgument(format!(
                "{key}: null destination pointer"
            )));
        }
        let index = indexes
            .entry(key)
            .or_insert_with(|| ChunkIndex::new(chunks, n));
        plan::pieces_of(key, r, chunks, index, &q.offsets, &q.sizes, &mut pieces)?;
    }
    Ok(pieces)
}

/// Checks that the region `offsets`/`sizes` (elements) of tensor `key` can be read: inside the
/// global shape and covered by the saved chunks, with no overlap. Pure planning, before the
/// caller allocates the destination: a hostile `.metadata` claiming `[3, 4e11]` then gives this
/// error, not an allocation of 1.2e12 elements.
///
/// Errors: as [`plan_pieces`] ([`Error::MissingKey`], [`Error::InvalidArgument`],
/// [`Error::Validation`] for a region not covered).
pub fn check_region(ck: &Checkpoint, key: &str, offsets: &[u64], sizes: &[u64]) -> Result<()> {
    let itemsize = match ck.entry(key)? {
        Entry::Tensor { dtype, .. } => dtype.itemsize(),
        Entry::Bytes { .. } => 1, // plan_pieces names it a byte object
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
    plan_pieces(ck, std::slice::from_ref(&request)).map(|_| ())
}

/// Reads the region `offsets`/`sizes` (elements) of tensor `key` into `out` (C order,
/// `prod(sizes) * itemsize` bytes), assembled from every chunk that overlaps it, through the
/// reader's mapped files (each item checked once per open checkpoint): a one-request load on the
/// calling thread, without staging, for tools (`diff`, `to-hf`, `Checkpoint.read`). The request is
/// validated, and its chunks found, by [`plan_pieces`] before any byte is read.
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
    let pieces = plan_pieces(ck, std::slice::from_ref(&request))?;
    let Entry::Tensor { dtype, .. } = ck.entry(key)? else {
        unreachable!("plan_pieces accepts tensors only")
    };
    let item = dtype.itemsize();
    for p in pieces {
        ck.with_chunk(key, p.chunk, |data, c| {
            let t = &data.tensor;
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
        })?;
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

/// Loads every request (see the module docs). Returns when every host destination is filled and
/// every host-to-device copy has completed and is ordered before `opts.cuda_stream`.
///
/// # Safety
/// Every request's `ptr..ptr+nbytes` must be memory the caller owns (host, or CUDA memory of
/// `device`), stays allocated, and that nothing else reads or writes until this returns.
///
/// Errors: those of [`plan_pieces`]; [`Error::Gpu`] when a CUDA destination is given without a
/// usable CUDA driver, or requests name several devices; [`Error::Corrupt`] naming key, file and
/// offset for a missing or truncated data file, an undecodable item or a CRC-32 mismatch;
/// [`Error::Io`] / [`Error::Remote`].
pub unsafe fn load(ck: &Checkpoint, reqs: &[Request], opts: &LoadOptions) -> Result<LoadStats> {
    let t0 = Instant::now();
    let pieces = plan_pieces(ck, reqs)?;
    let mut devices: Vec<u32> = reqs.iter().filter_map(|r| r.device).collect();
    devices.sort_unstable();
    devices.dedup();
    if devices.len() > 1 {
        return Err(Error::InvalidArgument(format!(
            "requests name CUDA devices {devices:?}; one call loads into one device (and the host)"
        )));
    }
    let device = devices.first().copied();
    if let Some(d) = device {
        if !gpu::available() {
            return Err(Error::Gpu(format!(
                "a destination is on CUDA device {d}, but no CUDA driver or device is usable here"
            )));
        }
    }

    // Items and files.
    let mut items: Vec<Item> = Vec::new();
    let mut item_of: HashMap<(&str, usize), usize> = HashMap::new();
    let mut piece_item = Vec::with_capacity(pieces.len());
    let mut files: Vec<&str> = Vec::new();
    let mut file_of: HashMap<&str, usize> = HashMap::new();
    for p in &pieces {
        let key = reqs[p.req].key.as_str();
        let Some(Entry::Tensor { chunks, .. }) = ck.metadata.entries.get(key) else {
            unreachable!("validated by plan_pieces")
        };
        let id = *item_of.entry((key, p.chunk)).or_insert_with(|| {
            let chunk = &chunks[p.chunk];
            let rel = chunk.storage.relative_path.as_str();
            let nf = files.len();
            let file = *file_of.entry(rel).or_insert(nf);
            if file == nf {
                files.push(rel);
            }
            items.push(Item {
                key,
                chunk,
                file,
                whole: false,
                transformed: ck
                    .metadata
                    .transforms
                    .contains_key(&(key.to_string(), Some(chunk.offsets.clone()))),
                check: None,
                blocks: None,
            });
            items.len() - 1
        });
        let c = items[id].chunk;
        items[id].whole |= p.lo == c.offsets
            && p.hi
                .iter()
                .zip(&c.offsets)
                .zip(&c.sizes)
                .all(|((&h, &o), &n)| h == o + n);
        piece_item.push(id);
    }
    let mut stats = LoadStats {
        requests: reqs.len(),
        ..Default::default()
    };
    for it in items.iter_mut() {
        let rec = ck.placed_record(it.key, Some(&it.chunk.offsets), &it.chunk.storage)?;
        match rec {
            Some(rec) if opts.check_crc && it.whole && !it.transformed => it.check = Some(rec),
            Some(rec)
                if opts.check_crc
                    && !it.transformed
                    && ck.block_bytes().is_some()
                    && !rec.blocks.is_empty() =>
            {
                it.blocks = Some(rec)
            }
            Some(_) if opts.check_crc && !it.whole => stats.items_unchecked += 1,
            _ => {}
        }
    }

    // Open every file and check every item lies inside it, before reading anything.
    let first_item_in = |f: usize| items.iter().find(|i| i.file == f).expect("file of an item");
    let mut handles = Vec::with_capacity(files.len());
    for (f, rel) in files.iter().enumerate() {
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
        handles.push(file.with_timeout(opts.timeout));
    }
    let sizes: Vec<u64> = handles.iter().map(DataSource::len).collect();
    let source = Source {
        ck,
        rels: &files,
        files: handles,
    };
    for it in &items {
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

    let budget = opts.staging_budget.unwrap_or(DEFAULT_LOAD_BUDGET_BYTES);
    if budget == 0 {
        return Err(Error::InvalidArgument(
            "staging_budget_bytes must be > 0 (None: the default)".into(),
        ));
    }
    // Host destinations take large contiguous pieces in place (DIRECT_MIN_BYTES); the buffers
    // only carry strided boxes (a resharded TP slice) and coalesced small reads, so small ones
    // keep a CPU load's extra memory a few percent of what it reads (64 MiB buffers made a
    // resharded CPU load peak 0.27x above the bytes it requested; Megatron's own is 0.07x).
    // CUDA destinations keep large pinned buffers: host-to-device copies want large transfers.
    let buffer = match device {
        Some(_) => DEFAULT_BUFFER_BYTES,
        None => HOST_BUFFER_BYTES,
    };
    let pool = staging::pool(budget, buffer, device)?;
    let max_read = pool.buffer_size as u64;
    // Reads in flight: enough to keep NVMe queues and the page cache's copy busy (16 on a 16-core
    // H200 host reached the disk's sequential ceiling cold and 27 GB/s warm, BENCHMARKS.md), and
    // no more than the pool's buffers, which each read holds (see `Exec::buffer`). A read into
    // CUDA memory also waits for its buffer's earlier host-to-device copy, so there more reads
    // than cores keep the cores copying: 24 on a 16-core H100 host loaded 16.9 GB in 0.459 s
    // against 0.473 s with 16 (BENCHMARKS.md, "GPU load closer to the copy floor").
    let cores = std::thread::available_parallelism().map_or(8, |n| n.get());
    let default_threads = match device {
        Some(_) => (cores * 3 / 2).clamp(4, 24),
        None => cores.clamp(4, 16),
    };
    let threads = opts
        .threads
        .unwrap_or(default_threads)
        .min(pool.capacity())
        .max(1);
    let readers = read_pool(threads)?;
    let counters = Counters::default();

    // Locate the tensor data of every item that is read in place.
    let layouts: Vec<Option<Layout>> = readers.install(|| {
        items
            .par_iter()
            .map(|it| {
                if it.transformed {
                    return Ok(None);
                }
                locate(ck, &source, it, &counters).map(Some)
            })
            .collect::<Result<_>>()
    })?;

    // Box copies, reads.
    let mut copies: Vec<plan::Copy> = Vec::new();
    let mut copy_item: Vec<usize> = Vec::new();
    let mut transformed_pieces = Vec::new();
    for (p, &id) in pieces.iter().zip(&piece_item) {
        let it = &items[id];
        let Some(layout) = &layouts[id] else {
            transformed_pieces.push((p, id));
            continue;
        };
        let Some(Entry::Tensor { dtype, .. }) = ck.metadata.entries.get(it.key) else {
            unreachable!("validated by plan_pieces")
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
            dtype.itemsize(),
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
    let checks = checks(ck, &items, &layouts, &copies, &copy_item)?;
    let items_checked = items
        .iter()
        .filter(|it| it.check.is_some() || it.blocks.is_some())
        .count() as u64;
    // The checked bytes are read too: whole items, and partial reads widened to whole blocks.
    let extra: Vec<(usize, std::ops::Range<u64>)> = checks
        .iter()
        .map(|c| (items[c.item].file, c.range.clone()))
        .collect();
    let host: Vec<bool> = reqs.iter().map(|r| r.device.is_none()).collect();
    let reads = plan::reads(
        &mut copies,
        &extra,
        &host,
        plan::ReadShape {
            max_read,
            gap: GAP_BYTES,
            direct_min: DIRECT_MIN_BYTES,
        },
    );
    // Checked ranges per file, sorted by offset (`checks` is sorted by file, then offset): a read
    // hashes the parts of those it overlaps.
    let checks_by_file: Vec<std::ops::Range<usize>> = (0..files.len())
        .map(|f| {
            let file_of = |c: &Check| items[c.item].file;
            checks.partition_point(|c| file_of(c) < f)..checks.partition_point(|c| file_of(c) <= f)
        })
        .collect();
    stats.plan_seconds = t0.elapsed().as_secs_f64();

    let copier = match device {
        Some(d) => Some(DeviceCopier::new(d, opts.cuda_stream)?),
        None => None,
    };
    let exec = Exec {
        ck,
        reqs,
        items: &items,
        source: &source,
        copies: &copies,
        copy_item: &copy_item,
        checks: &checks,
        checks_by_file: &checks_by_file,
        pool: &pool,
        copier: copier.as_ref(),
        pending: Mutex::new(std::collections::VecDeque::new()),
        counters: &counters,
    };
    // The reads run on the pool while this thread watches for Ctrl-C (a load of hundreds of GB
    // must stop within a read, not at its end): reads not yet started then fail as Interrupted.
    // A Ctrl-C already seen (during planning) stops the load before its first read.
    let (outcome, _) = crate::interrupt::watching(|cancel| {
        readers.install(|| {
            reads
                .par_iter()
                .with_max_len(1)
                .map(|r| {
                    if cancel.load(std::sync::atomic::Ordering::Relaxed) {
                        return Err(Error::Interrupted(Stopped::Load));
                    }
                    exec.read(r)
                })
                .collect::<Result<Vec<Vec<Segment>>>>()
        })
    });
    let outcome = outcome.and_then(|segments| {
        for (p, id) in &transformed_pieces {
            exec.transformed(p, *id)?;
        }
        exec.verify(segments.into_iter().flatten().collect())
    });
    // Copies still in flight read staging buffers and write destinations: always wait for them.
    let finished = match &copier {
        Some(c) => c.finish_into(opts.cuda_stream),
        None => Ok(()),
    };
    // Buffers kept for their copies go back to the pool only now that the copies are done (or
    // failed), so that no other user of the process's pool overwrites one under a copy.
    for (b, _) in exec.pending.lock().unwrap().drain(..) {
        pool.give_back(b);
    }
    outcome?;
    finished?;
    stats.items_checked = items_checked;
    stats.bytes_read = counters.bytes.load(std::sync::atomic::Ordering::Relaxed);
    stats.read_ops = counters.ops.load(std::sync::atomic::Ordering::Relaxed);
    stats.seconds = t0.elapsed().as_secs_f64();
    Ok(stats)
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
    let Some(Entry::Tensor { dtype, .. }) = ck.metadata.entries.get(it.key) else {
        unreachable!("validated by plan_pieces")
    };
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
        let reason = if t.dtype != *dtype {
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
                rec,
                range: s.offset..s.offset + s.length,
                block: None,
            });
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
                rec,
                range: l.payload.start + r.start..l.payload.start + r.end,
                block: Some(b),
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
    items: &'a [Item<'a>],
    source: &'a Source<'a>,
    copies: &'a [plan::Copy],
    copy_item: &'a [usize],
    checks: &'a [Check<'a>],
    /// The indices in `checks` of each file's checks.
    checks_by_file: &'a [std::ops::Range<usize>],
    pool: &'a StagingPool,
    copier: Option<&'a DeviceCopier>,
    /// Staging buffers whose host-to-device copies may still run, oldest first, each with the
    /// event that completes after them. Kept out of the pool until the end of the load.
    pending: Mutex<std::collections::VecDeque<(HostBuffer, CudaEvent)>>,
    counters: &'a Counters,
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
    /// Runs one read and its copy-outs; returns the CRC-32 segments it hashed.
    fn read(&self, r: &plan::Read) -> Result<Vec<Segment>> {
        let len = (r.range.end - r.range.start) as usize;
        // Names the first item the read serves, for a truncation found while reading.
        let what = || match r.copies.first() {
            Some(&c) => {
                let it = &self.items[self.copy_item[c]];
                item_name(it.key, it.chunk)
            }
            None => format!("bytes {}..{} of checked items", r.range.start, r.range.end),
        };
        let mut segments = Vec::new();
        if let Some(ci) = r.direct {
            let c = &self.copies[ci];
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
        let mut uploaded = false;
        for &ci in &r.copies {
            let c = &self.copies[ci];
            let q = &self.reqs[c.req];
            let src = &bytes[(c.copy.src - r.range.start) as usize..];
            // SAFETY: as above; the copy lies inside both the read and the destination.
            unsafe {
                match (q.device, self.copier) {
                    (None, _) => copy_host(&c.copy, src.as_ptr(), q.ptr as *mut u8),
                    (Some(_), Some(copier)) => {
                        upload(copier, &c.copy, src.as_ptr(), q.ptr)?;
                        uploaded = true;
                    }
                    (Some(_), None) => unreachable!("a copier exists for device requests"),
                }
            }
        }
        if uploaded {
            let copier = self.copier.expect("uploaded");
            let ev = copier.record()?;
            match &mut buf {
                Buf::Pooled(_, b) => {
                    let b = b.take().expect("held");
                    self.pending.lock().unwrap().push_back((b, ev));
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
        let kept = self.pending.lock().unwrap().pop_front();
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
    fn hash(
        &self,
        file: usize,
        range: &std::ops::Range<u64>,
        bytes: &[u8],
        out: &mut Vec<Segment>,
    ) {
        let ids = self.checks_by_file[file].clone();
        let checks = &self.checks[ids.clone()];
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
        let Some(Entry::Tensor { dtype, chunks, .. }) = self.ck.metadata.entries.get(it.key) else {
            unreachable!("validated by plan_pieces")
        };
        let index = chunks
            .iter()
            .position(|c| std::ptr::eq(c, it.chunk))
            .expect("chunk of its entry");
        let (data, c) = self.ck.chunk(it.key, index)?;
        let item = dtype.itemsize();
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
            match (q.device, self.copier) {
                (Some(_), Some(copier)) => {
                    upload(copier, &bc, boxed.as_ptr(), q.ptr)?;
                    gpu::wait(&copier.record()?)?; // `boxed` is freed on return
                }
                _ => copy_host(&bc, boxed.as_ptr(), q.ptr as *mut u8),
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
        for (k, c) in self.checks.iter().enumerate() {
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
            let key = self.items[c.item].key;
            assert_eq!(next, c.range.end, "CRC segments tile {key}");
            match c.block {
                None => self.ck.check_crc(c.rec, crc.finalize())?,
                Some(b) => self
                    .ck
                    .check_block_crc(c.rec, b, c.range.clone(), crc.finalize())?,
            }
        }
        Ok(())
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
    use crate::format::dtype::DType;
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
        let mut buf = vec![0u8; 48];
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
}
