//! Writes one rank's items into its `.distcp` data file: every tensor chunk and byte object becomes
//! a self-contained torch.save archive at a precomputed offset (torch's `filesystem.py`
//! `_write_item`), byte objects first, then tensors, as torch's `_write_files_from_queue` orders
//! them. Payloads are split into pieces that rayon copies with positioned writes while computing
//! their CRC-32s; the CRCs are combined per archive and the archive tails written last. On request,
//! the SHA-256 of the whole file is computed from the bytes as they are written (never read back):
//! see [`InOrder`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Condvar, Mutex};

use rayon::prelude::*;

use crate::blockcrc::{hash_piece, PayloadCrc, PieceCrc};

use crate::error::{Error, Result, Stopped};
use crate::format::dtype::DType;
use crate::format::zip::ArchiveLayout;
use crate::staging::{HostBuffer, StagingPool};
use crate::storage::remote::Upload;
use crate::storage::{DataFile, DataSink};

/// Payload bytes per parallel write task.
const PIECE_BYTES: usize = 8 << 20;

/// One local chunk of a tensor to save.
pub struct TensorChunk<'a> {
    /// DCP key (Megatron's ShardedTensor `key`).
    pub fqn: String,
    /// dtype of the elements.
    pub dtype: DType,
    /// Global shape in elements, including prepended axes.
    pub global_shape: Vec<u64>,
    /// Global offsets of this chunk in elements, one per dimension.
    pub offsets: Vec<u64>,
    /// Chunk shape in elements (prepended axes of size 1 included).
    pub sizes: Vec<u64>,
    /// The chunk's elements, contiguous, little-endian, `prod(sizes) * itemsize` bytes.
    pub data: Payload<'a>,
}

/// Where a chunk's bytes are.
#[derive(Clone, Copy, Debug)]
pub enum Payload<'a> {
    /// Host memory.
    Host(&'a [u8]),
    /// `len` bytes at device address `ptr` on CUDA device `device`; read through staging only.
    Device {
        /// CUDA device address of the first byte.
        ptr: u64,
        /// Size in bytes.
        len: u64,
        /// CUDA device ordinal.
        device: u32,
    },
}

impl Payload<'_> {
    /// Size in bytes.
    pub fn len(&self) -> u64 {
        match self {
            Payload::Host(b) => b.len() as u64,
            Payload::Device { len, .. } => *len,
        }
    }

    /// Whether the payload holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One byte object to save: `bytes` must already be a complete torch.save archive
/// (torch's `DefaultSavePlanner.transform_object` saves each with `torch.save`); `fqn` is its DCP
/// key (Megatron's ShardedObject `unique_key`).
pub struct ByteObject<'a> {
    /// DCP key (Megatron's ShardedObject `unique_key`).
    pub fqn: String,
    /// The complete torch.save archive.
    pub bytes: &'a [u8],
}

/// Where one item landed: byte `offset` and `length` in the file, and the CRC-32 of its bytes
/// (recorded in the part and the checksum sidecar; DCP itself has no checksum).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placed {
    /// Byte offset of the item in the file.
    pub offset: u64,
    /// Length of the item in bytes.
    pub length: u64,
    pub(crate) crc32: u32,
    /// CRC-32s of the blocks of a tensor's payload ([`crate::blockcrc`]); empty for objects.
    pub blocks: Vec<u32>,
}

/// Where each item landed, tensors then objects in input order.
pub struct Written {
    /// Each tensor chunk's place, in input order.
    pub tensors: Vec<Placed>,
    /// Each byte object's place, in input order.
    pub objects: Vec<Placed>,
    pub(crate) file_size: u64,
    /// SHA-256 of the whole file, when asked for (`digest`).
    pub sha256: Option<[u8; 32]>,
}

/// The file's bytes fed in file order as they are written: the running payload and block CRC-32s
/// of each tensor (an archive tail holds its payload's CRC, so it is known once the payload has passed)
/// and, when asked for, the SHA-256 of the whole file, for megatron-core 0.19's integrity manifest
/// (`integrity.json`, see [`crate::commit::manifest`]). SHA-256 cannot be combined from pieces as CRC-32
/// can, hence the order.
struct InOrder {
    sha: Option<sha2::Sha256>,
    payload_crc: Vec<PayloadCrc>,
    suffixes: Vec<Option<Vec<u8>>>,
}

impl InOrder {
    fn new(tensors: usize, digest: bool) -> InOrder {
        use sha2::Digest;
        InOrder {
            sha: digest.then(sha2::Sha256::new),
            payload_crc: vec![PayloadCrc::default(); tensors],
            suffixes: vec![None; tensors],
        }
    }

    /// Feeds the next segment of the file; `bytes` are its bytes, except for an archive tail,
    /// which this fills in (a window leaves tails as zeros, [`fill_window`]).
    fn feed(&mut self, lay: &FileLayout, seg: &Segment, bytes: &mut [u8]) {
        if let Fill::Hole { item, at } = seg.fill {
            let tail = self.tail(lay, item, at, seg.len);
            bytes.copy_from_slice(tail);
        }
        self.feed_bytes(seg, bytes);
    }

    /// [`InOrder::feed`] for a segment whose bytes are the caller's (read only), or a tail.
    fn feed_ref(&mut self, lay: &FileLayout, seg: &Segment, bytes: &[u8]) {
        match seg.fill {
            Fill::Hole { item, at } => {
                let tail = self.tail(lay, item, at, seg.len).to_vec();
                self.feed_bytes(seg, &tail);
            }
            _ => self.feed_bytes(seg, bytes),
        }
    }

    fn feed_bytes(&mut self, seg: &Segment, bytes: &[u8]) {
        use sha2::Digest;
        if let Some((item, _)) = seg.payload {
            self.payload_crc[item].update(bytes);
        }
        if let Some(sha) = &mut self.sha {
            sha.update(bytes);
        }
    }

    /// Bytes `at..at + len` of tensor `item`'s archive tail; its payload must have been fed.
    fn tail(&mut self, lay: &FileLayout, item: usize, at: u64, len: usize) -> &[u8] {
        let crc = self.payload_crc[item].payload();
        let suffix = self.suffixes[item]
            .get_or_insert_with(|| lay.layouts[item].suffix(crc.clone().finalize()));
        &suffix[at as usize..at as usize + len]
    }

    fn sha256(self) -> Option<[u8; 32]> {
        use sha2::Digest;
        self.sha.map(|s| s.finalize().into())
    }
}

/// SHA-256 of the file [`write_direct`] writes, from the same host bytes in file order (run beside
/// the parallel writes). None when a payload is in device memory (the write refuses it anyway).
fn digest_direct(
    tensors: &[TensorChunk],
    objects: &[&ByteObject],
    lay: &FileLayout,
) -> Option<[u8; 32]> {
    let mut order = InOrder::new(tensors.len(), true);
    for seg in plan_windows(tensors, objects, lay, lay.total.max(1))
        .iter()
        .flatten()
    {
        match seg.fill {
            Fill::Bytes(b) => order.feed_ref(lay, seg, b),
            Fill::Hole { .. } => order.feed_ref(lay, seg, &[]),
            Fill::Device { .. } => return None,
        }
    }
    order.sha256()
}

/// Checks a chunk's dtype, shapes and byte count.
///
/// Errors: [`Error::UnsupportedDtype`], [`Error::InvalidArgument`] naming the key.
pub fn check_chunk(c: &TensorChunk) -> Result<()> {
    if !c.dtype.writable() {
        return Err(Error::UnsupportedDtype(c.dtype.torch_name().to_string()));
    }
    let n = c.global_shape.len();
    if c.offsets.len() != n || c.sizes.len() != n {
        return Err(Error::InvalidArgument(format!(
            "{}: global_shape {:?}, offsets {:?} and sizes {:?} must have the same number of dimensions",
            c.fqn, c.global_shape, c.offsets, c.sizes
        )));
    }
    let expect = c
        .sizes
        .iter()
        .try_fold(c.dtype.itemsize(), |acc, &s| acc.checked_mul(s));
    if expect != Some(c.data.len()) {
        return Err(Error::InvalidArgument(format!(
            "{}: chunk of shape {:?} and dtype {} needs {:?} bytes, got {}",
            c.fqn,
            c.sizes,
            c.dtype.torch_name(),
            expect,
            c.data.len()
        )));
    }
    Ok(())
}

/// How to stage payloads through host buffers (required for device payloads; for host payloads it
/// lets the caller reuse its memory as soon as `on_staged` runs).
pub struct Staging<'s> {
    /// The host buffers payloads are staged through.
    pub pool: &'s crate::staging::StagingPool,
    /// The caller's current CUDA stream per device (`CUstream` as an integer).
    pub caller_streams: &'s std::collections::HashMap<u32, u64>,
    /// Called once every payload byte has been copied into host buffers; from then on the writer no
    /// longer reads the caller's memory.
    pub on_staged: Option<Box<dyn FnOnce() + Send + 's>>,
}

/// How [`write_rank`] writes, besides what.
#[derive(Clone, Copy)]
pub struct WriteOptions<'a> {
    /// Makes the archives' `serialization_id`s distinct per rank.
    pub seed: u64,
    /// Compute [`Written::sha256`].
    pub digest: bool,
    /// Set on Ctrl-C ([`crate::interrupt::watching`]): the write stops at its next piece or
    /// window with [`Error::Interrupted`].
    pub stop: &'a AtomicBool,
}

/// [`Error::Interrupted`] once `stop` is set. One relaxed load: checked before every piece or
/// window, on the hot path.
fn check_stop(stop: &AtomicBool) -> Result<()> {
    match stop.load(Ordering::Relaxed) {
        true => Err(Error::Interrupted(Stopped::Commit)),
        false => Ok(()),
    }
}

/// Writes all items of one rank into `sink` (a new data file, [`crate::storage::Location::create_data`]),
/// durably. Without `staging`,
/// host payloads are written straight from the caller's memory; with it, payloads go through the
/// staging pool (required for device payloads). With `how.digest`, [`Written::sha256`] is the file's
/// SHA-256, computed from the bytes written (host memory or staging buffers, in file order), not by
/// reading the file back. The bytes are the same on every sink: see [`write_positioned`] and
/// [`write_stream`] for how each is filled.
///
/// Errors: [`Error::InvalidArgument`] for malformed chunks or device payloads without staging,
/// [`Error::Gpu`] for CUDA failures, [`Error::Io`] for any write failure (including a full disk at
/// preallocation), [`Error::Remote`] for upload failures (the upload is aborted),
/// [`Error::Interrupted`] when `how.stop` was set (the file is left partial, the upload aborted).
pub fn write_rank(
    sink: DataSink,
    tensors: &[TensorChunk],
    objects: &[&ByteObject],
    staging: Option<Staging>,
    how: WriteOptions,
) -> Result<Written> {
    match sink {
        DataSink::Positioned(file) => write_positioned(&file, tensors, objects, staging, how),
        DataSink::Stream(upload) => {
            let part_bytes = upload.part_bytes();
            write_stream(upload, part_bytes, tensors, objects, staging, how)
        }
    }
}

/// [`write_rank`] into a local file: it is preallocated, then objects, archive heads and payload
/// pieces are written by parallel positioned writes, and the archive tails last (once their
/// payload's CRC-32 is combined from its pieces'); then fsync.
fn write_positioned(
    file: &DataFile,
    tensors: &[TensorChunk],
    objects: &[&ByteObject],
    staging: Option<Staging>,
    how: WriteOptions,
) -> Result<Written> {
    let lay = FileLayout::new(how.seed, tensors, objects)?;
    file.reserve(lay.total)?;
    let (mut pieces, sha256) = match staging {
        None if how.digest => {
            let (pieces, sha) = rayon::join(
                || write_direct(file, tensors, objects, &lay, how.stop),
                || digest_direct(tensors, objects, &lay),
            );
            (pieces?, sha)
        }
        None => (write_direct(file, tensors, objects, &lay, how.stop)?, None),
        Some(st) => write_staged(file, tensors, objects, &lay, st, how)?,
    };

    // Combine piece CRCs in payload order and write the archive tails.
    pieces.sort_unstable_by_key(|p| (p.item, p.at));
    let mut per_item = vec![PayloadCrc::default(); tensors.len()];
    for p in &pieces {
        per_item[p.item].add_piece(p);
    }
    let tensor_crcs = per_item
        .into_par_iter()
        .enumerate()
        .map(|(i, payload)| {
            let l = &lay.layouts[i];
            let tail_at = lay.tensor_pos[i].0 + l.prefix.len() as u64 + l.payload_len;
            let suffix = l.suffix(payload.payload().clone().finalize());
            file.write_at(&suffix, tail_at)?;
            Ok((item_crc(l, payload.payload(), &suffix), payload.finish()))
        })
        .collect::<Result<Vec<(u32, Vec<u32>)>>>()?;
    file.sync()?;
    Ok(lay.written(objects, tensor_crcs, sha256))
}

/// [`write_rank`] into an object-store upload: the same bytes as [`write_positioned`], strictly in
/// file order, one window after the other, as the parts of the upload: archive tails are filled in as their window is
/// built, since every payload byte before a tail has been CRC'd by then. Windows are
/// `part_bytes` long, or the staging buffer size when staging; windows are gathered into parts of
/// at least `part_bytes` (all but the last), and a file of one part is a single PUT. Parts upload
/// concurrently (see [`Upload`](crate::storage::remote::Upload)) while the next window is filled;
/// a staged window is copied out of its pinned buffer, so buffers return to the pool at once.
///
fn write_stream(
    mut upload: Upload,
    part_bytes: usize,
    tensors: &[TensorChunk],
    objects: &[&ByteObject],
    staging: Option<Staging>,
    how: WriteOptions,
) -> Result<Written> {
    let lay = FileLayout::new(how.seed, tensors, objects)?;
    let bsize = staging
        .as_ref()
        .map_or(part_bytes, |st| st.pool.buffer_size) as u64;
    let plan = plan_windows(tensors, objects, &lay, bsize);
    let mut order = InOrder::new(tensors.len(), how.digest);
    let mut copiers = std::collections::HashMap::new();
    let (pool, streams) = match &staging {
        Some(st) => (Some(st.pool), Some(st.caller_streams)),
        None => (None, None),
    };
    // Windows are built straight into the part being gathered: one copy out of a pinned buffer,
    // none for host data.
    let mut pending: Vec<u8> = Vec::new();
    let mut multipart = false;
    for segs in &plan {
        // Dropping `upload` on the way out aborts it.
        check_stop(how.stop)?;
        let used = segs.last().map_or(0, |s| s.buf_at + s.len);
        let start = pending.len();
        match pool {
            Some(pool) => {
                let mut buf = pool.take();
                let filled = (|| {
                    let events = fill_window(segs, buf.as_mut_slice(), &mut copiers, streams)?;
                    for e in &events {
                        crate::gpu::wait(e)?;
                    }
                    pending.extend_from_slice(&buf.as_slice()[..used]);
                    Ok(())
                })();
                pool.give_back(buf);
                filled?;
            }
            None => {
                pending.resize(start + used, 0);
                fill_window(segs, &mut pending[start..], &mut copiers, None)?;
            }
        }
        let window = &mut pending[start..];
        for seg in segs {
            order.feed(&lay, seg, &mut window[seg.buf_at..seg.buf_at + seg.len]);
        }
        if pending.len() >= part_bytes {
            upload.part(std::mem::take(&mut pending))?;
            multipart = true;
        }
    }
    if let Some(f) = staging.and_then(|st| st.on_staged) {
        f();
    }
    if !multipart {
        upload.single(pending)?;
    } else {
        if !pending.is_empty() {
            upload.part(pending)?;
        }
        upload.finish()?;
    }
    let tensor_crcs = (0..tensors.len())
        .map(|i| {
            let suffix = order.suffixes[i].take().unwrap_or_default();
            let payload = std::mem::take(&mut order.payload_crc[i]);
            (
                item_crc(&lay.layouts[i], payload.payload(), &suffix),
                payload.finish(),
            )
        })
        .collect();
    Ok(lay.written(objects, tensor_crcs, order.sha256()))
}

/// CRC-32 of a whole tensor item: archive head, payload, tail.
fn item_crc(l: &ArchiveLayout, payload: &crc32fast::Hasher, suffix: &[u8]) -> u32 {
    let mut item = crc32fast::Hasher::new();
    item.update(&l.prefix);
    item.combine(payload);
    item.update(suffix);
    item.finalize()
}

/// Where every item of a rank's file goes: byte objects first, then one torch.save archive per
/// tensor chunk; offsets and lengths in bytes.
struct FileLayout {
    object_pos: Vec<(u64, u64)>,
    layouts: Vec<ArchiveLayout>,
    tensor_pos: Vec<(u64, u64)>,
    total: u64,
}

impl FileLayout {
    /// `seed` makes the archives' `serialization_id`s distinct per rank.
    fn new(seed: u64, tensors: &[TensorChunk], objects: &[&ByteObject]) -> Result<FileLayout> {
        for t in tensors {
            check_chunk(t)?;
        }
        let mut cursor = 0u64;
        let mut object_pos = Vec::with_capacity(objects.len());
        for o in objects {
            object_pos.push((cursor, o.bytes.len() as u64));
            cursor += o.bytes.len() as u64;
        }
        let mut layouts = Vec::with_capacity(tensors.len());
        let mut tensor_pos = Vec::with_capacity(tensors.len());
        for (i, t) in tensors.iter().enumerate() {
            let id = format!("{:040}", ((seed as u128) << 64) | i as u128);
            let l = ArchiveLayout::for_tensor(t.dtype, &t.sizes, &id);
            tensor_pos.push((cursor, l.len()));
            cursor += l.len();
            layouts.push(l);
        }
        Ok(FileLayout {
            object_pos,
            layouts,
            tensor_pos,
            total: cursor,
        })
    }

    fn written(
        &self,
        objects: &[&ByteObject],
        tensor_crcs: Vec<(u32, Vec<u32>)>,
        sha256: Option<[u8; 32]>,
    ) -> Written {
        let place = |&(offset, length): &(u64, u64), (crc32, blocks)| Placed {
            offset,
            length,
            crc32,
            blocks,
        };
        Written {
            tensors: self
                .tensor_pos
                .iter()
                .zip(tensor_crcs)
                .map(|(p, c)| place(p, c))
                .collect(),
            objects: self
                .object_pos
                .iter()
                .zip(objects)
                .map(|(p, o)| place(p, (crc32fast::hash(o.bytes), Vec::new())))
                .collect(),
            file_size: self.total,
            sha256,
        }
    }
}

/// Objects, archive heads and host payload pieces, all written in parallel from where they are.
fn write_direct(
    file: &DataFile,
    tensors: &[TensorChunk],
    objects: &[&ByteObject],
    lay: &FileLayout,
    stop: &AtomicBool,
) -> Result<Vec<PieceCrc>> {
    let (object_pos, layouts, tensor_pos) = (&lay.object_pos, &lay.layouts, &lay.tensor_pos);
    enum Task<'a> {
        Raw(&'a [u8], u64),
        Piece {
            item: usize,
            bytes: &'a [u8],
            payload_at: u64,
            at: u64,
        },
    }
    let mut tasks: Vec<Task> = Vec::new();
    for (o, &(at, _)) in objects.iter().zip(object_pos) {
        tasks.push(Task::Raw(o.bytes, at));
    }
    for (i, (t, l)) in tensors.iter().zip(layouts).enumerate() {
        let at = tensor_pos[i].0;
        tasks.push(Task::Raw(&l.prefix, at));
        let Payload::Host(data) = t.data else {
            return Err(Error::InvalidArgument(format!(
                "{}: device memory can only be saved through staging",
                t.fqn
            )));
        };
        let base = at + l.prefix.len() as u64;
        for (k, piece) in data.chunks(PIECE_BYTES).enumerate() {
            let payload_at = (k * PIECE_BYTES) as u64;
            tasks.push(Task::Piece {
                item: i,
                bytes: piece,
                payload_at,
                at: base + payload_at,
            });
        }
    }
    let pieces = tasks
        .par_iter()
        .map(|task| -> Result<Option<PieceCrc>> {
            check_stop(stop)?;
            match task {
                Task::Raw(bytes, at) => file.write_at(bytes, *at).map(|_| None),
                Task::Piece {
                    item,
                    bytes,
                    payload_at,
                    at,
                } => {
                    let crc = hash_piece(*item, *payload_at, bytes);
                    file.write_at(bytes, *at)?;
                    Ok(Some(crc))
                }
            }
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(pieces.into_iter().flatten().collect())
}

/// What fills part of a staging window.
enum Fill<'a> {
    /// Bytes we own or the caller's host memory.
    Bytes(&'a [u8]),
    /// Device memory of one tensor payload.
    Device { ptr: u64, device: u32 },
    /// Bytes `at..` of tensor `item`'s archive tail, known once its payload CRC is; left as zeros
    /// by [`fill_window`].
    Hole { item: usize, at: u64 },
}

/// One part of a window: `len` bytes at `buf_at` in the buffer; `payload` names the tensor and the
/// offset in its payload when the bytes are payload (their CRC is taken).
struct Segment<'a> {
    buf_at: usize,
    len: usize,
    fill: Fill<'a>,
    payload: Option<(usize, u64)>,
}

/// Cuts the file into windows of `bsize` bytes, in file order, and lists what fills each.
fn plan_windows<'a>(
    tensors: &'a [TensorChunk],
    objects: &'a [&ByteObject],
    lay: &'a FileLayout,
    bsize: u64,
) -> Vec<Vec<Segment<'a>>> {
    // The file as a list of (file offset, len, fill, payload position), in order.
    let mut parts: Vec<(u64, u64, Fill, Option<(usize, u64)>)> = Vec::new();
    for (o, &(at, len)) in objects.iter().zip(&lay.object_pos) {
        parts.push((at, len, Fill::Bytes(o.bytes), None));
    }
    for (i, (t, l)) in tensors.iter().zip(&lay.layouts).enumerate() {
        let at = lay.tensor_pos[i].0;
        parts.push((at, l.prefix.len() as u64, Fill::Bytes(&l.prefix), None));
        let fill = match t.data {
            Payload::Host(b) => Fill::Bytes(b),
            Payload::Device { ptr, device, .. } => Fill::Device { ptr, device },
        };
        parts.push((
            at + l.prefix.len() as u64,
            l.payload_len,
            fill,
            Some((i, 0)),
        ));
        parts.push((
            at + l.prefix.len() as u64 + l.payload_len,
            l.len() - l.prefix.len() as u64 - l.payload_len,
            Fill::Hole { item: i, at: 0 },
            None,
        ));
    }
    let windows = lay.total.div_ceil(bsize);
    let mut plan: Vec<Vec<Segment>> = (0..windows).map(|_| Vec::new()).collect();
    for (at, len, fill, payload) in parts {
        let mut done = 0u64;
        while done < len {
            let pos = at + done;
            let w = pos / bsize;
            let n = (len - done).min((w + 1) * bsize - pos);
            let piece = match &fill {
                Fill::Bytes(b) => Fill::Bytes(&b[done as usize..(done + n) as usize]),
                Fill::Device { ptr, device } => Fill::Device {
                    ptr: ptr + done,
                    device: *device,
                },
                Fill::Hole { item, .. } => Fill::Hole {
                    item: *item,
                    at: done,
                },
            };
            plan[w as usize].push(Segment {
                buf_at: (pos - w * bsize) as usize,
                len: n as usize,
                fill: piece,
                payload: payload.map(|(i, _)| (i, done)),
            });
            done += n;
        }
    }
    plan
}

/// Fills one window's buffer: host bytes copied now, device bytes queued on per-device side
/// streams (ordered after the caller's streams). Returns one event per device used; the window's
/// bytes are valid once they have completed.
fn fill_window(
    segs: &[Segment],
    dst: &mut [u8],
    copiers: &mut std::collections::HashMap<u32, crate::gpu::DeviceCopier>,
    caller_streams: Option<&std::collections::HashMap<u32, u64>>,
) -> Result<Vec<cudarc::driver::CudaEvent>> {
    let mut devices: Vec<u32> = Vec::new();
    for seg in segs {
        let out = &mut dst[seg.buf_at..seg.buf_at + seg.len];
        match &seg.fill {
            Fill::Bytes(b) => out.copy_from_slice(b),
            Fill::Hole { .. } => out.fill(0),
            Fill::Device { ptr, device } => {
                let Some(streams) = caller_streams else {
                    return Err(Error::InvalidArgument(
                        "device memory can only be saved through staging".into(),
                    ));
                };
                if !copiers.contains_key(device) {
                    let stream = streams.get(device).copied().unwrap_or(0);
                    copiers.insert(*device, crate::gpu::DeviceCopier::new(*device, stream)?);
                }
                // SAFETY: the caller keeps the tensors alive and unmodified until on_staged;
                // `out` is part of a buffer that stays lent to this save until the window's
                // events have been waited for.
                unsafe { copiers[device].copy(out, *ptr)? };
                if !devices.contains(device) {
                    devices.push(*device);
                }
            }
        }
    }
    devices.iter().map(|d| copiers[d].record()).collect()
}

/// The file is cut into windows of one buffer each, in file order, so each buffer becomes one
/// large positioned write however small the items in it are. The caller's thread fills buffers
/// ([`Stager::stage`]) while writer threads wait for each buffer's copies, CRC its payload bytes
/// and write it ([`Writers::run`]). With `digest`, each writer then feeds its window to the file's
/// SHA-256 when the windows before it have been fed (windows are handed out in file order, so the
/// next one is always held by a writer), and returns the digest.
fn write_staged(
    file: &DataFile,
    tensors: &[TensorChunk],
    objects: &[&ByteObject],
    lay: &FileLayout,
    st: Staging,
    how: WriteOptions,
) -> Result<(Vec<PieceCrc>, Option<[u8; 32]>)> {
    let bsize = st.pool.buffer_size as u64;
    let plan = plan_windows(tensors, objects, lay, bsize);
    let workers = std::thread::available_parallelism()
        .map_or(4, |n| n.get())
        .clamp(2, 8);
    let (tx, rx) = mpsc::channel::<Filled>();
    let rx = Mutex::new(rx);
    let mut stager = Stager {
        pool: st.pool,
        caller_streams: st.caller_streams,
        // When the whole file fits in the pool, writing starts only once everything is staged:
        // the caller's stall is then the copy time alone, without writers competing for memory
        // bandwidth and the driver. Otherwise buffers must be written to be reused, so writes
        // overlap copies.
        defer: plan.len() <= st.pool.capacity(),
        held: Vec::new(),
        copiers: HashMap::new(),
        stop: how.stop,
    };
    let writers = Writers {
        file,
        plan: &plan,
        lay,
        bsize,
        pool: st.pool,
        digest: how.digest,
        stop: how.stop,
        turn: (
            Mutex::new(Turn {
                next: 0,
                order: InOrder::new(tensors.len(), how.digest),
                failed: false,
            }),
            Condvar::new(),
        ),
    };
    let result: Result<Vec<PieceCrc>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| scope.spawn(|| writers.run(&rx)))
            .collect();
        let produce = stager.stage(&plan, &tx);
        if matches!(produce, Ok(true)) {
            if let Some(f) = st.on_staged {
                f();
            }
        }
        drop(tx);
        join_writers(handles, produce.err())
    });
    let sha256 = how
        .digest
        .then(|| writers.turn.0.into_inner().unwrap().order.sha256())
        .flatten();
    Ok((result?, sha256))
}

/// A filled staging buffer on its way to a writer: window `w` of the plan, whose first `used`
/// bytes are valid once `events` have completed.
struct Filled {
    w: u64,
    buf: HostBuffer,
    used: usize,
    events: Vec<cudarc::driver::CudaEvent>,
}

/// The caller's side of [`write_staged`]: fills staging buffers in file order.
struct Stager<'s> {
    pool: &'s StagingPool,
    caller_streams: &'s HashMap<u32, u64>,
    /// Hold every filled buffer until all are staged, then hand them out.
    defer: bool,
    held: Vec<Filled>,
    copiers: HashMap<u32, crate::gpu::DeviceCopier>,
    /// [`WriteOptions::stop`].
    stop: &'s AtomicBool,
}

impl Stager<'_> {
    /// Fills every window of `plan` and sends it to the writers, in file order; returns once every
    /// copy has landed (true), or early when the writers stopped on an error, which they report
    /// (false).
    ///
    /// Errors: as [`fill_window`], CUDA errors waiting for the copies, [`Error::Interrupted`].
    fn stage(&mut self, plan: &[Vec<Segment>], tx: &mpsc::Sender<Filled>) -> Result<bool> {
        for (w, segs) in plan.iter().enumerate() {
            check_stop(self.stop)?;
            let mut buf = self.pool.take();
            let used = segs.last().map_or(0, |s| s.buf_at + s.len);
            let events = fill_window(
                segs,
                buf.as_mut_slice(),
                &mut self.copiers,
                Some(self.caller_streams),
            )?;
            let filled = Filled {
                w: w as u64,
                buf,
                used,
                events,
            };
            if self.defer {
                self.held.push(filled);
            } else if tx.send(filled).is_err() {
                return Ok(false); // writers stopped on an error, reported below
            }
        }
        // Every copy has landed once each side stream has drained.
        for c in self.copiers.values() {
            crate::gpu::wait(&c.record()?)?;
        }
        for filled in self.held.drain(..) {
            if tx.send(filled).is_err() {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// Whose turn it is to feed the file's SHA-256: the next window to feed, the digest state, and
/// whether a writer failed (then nobody feeds, and nobody waits any longer).
struct Turn {
    next: u64,
    order: InOrder,
    failed: bool,
}

/// What the writer threads of [`write_staged`] share.
struct Writers<'a> {
    file: &'a DataFile,
    plan: &'a [Vec<Segment<'a>>],
    lay: &'a FileLayout,
    bsize: u64,
    pool: &'a StagingPool,
    digest: bool,
    /// [`WriteOptions::stop`].
    stop: &'a AtomicBool,
    /// The [`Turn`] and its wake-up.
    turn: (Mutex<Turn>, Condvar),
}

impl Writers<'_> {
    /// One writer thread: takes filled windows until the channel closes, writes each (after its
    /// copies) and gives its buffer back. After a failure it writes nothing more but still takes
    /// windows, so the stager never blocks on a full pool. Returns its pieces' CRC-32s or its
    /// first error.
    fn run(&self, rx: &Mutex<mpsc::Receiver<Filled>>) -> Result<Vec<PieceCrc>> {
        let mut crcs = Vec::new();
        let mut first_err = None;
        loop {
            let msg = rx.lock().unwrap().recv();
            let Ok(filled) = msg else {
                break;
            };
            if first_err.is_none() {
                if let Err(e) = self.write(&filled, &mut crcs) {
                    first_err = Some(e);
                }
            }
            if self.digest {
                self.feed_in_turn(&filled, first_err.is_some());
            }
            self.pool.give_back(filled.buf);
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(crcs),
        }
    }

    /// Waits for a window's copies, takes the CRC-32s of its payload pieces and writes it; on
    /// Ctrl-C writes nothing (deferred windows are all written after staging, so the stager's
    /// check alone would not stop them).
    fn write(&self, filled: &Filled, crcs: &mut Vec<PieceCrc>) -> Result<()> {
        check_stop(self.stop)?;
        for e in &filled.events {
            crate::gpu::wait(e)?;
        }
        let bytes = &filled.buf.as_slice()[..filled.used];
        for seg in &self.plan[filled.w as usize] {
            if let Some((item, off)) = seg.payload {
                let b = &bytes[seg.buf_at..seg.buf_at + seg.len];
                crcs.push(hash_piece(item, off, b));
            }
        }
        self.file.write_at(bytes, filled.w * self.bsize)
    }

    /// Feeds a window to the file's SHA-256 once the windows before it have been fed; a writer
    /// that `failed` instead stops everyone waiting.
    fn feed_in_turn(&self, filled: &Filled, failed: bool) {
        let (lock, wake) = &self.turn;
        let mut g = lock.lock().unwrap();
        while g.next != filled.w && !g.failed {
            g = wake.wait(g).unwrap();
        }
        if failed {
            g.failed = true; // nobody will feed this window: stop waiting for it
        } else if !g.failed {
            let bytes = &filled.buf.as_slice()[..filled.used];
            for seg in &self.plan[filled.w as usize] {
                let b = &bytes[seg.buf_at..seg.buf_at + seg.len];
                g.order.feed_ref(self.lay, seg, b);
            }
            g.next += 1;
        }
        wake.notify_all();
    }
}

/// Joins the writer threads and gathers their pieces' CRC-32s; the error is the stager's
/// (`staged`) if any, else the first writer's.
fn join_writers(
    handles: Vec<std::thread::ScopedJoinHandle<Result<Vec<PieceCrc>>>>,
    staged: Option<Error>,
) -> Result<Vec<PieceCrc>> {
    let mut pieces = Vec::new();
    let mut err = staged;
    for h in handles {
        match h.join().expect("writer thread panicked") {
            Ok(c) => pieces.extend(c),
            Err(e) => err = err.or(Some(e)),
        }
    }
    match err {
        Some(e) => Err(e),
        None => Ok(pieces),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::Digest;

    /// A local data file at `path` as a sink.
    fn sink(path: &std::path::Path) -> DataSink<'static> {
        DataSink::Positioned(DataFile::create_empty(path).unwrap())
    }

    /// An upload of object `f` at `loc`, an object store.
    fn upload(loc: &crate::storage::Location) -> Upload<'_> {
        match loc.create_data("f").unwrap() {
            DataSink::Stream(u) => u,
            DataSink::Positioned(_) => panic!("{loc} is an object store"),
        }
    }

    /// Seed 1, `digest` as given, never stopped.
    fn how(digest: bool) -> WriteOptions<'static> {
        static GO: AtomicBool = AtomicBool::new(false);
        WriteOptions {
            seed: 1,
            digest,
            stop: &GO,
        }
    }

    /// One whole 1-D uint8 tensor `t{i}` per buffer.
    fn uint8_chunks(data: &[Vec<u8>]) -> Vec<TensorChunk<'_>> {
        data.iter()
            .enumerate()
            .map(|(i, d)| TensorChunk {
                fqn: format!("t{i}"),
                dtype: DType::from_torch_name("torch.uint8").unwrap(),
                global_shape: vec![d.len() as u64],
                offsets: vec![0],
                sizes: vec![d.len() as u64],
                data: Payload::Host(d),
            })
            .collect()
    }

    /// The block CRC-32s each write path records are those of the payload's 1 MiB blocks as they
    /// lie in the file (direct pieces, staging windows of 4 KiB and 3 MiB, object-store parts),
    /// the last block short, none for an empty tensor.
    #[test]
    fn block_crcs_are_those_of_the_payload_blocks_in_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let b = crate::blockcrc::BLOCK_BYTES as usize;
        let data: Vec<Vec<u8>> = [2 * b + 1000, 0, b]
            .iter()
            .map(|&n| (0..n).map(|k| (k * 13 + k / 4099) as u8).collect())
            .collect();
        let tensors = uint8_chunks(&data);
        let check = |w: &Written, file: &[u8], name: &str| {
            for (p, d) in w.tensors.iter().zip(&data) {
                let item = &file[p.offset as usize..(p.offset + p.length) as usize];
                assert_eq!(crc32fast::hash(item), p.crc32, "{name}");
                let at = if d.is_empty() {
                    0
                } else {
                    item.windows(64).position(|x| x == &d[..64]).unwrap()
                };
                let want: Vec<u32> = item[at..at + d.len()]
                    .chunks(b)
                    .map(crc32fast::hash)
                    .collect();
                assert_eq!(p.blocks, want, "{name}");
            }
        };
        let streams = std::collections::HashMap::new();
        for (name, budget, buffer) in [
            ("direct", 0, 0),
            ("staged", 3 * 4096, 4096),
            ("big", 64 << 20, 3 << 20),
        ] {
            let path = dir.path().join(name);
            let pool = (budget > 0)
                .then(|| crate::staging::StagingPool::new(budget, buffer, None).unwrap());
            let st = pool.as_ref().map(|pool| Staging {
                pool,
                caller_streams: &streams,
                on_staged: None,
            });
            let w = write_rank(sink(&path), &tensors, &[], st, how(false)).unwrap();
            check(&w, &std::fs::read(&path).unwrap(), name);
        }
        let loc = crate::storage::Location::parse("memory://b/blocks").unwrap();
        let w = write_stream(upload(&loc), 5000, &tensors, &[], None, how(false)).unwrap();
        check(&w, &loc.read("f").unwrap().unwrap(), "object");
    }

    /// The digest computed while writing equals the SHA-256 of the file on disk, on the direct path
    /// and on the staged path with windows written out of order (more windows than buffers).
    #[test]
    fn sha256_while_writing_equals_the_file_digest() {
        let dir = tempfile::tempdir().unwrap();
        let data: Vec<Vec<u8>> = (0..5u32)
            .map(|i| (0..(9_000 * (i + 1))).map(|k| (k * 31 + i) as u8).collect())
            .collect();
        let tensors = uint8_chunks(&data);
        let obj = b"PK object bytes".to_vec();
        let object = ByteObject {
            fqn: "o".into(),
            bytes: &obj,
        };
        let objects = [&object];
        let streams = std::collections::HashMap::new();
        for (name, budget) in [("direct", 0), ("staged", 3 * 4096), ("deferred", 64 << 20)] {
            let path = dir.path().join(name);
            let pool =
                (budget > 0).then(|| crate::staging::StagingPool::new(budget, 4096, None).unwrap());
            let st = pool.as_ref().map(|pool| Staging {
                pool,
                caller_streams: &streams,
                on_staged: None,
            });
            let w = write_rank(sink(&path), &tensors, &objects, st, how(true)).unwrap();
            let on_disk: [u8; 32] = sha2::Sha256::digest(std::fs::read(&path).unwrap()).into();
            assert_eq!(w.sha256, Some(on_disk), "{name}");
            let none = write_rank(sink(&path), &tensors, &objects, None, how(false)).unwrap();
            assert_eq!(none.sha256, None);
        }
        // The object-store writer, in parts of 4 KiB: the same digest as the uploaded object's.
        let loc = crate::storage::Location::parse("memory://b/sha256").unwrap();
        let w = write_stream(upload(&loc), 4096, &tensors, &objects, None, how(true)).unwrap();
        let uploaded: [u8; 32] = sha2::Sha256::digest(loc.read("f").unwrap().unwrap()).into();
        assert_eq!(w.sha256, Some(uploaded));
    }

    /// Once Ctrl-C was seen every write path stops before its next piece or window with
    /// `Interrupted` ("nothing committed"): direct, staged (overlapped and deferred), object store.
    #[test]
    fn a_stopped_write_ends_interrupted() {
        let dir = tempfile::tempdir().unwrap();
        let data: Vec<Vec<u8>> = vec![vec![5u8; 3 * PIECE_BYTES + 7]];
        let tensors = uint8_chunks(&data);
        let stopped = AtomicBool::new(true);
        let how = WriteOptions {
            seed: 1,
            digest: true,
            stop: &stopped,
        };
        let interrupted =
            |r: Result<Written>| matches!(r, Err(Error::Interrupted(Stopped::Commit)));
        let streams = std::collections::HashMap::new();
        for (name, budget) in [("direct", 0), ("staged", 3 * 4096), ("deferred", 64 << 20)] {
            let path = dir.path().join(name);
            let pool =
                (budget > 0).then(|| crate::staging::StagingPool::new(budget, 4096, None).unwrap());
            let st = pool.as_ref().map(|pool| Staging {
                pool,
                caller_streams: &streams,
                on_staged: None,
            });
            assert!(
                interrupted(write_rank(sink(&path), &tensors, &[], st, how)),
                "{name}"
            );
        }
        let loc = crate::storage::Location::parse("memory://b/stopped").unwrap();
        assert!(interrupted(write_stream(
            upload(&loc),
            4096,
            &tensors,
            &[],
            None,
            how
        )));
        assert_eq!(loc.read("f").unwrap(), None, "the upload was aborted");
    }
}
