//! Pure planning of a load: which saved chunk feeds which part of which request (an interval index
//! per tensor, not a scan of every chunk for every request), whether every request is covered, and
//! which byte ranges of which data file to read, coalesced into large reads that each list the
//! strided box copies out of them. No I/O here: the executor ([`super`]) does the reads.

use std::ops::Range;

use crate::error::{Error, Result};
use crate::format::metadata::{volume, Chunk};

/// Global element box `[lo, hi)` of one saved chunk that one request needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Index of the request.
    pub req: usize,
    /// Index of the chunk in its entry's chunk list.
    pub chunk: usize,
    pub(crate) lo: Vec<u64>,
    pub(crate) hi: Vec<u64>,
}

/// The chunks of one tensor, sorted along one dimension: `overlapping` binary-searches the
/// candidates whose extent along that dimension meets the request, then filters them on the other
/// dimensions.
///
/// The dimension is the one with the most distinct chunk offsets. TP, PP, EP and DP layouts save a
/// grid of chunks (PP and EP mostly as separate keys; TP splits one or two dimensions; the
/// distributed optimizer splits a flattened 1-d tensor into many chunks), so a request's
/// candidates are the chunks of one band of that most-split dimension: for an `a × b` grid with
/// `a >= b` that is at most `b <= sqrt(a·b)` chunks past an `O(log a·b)` search, and for 1-d
/// layouts exactly the chunks that overlap.
pub struct ChunkIndex {
    dim: usize,
    /// Chunk indices sorted by their offset along `dim`.
    order: Vec<usize>,
    /// Offsets along `dim`, in `order`.
    starts: Vec<u64>,
    /// Largest chunk extent along `dim`: no chunk starting before `lo - max_len` reaches `lo`.
    max_len: u64,
}

impl ChunkIndex {
    /// Indexes the chunks that have `ndim` dimensions (others cannot belong to the tensor and are
    /// left out, so a region they claim to cover reports as uncovered).
    pub fn new(chunks: &[Chunk], ndim: usize) -> ChunkIndex {
        let valid: Vec<usize> = (0..chunks.len())
            .filter(|&i| chunks[i].offsets.len() == ndim && chunks[i].sizes.len() == ndim)
            .collect();
        let dim = (0..ndim)
            .max_by_key(|&d| {
                let mut o: Vec<u64> = valid.iter().map(|&i| chunks[i].offsets[d]).collect();
                o.sort_unstable();
                o.dedup();
                o.len()
            })
            .unwrap_or(0);
        let mut order = valid;
        if ndim > 0 {
            order.sort_by_key(|&i| chunks[i].offsets[dim]);
        }
        let starts = if ndim > 0 {
            order.iter().map(|&i| chunks[i].offsets[dim]).collect()
        } else {
            vec![0; order.len()]
        };
        let max_len = if ndim > 0 {
            order
                .iter()
                .map(|&i| chunks[i].sizes[dim])
                .max()
                .unwrap_or(0)
        } else {
            0
        };
        ChunkIndex {
            dim,
            order,
            starts,
            max_len,
        }
    }

    /// Calls `f(chunk, lo, hi)` for every chunk that overlaps the box `[lo, hi)` (global
    /// coordinates), with the intersection; empty intersections are skipped.
    pub fn overlapping(
        &self,
        chunks: &[Chunk],
        lo: &[u64],
        hi: &[u64],
        mut f: impl FnMut(usize, Vec<u64>, Vec<u64>),
    ) {
        let n = lo.len();
        let (first, last) = if n == 0 {
            (0, self.order.len())
        } else {
            let from = lo[self.dim].saturating_sub(self.max_len);
            (
                self.starts.partition_point(|&s| s < from),
                self.starts.partition_point(|&s| s < hi[self.dim]),
            )
        };
        for &i in &self.order[first..last] {
            let c = &chunks[i];
            let ilo: Vec<u64> = (0..n).map(|d| c.offsets[d].max(lo[d])).collect();
            let ihi: Vec<u64> = (0..n)
                .map(|d| c.offsets[d].saturating_add(c.sizes[d]).min(hi[d]))
                .collect();
            if (0..n).all(|d| ilo[d] < ihi[d]) {
                f(i, ilo, ihi);
            }
        }
    }
}

/// The intersection of two boxes, None when empty.
pub fn intersect(ao: &[u64], asz: &[u64], bo: &[u64], bsz: &[u64]) -> Option<(Vec<u64>, Vec<u64>)> {
    let n = ao.len();
    if asz.len() != n || bo.len() != n || bsz.len() != n {
        return None;
    }
    let lo: Vec<u64> = (0..n).map(|d| ao[d].max(bo[d])).collect();
    let hi: Vec<u64> = (0..n)
        .map(|d| (ao[d] + asz[d]).min(bo[d] + bsz[d]))
        .collect();
    if (0..n).any(|d| lo[d] >= hi[d]) {
        return None;
    }
    let sizes = (0..n).map(|d| hi[d] - lo[d]).collect();
    Some((lo, sizes))
}

/// Copies the box `[lo, hi)` (global coordinates) from a tensor stored in `src` (element 0 at
/// `storage_offset`, `strides` in elements) whose origin is at `chunk_off`, into `out`, a
/// contiguous buffer for the region at `region_off` of `region_sizes`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn copy_box(
    src: &[u8],
    storage_offset: u64,
    strides: &[u64],
    chunk_off: &[u64],
    region_off: &[u64],
    region_sizes: &[u64],
    lo: &[u64],
    hi: &[u64],
    item: u64,
    out: &mut [u8],
) {
    let n = lo.len();
    let item = item as usize;
    if n == 0 {
        let s = storage_offset as usize * item;
        out[..item].copy_from_slice(&src[s..s + item]);
        return;
    }
    let mut out_strides = vec![1u64; n];
    for d in (0..n - 1).rev() {
        out_strides[d] = out_strides[d + 1] * region_sizes[d + 1];
    }
    let run = (hi[n - 1] - lo[n - 1]) as usize;
    let mut idx = lo.to_vec();
    loop {
        let mut s = storage_offset;
        let mut o = 0u64;
        for d in 0..n {
            s += (idx[d] - chunk_off[d]) * strides[d];
            o += (idx[d] - region_off[d]) * out_strides[d];
        }
        let (s, o) = (s as usize * item, o as usize * item);
        if strides[n - 1] == 1 {
            out[o..o + run * item].copy_from_slice(&src[s..s + run * item]);
        } else {
            let st = strides[n - 1] as usize * item;
            for k in 0..run {
                out[o + k * item..o + (k + 1) * item]
                    .copy_from_slice(&src[s + k * st..s + k * st + item]);
            }
        }
        // Odometer over all dimensions but the last.
        let mut d = n - 1;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < hi[d] {
                break;
            }
            idx[d] = lo[d];
        }
    }
}

/// A box `[lo, hi)` of `region` that no box of `covered` touches, if any (boxes are subtracted one
/// by one; only run when the volumes say something is missing, so its cost does not matter).
pub fn uncovered(
    lo: &[u64],
    hi: &[u64],
    covered: &[(Vec<u64>, Vec<u64>)],
) -> Option<Vec<Range<u64>>> {
    let n = lo.len();
    let mut left: Vec<Vec<Range<u64>>> = vec![(0..n).map(|d| lo[d]..hi[d]).collect()];
    for (clo, chi) in covered {
        let mut next = Vec::new();
        for b in left {
            if (0..n).any(|d| chi[d] <= b[d].start || clo[d] >= b[d].end) {
                next.push(b);
                continue;
            }
            // Peel off the parts of `b` outside the covered box, one dimension at a time.
            let mut rest = b;
            for d in 0..n {
                if rest[d].start < clo[d] {
                    let mut below = rest.clone();
                    below[d] = rest[d].start..clo[d];
                    next.push(below);
                    rest[d].start = clo[d];
                }
                if rest[d].end > chi[d] {
                    let mut above = rest.clone();
                    above[d] = chi[d]..rest[d].end;
                    next.push(above);
                    rest[d].end = chi[d];
                }
            }
        }
        left = next;
    }
    left.into_iter().next()
}

/// The pieces of one request `[lo, lo+sizes)` of tensor `key`, or [`Error::Validation`] naming an
/// uncovered box when the chunks do not cover it.
pub fn pieces_of(
    key: &str,
    req: usize,
    chunks: &[Chunk],
    index: &ChunkIndex,
    lo: &[u64],
    sizes: &[u64],
    out: &mut Vec<Piece>,
) -> Result<()> {
    let hi: Vec<u64> = lo.iter().zip(sizes).map(|(&o, &s)| o + s).collect();
    let total = volume(sizes).unwrap_or(u64::MAX);
    if total == 0 {
        return Ok(());
    }
    let first = out.len();
    let mut covered = 0u64;
    index.overlapping(chunks, lo, &hi, |chunk, plo, phi| {
        covered += plo.iter().zip(&phi).map(|(a, b)| b - a).product::<u64>();
        out.push(Piece {
            req,
            chunk,
            lo: plo,
            hi: phi,
        });
    });
    // Equal volumes prove coverage only when no two pieces overlap: two chunks claiming the same
    // elements (damaged or hostile `.metadata`; torch and our merge refuse to write them) could
    // hide a hole of the same size, and the hole would keep the destination's old values.
    if covered == total {
        if let Some((a, b)) = overlapping_pair(&out[first..]) {
            return Err(Error::Validation(format!(
                "{key}: saved chunks {} and {} overlap inside region {lo:?}+{sizes:?}",
                out[first + a].chunk,
                out[first + b].chunk
            )));
        }
    }
    if covered != total {
        let boxes: Vec<(Vec<u64>, Vec<u64>)> = out[first..]
            .iter()
            .map(|p| (p.lo.clone(), p.hi.clone()))
            .collect();
        let what = match uncovered(lo, &hi, &boxes) {
            Some(b) => format!(
                "elements {} are in no saved chunk",
                b.iter()
                    .map(|r| format!("{}:{}", r.start, r.end))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            None => format!("saved chunks overlap ({covered} elements for {total})"),
        };
        return Err(Error::Validation(format!(
            "{key}: region {lo:?}+{sizes:?} is not covered by the saved chunks: {what}"
        )));
    }
    Ok(())
}

/// Two pieces (indices into `pieces`) whose boxes share an element, if any. A sweep along the
/// first dimension: a piece is compared only with the pieces whose extent along it is still open,
/// so a grid of chunks costs one row band per piece, not every pair.
fn overlapping_pair(pieces: &[Piece]) -> Option<(usize, usize)> {
    if pieces.len() < 2 || pieces[0].lo.is_empty() {
        return None;
    }
    let mut order: Vec<usize> = (0..pieces.len()).collect();
    order.sort_by_key(|&i| pieces[i].lo[0]);
    let mut open: Vec<usize> = Vec::new();
    for &i in &order {
        let p = &pieces[i];
        open.retain(|&j| pieces[j].hi[0] > p.lo[0]);
        for &j in &open {
            let q = &pieces[j];
            if (0..p.lo.len()).all(|d| p.lo[d] < q.hi[d] && q.lo[d] < p.hi[d]) {
                return Some((j.min(i), j.max(i)));
            }
        }
        open.push(i);
    }
    None
}

/// A strided box copy: `dims` (outermost first) of `(count, src_stride, dst_stride)` in bytes over
/// contiguous runs of `run` bytes. `src` is a byte offset in a data file, `dst` a byte offset in the
/// request's destination.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BoxCopy {
    pub(crate) src: u64,
    pub(crate) dst: u64,
    pub(crate) run: u64,
    pub(crate) dims: Vec<(u64, u64, u64)>,
}

impl BoxCopy {
    /// The box copy of the global box `[lo, hi)` from a stored tensor whose element 0 is at file
    /// byte `base` (its storage record start plus `storage_offset`) with element `strides`, chunk
    /// origin `chunk_off`, into a C-contiguous destination for the region at `req_off` of
    /// `req_sizes`. Dimensions of extent 1 are dropped and contiguous ones merged into the run.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        base: u64,
        strides: &[u64],
        chunk_off: &[u64],
        req_off: &[u64],
        req_sizes: &[u64],
        lo: &[u64],
        hi: &[u64],
        item: u64,
    ) -> BoxCopy {
        let n = lo.len();
        let mut dst_strides = vec![item; n];
        for d in (0..n.saturating_sub(1)).rev() {
            dst_strides[d] = dst_strides[d + 1] * req_sizes[d + 1];
        }
        let mut src = base;
        let mut dst = 0;
        let mut dims = Vec::with_capacity(n);
        for d in 0..n {
            src += (lo[d] - chunk_off[d]) * strides[d] * item;
            dst += (lo[d] - req_off[d]) * dst_strides[d];
            if hi[d] - lo[d] > 1 {
                dims.push((hi[d] - lo[d], strides[d] * item, dst_strides[d]));
            }
        }
        let mut run = item;
        while let Some(&(count, s, t)) = dims.last() {
            if s != run || t != run {
                break;
            }
            run *= count;
            dims.pop();
        }
        BoxCopy {
            src,
            dst,
            run,
            dims,
        }
    }

    /// Bytes of the data file from the first byte copied to the last, inclusive.
    pub fn span(&self) -> u64 {
        self.run + self.dims.iter().map(|&(c, s, _)| (c - 1) * s).sum::<u64>()
    }

    /// Bytes copied.
    pub fn bytes(&self) -> u64 {
        self.run * self.dims.iter().map(|d| d.0).product::<u64>()
    }

    /// Whether the source bytes are one contiguous range (so are the destination bytes then).
    pub fn contiguous(&self) -> bool {
        self.dims.is_empty()
    }

    /// Splits into copies whose span is at most `max` bytes (a single run is cut; otherwise the
    /// outermost dimension is cut into groups of rows, recursing into a row that alone is larger).
    pub fn split(self, max: u64, out: &mut Vec<BoxCopy>) {
        if self.span() <= max {
            out.push(self);
            return;
        }
        if self.dims.is_empty() {
            let mut at = 0;
            while at < self.run {
                let len = max.min(self.run - at);
                out.push(BoxCopy {
                    src: self.src + at,
                    dst: self.dst + at,
                    run: len,
                    dims: Vec::new(),
                });
                at += len;
            }
            return;
        }
        let (count, s, t) = self.dims[0];
        let row = BoxCopy {
            src: self.src,
            dst: self.dst,
            run: self.run,
            dims: self.dims[1..].to_vec(),
        };
        let row_span = row.span();
        let per = if row_span > max || s == 0 {
            1
        } else {
            ((max - row_span) / s + 1).max(1)
        };
        let mut i = 0;
        while i < count {
            let k = per.min(count - i);
            let mut dims = Vec::with_capacity(self.dims.len());
            if k > 1 {
                dims.push((k, s, t));
            }
            dims.extend_from_slice(&row.dims);
            let part = BoxCopy {
                src: row.src + i * s,
                dst: row.dst + i * t,
                run: row.run,
                dims,
            };
            if k == 1 && row_span > max {
                part.split(max, out);
            } else {
                out.push(part);
            }
            i += k;
        }
    }
}

/// One copy of the plan: box `copy` of the data file `file` into request `req`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Copy {
    pub file: usize,
    pub req: usize,
    pub copy: BoxCopy,
    /// Read straight into the destination (host, contiguous, large, overlapping no other copy).
    pub direct: bool,
}

/// One read of the plan: bytes `range` of data file `file`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Read {
    pub file: usize,
    pub range: Range<u64>,
    /// Read straight into the destination of this copy (index into the plan's copies), else into
    /// a buffer from which `copies` are copied out.
    pub direct: Option<usize>,
    /// Copies (indices) whose source lies in this read.
    pub copies: Vec<usize>,
}

/// How reads are shaped.
#[derive(Clone, Copy, Debug)]
pub struct ReadShape {
    /// Largest buffered read in bytes (the staging buffer size); also the largest piece of a
    /// direct read (for parallelism).
    pub max_read: u64,
    /// Holes between needed ranges smaller than this are read through (one read instead of two).
    pub gap: u64,
    /// Smallest copy read straight into its destination (smaller ones are cheaper coalesced).
    pub direct_min: u64,
}

/// Marks the direct copies and groups every byte to read into reads: per file, the ranges of
/// the buffered copies and `extra` ranges (whole items, and the CRC blocks around partial reads,
/// whose CRC-32s are checked: bytes read but copied nowhere) are merged when
/// closer than `gap`, minus the ranges read directly, and cut into reads of at most `max_read`
/// bytes, never inside a copy (ranges of overlapping copies form one uncuttable cluster, so such a
/// read may be longer).
///
/// `copies` must already be split to `max_read`; `host[req]` says whether request `req` is host
/// memory (only those are read into directly).
pub fn reads(
    copies: &mut [Copy],
    extra: &[(usize, Range<u64>)],
    host: &[bool],
    shape: ReadShape,
) -> Vec<Read> {
    let mut out = Vec::new();
    for (file, FileShare { mut ids, extra }) in by_file(copies, extra).into_iter().enumerate() {
        ids.sort_by_key(|&i| (copies[i].copy.src, copies[i].copy.span()));
        let direct = mark_direct(copies, &ids, host, shape.direct_min);
        let spans = || {
            ids.iter()
                .filter(|&&i| !copies[i].direct)
                .map(|&i| copies[i].copy.src..copies[i].copy.src + copies[i].copy.span())
        };
        // Needed ranges, merged across small holes.
        let needed = coalesce(spans().chain(extra).collect(), |m, r| {
            r.start <= m.end.saturating_add(shape.gap)
        });
        let buffered = minus_direct(needed, copies, &direct);
        // Clusters of overlapping buffered copies: reads are cut only between them.
        let clusters = coalesce(spans().collect(), |c, r| r.start < c.end);
        let first_read = out.len();
        cut_reads(file, &buffered, &clusters, shape.max_read, &mut out);
        assign_copies(&mut out[first_read..], copies, &ids);
        out.extend(direct.into_iter().map(|i| {
            let c = &copies[i].copy;
            Read {
                file,
                range: c.src..c.src + c.run,
                direct: Some(i),
                copies: vec![i],
            }
        }));
    }
    out
}

/// One data file's share of the reads: its copies (indices) and `extra` ranges.
#[derive(Clone, Default)]
struct FileShare {
    ids: Vec<usize>,
    extra: Vec<Range<u64>>,
}

/// The copies and `extra` ranges of each data file, by file index (as many files as the highest
/// index named).
fn by_file(copies: &[Copy], extra: &[(usize, Range<u64>)]) -> Vec<FileShare> {
    let nfiles = copies
        .iter()
        .map(|c| c.file + 1)
        .chain(extra.iter().map(|e| e.0 + 1))
        .max()
        .unwrap_or(0);
    let mut files = vec![FileShare::default(); nfiles];
    for (i, c) in copies.iter().enumerate() {
        files[c.file].ids.push(i);
    }
    for (f, r) in extra {
        files[*f].extra.push(r.clone());
    }
    files
}

/// Marks the direct copies among one file's copies `ids` (sorted by start, then span): contiguous
/// host copies of at least `direct_min` bytes that no other copy overlaps. Returns them sorted by
/// start.
fn mark_direct(copies: &mut [Copy], ids: &[usize], host: &[bool], direct_min: u64) -> Vec<usize> {
    // `reach`: the furthest end of the copies before, which are sorted by start.
    let mut reach = 0;
    for (k, &i) in ids.iter().enumerate() {
        let c = &copies[i];
        let (a, b) = (c.copy.src, c.copy.src + c.copy.span());
        let alone = reach <= a && ids.get(k + 1).is_none_or(|&j| copies[j].copy.src >= b);
        reach = reach.max(b);
        copies[i].direct = alone && c.copy.contiguous() && c.copy.run >= direct_min && host[c.req];
    }
    let mut direct: Vec<usize> = ids.iter().copied().filter(|&i| copies[i].direct).collect();
    direct.sort_by_key(|&i| copies[i].copy.src);
    direct
}

/// `ranges` sorted by start, each merged into the one before when `joins(before, it)`.
fn coalesce(
    mut ranges: Vec<Range<u64>>,
    joins: impl Fn(&Range<u64>, &Range<u64>) -> bool,
) -> Vec<Range<u64>> {
    ranges.sort_by_key(|r| r.start);
    let mut merged: Vec<Range<u64>> = Vec::new();
    for r in ranges {
        match merged.last_mut() {
            Some(m) if joins(m, &r) => m.end = m.end.max(r.end),
            _ => merged.push(r),
        }
    }
    merged
}

/// The `merged` ranges minus the bytes of the `direct` copies (sorted by start): direct ranges lie
/// inside items, whose other bytes may still be needed.
fn minus_direct(merged: Vec<Range<u64>>, copies: &[Copy], direct: &[usize]) -> Vec<Range<u64>> {
    let mut buffered: Vec<Range<u64>> = Vec::new();
    let mut d = 0;
    for m in merged {
        let mut start = m.start;
        while d < direct.len() && copies[direct[d]].copy.src < m.end {
            let c = &copies[direct[d]].copy;
            let (a, b) = (c.src, c.src + c.run);
            if b > start {
                if a > start {
                    buffered.push(start..a.min(m.end));
                }
                start = start.max(b);
            }
            if b > m.end {
                break;
            }
            d += 1;
        }
        if start < m.end {
            buffered.push(start..m.end);
        }
    }
    buffered
}

/// Appends to `out` the reads of file `file` that cover the `buffered` ranges, each at most
/// `max_read` bytes unless a cluster (of overlapping copies, sorted) is longer: never cut inside one.
fn cut_reads(
    file: usize,
    buffered: &[Range<u64>],
    clusters: &[Range<u64>],
    max_read: u64,
    out: &mut Vec<Read>,
) {
    let read = |range| Read {
        file,
        range,
        direct: None,
        copies: Vec::new(),
    };
    for r in buffered {
        let mut start = r.start;
        while r.end - start > max_read {
            let mut cut = start + max_read;
            // Inside a cluster: cut before it, or after it when it begins at `start`.
            let k = clusters.partition_point(|c| c.end <= cut);
            if let Some(c) = clusters.get(k).filter(|c| c.start < cut) {
                cut = if c.start > start { c.start } else { c.end };
            }
            out.push(read(start..cut));
            start = cut;
        }
        if start < r.end {
            out.push(read(start..r.end));
        }
    }
}

/// Gives each buffered copy among `ids` to the read (of one file's `reads`, sorted by start)
/// holding its first byte: its whole span by construction.
fn assign_copies(reads: &mut [Read], copies: &[Copy], ids: &[usize]) {
    let starts: Vec<u64> = reads.iter().map(|r| r.range.start).collect();
    for &i in ids.iter().filter(|&&i| !copies[i].direct) {
        let k = starts.partition_point(|&s| s <= copies[i].copy.src) - 1;
        reads[k].copies.push(i);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::metadata::StorageInfo;

    fn chunk(offsets: &[u64], sizes: &[u64]) -> Chunk {
        Chunk {
            offsets: offsets.to_vec(),
            sizes: sizes.to_vec(),
            storage: StorageInfo {
                relative_path: "f".into(),
                offset: 0,
                length: 0,
            },
        }
    }

    /// A `rows × cols` grid of chunks of `r × c` elements each.
    fn grid(rows: u64, cols: u64, r: u64, c: u64) -> Vec<Chunk> {
        let mut out = Vec::new();
        for i in 0..rows {
            for j in 0..cols {
                out.push(chunk(&[i * r, j * c], &[r, c]));
            }
        }
        out
    }

    #[test]
    fn index_finds_exactly_the_overlapping_chunks() {
        let chunks = grid(8, 3, 10, 7);
        let idx = ChunkIndex::new(&chunks, 2);
        assert_eq!(idx.dim, 0, "dim 0 has the most distinct offsets");
        for (lo, hi) in [
            ([0, 0], [80, 21]),
            ([15, 3], [16, 4]),
            ([9, 6], [31, 15]),
            ([79, 20], [80, 21]),
        ] {
            let mut got = Vec::new();
            idx.overlapping(&chunks, &lo, &hi, |i, _, _| got.push(i));
            got.sort();
            let want: Vec<usize> = (0..chunks.len())
                .filter(|&i| {
                    (0..2).all(|d| {
                        chunks[i].offsets[d] < hi[d]
                            && chunks[i].offsets[d] + chunks[i].sizes[d] > lo[d]
                    })
                })
                .collect();
            assert_eq!(got, want, "{lo:?}..{hi:?}");
        }
    }

    #[test]
    fn coverage_names_the_hole() {
        let mut chunks = grid(2, 2, 4, 4);
        chunks.remove(3); // rows 4..8, cols 4..8 missing
        let idx = ChunkIndex::new(&chunks, 2);
        let mut out = Vec::new();
        pieces_of("w", 0, &chunks, &idx, &[0, 0], &[4, 8], &mut out).unwrap();
        assert_eq!(out.len(), 2);
        let e = pieces_of("w", 0, &chunks, &idx, &[2, 2], &[4, 4], &mut out)
            .unwrap_err()
            .to_string();
        assert!(e.contains("w: region [2, 2]+[4, 4]"), "{e}");
        assert!(e.contains("elements 4:6, 4:6 are in no saved chunk"), "{e}");
    }

    #[test]
    fn overlapping_chunks_cannot_hide_a_hole() {
        // Rows 0..4 saved twice, rows 4..8 never: the volumes add up to the request's.
        let mut chunks = grid(1, 1, 4, 8);
        chunks.push(chunk(&[0, 0], &[4, 8]));
        let idx = ChunkIndex::new(&chunks, 2);
        let mut out = Vec::new();
        let e = pieces_of("w", 0, &chunks, &idx, &[0, 0], &[8, 8], &mut out)
            .unwrap_err()
            .to_string();
        assert!(e.contains("w: saved chunks 0 and 1 overlap"), "{e}");
        // A grid's disjoint pieces pass.
        let chunks = grid(4, 4, 2, 2);
        let idx = ChunkIndex::new(&chunks, 2);
        out.clear();
        pieces_of("w", 0, &chunks, &idx, &[0, 0], &[8, 8], &mut out).unwrap();
        assert_eq!(out.len(), 16);
    }

    #[test]
    fn box_copy_merges_contiguous_dims_and_splits() {
        // Chunk [4, 6] at (0, 0), request columns 2..5 of all rows into a [4, 3] destination.
        let b = BoxCopy::new(
            1000,
            &[6, 1],
            &[0, 0],
            &[0, 2],
            &[4, 3],
            &[0, 2],
            &[4, 5],
            2,
        );
        assert_eq!(
            b,
            BoxCopy {
                src: 1004,
                dst: 0,
                run: 6,
                dims: vec![(4, 12, 6)]
            }
        );
        assert_eq!(b.span(), 42);
        assert_eq!(b.bytes(), 24);
        // Whole rows merge into one run.
        let w = BoxCopy::new(0, &[6, 1], &[0, 0], &[1, 0], &[2, 6], &[1, 0], &[3, 6], 4);
        assert_eq!((w.src, w.run, w.dims.len()), (24, 48, 0));
        let mut parts = Vec::new();
        b.clone().split(20, &mut parts);
        assert!(parts.iter().all(|p| p.span() <= 20), "{parts:?}");
        assert_eq!(parts.iter().map(|p| p.bytes()).sum::<u64>(), 24);
        let mut parts = Vec::new();
        w.split(20, &mut parts);
        assert_eq!(
            parts
                .iter()
                .map(|p| (p.src, p.dst, p.run))
                .collect::<Vec<_>>(),
            vec![(24, 0, 20), (44, 20, 20), (64, 40, 8)]
        );
    }

    fn copy(file: usize, req: usize, src: u64, run: u64) -> Copy {
        Copy {
            file,
            req,
            copy: BoxCopy {
                src,
                dst: 0,
                run,
                dims: vec![],
            },
            direct: false,
        }
    }

    #[test]
    fn reads_coalesce_small_gaps_and_bound_their_size() {
        let shape = ReadShape {
            max_read: 100,
            gap: 10,
            direct_min: 1 << 40,
        };
        let mut copies = vec![
            copy(0, 0, 0, 30),
            copy(0, 1, 35, 30),  // 5-byte hole: read through
            copy(0, 2, 200, 30), // 135-byte hole: a new read
            copy(1, 0, 0, 60),
            copy(1, 1, 60, 60), // adjacent, but 120 bytes > max_read: two reads
        ];
        let r = reads(&mut copies, &[], &[true; 3], shape);
        let got: Vec<(usize, Range<u64>, Vec<usize>)> =
            r.into_iter().map(|r| (r.file, r.range, r.copies)).collect();
        assert_eq!(
            got,
            vec![
                (0, 0..65, vec![0, 1]),
                (0, 200..230, vec![2]),
                (1, 0..60, vec![3]),
                (1, 60..120, vec![4]),
            ]
        );
    }

    #[test]
    fn direct_reads_leave_the_rest_of_a_checked_item_buffered() {
        let shape = ReadShape {
            max_read: 1000,
            gap: 10,
            direct_min: 50,
        };
        // Item 0..300 checked; its data 64..264 goes straight to a host destination.
        let mut copies = vec![copy(0, 0, 64, 200), copy(0, 1, 300, 20)];
        let r = reads(&mut copies, &[(0, 0..300)], &[true, true], shape);
        let got: Vec<(Range<u64>, Option<usize>)> =
            r.into_iter().map(|r| (r.range, r.direct)).collect();
        assert_eq!(
            got,
            vec![(0..64, None), (264..320, None), (64..264, Some(0))]
        );
        // A device destination is never read into directly.
        let mut copies = vec![copy(0, 0, 64, 200)];
        let r = reads(&mut copies, &[(0, 0..300)], &[false], shape);
        assert_eq!(r.len(), 1);
        assert_eq!((r[0].range.clone(), r[0].direct), (0..300, None));
    }

    #[test]
    fn overlapping_copies_are_never_cut_apart() {
        let shape = ReadShape {
            max_read: 50,
            gap: 0,
            direct_min: 1,
        };
        // Two requests need overlapping bytes: neither is direct, one read holds both.
        let mut copies = vec![copy(0, 0, 0, 40), copy(0, 1, 20, 40)];
        let r = reads(&mut copies, &[], &[true, true], shape);
        assert_eq!(r.len(), 1);
        assert_eq!(
            (r[0].range.clone(), r[0].copies.clone()),
            (0..60, vec![0, 1])
        );
        assert!(copies.iter().all(|c| !c.direct));
    }

    #[test]
    fn intersections_of_boxes() {
        assert_eq!(
            intersect(&[0, 0], &[4, 8], &[2, 4], &[4, 8]),
            Some((vec![2, 4], vec![2, 4]))
        );
        assert_eq!(intersect(&[0], &[4], &[4], &[4]), None);
    }

    /// A box copy out of a transposed (column-major) source lands in C order, and a scalar copies
    /// its one element.
    #[test]
    fn copy_box_follows_source_strides() {
        // A 2x3 u8 tensor stored column-major: element (i, j) at storage index i + 2 * j.
        let src: Vec<u8> = vec![0, 10, 1, 11, 2, 12];
        let mut out = vec![0u8; 4];
        // Region rows 0..2, columns 1..3 of the global tensor; the chunk is all of it.
        copy_box(
            &src,
            0,
            &[1, 2],
            &[0, 0],
            &[0, 1],
            &[2, 2],
            &[0, 1],
            &[2, 3],
            1,
            &mut out,
        );
        assert_eq!(out, vec![1, 2, 11, 12]);
        let mut one = [0u8; 2];
        copy_box(&[7, 9, 5, 6], 1, &[], &[], &[], &[], &[], &[], 2, &mut one);
        assert_eq!(one, [5, 6]);
    }

    #[test]
    fn by_file_counts_files_from_copies_and_extra_ranges() {
        let copies = [copy(1, 0, 0, 4), copy(0, 0, 8, 4), copy(1, 1, 2, 4)];
        let files = by_file(&copies, &[(2, 0..9), (1, 3..4), (2, 10..12), (1, 5..6)]);
        let got: Vec<(Vec<usize>, Vec<Range<u64>>)> =
            files.into_iter().map(|f| (f.ids, f.extra)).collect();
        assert_eq!(
            got,
            vec![
                (vec![1], vec![]),
                (vec![0, 2], vec![3..4, 5..6]),
                (vec![], vec![0..9, 10..12])
            ]
        );
        assert!(by_file(&[], &[]).is_empty());
    }

    /// Direct: large, contiguous, host, and overlapping no other copy (before or after it).
    #[test]
    fn mark_direct_takes_lone_large_host_copies() {
        let mut copies = vec![
            copy(0, 0, 0, 50),   // overlaps the next: buffered
            copy(0, 0, 40, 50),  // overlaps the one before: buffered
            copy(0, 1, 200, 50), // a device request: buffered
            copy(0, 0, 300, 10), // too small: buffered
            copy(0, 0, 100, 50), // direct
            copy(0, 0, 400, 60), // direct
        ];
        let mut strided = copy(0, 0, 500, 50);
        strided.copy.dims = vec![(2, 100, 50)]; // not contiguous: buffered
        copies.push(strided);
        let mut ids: Vec<usize> = (0..copies.len()).collect();
        ids.sort_by_key(|&i| (copies[i].copy.src, copies[i].copy.span()));
        let direct = mark_direct(&mut copies, &ids, &[true, false], 50);
        assert_eq!(direct, vec![4, 5]);
        let marked: Vec<bool> = copies.iter().map(|c| c.direct).collect();
        assert_eq!(marked, [false, false, false, false, true, true, false]);
    }

    #[test]
    fn coalesce_sorts_then_merges_what_joins() {
        let ranges = vec![20..30, 0..10, 12..15, 5..8];
        let gap2 = |m: &Range<u64>, r: &Range<u64>| r.start <= m.end + 2;
        assert_eq!(coalesce(ranges.clone(), gap2), vec![0..15, 20..30]);
        let overlap = |m: &Range<u64>, r: &Range<u64>| r.start < m.end;
        assert_eq!(coalesce(ranges, overlap), vec![0..10, 12..15, 20..30]);
        assert_eq!(coalesce(vec![0..10, 10..12], overlap), vec![0..10, 10..12]);
    }

    #[test]
    fn minus_direct_leaves_the_bytes_around_direct_copies() {
        let copies = [copy(0, 0, 10, 20), copy(0, 0, 40, 10), copy(0, 0, 95, 10)];
        let got = minus_direct(vec![0..50, 60..100, 100..120], &copies, &[0, 1, 2]);
        assert_eq!(got, vec![0..10, 30..40, 60..95, 105..120]);
        assert_eq!(
            minus_direct(vec![0..5, 6..9], &copies, &[]),
            vec![0..5, 6..9]
        );
    }

    #[test]
    fn cut_reads_bounds_reads_but_never_cuts_a_cluster() {
        let mut out = Vec::new();
        cut_reads(3, &[0..250, 300..310], &[90..130, 300..305], 100, &mut out);
        let got: Vec<(usize, Range<u64>)> = out.iter().map(|r| (r.file, r.range.clone())).collect();
        // The cut at 100 falls inside the cluster 90..130: the read ends before it; the next one
        // starts at the cluster and its cut, 190, lies past it.
        assert_eq!(
            got,
            vec![(3, 0..90), (3, 90..190), (3, 190..250), (3, 300..310)]
        );
        let mut out = Vec::new();
        cut_reads(0, &[0..300, 400..401], &[0..150, 400..401], 100, &mut out);
        let got: Vec<Range<u64>> = out.into_iter().map(|r| r.range).collect();
        assert_eq!(
            got,
            vec![0..150, 150..250, 250..300, 400..401],
            "a cluster at the start: after it"
        );
    }

    #[test]
    fn assign_copies_gives_each_copy_the_read_of_its_first_byte() {
        let mut copies = vec![copy(0, 0, 0, 10), copy(0, 0, 55, 10), copy(0, 0, 70, 5)];
        copies[2].direct = true;
        let mut reads: Vec<Read> = [0..50u64, 50..100]
            .into_iter()
            .map(|range| Read {
                file: 0,
                range,
                direct: None,
                copies: Vec::new(),
            })
            .collect();
        assign_copies(&mut reads, &copies, &[0, 1, 2]);
        assert_eq!((&reads[0].copies, &reads[1].copies), (&vec![0], &vec![1]));
    }
}
