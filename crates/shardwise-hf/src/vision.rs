//! The vision tower of a multimodal conversion (`--base-hf DIR`): a Megatron text checkpoint holds
//! no vision weights, so the multimodal model's `model.visual.*` tensors are copied byte for byte
//! from the original release's safetensors, after their names and shapes are checked against the
//! config's `vision_config` ([`super::spec::Multimodal::vision`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value as Json};

use super::plan::HfTensor;
use super::spec::{Multimodal, Post};
use super::write::{dtype_of_st, INDEX};
use shardwise::error::{Error, Result};

/// A tensor of an HF safetensors folder: its file, dtype, shape and data byte range in the file.
struct Stored {
    file: PathBuf,
    dtype: safetensors::Dtype,
    shape: Vec<u64>,
    start: u64,
    len: u64,
}

/// The tensors of the HF folder `dir` whose names start with `prefix` (the index's files, or
/// `model.safetensors`), read from the safetensors headers.
///
/// Errors: [`Error::InvalidArgument`] for a folder without weights, an index naming a file outside
/// the folder, or a header safetensors refuses; [`Error::Io`].
fn stored_tensors(dir: &Path, prefix: &str) -> Result<BTreeMap<String, Stored>> {
    let bad = |why: String| Error::InvalidArgument(format!("--base-hf {}: {why}", dir.display()));
    let index = dir.join(INDEX);
    let files: Vec<String> = match shardwise::storage::read_regular(&index) {
        Ok(bytes) => {
            let v: Json = serde_json::from_slice(&bytes)
                .map_err(|e| bad(format!("{INDEX} is not JSON: {e}")))?;
            let Some(map) = v.get("weight_map").and_then(|m| m.as_object()) else {
                return Err(bad(format!("{INDEX} has no weight_map")));
            };
            let mut files: Vec<String> = map
                .iter()
                .filter(|(k, _)| k.starts_with(prefix))
                .filter_map(|(_, f)| f.as_str().map(String::from))
                .collect();
            files.sort();
            files.dedup();
            files
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => vec!["model.safetensors".into()],
        Err(e) => return Err(Error::io("read", &index)(e)),
    };
    let mut out = BTreeMap::new();
    for name in files {
        // A plain file name: an index never leads a read out of the folder.
        if name.contains(['/', '\\']) || name.starts_with('.') {
            return Err(bad(format!(
                "{INDEX} names {name:?}, not a file of the folder"
            )));
        }
        let file = dir.join(&name);
        let f = shardwise::storage::open_regular(&file).map_err(Error::io("open", &file))?;
        // SAFETY: a read-only mapping of a file we do not write (as `diff` maps HF folders),
        // dropped once its header is read.
        let map = unsafe { memmap2::Mmap::map(&f) }.map_err(Error::io("map", &file))?;
        // The whole file, so that the safetensors crate checks every data range against it.
        let (n, meta) = safetensors::SafeTensors::read_metadata(&map)
            .map_err(|e| bad(format!("{name}: not a safetensors file: {e:?}")))?;
        let n = n as u64;
        for (k, info) in meta.tensors() {
            if !k.starts_with(prefix) {
                continue;
            }
            let (a, b) = info.data_offsets;
            out.insert(
                k.clone(),
                Stored {
                    file: file.clone(),
                    dtype: info.dtype,
                    shape: info.shape.iter().map(|&d| d as u64).collect(),
                    start: 8 + n + a as u64,
                    len: (b - a) as u64,
                },
            );
        }
    }
    Ok(out)
}

/// A product of `vision_config` fields (a number stands for itself); None when one is absent or
/// the product overflows (never a wrapped size that could match a stored shape).
fn product(vc: &Map<String, Json>, fields: &[&str]) -> Option<u64> {
    fields.iter().try_fold(1u64, |n, f| {
        n.checked_mul(f.parse().ok().or_else(|| vc.get(*f)?.as_u64())?)
    })
}

/// The vision blocks `stored` holds: the distinct `{b}` of its `<prefix>blocks.{b}.` names.
fn held_blocks(stored: &BTreeMap<String, Stored>, prefix: &str) -> u64 {
    let blocks: std::collections::BTreeSet<&str> = stored
        .keys()
        .filter_map(|k| {
            k.strip_prefix(prefix)?
                .strip_prefix("blocks.")?
                .split('.')
                .next()
        })
        .collect();
    blocks.len() as u64
}

/// The vision tensors `mm.vision` implies for `vision_config` `vc` with `depth` blocks: name ->
/// (shape, the fields of each dimension).
///
/// Errors: [`Error::InvalidArgument`] naming a tensor whose shape lacks a field.
fn wanted(
    vc: &Map<String, Json>,
    mm: &Multimodal,
    depth: u64,
) -> Result<BTreeMap<String, (Vec<u64>, String)>> {
    let mut want = BTreeMap::new();
    for o in mm.vision {
        let shape: Option<Vec<u64>> = o.shape.iter().map(|f| product(vc, f)).collect();
        let Some(shape) = shape else {
            return Err(Error::InvalidArgument(format!(
                "config.json's vision_config lacks a field of {}'s shape {:?} (or its product overflows)",
                o.name, o.shape
            )));
        };
        let fields: Vec<String> = o.shape.iter().map(|f| f.join(" x ")).collect();
        let blocks = if o.name.contains("{b}") { depth } else { 1 };
        for b in 0..blocks {
            let name = format!(
                "{}{}",
                mm.vision_prefix,
                o.name.replace("{b}", &b.to_string())
            );
            want.insert(name, (shape.clone(), fields.join(", ")));
        }
    }
    Ok(want)
}

/// The vision tensors of the multimodal model, as copies of `base`'s: every tensor
/// `mm.vision` implies for `vision_config` (of `config`, the `--hf-config`) must be in `base` with
/// that shape, and `base` may hold no other tensor under `mm.vision_prefix`; the tower's output
/// width (`out_hidden_size`) must be the text model's `hidden`. Each copy keeps its stored dtype.
///
/// Errors: [`Error::InvalidArgument`] naming what is missing, extra or of another shape (with the
/// `vision_config` fields that imply it), or a config without `vision_config`; errors of reading
/// `base`.
pub(crate) fn vision_tensors(
    base: &Path,
    config: &Json,
    mm: &Multimodal,
    hidden: u64,
) -> Result<Vec<HfTensor>> {
    let Some(Json::Object(vc)) = config.get("vision_config") else {
        return Err(Error::InvalidArgument(
            "config.json has a text_config but no vision_config: the vision tower's shapes are unknown".into(),
        ));
    };
    let field = |k: &str| {
        vc.get(k).and_then(|v| v.as_u64()).ok_or_else(|| {
            Error::InvalidArgument(format!("config.json's vision_config has no integer {k:?}"))
        })
    };
    let (depth, out_hidden) = (field("depth")?, field("out_hidden_size")?);
    if out_hidden != hidden {
        return Err(Error::InvalidArgument(format!(
            "vision_config.out_hidden_size is {out_hidden}, the text model's hidden_size {hidden}"
        )));
    }
    let stored = stored_tensors(base, mm.vision_prefix)?;
    // Checked before the names of `depth` blocks are built: a count from config.json sizes
    // nothing until the files confirm it.
    let held = held_blocks(&stored, mm.vision_prefix);
    if depth > held {
        return Err(Error::InvalidArgument(format!(
            "vision_config.depth = {depth}, but --base-hf {} holds {held} vision blocks ({}blocks.*)",
            base.display(),
            mm.vision_prefix
        )));
    }
    let want = wanted(vc, mm, depth)?;
    let missing: Vec<&str> = want
        .keys()
        .filter(|n| !stored.contains_key(*n))
        .map(|n| n.as_str())
        .collect();
    let extra: Vec<&str> = stored
        .keys()
        .filter(|n| !want.contains_key(*n))
        .map(|n| n.as_str())
        .collect();
    if !missing.is_empty() || !extra.is_empty() {
        let show = |v: &[&str]| v.iter().take(5).copied().collect::<Vec<_>>().join(", ");
        return Err(Error::InvalidArgument(format!(
            "--base-hf {}: its vision tower is not the one vision_config describes (depth {depth}): {} missing{}{}; {} not in it{}{}",
            base.display(),
            missing.len(),
            if missing.is_empty() { "" } else { ": " },
            show(&missing),
            extra.len(),
            if extra.is_empty() { "" } else { ": " },
            show(&extra),
        )));
    }
    let mut out = Vec::with_capacity(want.len());
    for (name, (shape, fields)) in want {
        let s = &stored[&name];
        if s.shape != shape {
            return Err(Error::InvalidArgument(format!(
                "--base-hf {}: {name} has shape {:?}; vision_config implies {shape:?} ({fields})",
                base.display(),
                s.shape
            )));
        }
        let dtype = dtype_of_st(s.dtype).ok_or_else(|| {
            Error::UnsupportedDtype(format!("{name}: {:?} in --base-hf", s.dtype))
        })?;
        let bytes = shape
            .iter()
            .try_fold(dtype.itemsize(), |n, &d| n.checked_mul(d));
        if bytes != Some(s.len) {
            return Err(Error::InvalidArgument(format!(
                "--base-hf {}: {name}'s data range is {} bytes, not {shape:?} of {}",
                base.display(),
                s.len,
                dtype.torch_name()
            )));
        }
        out.push(HfTensor {
            name,
            shape,
            src_dtype: dtype,
            pieces: Vec::new(),
            post: Post::None,
            from_file: Some((s.file.clone(), s.start)),
            quant: None,
            with_previous: false,
        });
    }
    Ok(out)
}
