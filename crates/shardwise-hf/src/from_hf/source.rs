//! The Hugging Face folder `from-hf` reads: `config.json` and the safetensors files
//! (`model.safetensors`, or the files `model.safetensors.index.json` names), parsed as data:
//! headers through the `safetensors` crate (offsets and sizes validated), file names from the
//! index accepted only as plain names inside the folder. Quantized weights are paired with their
//! scales ([`super::super::quant`]): an FP8 `x.weight` with `x.weight_scale_inv`, an MXFP4 `x` with
//! `x_blocks` / `x_scales`, and each pair is one logical tensor, in transformers' parameter layout
//! and dtype once dequantized. Data is read with positioned reads into the caller's buffer, so
//! memory holds only the tensor being converted.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde_json::Value as Json;

use super::super::quant::{self, Scheme};
use super::super::write::dtype_of_st;
use shardwise::error::{Error, Result};
use shardwise::format::dtype::DType;

use super::super::write::INDEX;

/// The single weight file of an unsharded folder (the index is [`INDEX`]).
const SINGLE: &str = "model.safetensors";

/// Where a stored tensor's bytes are: file index, absolute byte offset, length.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Span {
    file: usize,
    offset: u64,
    len: u64,
}

impl Span {
    /// Bytes `[at, at + len)` of the span.
    fn slice(&self, at: u64, len: u64) -> Span {
        Span {
            file: self.file,
            offset: self.offset + at,
            len,
        }
    }
}

/// One stored safetensors tensor.
#[derive(Clone, Debug)]
struct Stored {
    dtype: DType,
    shape: Vec<u64>,
    span: Span,
}

/// How a logical tensor is stored.
#[derive(Clone, Debug)]
enum Storage {
    Plain(Span),
    /// An e4m3fn weight and its float scale grid.
    Fp8 {
        weight: Span,
        scale: Span,
        scale_dtype: DType,
        block: [u64; 2],
    },
    /// e2m1 blocks `[.., G, 16]` and e8m0 scales `[.., G]`; the logical tensor is their
    /// dequantization `[.., R, G*32]` with the last two dimensions swapped (transformers' gpt_oss
    /// parameter, [`quant`] module docs).
    Mxfp4 {
        blocks: Span,
        scales: Span,
    },
}

/// A tensor as transformers' model holds it after loading.
#[derive(Clone, Debug)]
pub(crate) struct HfTensor {
    /// The stored dtype (float32/bfloat16/float16 for plain tensors; the dtype dequantization
    /// produces otherwise is the caller's choice).
    pub dtype: DType,
    pub shape: Vec<u64>,
    /// The stored names it is made of (for errors and the unmapped check).
    pub stored: Vec<String>,
    storage: Storage,
}

impl HfTensor {
    /// Whether it is stored quantized.
    pub(crate) fn quantized(&self) -> bool {
        !matches!(self.storage, Storage::Plain(_))
    }
}

/// An HF folder, opened.
pub(crate) struct HfSource {
    pub dir: PathBuf,
    /// config.json, parsed.
    pub config: Json,
    /// Its bytes (part of the conversion's identity).
    pub config_bytes: Vec<u8>,
    pub files: Vec<String>,
    handles: Vec<File>,
    /// Logical tensors by name.
    pub tensors: BTreeMap<String, HfTensor>,
}

/// A plain file name inside the folder: no separator, not `.`/`..`, no leading dot.
fn check_file_name(dir: &Path, name: &str) -> Result<()> {
    if name.is_empty() || name.contains(['/', '\\', '\0']) || name.starts_with('.') {
        return Err(Error::Validation(format!(
            "{}: weight file name {name:?} is not a plain file name in the folder",
            dir.join(INDEX).display()
        )));
    }
    Ok(())
}

/// The header of safetensors file `path`: every tensor's dtype, shape and byte span.
fn read_header(path: &Path, file: &File, index: usize) -> Result<BTreeMap<String, Stored>> {
    // Mapped, not read: only the header's pages are touched, and the crate checks the header's
    // offsets against the file's length.
    // SAFETY: read-only map of a file we do not write; a concurrent writer would be a misuse the
    // crate's own readers share.
    let map = unsafe { memmap2::Mmap::map(file) }.map_err(Error::io("map", path))?;
    parse_header(path, &map, index)
}

/// [`read_header`] of the bytes of safetensors file `path` (the whole file: the crate checks the
/// header's offsets against its length). Untrusted input: fuzzed ([`shardwise::fuzzing`]).
///
/// Errors: [`Error::Corrupt`] for a malformed header; [`Error::UnsupportedDtype`].
fn parse_header(path: &Path, bytes: &[u8], index: usize) -> Result<BTreeMap<String, Stored>> {
    let corrupt = |reason: String| Error::Corrupt {
        path: path.to_path_buf(),
        reason,
    };
    let (n, meta) = safetensors::SafeTensors::read_metadata(bytes)
        .map_err(|e| corrupt(format!("not a safetensors file: {e}")))?;
    let data_start = 8 + n as u64;
    let mut out = BTreeMap::new();
    for (name, info) in meta.tensors() {
        let dtype = dtype_of_st(info.dtype).ok_or_else(|| {
            Error::UnsupportedDtype(format!(
                "{}: tensor {name} has dtype {:?}, which from-hf does not read",
                path.display(),
                info.dtype
            ))
        })?;
        let (a, b) = info.data_offsets;
        out.insert(
            name,
            Stored {
                dtype,
                shape: info.shape.iter().map(|&d| d as u64).collect(),
                span: Span {
                    file: index,
                    offset: data_start + a as u64,
                    len: (b - a) as u64,
                },
            },
        );
    }
    Ok(out)
}

/// `pattern` (`*` matching any run of characters) against module name `name`, or `name`
/// under the module `pattern` (transformers matches `modules_to_not_convert` entries as module
/// prefixes: `model.layers.*.self_attn` covers `model.layers.0.self_attn.q_proj`).
fn module_matches(pattern: &str, name: &str) -> bool {
    fn glob(p: &[u8], s: &[u8]) -> bool {
        match p.split_first() {
            None => s.is_empty(),
            Some((b'*', rest)) => (0..=s.len()).any(|i| glob(rest, &s[i..])),
            Some((c, rest)) => s.first() == Some(c) && glob(rest, &s[1..]),
        }
    }
    let (p, n) = (pattern.as_bytes(), name.as_bytes());
    glob(p, n)
        || (0..n.len())
            .filter(|&i| n[i] == b'.')
            .any(|i| glob(p, &n[..i]))
}

impl HfSource {
    /// Opens `dir`: config.json, the index (or the single file), every header; pairs quantized
    /// weights with their scales as the config's `quantization_config` says.
    ///
    /// Errors: [`Error::InvalidArgument`] for a missing or unparsable config.json, a missing
    /// weight file or index, or an unreadable `quantization_config`; [`Error::Validation`] for an
    /// index naming a file outside the folder or a tensor its file lacks, a tensor in two files,
    /// quantized tensors without a `quantization_config` (or without their scales), scale grids
    /// that do not fit their weights, a quantized weight the config says stays unconverted;
    /// [`Error::Corrupt`] for a damaged header; [`Error::Io`].
    pub(crate) fn open(dir: &Path) -> Result<HfSource> {
        let cfg_path = dir.join(crate::output::CONFIG);
        let config_bytes = shardwise::storage::read_regular(&cfg_path).map_err(|e| {
            Error::InvalidArgument(format!(
                "{}: cannot read the HF config ({e}); from-hf needs the folder of a Hugging Face model (config.json and safetensors files)",
                cfg_path.display()
            ))
        })?;
        let config: Json = serde_json::from_slice(&config_bytes).map_err(|e| {
            Error::InvalidArgument(format!("{}: not JSON: {e}", cfg_path.display()))
        })?;
        let scheme = quant::scheme(&config)?;
        let files = weight_files(dir)?;
        let mut handles = Vec::with_capacity(files.len());
        let mut stored: BTreeMap<String, Stored> = BTreeMap::new();
        for (i, f) in files.iter().enumerate() {
            let path = dir.join(f);
            let file = shardwise::storage::open_regular(&path).map_err(Error::io("open", &path))?;
            for (name, t) in read_header(&path, &file, i)? {
                if let Some(prev) = stored.get(&name) {
                    return Err(Error::Validation(format!(
                        "tensor {name} is in two weight files, {} and {f}",
                        files[prev.span.file]
                    )));
                }
                stored.insert(name, t);
            }
            handles.push(file);
        }
        check_index(dir, |name| {
            stored.get(name).map(|t| files[t.span.file].as_str())
        })?;
        let not_converted: Vec<String> = config
            .get("quantization_config")
            .and_then(|q| q.get("modules_to_not_convert"))
            .and_then(|m| m.as_array())
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        let tensors = pair(dir, stored, scheme, &not_converted)?;
        Ok(HfSource {
            dir: dir.to_path_buf(),
            config,
            config_bytes,
            files,
            handles,
            tensors,
        })
    }

    /// The identity of the input for a save id: config.json's bytes, each weight file's name,
    /// size and modification time.
    pub(crate) fn identity(&self) -> Result<Vec<u8>> {
        let mut id = self.config_bytes.clone();
        for (f, h) in self.files.iter().zip(&self.handles) {
            let m = h.metadata().map_err(Error::io("stat", &self.dir.join(f)))?;
            let mtime = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            id.extend_from_slice(format!("\0{f}\0{}\0{mtime}", m.len()).as_bytes());
        }
        Ok(id)
    }

    fn read_span(&self, s: &Span, buf: &mut [u8]) -> Result<()> {
        debug_assert_eq!(buf.len() as u64, s.len);
        self.handles[s.file]
            .read_exact_at(buf, s.offset)
            .map_err(Error::io("read", &self.dir.join(&self.files[s.file])))
    }

    /// Reads tensor `name` into `dst`: `prod(shape)` values of `out` (float32, bfloat16 or
    /// float16; plain tensors of another dtype must be read as their own dtype), converted or
    /// dequantized as transformers loads it.
    ///
    /// Errors: [`Error::UnsupportedDtype`] for a conversion from or to a non-float dtype;
    /// [`Error::Validation`] for a scale the MX format calls NaN; [`Error::Io`].
    pub(crate) fn read(&self, name: &str, out: DType, dst: &mut [u8]) -> Result<()> {
        let t = &self.tensors[name];
        let n: u64 = t.shape.iter().product();
        debug_assert_eq!(dst.len() as u64, n * out.itemsize());
        match &t.storage {
            Storage::Plain(s) if t.dtype == out => self.read_span(s, dst),
            Storage::Plain(s) => {
                let mut raw = vec![0u8; s.len as usize];
                self.read_span(s, &mut raw)?;
                convert_float(&raw, t.dtype, out, dst)
                    .map_err(|e| Error::UnsupportedDtype(format!("{name}: {e}")))
            }
            Storage::Fp8 {
                weight,
                scale,
                scale_dtype,
                block,
            } => {
                let mut w = vec![0u8; weight.len as usize];
                self.read_span(weight, &mut w)?;
                let mut s = vec![0u8; scale.len as usize];
                self.read_span(scale, &mut s)?;
                let s = quant::scales_f32(&t.stored[1], &s, *scale_dtype)?;
                quant::fp8_dequantize(name, &w, &t.shape, &s, *block, out, dst)
            }
            Storage::Mxfp4 { blocks, scales } => {
                let mut b = vec![0u8; blocks.len as usize];
                self.read_span(blocks, &mut b)?;
                let mut s = vec![0u8; scales.len as usize];
                self.read_span(scales, &mut s)?;
                // Dequantized as stored ([.., R, C]), then swapped into the parameter's [.., C, R].
                let mut tmp = vec![0u8; dst.len()];
                quant::mxfp4_dequantize(name, &b, &s, out, &mut tmp)?;
                let k = t.shape.len();
                let stored_shape: Vec<u64> = t.shape[..k - 2]
                    .iter()
                    .copied()
                    .chain([t.shape[k - 1], t.shape[k - 2]])
                    .collect();
                transpose_last2(&tmp, &stored_shape, out.itemsize() as usize, dst);
                Ok(())
            }
        }
    }
}

impl HfSource {
    /// Whether tensors `a` and `b` hold the same values: the same dtype, shape and stored bytes
    /// (compared 16 MiB at a time), or for a quantized one the same values as read in float32.
    ///
    /// Errors: [`Error::Io`], and [`HfSource::read`]'s.
    pub(crate) fn same_values(&self, a: &str, b: &str) -> Result<bool> {
        let (ta, tb) = (&self.tensors[a], &self.tensors[b]);
        if ta.shape != tb.shape {
            return Ok(false);
        }
        if let (Storage::Plain(sa), Storage::Plain(sb), true) =
            (&ta.storage, &tb.storage, ta.dtype == tb.dtype)
        {
            const STEP: u64 = 16 << 20;
            let (mut x, mut y) = (Vec::new(), Vec::new());
            for at in (0..sa.len).step_by(STEP as usize) {
                let n = STEP.min(sa.len - at);
                let (pa, pb) = (sa.slice(at, n), sb.slice(at, n));
                x.resize(n as usize, 0);
                y.resize(n as usize, 0);
                self.read_span(&pa, &mut x)?;
                self.read_span(&pb, &mut y)?;
                if x != y {
                    return Ok(false);
                }
            }
            return Ok(true);
        }
        let n = ta.shape.iter().product::<u64>() as usize * 4;
        let (mut x, mut y) = (vec![0u8; n], vec![0u8; n]);
        self.read(a, DType::F32, &mut x)?;
        self.read(b, DType::F32, &mut y)?;
        Ok(x == y)
    }
}

/// Swaps the last two dimensions of `src` (`shape` `[.., r, c]`, items of `item` bytes) into
/// `dst` (`[.., c, r]`).
pub(crate) fn transpose_last2(src: &[u8], shape: &[u64], item: usize, dst: &mut [u8]) {
    let k = shape.len();
    let (r, c) = (shape[k - 2] as usize, shape[k - 1] as usize);
    let mat = r * c * item;
    for (s, d) in src
        .chunks_exact(mat.max(1))
        .zip(dst.chunks_exact_mut(mat.max(1)))
    {
        for i in 0..r {
            for j in 0..c {
                let from = (i * c + j) * item;
                let to = (j * r + i) * item;
                d[to..to + item].copy_from_slice(&s[from..from + item]);
            }
        }
    }
}

/// Converts little-endian floats between float32, bfloat16 and float16 (round to nearest even).
fn convert_float(
    src: &[u8],
    from: DType,
    to: DType,
    dst: &mut [u8],
) -> std::result::Result<(), String> {
    use half::{bf16, f16};
    let get: fn(&[u8]) -> f32 = match from {
        DType::F32 => |c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
        DType::BF16 => |c| bf16::from_le_bytes([c[0], c[1]]).to_f32(),
        DType::F16 => |c| f16::from_le_bytes([c[0], c[1]]).to_f32(),
        other => {
            return Err(format!(
                "{} is not a float dtype from-hf converts",
                other.torch_name()
            ))
        }
    };
    let (fi, ti) = (from.itemsize() as usize, to.itemsize() as usize);
    match to {
        DType::F32 => src
            .chunks_exact(fi)
            .zip(dst.chunks_exact_mut(ti))
            .for_each(|(s, d)| d.copy_from_slice(&get(s).to_le_bytes())),
        DType::BF16 => src
            .chunks_exact(fi)
            .zip(dst.chunks_exact_mut(ti))
            .for_each(|(s, d)| d.copy_from_slice(&bf16::from_f32(get(s)).to_le_bytes())),
        DType::F16 => src
            .chunks_exact(fi)
            .zip(dst.chunks_exact_mut(ti))
            .for_each(|(s, d)| d.copy_from_slice(&f16::from_f32(get(s)).to_le_bytes())),
        other => {
            return Err(format!(
                "{} is not a float dtype from-hf writes",
                other.torch_name()
            ))
        }
    }
    Ok(())
}

/// Checks that every tensor the index of `dir` names is in the file it names (`holder(name)`: the
/// weight file that holds `name`, None if none does); a folder without an index passes.
///
/// Errors: [`Error::Validation`] naming the first tensor the index misplaces; the index's errors.
pub(crate) fn check_index<'a>(dir: &Path, holder: impl Fn(&str) -> Option<&'a str>) -> Result<()> {
    let Some(map) = index_map(dir)? else {
        return Ok(());
    };
    for (name, f) in &map {
        if holder(name) != Some(f.as_str()) {
            return Err(Error::Validation(format!(
                "{INDEX} puts {name} in {f}, which does not hold it"
            )));
        }
    }
    Ok(())
}

/// The weight files of `dir`, as transformers' loaders find them: those the index names (sorted,
/// each once), or `model.safetensors`.
///
/// Errors: [`Error::InvalidArgument`] for an index naming a file that is not in the folder, or a
/// folder with neither; [`Error::Validation`] for a name outside the folder; the index's errors.
pub(crate) fn weight_files(dir: &Path) -> Result<Vec<String>> {
    match index_map(dir)? {
        Some(map) => {
            let files: BTreeSet<String> = map.into_values().collect();
            for f in &files {
                check_file_name(dir, f)?;
                if !dir.join(f).is_file() {
                    return Err(Error::InvalidArgument(format!(
                        "{INDEX} names {f}, which is not a file in {}",
                        dir.display()
                    )));
                }
            }
            Ok(files.into_iter().collect())
        }
        None if dir.join(SINGLE).is_file() => Ok(vec![SINGLE.to_string()]),
        None => Err(Error::InvalidArgument(format!(
            "{} has neither {INDEX} nor {SINGLE}",
            dir.display()
        ))),
    }
}

/// The index's `weight_map` (tensor name -> file name), None without an index.
fn index_map(dir: &Path) -> Result<Option<BTreeMap<String, String>>> {
    let path = dir.join(INDEX);
    let bytes = match shardwise::storage::read_regular(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io("read", &path)(e)),
    };
    parse_index(&path, &bytes).map(Some)
}

/// The `weight_map` of index file `path` from its bytes. Untrusted input: fuzzed
/// ([`shardwise::fuzzing`]).
///
/// Errors: [`Error::Corrupt`] for JSON without a `weight_map` of file names.
pub(crate) fn parse_index(path: &Path, bytes: &[u8]) -> Result<BTreeMap<String, String>> {
    let bad = |r: &str| Error::Corrupt {
        path: path.to_path_buf(),
        reason: r.to_string(),
    };
    let v: Json = serde_json::from_slice(bytes).map_err(|e| bad(&format!("not JSON: {e}")))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("no weight_map object"))?;
    let mut out = BTreeMap::new();
    for (k, f) in map {
        let f = f
            .as_str()
            .ok_or_else(|| bad(&format!("weight_map[{k}] is not a file name")))?;
        out.insert(k.clone(), f.to_string());
    }
    Ok(out)
}

/// [`parse_header`] (of a whole file's bytes) and [`parse_index`] of untrusted bytes, results
/// dropped: the entry point of [`shardwise::fuzzing`].
pub(crate) fn parse_untrusted(header: Option<&[u8]>, index: Option<&[u8]>) {
    if let Some(b) = header {
        let _ = parse_header(Path::new("fuzz.safetensors"), b, 0);
    }
    if let Some(b) = index {
        let _ = parse_index(Path::new("fuzz.index.json"), b);
    }
}

/// Pairs stored tensors into logical ones (see the module docs): the quantized weights with their
/// scales as `scheme` says, then every other stored tensor as it is.
fn pair(
    dir: &Path,
    mut stored: BTreeMap<String, Stored>,
    scheme: Option<Scheme>,
    not_converted: &[String],
) -> Result<BTreeMap<String, HfTensor>> {
    let mut out = match scheme {
        Some(Scheme::Fp8Block(block)) => pair_fp8(&mut stored, block, not_converted)?,
        Some(Scheme::Mxfp4) => pair_mxfp4(&mut stored, not_converted)?,
        // `quant::scheme` reads no compressed-tensors or ModelOpt config: nothing to pair.
        Some(s @ (Scheme::Nvfp4(_) | Scheme::Mxfp8)) => {
            return Err(Error::InvalidArgument(format!(
                "{}: {s:?} folders are written by to-hf --quantize, not read by from-hf",
                dir.display()
            )))
        }
        None => BTreeMap::new(),
    };
    for (name, t) in stored {
        out.insert(name.clone(), plain(dir, name, t, scheme)?);
    }
    Ok(out)
}

/// Whether `module` is one `quantization_config.modules_to_not_convert` lists.
fn listed(not_converted: &[String], module: &str) -> bool {
    not_converted.iter().any(|p| module_matches(p, module))
}

/// Takes each FP8 weight `x.weight` and its scale `x.weight_scale_inv` out of `stored`, paired
/// ([`fp8_tensor`]).
///
/// Errors: [`fp8_tensor`]'s.
fn pair_fp8(
    stored: &mut BTreeMap<String, Stored>,
    block: [u64; 2],
    not_converted: &[String],
) -> Result<BTreeMap<String, HfTensor>> {
    let mut out = BTreeMap::new();
    let scales: Vec<String> = stored
        .keys()
        .filter(|k| k.ends_with(quant::SCALE_INV_SUFFIX))
        .cloned()
        .collect();
    for sname in scales {
        let wname = sname
            .strip_suffix(quant::SCALE_INV_SUFFIX)
            .unwrap()
            .to_string();
        let Some(w) = stored.remove(&wname) else {
            // Left in `stored`: reported as a tensor no rule maps.
            continue;
        };
        let s = stored.remove(&sname).unwrap();
        let t = fp8_tensor(&wname, w, sname, s, block, not_converted)?;
        out.insert(wname, t);
    }
    Ok(out)
}

/// FP8 weight `w` (`wname`) with its scale grid `s` (`sname`) in blocks of `block`.
///
/// Errors: [`Error::Validation`] for a weight that is not float8_e4m3fn, a scale grid that does
/// not fit the weight, a weight `modules_to_not_convert` lists.
fn fp8_tensor(
    wname: &str,
    w: Stored,
    sname: String,
    s: Stored,
    block: [u64; 2],
    not_converted: &[String],
) -> Result<HfTensor> {
    if w.dtype != DType::F8E4M3FN {
        return Err(Error::Validation(format!(
            "{wname} has a scale {sname} but is {}, not float8_e4m3fn",
            w.dtype.torch_name()
        )));
    }
    let want = quant::fp8_scale_shape(&w.shape, block);
    if w.shape.len() < 2 || s.shape != want {
        return Err(Error::Validation(format!(
            "{sname} has shape {:?}; its weight {wname} {:?} in {}x{} blocks needs {want:?}",
            s.shape, w.shape, block[0], block[1]
        )));
    }
    let module = wname.rsplit_once('.').map_or(wname, |(m, _)| m);
    if listed(not_converted, module) {
        return Err(Error::Validation(format!(
            "{wname} is stored quantized, but quantization_config.modules_to_not_convert lists {module}"
        )));
    }
    Ok(HfTensor {
        dtype: w.dtype,
        shape: w.shape,
        stored: vec![wname.to_string(), sname],
        storage: Storage::Fp8 {
            weight: w.span,
            scale: s.span,
            scale_dtype: s.dtype,
            block,
        },
    })
}

/// Takes each MXFP4 `x_blocks` and its `x_scales` out of `stored`, paired as `x`
/// ([`mxfp4_tensor`]).
///
/// Errors: [`Error::Validation`] for blocks without their scales; [`mxfp4_tensor`]'s.
fn pair_mxfp4(
    stored: &mut BTreeMap<String, Stored>,
    not_converted: &[String],
) -> Result<BTreeMap<String, HfTensor>> {
    let mut out = BTreeMap::new();
    let blocks: Vec<String> = stored
        .keys()
        .filter(|k| k.ends_with(quant::MXFP4_BLOCKS_SUFFIX))
        .cloned()
        .collect();
    for bname in blocks {
        let base = bname
            .strip_suffix(quant::MXFP4_BLOCKS_SUFFIX)
            .unwrap()
            .to_string();
        let sname = format!("{base}{}", quant::MXFP4_SCALES_SUFFIX);
        let Some(s) = stored.remove(&sname) else {
            return Err(Error::Validation(format!("{bname} has no scales {sname}")));
        };
        let b = stored.remove(&bname).unwrap();
        let t = mxfp4_tensor(&base, bname, b, sname, s, not_converted)?;
        out.insert(base, t);
    }
    Ok(out)
}

/// MXFP4 blocks `b` (`bname`) with their scales `s` (`sname`) as the logical tensor `base`, in
/// transformers' parameter layout (the last two dimensions of the dequantized `[.., R, G*32]`
/// swapped).
///
/// Errors: [`Error::Validation`] for blocks and scales that are not MXFP4's, a tensor
/// `modules_to_not_convert` covers.
fn mxfp4_tensor(
    base: &str,
    bname: String,
    b: Stored,
    sname: String,
    s: Stored,
    not_converted: &[String],
) -> Result<HfTensor> {
    let logical = quant::mxfp4_logical_shape(&b.shape);
    let fits = logical.is_some()
        && b.dtype == DType::U8
        && s.dtype == DType::U8
        && s.shape == b.shape[..b.shape.len() - 1];
    let Some(mut shape) = logical.filter(|l| fits && l.len() >= 2) else {
        return Err(Error::Validation(format!(
            "{bname} ({} {:?}) and {sname} ({} {:?}) are not MXFP4 blocks [.., G, 16] and scales [.., G], both uint8",
            b.dtype.torch_name(),
            b.shape,
            s.dtype.torch_name(),
            s.shape
        )));
    };
    if listed(not_converted, base) {
        return Err(Error::Validation(format!(
            "{base} is stored quantized, but quantization_config.modules_to_not_convert covers it"
        )));
    }
    let k = shape.len();
    shape.swap(k - 2, k - 1);
    Ok(HfTensor {
        dtype: DType::U8,
        shape,
        stored: vec![bname, sname],
        storage: Storage::Mxfp4 {
            blocks: b.span,
            scales: s.span,
        },
    })
}

/// Stored tensor `t` (`name`) as it is, one left unpaired: a quantized dtype is refused, as
/// nothing says how to read it.
///
/// Errors: [`Error::Validation`] for an FP8 tensor without its scale or without a
/// `quantization_config` (`scheme` None), or MXFP4 blocks without one.
fn plain(dir: &Path, name: String, t: Stored, scheme: Option<Scheme>) -> Result<HfTensor> {
    let no_config = |what: &str| {
        Error::Validation(format!(
            "{name} is {what}, but {}'s config.json has no quantization_config that says how to read it",
            dir.display()
        ))
    };
    match t.dtype {
        DType::F8E4M3FN | DType::F8E5M2 => {
            return Err(match scheme {
                None => no_config(&format!("{} (quantized)", t.dtype.torch_name())),
                Some(_) => Error::Validation(format!(
                    "{name} is {} with no {name}{} beside it",
                    t.dtype.torch_name(),
                    quant::SCALE_INV_SUFFIX
                )),
            })
        }
        DType::U8 if scheme.is_none() && name.ends_with(quant::MXFP4_BLOCKS_SUFFIX) => {
            return Err(no_config("uint8 MXFP4 blocks"))
        }
        _ => {}
    }
    Ok(HfTensor {
        dtype: t.dtype,
        shape: t.shape,
        stored: vec![name],
        storage: Storage::Plain(t.span),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modules_match_as_transformers_prefixes() {
        assert!(module_matches(
            "model.layers.*.self_attn",
            "model.layers.3.self_attn.q_proj"
        ));
        assert!(module_matches("lm_head", "lm_head"));
        assert!(!module_matches("lm_head", "lm_headx"));
        assert!(!module_matches(
            "model.layers.*.self_attn",
            "model.layers.3.mlp.experts.gate_up_proj"
        ));
        assert!(module_matches(
            "model.layers.*.mlp.router",
            "model.layers.10.mlp.router"
        ));
    }

    fn stored(dtype: DType, shape: &[u64]) -> Stored {
        Stored {
            dtype,
            shape: shape.to_vec(),
            span: Span {
                file: 0,
                offset: 0,
                len: 0,
            },
        }
    }

    #[test]
    fn an_fp8_weight_pairs_with_a_scale_grid_that_fits() {
        let w = || stored(DType::F8E4M3FN, &[256, 200]);
        let s = |shape: &[u64]| stored(DType::F32, shape);
        let pair = |w, shape: &[u64], listed: &[String]| {
            fp8_tensor(
                "m.weight",
                w,
                "m.weight_scale_inv".into(),
                s(shape),
                [128, 128],
                listed,
            )
            .map_err(|e| e.to_string())
        };
        let t = pair(w(), &[2, 2], &[]).unwrap();
        assert_eq!((t.shape.clone(), t.stored.len()), (vec![256, 200], 2));
        assert!(t.quantized());
        let e = pair(w(), &[2, 1], &[]).unwrap_err();
        assert!(e.contains("m.weight_scale_inv has shape [2, 1]; its weight m.weight [256, 200] in 128x128 blocks needs [2, 2]"), "{e}");
        let e = pair(stored(DType::BF16, &[256, 200]), &[2, 2], &[]).unwrap_err();
        assert!(e.contains("is bfloat16, not float8_e4m3fn"), "{e}");
        let e = pair(w(), &[2, 2], &["m".into()]).unwrap_err();
        assert!(e.contains("modules_to_not_convert lists m"), "{e}");
        // A scale without its weight stays, for the unmapped check.
        let mut all = BTreeMap::from([("x.weight_scale_inv".to_string(), s(&[2, 2]))]);
        assert!(pair_fp8(&mut all, [128, 128], &[]).unwrap().is_empty());
        assert_eq!(all.len(), 1);
    }

    #[test]
    fn mxfp4_blocks_pair_with_their_scales_into_the_parameter() {
        let b = || stored(DType::U8, &[2, 6, 3, 16]);
        let t = mxfp4_tensor(
            "e.down",
            "e.down_blocks".into(),
            b(),
            "e.down_scales".into(),
            stored(DType::U8, &[2, 6, 3]),
            &[],
        )
        .unwrap();
        // [E, R, G*32] stored, the parameter [E, G*32, R].
        assert_eq!(t.shape, vec![2, 96, 6]);
        let e = mxfp4_tensor(
            "e.down",
            "e.down_blocks".into(),
            b(),
            "e.down_scales".into(),
            stored(DType::U8, &[2, 6]),
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("are not MXFP4 blocks [.., G, 16]"), "{e}");
        let mut all = BTreeMap::from([("e.down_blocks".to_string(), b())]);
        let e = pair_mxfp4(&mut all, &[]).unwrap_err().to_string();
        assert!(
            e.contains("e.down_blocks has no scales e.down_scales"),
            "{e}"
        );
    }

    #[test]
    fn a_quantized_tensor_left_unpaired_is_refused() {
        let dir = Path::new("/m");
        let t = plain(dir, "n".into(), stored(DType::BF16, &[2]), None).unwrap();
        assert!(!t.quantized());
        let e = plain(dir, "n".into(), stored(DType::F8E4M3FN, &[2]), None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(
                "n is float8_e4m3fn (quantized), but /m's config.json has no quantization_config"
            ),
            "{e}"
        );
        let fp8 = Some(Scheme::Fp8Block([128, 128]));
        let e = plain(dir, "n".into(), stored(DType::F8E4M3FN, &[2]), fp8)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("n is float8_e4m3fn with no n_scale_inv beside it"),
            "{e}"
        );
        let e = plain(dir, "x_blocks".into(), stored(DType::U8, &[2]), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("x_blocks is uint8 MXFP4 blocks, but"), "{e}");
    }

    #[test]
    fn transposes_per_matrix() {
        // Two [2, 3] matrices of u8.
        let src: Vec<u8> = (0..12).collect();
        let mut dst = vec![0u8; 12];
        transpose_last2(&src, &[2, 2, 3], 1, &mut dst);
        assert_eq!(dst, vec![0, 3, 1, 4, 2, 5, 6, 9, 7, 10, 8, 11]);
    }
}
