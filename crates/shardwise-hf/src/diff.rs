//! `shardwise diff A B`: compares two checkpoints key by key, whatever their layouts.
//!
//! Two torch_dist / DCP checkpoints are compared as global tensors: for every key in both, each
//! intersection of a chunk of A with a chunk of B is read from both sides (only the chunks it
//! overlaps, through [`shardwise::load::read_region`]) in slabs of at most `slab_bytes`, so memory
//! stays at about `threads x 2 x slab_bytes` whatever the tensor sizes (on an object store each
//! slab also fetches the items it overlaps whole). A checkpoint and a Hugging Face safetensors
//! folder are compared through the `to-hf` mapping ([`crate`]): every HF tensor the
//! checkpoint converts to is compared, piece by piece, with the folder's tensor of that name.
//!
//! Numbers: `max_abs` is the largest |a - b|, `max_rel` the largest |a - b| / max(|a|, |b|), and an
//! element is within tolerance when |a - b| <= atol + rtol * max(|a|, |b|) (symmetric in A and B;
//! NaN equals NaN, NaN against a number is out of tolerance with |a - b| = inf).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use rayon::prelude::*;
use serde::Serialize;

use crate::{self as hf, HfOptions, HfTensor};
use shardwise::error::{Error, Result};
use shardwise::format::dtype::DType;
use shardwise::format::metadata::{volume, Chunk, Entry};
use shardwise::format::zip::contiguous_strides;
use shardwise::format::{COMMON_FILE, METADATA_FILE};
use shardwise::load::{intersect, read_region};
use shardwise::reader::Checkpoint;
use shardwise::storage::Location;

/// The default worker threads of a diff: the CPUs, at most 8 (each holds two 32 MiB slabs).
pub fn default_threads() -> usize {
    shardwise::workers::cpus().min(8)
}

/// What to compare and how.
#[derive(Clone, Debug)]
pub struct DiffOptions {
    /// Absolute tolerance.
    pub atol: f64,
    /// Relative tolerance.
    pub rtol: f64,
    /// Glob patterns (`*`, `?`) of the keys to compare (HF names when one side is an HF folder);
    /// empty: every key.
    pub keys: Vec<String>,
    /// Glob patterns of keys to leave out.
    pub exclude: Vec<String>,
    /// The `to-hf` mapping when one side is an HF folder; its `config` defaults to the folder's
    /// `config.json`.
    pub hf: HfOptions,
    /// Largest slab read from one side at a time, in bytes.
    pub slab_bytes: u64,
    /// Worker threads (each holds two slabs).
    pub threads: usize,
}

/// `diff`'s options as the user gives them, the CLI's flags and Python's keywords alike:
/// [`DiffOptions::from_user`] checks them, the one place for both.
#[derive(Clone, Debug, Default)]
pub struct DiffRequest {
    pub atol: f64,
    pub rtol: f64,
    pub keys: Vec<String>,
    pub exclude: Vec<String>,
    /// The to-hf mapping's config.json and architecture, and whether it skips unmapped keys.
    pub hf_config: Option<PathBuf>,
    pub arch: Option<String>,
    pub allow_unmapped: bool,
    /// Worker threads; None: [`default_threads`].
    pub threads: Option<usize>,
}

/// How error messages name the options: as the CLI's flags (`--atol`, `--threads`) or as
/// Python's keywords (`atol`, `workers`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spelling {
    Flags,
    Keywords,
}

impl DiffOptions {
    /// The options `user` asks for, checked: tolerances >= 0, the worker count, the to-hf
    /// mapping's options; 32 MiB slabs.
    ///
    /// Errors: [`Error::InvalidArgument`] naming the options as `spelling` does.
    pub fn from_user(user: DiffRequest, spelling: Spelling) -> Result<DiffOptions> {
        let (tolerances, threads) = match spelling {
            Spelling::Flags => ("--atol and --rtol", "--threads"),
            Spelling::Keywords => ("atol and rtol", "workers"),
        };
        if !(user.atol >= 0.0 && user.rtol >= 0.0) {
            return Err(Error::InvalidArgument(format!(
                "{tolerances} must be numbers >= 0"
            )));
        }
        let threads = shardwise::workers::count(threads, user.threads, default_threads())?;
        Ok(DiffOptions {
            atol: user.atol,
            rtol: user.rtol,
            keys: user.keys,
            exclude: user.exclude,
            hf: HfOptions::from_user(hf::ToHfRequest {
                hf_config: user.hf_config,
                arch: user.arch,
                workers: Some(threads),
                allow_unmapped: user.allow_unmapped,
                ..Default::default()
            })?,
            slab_bytes: 32 << 20,
            threads,
        })
    }
}

/// The verdict on one key.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Same kind, dtype, global shape and bytes.
    Equal,
    /// Same kind and shape, values within atol/rtol but not bit for bit (or a dtype that differs
    /// is reported as `Different` even when values are close).
    Close,
    Different,
    OnlyInA,
    OnlyInB,
    /// A side could not be read (damaged item, missing chunk); `message` says why.
    Unreadable,
}

/// The comparison of one key.
#[derive(Clone, Debug, Serialize)]
pub struct KeyDiff {
    pub key: String,
    pub status: Status,
    /// "tensor" or "object" (for A, or B when only in B).
    pub kind: &'static str,
    pub dtype_a: Option<&'static str>,
    pub dtype_b: Option<&'static str>,
    pub shape_a: Option<Vec<u64>>,
    pub shape_b: Option<Vec<u64>>,
    /// Elements compared.
    pub elements: u64,
    /// Elements outside atol/rtol.
    pub mismatched: u64,
    pub max_abs: Option<f64>,
    pub max_rel: Option<f64>,
    pub message: Option<String>,
}

/// What `diff` found.
#[derive(Clone, Debug, Serialize)]
pub struct DiffReport {
    pub a: String,
    pub b: String,
    /// "checkpoints" or "hf" (one side an HF safetensors folder, compared through `to-hf`).
    pub mode: &'static str,
    pub atol: f64,
    pub rtol: f64,
    pub equal: usize,
    pub close: usize,
    pub different: usize,
    pub only_in_a: usize,
    pub only_in_b: usize,
    pub unreadable: usize,
    /// Checkpoint keys the `to-hf` mapping skips (optimizer state, extra state, objects).
    pub skipped_keys: usize,
    /// 0 when every key is in both and equal within tolerance, 1 when something differs, 2 when a
    /// key could not be read (the exit status of `shardwise diff`).
    pub exit_code: i32,
    /// Every compared key, sorted.
    pub keys: Vec<KeyDiff>,
}

/// One side of a diff.
enum Side {
    Dcp(Box<Checkpoint>),
    Hf(HfFolder),
}

/// Opens `loc` as a checkpoint, or as an HF safetensors folder when it is a local directory with
/// `*.safetensors` files and no `.metadata`.
fn open_side(loc: &Location) -> Result<Side> {
    if let Some(dir) = loc.as_local() {
        if !dir.join(METADATA_FILE).exists() && HfFolder::is_one(dir) {
            return Ok(Side::Hf(HfFolder::open(dir)?));
        }
    }
    Ok(Side::Dcp(Box::new(Checkpoint::open(loc)?)))
}

/// Compares checkpoint `a` with `b` (directories, object-store URLs, or one HF safetensors folder).
///
/// Errors: when a side cannot be opened (no `.metadata`, not a safetensors folder), for two HF
/// folders, a `--keys` pattern that selects no key or an `--exclude` that leaves none
/// ([`Error::InvalidArgument`]), and the `to-hf`
/// mapping's errors in HF mode; per-key read failures are
/// [`Status::Unreadable`] entries of the report instead.
pub fn diff(a: &Location, b: &Location, opts: &DiffOptions) -> Result<DiffReport> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(opts.threads.max(1))
        .build()
        .map_err(|e| Error::InvalidArgument(format!("thread pool: {e}")))?;
    let (sa, sb) = (open_side(a)?, open_side(b)?);
    let mut report = DiffReport {
        a: a.to_string(),
        b: b.to_string(),
        mode: "checkpoints",
        atol: opts.atol,
        rtol: opts.rtol,
        equal: 0,
        close: 0,
        different: 0,
        only_in_a: 0,
        only_in_b: 0,
        unreadable: 0,
        skipped_keys: 0,
        exit_code: 0,
        keys: Vec::new(),
    };
    let keys = pool.install(|| match (&sa, &sb) {
        (Side::Dcp(x), Side::Dcp(y)) => Ok(diff_checkpoints(x, y, opts)),
        (Side::Dcp(x), Side::Hf(h)) => diff_hf(x, h, opts, false, &mut report),
        (Side::Hf(h), Side::Dcp(y)) => diff_hf(y, h, opts, true, &mut report),
        (Side::Hf(_), Side::Hf(_)) => Err(Error::InvalidArgument(
            "both sides are HF safetensors folders; diff compares a checkpoint with a checkpoint \
             or with an HF folder"
                .into(),
        )),
    })?;
    // A `--keys` pattern that selects nothing is a mistyped name, not "0 different".
    if let Some(p) = opts
        .keys
        .iter()
        .find(|p| !keys.iter().any(|k| glob(p, &k.key)))
    {
        return Err(Error::InvalidArgument(format!(
            "--keys {p:?} matches no key of either side (after --exclude)"
        )));
    }
    if keys.is_empty() && !opts.exclude.is_empty() {
        return Err(Error::InvalidArgument(
            "--exclude leaves no key of either side to compare".into(),
        ));
    }
    for k in &keys {
        match k.status {
            Status::Equal => report.equal += 1,
            Status::Close => report.close += 1,
            Status::Different => report.different += 1,
            Status::OnlyInA => report.only_in_a += 1,
            Status::OnlyInB => report.only_in_b += 1,
            Status::Unreadable => report.unreadable += 1,
        }
    }
    report.keys = keys;
    report.exit_code = if report.unreadable > 0 {
        2
    } else if report.different + report.only_in_a + report.only_in_b > 0 {
        1
    } else {
        0
    };
    Ok(report)
}

/// Whether `key` passes the `--keys` / `--exclude` globs.
fn selected(key: &str, opts: &DiffOptions) -> bool {
    (opts.keys.is_empty() || opts.keys.iter().any(|p| glob(p, key)))
        && !opts.exclude.iter().any(|p| glob(p, key))
}

/// Glob match: `*` any run of characters (including `/` and `.`), `?` one character.
pub fn glob(pattern: &str, s: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), s.chars().collect());
    // Iterative matcher with one backtrack point (the last `*`).
    let (mut i, mut j, mut star, mut mark) = (0usize, 0usize, None::<usize>, 0usize);
    while j < t.len() {
        if i < p.len() && (p[i] == '?' || p[i] == t[j]) {
            i += 1;
            j += 1;
        } else if i < p.len() && p[i] == '*' {
            star = Some(i);
            mark = j;
            i += 1;
        } else if let Some(st) = star {
            i = st + 1;
            mark += 1;
            j = mark;
        } else {
            return false;
        }
    }
    p[i..].iter().all(|&c| c == '*')
}

fn new_key(key: &str, kind: &'static str, status: Status) -> KeyDiff {
    KeyDiff {
        key: key.to_string(),
        status,
        kind,
        dtype_a: None,
        dtype_b: None,
        shape_a: None,
        shape_b: None,
        elements: 0,
        mismatched: 0,
        max_abs: None,
        max_rel: None,
        message: None,
    }
}

/// One unit of work: a box read from both sides.
struct Task {
    key: usize,
    /// The checkpoint key the A region is read from, when it is not the compared key (HF mode:
    /// a piece's key).
    source: Option<String>,
    /// Region of A (global element offsets and sizes).
    a: (Vec<u64>, Vec<u64>),
    /// Where the same elements are in B: a region, or a flat element range of an HF tensor.
    b: Target,
}

enum Target {
    Region(Vec<u64>),
    Flat(u64),
}

/// Running numbers of one key.
#[derive(Clone, Debug, Default)]
struct Acc {
    elements: u64,
    mismatched: u64,
    max_abs: f64,
    max_rel: f64,
    /// Some element differs in its bytes (or the dtypes differ).
    not_bitwise: bool,
    /// Values could not be compared as numbers (dtype without a numeric decoding here).
    bytes_only: bool,
}

impl Acc {
    fn merge(&mut self, o: &Acc) {
        self.elements += o.elements;
        self.mismatched += o.mismatched;
        self.max_abs = nan_max(self.max_abs, o.max_abs);
        self.max_rel = nan_max(self.max_rel, o.max_rel);
        self.not_bitwise |= o.not_bitwise;
        self.bytes_only |= o.bytes_only;
    }
}

fn nan_max(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.max(b)
    }
}

/// Compares `n` elements: `a` of dtype `da` with `b` of dtype `db`.
fn compare(a: &[u8], da: DType, b: &[u8], db: DType, atol: f64, rtol: f64) -> Acc {
    let n = a.len() as u64 / da.itemsize();
    let mut acc = Acc {
        elements: n,
        ..Default::default()
    };
    if da == db && a == b {
        return acc;
    }
    acc.not_bitwise = true;
    const BLOCK: usize = 1 << 14;
    let (ia, ib) = (da.itemsize() as usize, db.itemsize() as usize);
    let (mut va, mut vb) = (Vec::with_capacity(BLOCK), Vec::with_capacity(BLOCK));
    for (ca, cb) in a.chunks(BLOCK * ia).zip(b.chunks(BLOCK * ib)) {
        if !(decode(ca, da, &mut va) && decode(cb, db, &mut vb)) {
            // No numeric view: count elements whose bytes differ.
            acc.bytes_only = true;
            acc.mismatched += if da == db {
                ca.chunks(ia)
                    .zip(cb.chunks(ib))
                    .filter(|(x, y)| x != y)
                    .count() as u64
            } else {
                (ca.len() / ia) as u64
            };
            continue;
        }
        for (&x, &y) in va.iter().zip(&vb) {
            if x == y || (x.is_nan() && y.is_nan()) {
                continue;
            }
            let d = if x.is_nan() || y.is_nan() {
                f64::INFINITY
            } else {
                (x - y).abs()
            };
            let scale = x.abs().max(y.abs());
            // Opposite infinities (and inf against a finite value) are out of any tolerance.
            let d = if d.is_nan() { f64::INFINITY } else { d };
            let rel = if scale > 0.0 && scale.is_finite() {
                d / scale
            } else {
                f64::INFINITY
            };
            acc.max_abs = acc.max_abs.max(d);
            acc.max_rel = acc.max_rel.max(rel);
            if !d.is_finite() || d > atol + rtol * scale {
                acc.mismatched += 1;
            }
        }
    }
    acc
}

/// Little-endian elements of `dtype` as f64 into `out` (cleared first); false for dtypes without a
/// real numeric value here (complex, float8).
fn decode(bytes: &[u8], dtype: DType, out: &mut Vec<f64>) -> bool {
    use half::{bf16, f16};
    out.clear();
    macro_rules! ints {
        ($t:ty) => {
            out.extend(
                bytes
                    .chunks_exact(std::mem::size_of::<$t>())
                    .map(|c| <$t>::from_le_bytes(c.try_into().unwrap()) as f64),
            )
        };
    }
    match dtype {
        DType::F64 => ints!(f64),
        DType::F32 => ints!(f32),
        DType::F16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f64()),
        ),
        DType::BF16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f64()),
        ),
        DType::I64 => ints!(i64),
        DType::I32 => ints!(i32),
        DType::I16 => ints!(i16),
        DType::I8 => ints!(i8),
        DType::U8 | DType::Bool => ints!(u8),
        DType::U16 => ints!(u16),
        DType::U32 => ints!(u32),
        DType::U64 => ints!(u64),
        DType::F8E4M3FN | DType::F8E5M2 | DType::C64 | DType::C128 => return false,
    }
    true
}

/// Elements of a shape or box ([`volume`]), saturating: a count past `u64` can never equal a
/// count of elements read, so comparisons with it fail as they should.
fn elements(sizes: &[u64]) -> u64 {
    volume(sizes).unwrap_or(u64::MAX)
}

/// Splits the box `offsets`/`sizes` into boxes of at most `budget` bytes (at least one element
/// each), in C order. Each box fixes the dimensions before some `d` to one index, takes a range of
/// `d` and all of the later ones, so it is one contiguous run of the box's C-order elements.
pub fn split_box(
    offsets: &[u64],
    sizes: &[u64],
    item: u64,
    budget: u64,
) -> Vec<(Vec<u64>, Vec<u64>)> {
    let n = sizes.len();
    if n == 0 || elements(sizes) == 0 {
        return if elements(sizes) == 0 && n > 0 {
            Vec::new()
        } else {
            vec![(offsets.to_vec(), sizes.to_vec())]
        };
    }
    // inner[d]: elements of one index of dimension d.
    let mut inner = vec![1u64; n];
    for d in (0..n - 1).rev() {
        inner[d] = inner[d + 1] * sizes[d + 1];
    }
    let d = (0..n)
        .find(|&d| inner[d].saturating_mul(item) <= budget)
        .unwrap_or(n - 1);
    let step = (budget / (inner[d] * item).max(1)).clamp(1, sizes[d]);
    let mut out = Vec::new();
    let mut idx = vec![0u64; d];
    loop {
        let mut start = 0;
        while start < sizes[d] {
            let len = step.min(sizes[d] - start);
            let mut o = offsets.to_vec();
            let mut s = sizes.to_vec();
            for k in 0..d {
                o[k] += idx[k];
                s[k] = 1;
            }
            o[d] += start;
            s[d] = len;
            out.push((o, s));
            start += len;
        }
        // Odometer over dimensions 0..d.
        let mut k = d;
        loop {
            if k == 0 {
                return out;
            }
            k -= 1;
            idx[k] += 1;
            if idx[k] < sizes[k] {
                break;
            }
            idx[k] = 0;
        }
    }
}

fn entry_kind(e: &Entry) -> &'static str {
    match e {
        Entry::Tensor { .. } => "tensor",
        Entry::Bytes { .. } => "object",
    }
}

/// Reads a region (offsets, sizes) of a key of side A into a buffer.
type ReadRegion<'a> = dyn Fn(&str, &[u64], &[u64], &mut [u8]) -> Result<()> + Sync + 'a;
/// Reads the elements matching a task's A region (its sizes) from side B into a buffer.
type ReadTarget<'a> = dyn Fn(&str, &Target, &[u64], &mut [u8]) -> Result<()> + Sync + 'a;

/// Runs `tasks` on the current pool and folds them per key into `out` (index = `Task::key`).
fn run_tasks(
    tasks: Vec<Task>,
    out: &mut [KeyDiff],
    types: &[(DType, DType)],
    opts: &DiffOptions,
    read_a: &ReadRegion,
    read_b: &ReadTarget,
) {
    let names: Vec<&str> = out.iter().map(|k| k.key.as_str()).collect();
    let results: Vec<(usize, std::result::Result<Acc, String>)> = tasks
        .par_iter()
        .map(|t| {
            let (da, db) = types[t.key];
            let n = elements(&t.a.1);
            let mut ba = vec![0u8; (n * da.itemsize()) as usize];
            let mut bb = vec![0u8; (n * db.itemsize()) as usize];
            let k = names[t.key];
            let r = read_a(t.source.as_deref().unwrap_or(k), &t.a.0, &t.a.1, &mut ba)
                .map_err(|e| format!("A: {e}"))
                .and_then(|_| read_b(k, &t.b, &t.a.1, &mut bb).map_err(|e| format!("B: {e}")))
                .map(|_| compare(&ba, da, &bb, db, opts.atol, opts.rtol));
            (t.key, r)
        })
        .collect();
    let mut accs: BTreeMap<usize, Acc> = BTreeMap::new();
    for (k, r) in results {
        match r {
            Ok(acc) => accs.entry(k).or_default().merge(&acc),
            Err(m) => {
                if out[k].status != Status::Unreadable {
                    out[k].status = Status::Unreadable;
                    out[k].message = Some(m);
                }
            }
        }
    }
    for (k, acc) in accs {
        let kd = &mut out[k];
        kd.elements = acc.elements;
        kd.mismatched = acc.mismatched;
        if !acc.bytes_only {
            kd.max_abs = Some(acc.max_abs);
            kd.max_rel = Some(acc.max_rel);
        }
        if kd.status == Status::Unreadable {
            continue;
        }
        kd.status = if kd.status == Status::Different || acc.mismatched > 0 {
            Status::Different
        } else if acc.not_bitwise {
            Status::Close
        } else {
            Status::Equal
        };
        if acc.mismatched > 0 && kd.message.is_none() {
            kd.message = Some(format!(
                "{} of {} elements outside atol/rtol",
                acc.mismatched, acc.elements
            ));
        }
    }
}

/// The keys of a diff with their verdicts before any value is read, the dtypes each side is read
/// in, and the reads left to compare ([`Task::key`] indexes `keys` and `types`).
#[derive(Default)]
struct Planned {
    keys: Vec<KeyDiff>,
    types: Vec<(DType, DType)>,
    tasks: Vec<Task>,
}

impl Planned {
    fn push(&mut self, kd: KeyDiff, types: (DType, DType)) {
        self.keys.push(kd);
        self.types.push(types);
    }
}

/// How a report names the two sides: the word for a shape, then where each value is.
struct Labels {
    shape: &'static str,
    a: &'static str,
    b: &'static str,
}

const CHECKPOINT_LABELS: Labels = Labels {
    shape: "global shape",
    a: "in A",
    b: "in B",
};

/// The checkpoint side first, whichever side it is.
const HF_LABELS: Labels = Labels {
    shape: "shape",
    a: "from the checkpoint",
    b: "in the HF folder",
};

/// Marks `kd` Different when the two tensors' shapes or dtypes differ; returns whether the shapes
/// agree, so that the values are compared (also across dtypes: how close they are is worth
/// reporting).
fn comparable(
    kd: &mut KeyDiff,
    shapes: (&[u64], &[u64]),
    dtypes: (DType, DType),
    labels: &Labels,
) -> bool {
    let Labels { shape, a, b } = labels;
    if shapes.0 != shapes.1 {
        kd.status = Status::Different;
        kd.message = Some(format!("{shape} {:?} {a}, {:?} {b}", shapes.0, shapes.1));
        return false;
    }
    if dtypes.0 != dtypes.1 {
        kd.status = Status::Different;
        kd.message = Some(format!(
            "dtype {} {a}, {} {b}",
            dtypes.0.torch_name(),
            dtypes.1.torch_name()
        ));
    }
    true
}

/// Compares two checkpoints key by key: plans every key ([`checkpoint_key`], [`tensor_tasks`],
/// [`compare_objects`]), reads and compares the tensors' slabs ([`run_tasks`]), then checks that
/// they covered every element ([`check_coverage`]).
fn diff_checkpoints(a: &Checkpoint, b: &Checkpoint, opts: &DiffOptions) -> Vec<KeyDiff> {
    let ea = &a.metadata.entries;
    let eb = &b.metadata.entries;
    let all: BTreeSet<&String> = ea
        .keys()
        .chain(eb.keys())
        .filter(|k| selected(k, opts))
        .collect();
    let mut plan = Planned::default();
    for key in all {
        let (xa, xb) = (ea.get(key), eb.get(key));
        let (mut kd, dtypes) = checkpoint_key(key, xa, xb);
        match (xa, xb) {
            (
                Some(Entry::Tensor {
                    global_shape: ga,
                    chunks: ca,
                    ..
                }),
                Some(Entry::Tensor {
                    global_shape: gb,
                    chunks: cb,
                    ..
                }),
            ) => {
                let at = plan.keys.len();
                let (sa, sb) = (
                    (ga.as_slice(), ca.as_slice()),
                    (gb.as_slice(), cb.as_slice()),
                );
                plan.tasks
                    .extend(tensor_tasks(&mut kd, at, sa, sb, dtypes, opts.slab_bytes));
            }
            (Some(Entry::Bytes { .. }), Some(Entry::Bytes { .. })) => {
                compare_objects(a, b, key, &mut kd)
            }
            (Some(x), Some(y)) => {
                kd.status = Status::Different;
                kd.message = Some(format!(
                    "a {} in A, a {} in B",
                    entry_kind(x),
                    entry_kind(y)
                ));
            }
            _ => {}
        }
        plan.push(kd, dtypes);
    }
    let read_a = |k: &str, o: &[u64], s: &[u64], buf: &mut [u8]| read_region(a, k, o, s, buf);
    let read_b = |k: &str, t: &Target, s: &[u64], buf: &mut [u8]| match t {
        Target::Region(o) => read_region(b, k, o, s, buf),
        Target::Flat(_) => unreachable!("checkpoint targets are regions"),
    };
    let Planned {
        mut keys,
        types,
        tasks,
    } = plan;
    run_tasks(tasks, &mut keys, &types, opts, &read_a, &read_b);
    check_coverage(&mut keys);
    if selected(COMMON_FILE, opts) {
        keys.extend(compare_common_files(a, b));
    }
    keys
}

/// `common.pt` (Megatron's common state: iteration, args, RNG and optimizer scalars) compared as
/// bytes, reported under its file name as an object. torch.save writes equal bytes for equal state
/// (its `serialization_id` is derived from the content), so a mismatch is a different state or a
/// different torch release. `None` when neither side has the file (a common state stored as a byte
/// object is already one of the keys).
fn compare_common_files(a: &Checkpoint, b: &Checkpoint) -> Option<KeyDiff> {
    let read = |c: &Checkpoint| c.location().read(COMMON_FILE);
    let (kd_status, message) = match (read(a), read(b)) {
        (Ok(None), Ok(None)) => return None,
        (Ok(Some(_)), Ok(None)) => (Status::OnlyInA, None),
        (Ok(None), Ok(Some(_))) => (Status::OnlyInB, None),
        (Ok(Some(x)), Ok(Some(y))) if x == y => (Status::Equal, None),
        (Ok(Some(x)), Ok(Some(y))) => (
            Status::Different,
            Some(format!(
                "common state differs ({} bytes in A, {} in B)",
                x.len(),
                y.len()
            )),
        ),
        (Err(e), _) => (Status::Unreadable, Some(format!("A: {e}"))),
        (_, Err(e)) => (Status::Unreadable, Some(format!("B: {e}"))),
    };
    let mut kd = new_key(COMMON_FILE, "object", kd_status);
    kd.message = message;
    Some(kd)
}

/// The report's entry of a checkpoint key before any comparison (only in A, only in B, or Equal
/// until found otherwise, with each side's dtype and shape) and the dtypes its sides are read in
/// (`U8` for an object or a missing side).
fn checkpoint_key(key: &str, xa: Option<&Entry>, xb: Option<&Entry>) -> (KeyDiff, (DType, DType)) {
    let mut kd = match (xa, xb) {
        (Some(x), None) => new_key(key, entry_kind(x), Status::OnlyInA),
        (None, Some(y)) => new_key(key, entry_kind(y), Status::OnlyInB),
        (Some(x), Some(_)) => new_key(key, entry_kind(x), Status::Equal),
        (None, None) => unreachable!("key comes from one of the sides"),
    };
    let mut dtypes = (DType::U8, DType::U8);
    if let Some(Entry::Tensor {
        dtype,
        global_shape,
        ..
    }) = xa
    {
        kd.dtype_a = Some(dtype.torch_name());
        kd.shape_a = Some(global_shape.clone());
        dtypes.0 = *dtype;
    }
    if let Some(Entry::Tensor {
        dtype,
        global_shape,
        ..
    }) = xb
    {
        kd.dtype_b = Some(dtype.torch_name());
        kd.shape_b = Some(global_shape.clone());
        dtypes.1 = *dtype;
    }
    (kd, dtypes)
}

/// The tasks of tensor key `at`, A's and B's global shape and chunks: each intersection of a
/// chunk of A with a chunk of B, in slabs of at most `slab_bytes`. None when the shapes differ
/// (`kd` says so, as it says when the dtypes do).
fn tensor_tasks(
    kd: &mut KeyDiff,
    at: usize,
    a: (&[u64], &[Chunk]),
    b: (&[u64], &[Chunk]),
    dtypes: (DType, DType),
    slab_bytes: u64,
) -> Vec<Task> {
    let mut tasks = Vec::new();
    if !comparable(kd, (a.0, b.0), dtypes, &CHECKPOINT_LABELS) {
        return tasks;
    }
    let item = dtypes.0.itemsize().max(dtypes.1.itemsize());
    for x in a.1 {
        for y in b.1 {
            let Some((o, s)) = intersect(&x.offsets, &x.sizes, &y.offsets, &y.sizes) else {
                continue;
            };
            for (o, s) in split_box(&o, &s, item, slab_bytes) {
                tasks.push(Task {
                    key: at,
                    source: None,
                    b: Target::Region(o.clone()),
                    a: (o, s),
                });
            }
        }
    }
    // A scalar or empty tensor still has its one (or zero) element compared above; chunks that do
    // not cover the shape make read_region fail: Unreadable.
    tasks
}
/// Compares the bytes of object `key` on both sides; a side that cannot be read makes it
/// Unreadable.
fn compare_objects(a: &Checkpoint, b: &Checkpoint, key: &str, kd: &mut KeyDiff) {
    match (a.read_bytes(key, 1 << 34), b.read_bytes(key, 1 << 34)) {
        (Ok(x), Ok(y)) => {
            if x != y {
                kd.status = Status::Different;
                kd.message = Some(format!(
                    "object bytes differ ({} bytes in A, {} in B)",
                    x.len(),
                    y.len()
                ));
            }
        }
        (Err(e), _) => {
            kd.status = Status::Unreadable;
            kd.message = Some(format!("A: {e}"));
        }
        (_, Err(e)) => {
            kd.status = Status::Unreadable;
            kd.message = Some(format!("B: {e}"));
        }
    }
}

/// Marks Unreadable each compared tensor whose elements were not all compared: intersections only
/// cover what both sides saved, so a chunk missing from one side would leave elements uncompared.
fn check_coverage(keys: &mut [KeyDiff]) {
    for k in keys {
        if let (Some(s), Status::Equal | Status::Close | Status::Different) = (
            k.shape_a.as_ref().filter(|_| k.shape_a == k.shape_b),
            k.status,
        ) {
            let total = elements(s);
            if k.elements != total {
                k.status = Status::Unreadable;
                k.message = Some(format!(
                    "the saved chunks of A and B together cover {} of the {total} elements",
                    k.elements
                ));
            }
        }
    }
}

/// The source of a task that reads a whole HF tensor through the to-hf mapping (NUL: never a
/// checkpoint key).
const WHOLE_HF: &str = "\0whole HF tensor:";

/// `ckpt` (through the to-hf mapping) against the HF folder `h`; `swapped` when the folder is A.
/// Plans every HF name ([`hf_key`], [`hf_tasks`]), then reads and compares ([`run_tasks`]).
fn diff_hf(
    ckpt: &Checkpoint,
    h: &HfFolder,
    opts: &DiffOptions,
    swapped: bool,
    report: &mut DiffReport,
) -> Result<Vec<KeyDiff>> {
    report.mode = "hf";
    let mut hopts = opts.hf.clone();
    if hopts.config.is_none() {
        let c = h.dir.join("config.json");
        if c.exists() {
            hopts.config = Some(c);
        }
    }
    let mapping = hf::plan(ckpt, &hopts)?;
    report.skipped_keys = mapping.skipped;
    let produced: BTreeMap<&str, &HfTensor> = mapping
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), t))
        .collect();
    let names: BTreeSet<&str> = produced
        .keys()
        .copied()
        .chain(h.tensors.keys().map(|k| k.as_str()))
        .filter(|k| selected(k, opts))
        .collect();
    let mut plan = Planned::default();
    for name in names {
        let (t, f) = (produced.get(name).copied(), h.tensors.get(name));
        let (mut kd, types) = hf_key(name, t, f, swapped);
        if let (Some(t), Some(f)) = (t, f) {
            if comparable(&mut kd, (&t.shape, &f.shape), types, &HF_LABELS) {
                let item = types.0.itemsize().max(types.1.itemsize());
                let at = plan.keys.len();
                plan.tasks
                    .extend(hf_tasks(at, name, t, item, opts.slab_bytes));
            }
        }
        plan.push(kd, types);
    }
    // compare() is symmetric: with the folder as A only the labels above swap; reads stay
    // (checkpoint, folder) to match `types`.
    let read_ckpt = |k: &str, o: &[u64], s: &[u64], buf: &mut [u8]| match k.strip_prefix(WHOLE_HF) {
        Some(name) => hf::read_hf_tensor(ckpt, produced[name], buf),
        None => read_region(ckpt, k, o, s, buf),
    };
    let read_hf = |k: &str, t: &Target, s: &[u64], buf: &mut [u8]| -> Result<()> {
        let Target::Flat(at) = t else {
            unreachable!("HF targets are flat ranges")
        };
        h.read_flat(k, *at, elements(s), buf)
    };
    let Planned {
        mut keys,
        types,
        tasks,
    } = plan;
    run_tasks(tasks, &mut keys, &types, opts, &read_ckpt, &read_hf);
    Ok(keys)
}

/// The report's entry of HF tensor `name` before any comparison: the checkpoint's tensor `t` and
/// the folder's `f`, labelled A and B (B and A when `swapped`); and the dtypes they are read in,
/// checkpoint first (`U8` for a missing side).
fn hf_key(
    name: &str,
    t: Option<&HfTensor>,
    f: Option<&HfEntry>,
    swapped: bool,
) -> (KeyDiff, (DType, DType)) {
    let (only_ckpt, only_hf) = if swapped {
        (Status::OnlyInB, Status::OnlyInA)
    } else {
        (Status::OnlyInA, Status::OnlyInB)
    };
    let mut kd = match (t, f) {
        (Some(_), None) => new_key(name, "tensor", only_ckpt),
        (None, Some(_)) => new_key(name, "tensor", only_hf),
        _ => new_key(name, "tensor", Status::Equal),
    };
    let (mut dc, mut dh) = (DType::U8, DType::U8);
    let (mut shape_c, mut shape_h) = (None, None);
    if let Some(t) = t {
        dc = t.src_dtype;
        shape_c = Some(t.shape.clone());
    }
    if let Some(f) = f {
        dh = f.dtype;
        shape_h = Some(f.shape.clone());
    }
    let (names_dc, names_dh) = (t.map(|_| dc.torch_name()), f.map(|_| dh.torch_name()));
    (kd.dtype_a, kd.dtype_b, kd.shape_a, kd.shape_b) = if swapped {
        (names_dh, names_dc, shape_h, shape_c)
    } else {
        (names_dc, names_dh, shape_c, shape_h)
    };
    (kd, (dc, dh))
}

/// The tasks of key `at`, HF tensor `name` made from the checkpoint as `t` says: its pieces in
/// slabs ([`piece_tasks`]), each compared with the flat range of the folder's tensor where the
/// piece lands; or the whole tensor at once when values are transformed after the gather.
fn hf_tasks(at: usize, name: &str, t: &HfTensor, item: u64, slab_bytes: u64) -> Vec<Task> {
    if t.post != hf::Post::None {
        // Values transformed after the gather (`+1`, transposes, interleaves): the
        // whole HF tensor is made as to-hf makes it and compared flat.
        return vec![Task {
            key: at,
            source: Some(format!("{WHOLE_HF}{name}")),
            a: (vec![0], vec![elements(&t.shape)]),
            b: Target::Flat(0),
        }];
    }
    let mut tasks = Vec::new();
    let mut flat = 0u64;
    for pc in &t.pieces {
        let piece = (pc.offsets.as_slice(), pc.sizes.as_slice());
        tasks.extend(piece_tasks(at, &pc.key, piece, flat, item, slab_bytes));
        flat += elements(&pc.sizes);
    }
    tasks
}

/// The tasks of key `at` reading one piece, box `piece` (offsets, sizes) of checkpoint key
/// `source`, in slabs of at most `slab_bytes`; the piece's elements are the HF tensor's from flat
/// element `flat` on.
fn piece_tasks(
    at: usize,
    source: &str,
    piece: (&[u64], &[u64]),
    flat: u64,
    item: u64,
    slab_bytes: u64,
) -> Vec<Task> {
    let (offsets, sizes) = piece;
    // Slabs of a piece are contiguous runs of its C-order elements.
    let strides = contiguous_strides(sizes);
    split_box(offsets, sizes, item, slab_bytes)
        .into_iter()
        .map(|(o, s)| {
            let rel: u64 = (0..o.len()).map(|d| (o[d] - offsets[d]) * strides[d]).sum();
            Task {
                key: at,
                source: Some(source.to_string()),
                a: (o, s),
                b: Target::Flat(flat + rel),
            }
        })
        .collect()
}

/// A Hugging Face safetensors folder, read as transformers' loaders and `from-hf` read it: the
/// files `model.safetensors.index.json` names, each tensor where the index puts it, or
/// `model.safetensors` alone; mapped.
struct HfFolder {
    dir: PathBuf,
    tensors: BTreeMap<String, HfEntry>,
}

struct HfEntry {
    file: std::sync::Arc<Mmap>,
    /// The weight file's name in the folder.
    file_name: String,
    dtype: DType,
    shape: Vec<u64>,
    /// Byte range of the data in the file.
    start: usize,
    len: usize,
}

impl HfFolder {
    /// Whether `dir` looks like an HF folder (an index or a `*.safetensors` file), to be opened
    /// as one rather than as a checkpoint.
    fn is_one(dir: &Path) -> bool {
        dir.join(hf::INDEX).is_file()
            || std::fs::read_dir(dir)
                .into_iter()
                .flatten()
                .flatten()
                .any(|e| {
                    let p = e.path();
                    p.extension().is_some_and(|x| x == "safetensors") && p.is_file()
                })
    }

    /// Maps the weight files of `dir` ([`hf::weight_files`]) and reads their headers (safetensors
    /// crate format); files the index does not name are not read (a stale shard of an earlier
    /// export is no part of the model).
    ///
    /// Errors: [`Error::InvalidArgument`] for a folder without an index or `model.safetensors`,
    /// or an index naming a missing file; [`Error::Validation`] for an index that puts a tensor in
    /// a file that does not hold it; [`Error::Corrupt`] for a malformed header or a tensor named in
    /// two files, a dtype with no DCP name; [`Error::Io`].
    fn open(dir: &Path) -> Result<HfFolder> {
        let mut tensors: BTreeMap<String, HfEntry> = BTreeMap::new();
        for file_name in hf::weight_files(dir)? {
            let path = dir.join(&file_name);
            let f = shardwise::storage::open_regular(&path).map_err(Error::io("open", &path))?;
            // SAFETY: read-only mapping of a file we do not write; a concurrent writer could only
            // produce wrong values, which the comparison reports.
            let map =
                std::sync::Arc::new(unsafe { Mmap::map(&f) }.map_err(Error::io("map", &path))?);
            let corrupt = |reason: String| Error::Corrupt {
                path: path.clone(),
                reason,
            };
            let (n, meta) = safetensors::SafeTensors::read_metadata(&map)
                .map_err(|e| corrupt(format!("not a safetensors file: {e}")))?;
            let data = 8 + n;
            for (name, info) in meta.tensors() {
                let dtype = hf::dtype_of_st(info.dtype).ok_or_else(|| {
                    corrupt(format!("{name}: dtype {:?} has no DCP name", info.dtype))
                })?;
                let (s, e) = info.data_offsets;
                let entry = HfEntry {
                    file: map.clone(),
                    file_name: file_name.clone(),
                    dtype,
                    shape: info.shape.iter().map(|&d| d as u64).collect(),
                    start: data + s,
                    len: e - s,
                };
                if tensors.insert(name.clone(), entry).is_some() {
                    return Err(corrupt(format!(
                        "{name} is in two files of {}",
                        dir.display()
                    )));
                }
            }
        }
        hf::check_index(dir, |name| tensors.get(name).map(|t| t.file_name.as_str()))?;
        Ok(HfFolder {
            dir: dir.to_path_buf(),
            tensors,
        })
    }

    /// Copies `n` elements of tensor `name` from flat element `at` into `buf`.
    fn read_flat(&self, name: &str, at: u64, n: u64, buf: &mut [u8]) -> Result<()> {
        let t = &self.tensors[name];
        let item = t.dtype.itemsize();
        let (s, l) = ((at * item) as usize, (n * item) as usize);
        if s + l > t.len || buf.len() != l {
            return Err(Error::Corrupt {
                path: self.dir.clone(),
                reason: format!(
                    "{name}: elements {at}+{n} pass the tensor's {} bytes",
                    t.len
                ),
            });
        }
        buf.copy_from_slice(&t.file[t.start + s..t.start + s + l]);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tolerance and worker rules, named as the CLI's flags or Python's keywords.
    #[test]
    fn options_from_user_check_tolerances_and_workers() {
        let ok = DiffOptions::from_user(DiffRequest::default(), Spelling::Flags).unwrap();
        assert_eq!(
            (ok.threads, ok.hf.threads),
            (default_threads(), default_threads())
        );
        assert_eq!(ok.slab_bytes, 32 << 20);
        let negative = DiffRequest {
            rtol: -1.0,
            ..Default::default()
        };
        for (spelling, want) in [
            (Spelling::Flags, "--atol and --rtol must be numbers >= 0"),
            (Spelling::Keywords, "atol and rtol must be numbers >= 0"),
        ] {
            let e = DiffOptions::from_user(negative.clone(), spelling).unwrap_err();
            assert_eq!(e.to_string(), format!("invalid argument: {want}"));
        }
        let nan = DiffRequest {
            atol: f64::NAN,
            ..Default::default()
        };
        assert!(DiffOptions::from_user(nan, Spelling::Flags).is_err());
        let none = DiffRequest {
            threads: Some(0),
            ..Default::default()
        };
        let e = DiffOptions::from_user(none.clone(), Spelling::Flags).unwrap_err();
        assert!(e.to_string().contains("--threads 0: at least one"), "{e}");
        let e = DiffOptions::from_user(none, Spelling::Keywords).unwrap_err();
        assert!(e.to_string().contains("workers 0: at least one"), "{e}");
    }

    #[test]
    fn globs() {
        assert!(glob("decoder.*.weight", "decoder.layers.mlp.weight"));
        assert!(glob("*", ""));
        assert!(glob("a?c", "abc") && !glob("a?c", "ac"));
        assert!(!glob("decoder.*", "embedding.word_embeddings.weight"));
        assert!(glob(
            "*_extra_state*",
            "decoder.layers.x._extra_state/shard_0_2"
        ));
    }

    #[test]
    fn split_box_covers_exactly_within_budget() {
        for (sizes, item, budget) in [
            (vec![7u64, 5, 3], 4u64, 64u64),
            (vec![7, 5, 3], 4, 4),
            (vec![7, 5, 3], 4, 1 << 20),
            (vec![1, 9], 2, 6),
            (vec![10], 8, 24),
        ] {
            let off = vec![2u64; sizes.len()];
            let boxes = split_box(&off, &sizes, item, budget);
            let mut seen = std::collections::HashSet::new();
            for (o, s) in &boxes {
                assert!(elements(s) * item <= budget.max(item), "{s:?} over budget");
                // Every element once.
                let mut idx = vec![0u64; s.len()];
                loop {
                    let g: Vec<u64> = (0..s.len()).map(|d| o[d] + idx[d]).collect();
                    assert!(seen.insert(g));
                    let mut d = s.len();
                    loop {
                        if d == 0 {
                            break;
                        }
                        d -= 1;
                        idx[d] += 1;
                        if idx[d] < s[d] {
                            break;
                        }
                        idx[d] = 0;
                        if d == 0 {
                            d = usize::MAX;
                            break;
                        }
                    }
                    if d == usize::MAX || s.is_empty() {
                        break;
                    }
                }
            }
            assert_eq!(seen.len() as u64, elements(&sizes));
        }
        assert_eq!(split_box(&[0, 0], &[4, 4], 4, 1 << 20).len(), 1);
    }

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn compare_numbers() {
        let a = f32s(&[1.0, 2.0, f32::NAN, 0.0]);
        let eq = compare(&a, DType::F32, &a, DType::F32, 0.0, 0.0);
        assert!(!eq.not_bitwise && eq.mismatched == 0 && eq.elements == 4);
        // One ulp on one element.
        let b = f32s(&[1.0, f32::from_bits(2.0f32.to_bits() + 1), f32::NAN, 0.0]);
        let d = compare(&a, DType::F32, &b, DType::F32, 0.0, 0.0);
        assert_eq!(d.mismatched, 1);
        assert!(d.max_abs > 0.0 && d.max_abs < 1e-6);
        assert!((d.max_rel - d.max_abs / 2.0).abs() < 1e-12);
        let tol = compare(&a, DType::F32, &b, DType::F32, 0.0, 1e-6);
        assert_eq!((tol.mismatched, tol.not_bitwise), (0, true));
        // NaN against a number.
        let c = f32s(&[1.0, 2.0, 3.0, 0.0]);
        let n = compare(&a, DType::F32, &c, DType::F32, 1.0, 1.0);
        assert_eq!(n.mismatched, 1);
        assert!(n.max_abs.is_infinite());
        // Across dtypes: bf16 1.0 == f32 1.0.
        let one_bf16 = half::bf16::from_f32(1.0).to_le_bytes().to_vec();
        let x = compare(&one_bf16, DType::BF16, &f32s(&[1.0]), DType::F32, 0.0, 0.0);
        assert_eq!((x.mismatched, x.max_abs), (0, 0.0));
    }

    fn tensor(dtype: DType, shape: &[u64]) -> Entry {
        Entry::Tensor {
            dtype,
            global_shape: shape.to_vec(),
            chunks: Vec::new(),
        }
    }

    fn chunk(offsets: &[u64], sizes: &[u64]) -> Chunk {
        Chunk {
            offsets: offsets.to_vec(),
            sizes: sizes.to_vec(),
            storage: shardwise::format::metadata::StorageInfo {
                relative_path: String::new(),
                offset: 0,
                length: 0,
            },
        }
    }

    /// (offsets, sizes, B's target) of each task.
    fn boxes(tasks: &[Task]) -> Vec<(Vec<u64>, Vec<u64>, String)> {
        tasks
            .iter()
            .map(|t| {
                let b = match &t.b {
                    Target::Region(o) => format!("region {o:?}"),
                    Target::Flat(at) => format!("flat {at}"),
                };
                (t.a.0.clone(), t.a.1.clone(), b)
            })
            .collect()
    }

    #[test]
    fn comparable_names_what_differs_in_each_mode() {
        let mut kd = new_key("w", "tensor", Status::Equal);
        let same = comparable(
            &mut kd,
            (&[2, 3], &[2, 3]),
            (DType::F32, DType::F32),
            &CHECKPOINT_LABELS,
        );
        assert!(same && kd.status == Status::Equal && kd.message.is_none());
        let dtypes = (DType::F32, DType::BF16);
        assert!(comparable(
            &mut kd,
            (&[2], &[2]),
            dtypes,
            &CHECKPOINT_LABELS
        ));
        assert_eq!(kd.status, Status::Different);
        assert_eq!(
            kd.message.as_deref(),
            Some("dtype float32 in A, bfloat16 in B")
        );
        let mut kd = new_key("w", "tensor", Status::Equal);
        assert!(!comparable(
            &mut kd,
            (&[2], &[3]),
            dtypes,
            &CHECKPOINT_LABELS
        ));
        assert_eq!(
            kd.message.as_deref(),
            Some("global shape [2] in A, [3] in B")
        );
        assert!(!comparable(&mut kd, (&[2], &[3, 1]), dtypes, &HF_LABELS));
        assert_eq!(
            kd.message.as_deref(),
            Some("shape [2] from the checkpoint, [3, 1] in the HF folder")
        );
        assert!(comparable(&mut kd, (&[2], &[2]), dtypes, &HF_LABELS));
        assert_eq!(
            kd.message.as_deref(),
            Some("dtype float32 from the checkpoint, bfloat16 in the HF folder")
        );
    }

    #[test]
    fn checkpoint_key_records_each_side() {
        let w = tensor(DType::BF16, &[4, 2]);
        let o = Entry::Bytes {
            storage: chunk(&[], &[]).storage,
        };
        let (kd, dtypes) = checkpoint_key("w", Some(&w), None);
        assert_eq!((kd.status, kd.kind), (Status::OnlyInA, "tensor"));
        assert_eq!(
            (kd.dtype_a, kd.shape_a),
            (Some("bfloat16"), Some(vec![4, 2]))
        );
        assert_eq!((kd.dtype_b, kd.shape_b), (None, None));
        assert_eq!(dtypes, (DType::BF16, DType::U8));
        let (kd, dtypes) = checkpoint_key("o", None, Some(&o));
        assert_eq!(
            (kd.status, kd.kind, kd.dtype_b),
            (Status::OnlyInB, "object", None)
        );
        assert_eq!(dtypes, (DType::U8, DType::U8));
        let (kd, dtypes) = checkpoint_key("x", Some(&o), Some(&w));
        assert_eq!(
            (kd.status, kd.kind, kd.dtype_b),
            (Status::Equal, "object", Some("bfloat16"))
        );
        assert_eq!(dtypes, (DType::U8, DType::BF16));
    }

    /// One task per slab of each intersection of an A chunk with a B chunk, read at the same
    /// place on both sides; none when the shapes differ.
    #[test]
    fn tensor_tasks_read_the_intersections_in_slabs() {
        let ca = [chunk(&[0, 0], &[2, 4]), chunk(&[2, 0], &[2, 4])];
        let cb = [chunk(&[1, 0], &[2, 4]), chunk(&[3, 0], &[1, 4])];
        let (a, b) = ((&[4u64, 4][..], &ca[..]), (&[4u64, 4][..], &cb[..]));
        let f32s = (DType::F32, DType::F32);
        let mut kd = new_key("w", "tensor", Status::Equal);
        let tasks = tensor_tasks(&mut kd, 7, a, b, f32s, 16);
        assert!(tasks.iter().all(|t| t.key == 7 && t.source.is_none()));
        let region = |o: &[u64]| format!("region {o:?}");
        assert_eq!(
            boxes(&tasks),
            vec![
                (vec![1, 0], vec![1, 4], region(&[1, 0])),
                (vec![2, 0], vec![1, 4], region(&[2, 0])),
                (vec![3, 0], vec![1, 4], region(&[3, 0])),
            ]
        );
        assert_eq!(kd.status, Status::Equal);
        assert_eq!(tensor_tasks(&mut kd, 0, a, b, f32s, 1 << 20).len(), 3);
        assert_eq!(
            tensor_tasks(&mut kd, 0, a, b, f32s, 8).len(),
            6,
            "half rows"
        );
        // Read as the wider dtype: 8-byte elements, half rows.
        let wider = (DType::F32, DType::F64);
        assert_eq!(tensor_tasks(&mut kd, 0, a, b, wider, 16).len(), 6);
        assert_eq!(kd.status, Status::Different);
        let mut kd = new_key("w", "tensor", Status::Equal);
        let other = (&[4u64, 5][..], &cb[..]);
        assert!(tensor_tasks(&mut kd, 0, a, other, f32s, 16).is_empty());
        assert_eq!(kd.status, Status::Different);
    }

    #[test]
    fn check_coverage_flags_elements_left_uncompared() {
        let key = |status, shape_b: &[u64], compared| {
            let mut k = new_key("w", "tensor", status);
            (k.shape_a, k.shape_b, k.elements) =
                (Some(vec![2, 3]), Some(shape_b.to_vec()), compared);
            k
        };
        let mut keys = [
            key(Status::Equal, &[2, 3], 6),
            key(Status::Close, &[2, 3], 3),
            key(Status::Different, &[3, 2], 0), // shapes differ: nothing was compared
            key(Status::Unreadable, &[2, 3], 0),
            key(Status::OnlyInA, &[2, 3], 0),
        ];
        check_coverage(&mut keys);
        let got: Vec<Status> = keys.iter().map(|k| k.status).collect();
        assert_eq!(
            got,
            [
                Status::Equal,
                Status::Unreadable,
                Status::Different,
                Status::Unreadable,
                Status::OnlyInA
            ]
        );
        assert_eq!(
            keys[1].message.as_deref(),
            Some("the saved chunks of A and B together cover 3 of the 6 elements")
        );
        assert!(keys[3].message.is_none());
    }

    fn hf_tensor(post: hf::Post) -> HfTensor {
        HfTensor {
            name: "w".into(),
            shape: vec![3, 2],
            src_dtype: DType::BF16,
            pieces: Vec::new(),
            post,
            from_file: None,
            quant: None,
            with_previous: false,
        }
    }

    fn hf_entry() -> HfEntry {
        let map = memmap2::MmapOptions::new().len(1).map_anon().unwrap();
        HfEntry {
            file: std::sync::Arc::new(map.make_read_only().unwrap()),
            file_name: "model.safetensors".into(),
            dtype: DType::F32,
            shape: vec![6],
            start: 0,
            len: 24,
        }
    }

    /// The checkpoint's side is A unless the folder is; the dtypes read stay (checkpoint, folder).
    #[test]
    fn hf_key_labels_the_sides() {
        let (t, f) = (hf_tensor(hf::Post::None), hf_entry());
        let (kd, types) = hf_key("w", Some(&t), Some(&f), false);
        assert_eq!(kd.status, Status::Equal);
        assert_eq!(
            (kd.dtype_a, kd.dtype_b),
            (Some("bfloat16"), Some("float32"))
        );
        assert_eq!((kd.shape_a, kd.shape_b), (Some(vec![3, 2]), Some(vec![6])));
        assert_eq!(types, (DType::BF16, DType::F32));
        let (kd, types) = hf_key("w", Some(&t), Some(&f), true);
        assert_eq!(
            (kd.dtype_a, kd.dtype_b),
            (Some("float32"), Some("bfloat16"))
        );
        assert_eq!((kd.shape_a, kd.shape_b), (Some(vec![6]), Some(vec![3, 2])));
        assert_eq!(types, (DType::BF16, DType::F32));
        let only = |t, f, swapped| hf_key("w", t, f, swapped).0.status;
        assert_eq!(only(Some(&t), None, false), Status::OnlyInA);
        assert_eq!(only(Some(&t), None, true), Status::OnlyInB);
        assert_eq!(only(None, Some(&f), false), Status::OnlyInB);
        assert_eq!(only(None, Some(&f), true), Status::OnlyInA);
        let (kd, types) = hf_key("w", None, Some(&f), true);
        assert_eq!(
            (kd.dtype_a, kd.dtype_b, kd.shape_b),
            (Some("float32"), None, None)
        );
        assert_eq!(types, (DType::U8, DType::F32));
    }

    /// A tensor with values transformed after the gather is compared whole, from the mapping.
    #[test]
    fn hf_tasks_compare_a_transformed_tensor_whole() {
        let tasks = hf_tasks(4, "w", &hf_tensor(hf::Post::AddOne), 2, 1);
        assert_eq!(tasks.len(), 1);
        assert_eq!(tasks[0].source.as_deref(), Some("\0whole HF tensor:w"));
        assert_eq!(
            boxes(&tasks),
            vec![(vec![0], vec![6], "flat 0".to_string())]
        );
        assert!(hf_tasks(4, "w", &hf_tensor(hf::Post::None), 2, 1).is_empty());
    }

    /// Each slab of a piece is compared with the HF tensor's elements from the piece's place on,
    /// plus the slab's C-order position in the piece.
    #[test]
    fn piece_tasks_place_slabs_in_the_flat_tensor() {
        let tasks = piece_tasks(1, "k", (&[2, 4], &[2, 3]), 10, 4, 12);
        assert!(tasks
            .iter()
            .all(|t| t.key == 1 && t.source.as_deref() == Some("k")));
        assert_eq!(
            boxes(&tasks),
            vec![
                (vec![2, 4], vec![1, 3], "flat 10".to_string()),
                (vec![3, 4], vec![1, 3], "flat 13".to_string()),
            ]
        );
        let tasks = piece_tasks(0, "k", (&[2, 4], &[2, 3]), 0, 4, 8);
        let flat: Vec<String> = boxes(&tasks).into_iter().map(|b| b.2).collect();
        assert_eq!(flat, ["flat 0", "flat 2", "flat 3", "flat 5"]);
        let scalar = piece_tasks(0, "k", (&[], &[]), 7, 4, 8);
        assert_eq!(boxes(&scalar), vec![(vec![], vec![], "flat 7".to_string())]);
    }
}
