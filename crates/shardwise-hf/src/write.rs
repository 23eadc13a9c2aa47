//! The output: the shard plan (which HF tensors go to which file), safetensors headers
//! (`safetensors` crate format), the data written in parallel at precomputed offsets, and
//! `model.safetensors.index.json` as `transformers` writes it.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Mutex;

use rayon::prelude::*;
use serde::Serialize;

use super::finite::{self, NonFinite};
use super::plan::{read_hf_tensor, HfTensor};
use super::quant;
use shardwise::error::{Error, Result, Stopped};
use shardwise::format::dtype::DType;
use shardwise::reader::Checkpoint;
use shardwise::storage::DataFile;

/// The index file name.
pub(crate) const INDEX: &str = "model.safetensors.index.json";

fn st_dtype(d: DType) -> Result<safetensors::Dtype> {
    use safetensors::Dtype as S;
    Ok(match d {
        DType::F32 => S::F32,
        DType::F64 => S::F64,
        DType::F16 => S::F16,
        DType::BF16 => S::BF16,
        DType::I64 => S::I64,
        DType::I32 => S::I32,
        DType::I16 => S::I16,
        DType::I8 => S::I8,
        DType::U8 => S::U8,
        DType::Bool => S::BOOL,
        DType::F8E4M3FN => S::F8_E4M3,
        DType::F8E5M2 => S::F8_E5M2,
        other => {
            return Err(Error::UnsupportedDtype(format!(
                "{} in safetensors output",
                other.torch_name()
            )))
        }
    })
}

/// The checkpoint dtype of a safetensors dtype (the inverse of [`st_dtype`]); None for dtypes
/// DCP has no name for.
pub(crate) fn dtype_of_st(d: safetensors::Dtype) -> Option<DType> {
    DType::READABLE
        .iter()
        .copied()
        .find(|&t| st_dtype(t).ok() == Some(d))
}

/// Converts little-endian floats between float32, bfloat16 and float16.
fn convert(bytes: &[u8], from: DType, to: DType) -> Result<Vec<u8>> {
    use half::{bf16, f16};
    let vals: Vec<f32> = match from {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => {
            return Err(Error::UnsupportedDtype(format!(
                "conversion from {}",
                other.torch_name()
            )))
        }
    };
    Ok(match to {
        DType::F32 => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::BF16 => vals
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
            .collect(),
        DType::F16 => vals
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_le_bytes())
            .collect(),
        other => {
            return Err(Error::UnsupportedDtype(format!(
                "conversion to {}",
                other.torch_name()
            )))
        }
    })
}

/// One output file: its tensors (indices into the plan's tensor list) and its header.
pub(crate) struct Shard {
    pub tensors: Vec<usize>,
    /// The JSON header, padded with spaces to a multiple of 8 bytes.
    pub header: Vec<u8>,
    /// Data bytes after the header.
    pub data_len: u64,
}

/// The output files of a conversion, fully determined by the tensor list and the options: every
/// tensor's file and absolute offset are known before any data moves.
pub(crate) struct ShardPlan {
    pub shards: Vec<Shard>,
    /// HF tensor name -> file name.
    pub weight_map: BTreeMap<String, String>,
    /// Sum of the data bytes.
    pub total: u64,
}

impl ShardPlan {
    pub fn file_name(&self, k: usize) -> String {
        format!("model-{:05}-of-{:05}.safetensors", k + 1, self.shards.len())
    }
}

/// safetensors refuses to open a file whose header is larger than this
/// (`safetensors::tensor::MAX_HEADER_SIZE`, 100 MB in safetensors 0.4-0.8).
pub(crate) const MAX_HEADER_BYTES: usize = 100_000_000;

/// What the shard plan allows a header to grow to: 10% below [`MAX_HEADER_BYTES`], so that the
/// estimate of an entry (which bounds each data offset by 20 digits) never matters.
pub(crate) const HEADER_BUDGET: usize = 90_000_000;

/// The safetensors tensors HF tensor `t` is written as, in file order (name, dtype, shape): itself
/// in the output dtype, or its quantized form ([`quant::stored`]: the weight and its scales,
/// always in one file).
fn st_tensors(t: &HfTensor, out_dtype: Option<DType>) -> Vec<(String, DType, Vec<u64>)> {
    match t.quant {
        Some(s) => quant::stored(&t.name, &t.shape, s),
        None => vec![(t.name.clone(), t.out_dtype(out_dtype), t.shape.clone())],
    }
}

/// The bytes written for `t` (all of its [`st_tensors`]).
fn written_bytes(t: &HfTensor, out_dtype: Option<DType>) -> u64 {
    st_tensors(t, out_dtype)
        .iter()
        .map(|(_, d, s)| s.iter().product::<u64>() * d.itemsize())
        .sum()
}

/// An upper bound of `t`'s entries in a safetensors header: per stored tensor
/// `"name":{"dtype":"BF16","shape":[..],"data_offsets":[a,b]},` with both offsets at 20 digits.
fn header_entry_bound(t: &HfTensor, out_dtype: Option<DType>) -> usize {
    st_tensors(t, out_dtype)
        .iter()
        .map(|(name, _, shape)| {
            let name = serde_json::to_string(name).map_or(name.len() * 6 + 2, |s| s.len());
            let shape: usize = shape.iter().map(|d| d.to_string().len() + 1).sum();
            name + shape + 100
        })
        .sum()
}

/// Shards greedy in tensor order, each at most `max_shard_bytes` of data (a larger tensor gets
/// its own file; a run of tensors quantized together, [`HfTensor::with_previous`], is never split,
/// so a file can exceed the size by the rest of that run) and at most `header_budget` bytes of header (a conversion of about 1.2M small
/// tensors into one 5 GB shard would otherwise write a 137 MB header that safetensors refuses);
/// `out_dtype` is the output dtype (None: as stored). A pure function of its arguments, so that
/// every part of a split conversion computes the same files.
///
/// Errors: [`Error::UnsupportedDtype`] for a dtype safetensors lacks; [`Error::InvalidArgument`]
/// if a header still came out over [`MAX_HEADER_BYTES`] (one tensor name larger than that).
pub(crate) fn shard_plan(
    tensors: &[HfTensor],
    out_dtype: Option<DType>,
    max_shard_bytes: u64,
    header_budget: usize,
) -> Result<ShardPlan> {
    let nbytes = |t: &HfTensor| written_bytes(t, out_dtype);
    // `{"__metadata__":{"format":"pt"},` and the closing brace.
    const HEADER_BASE: usize = 64;
    let mut groups: Vec<Vec<usize>> = vec![Vec::new()];
    let (mut size, mut header) = (0u64, HEADER_BASE);
    for (i, t) in tensors.iter().enumerate() {
        let (n, h) = (nbytes(t), header_entry_bound(t, out_dtype));
        let full = size + n > max_shard_bytes || header + h > header_budget;
        // A scale group's run of tensors stays in one file (one job writes it).
        if !groups.last().unwrap().is_empty() && full && !t.with_previous {
            groups.push(Vec::new());
            (size, header) = (0, HEADER_BASE);
        }
        groups.last_mut().unwrap().push(i);
        size += n;
        header += h;
    }
    let mut shards = Vec::with_capacity(groups.len());
    for idx in groups {
        let mut infos = Vec::with_capacity(idx.len());
        let mut at = 0usize;
        for &i in &idx {
            for (name, dtype, shape) in st_tensors(&tensors[i], out_dtype) {
                let n = (shape.iter().product::<u64>() * dtype.itemsize()) as usize;
                infos.push((
                    name,
                    safetensors::tensor::TensorInfo {
                        dtype: st_dtype(dtype)?,
                        shape: shape.iter().map(|&d| d as usize).collect(),
                        data_offsets: (at, at + n),
                    },
                ));
                at += n;
            }
        }
        let meta = safetensors::tensor::Metadata::new(
            Some(HashMap::from([("format".to_string(), "pt".to_string())])),
            infos,
        )
        .map_err(|e| Error::InvalidArgument(format!("safetensors header: {e}")))?;
        let mut header = serde_json::to_vec(&meta)
            .map_err(|e| Error::InvalidArgument(format!("safetensors header: {e}")))?;
        header.resize(header.len().next_multiple_of(8), b' ');
        if header.len() > MAX_HEADER_BYTES {
            return Err(Error::InvalidArgument(format!(
                "a safetensors header of {} bytes (safetensors opens at most {MAX_HEADER_BYTES})",
                header.len()
            )));
        }
        shards.push(Shard {
            tensors: idx,
            header,
            data_len: at as u64,
        });
    }
    let mut plan = ShardPlan {
        shards,
        weight_map: BTreeMap::new(),
        total: 0,
    };
    for k in 0..plan.shards.len() {
        let name = plan.file_name(k);
        for &i in &plan.shards[k].tensors {
            for (st, _, _) in st_tensors(&tensors[i], out_dtype) {
                plan.weight_map.insert(st, name.clone());
            }
        }
        plan.total += plan.shards[k].data_len;
    }
    Ok(plan)
}

/// How [`write_shards`] writes values: `dtype` the output dtype (None: as stored), and whether
/// non-finite values are quantized anyway (`--allow-nonfinite`) instead of refused.
#[derive(Clone, Copy)]
pub(crate) struct Values {
    pub dtype: Option<DType>,
    pub allow_nonfinite: bool,
}

/// Writes shards `which` of `plan` (indices into `plan.shards`), shard k to `path(k)`: headers
/// first, then every tensor of those shards read, converted to `values.dtype` (or quantized) and
/// written at its offset by `threads` workers; files are synced. `progress(bytes)` is called as
/// tensors are written. Returns the non-finite values of each HF tensor written that holds any
/// ([`finite`]), by name.
///
/// Errors: the reads' and conversions' errors; [`Error::Validation`] for a tensor to quantize
/// that holds NaN or infinities ([`finite::refusal`]) unless `values.allow_nonfinite`; storage
/// errors; [`Error::Interrupted`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn write_shards(
    ckpt: &Checkpoint,
    tensors: &[HfTensor],
    plan: &ShardPlan,
    which: &[usize],
    values: Values,
    threads: usize,
    path: &dyn Fn(usize) -> PathBuf,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<BTreeMap<String, NonFinite>> {
    // The write jobs: each a run of (tensor, file, absolute offset), one tensor or a scale group.
    let mut jobs: Vec<Vec<(usize, usize, u64)>> = Vec::new();
    let mut files = Vec::with_capacity(which.len());
    for (f, &k) in which.iter().enumerate() {
        let s = &plan.shards[k];
        let data_start = 8 + s.header.len() as u64;
        let file = DataFile::create(&path(k), data_start + s.data_len)?;
        file.write_at(&(s.header.len() as u64).to_le_bytes(), 0)?;
        file.write_at(&s.header, 8)?;
        let mut off = 0u64;
        for &i in &s.tensors {
            match jobs.last_mut() {
                Some(run) if tensors[i].with_previous => run.push((i, f, data_start + off)),
                _ => jobs.push(vec![(i, f, data_start + off)]),
            }
            off += written_bytes(&tensors[i], values.dtype);
        }
        files.push(file);
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build()
        .map_err(|e| Error::InvalidArgument(format!("thread pool: {e}")))?;
    let nonfinite = Mutex::new(BTreeMap::new());
    // The workers run on the pool while this thread watches for Ctrl-C (the interrupt check runs
    // Python's signal handlers, which only the calling thread may): a job not yet started, and a
    // job between its read and its write, stop with `Interrupted`, so the conversion ends within
    // about one job's read and nothing is committed.
    let (total, _) = shardwise::interrupt::watching(|cancel| -> Result<u64> {
        let stopped = || -> Result<()> {
            match cancel.load(Ordering::Relaxed) {
                true => Err(Error::Interrupted(Stopped::Commit)),
                false => Ok(()),
            }
        };
        pool.install(|| {
            jobs.par_iter()
                .with_max_len(1)
                .map(|run| -> Result<u64> {
                    stopped()?;
                    let outputs = run_bytes(ckpt, tensors, run, values)?;
                    stopped()?;
                    let mut n = 0;
                    for (&(i, f, off), (bytes, found)) in run.iter().zip(outputs) {
                        files[f].write_at(&bytes, off)?;
                        progress(bytes.len() as u64);
                        n += bytes.len() as u64;
                        if found.total() > 0 {
                            let mut m = nonfinite.lock().unwrap_or_else(|e| e.into_inner());
                            m.insert(tensors[i].name.clone(), found);
                        }
                    }
                    Ok(n)
                })
                .sum::<Result<u64>>()
        })
    });
    total?;
    for f in &files {
        f.sync()?;
    }
    Ok(nonfinite.into_inner().unwrap_or_else(|e| e.into_inner()))
}

/// The bytes written for each tensor of `run` (a tensor, or a scale group's members in order),
/// with the non-finite values of what it writes: each read, then converted to the output dtype
/// (counted in the bytes written), or rounded to it and quantized ([`quant::quantize_prepared`],
/// counted in the rounded values, and refused unless `values.allow_nonfinite`) with the largest
/// `|x|` over the whole run as its tensor-scale statistic.
///
/// Errors: the reads' and conversions' errors; [`Error::Validation`] for non-finite values to
/// quantize, naming the first member of the run that holds any.
fn run_bytes(
    ckpt: &Checkpoint,
    tensors: &[HfTensor],
    run: &[(usize, usize, u64)],
    values: Values,
) -> Result<Vec<(Vec<u8>, NonFinite)>> {
    let read = |t: &HfTensor| -> Result<Vec<u8>> {
        let item = t.src_dtype.itemsize();
        let mut buf = vec![0u8; (t.shape.iter().product::<u64>() * item) as usize];
        read_hf_tensor(ckpt, t, &mut buf)?;
        Ok(buf)
    };
    if let [(i, _, _)] = run {
        let t = &tensors[*i];
        if t.quant.is_none() {
            let out = t.out_dtype(values.dtype);
            let buf = read(t)?;
            let buf = if out == t.src_dtype {
                buf
            } else {
                convert(&buf, t.src_dtype, out)?
            };
            let found = finite::count(&buf, out);
            return Ok(vec![(buf, found)]);
        }
    }
    // Quantized: a tensor alone, or a scale group (every member is quantized, see
    // `gather_scale_groups`), rounded to the output dtype and checked before any is quantized.
    let mut prepared = Vec::with_capacity(run.len());
    for &(i, _, _) in run {
        let t = &tensors[i];
        let out = t.out_dtype(values.dtype);
        let scheme = t.quant.ok_or_else(|| {
            Error::Validation(format!("{}: in a scale group but not quantized", t.name))
        })?;
        let x = quant::prepared(&t.name, &read(t)?, t.src_dtype, out)?;
        let found = finite::count_f32(&x);
        if found.total() > 0 && !values.allow_nonfinite {
            return Err(Error::Validation(finite::refusal(
                scheme.quantize_name(),
                &t.name,
                found,
                out,
            )));
        }
        prepared.push((t, scheme, out, x, found));
    }
    let group_amax = prepared
        .iter()
        .map(|(_, _, _, x, _)| quant::amax(x))
        .fold(0f32, f32::max);
    prepared
        .into_iter()
        .map(|(t, scheme, out, x, found)| {
            let bytes = quant::quantize_prepared(&t.name, scheme, x, out, &t.shape, group_amax)?;
            Ok((bytes, found))
        })
        .collect()
}

/// The bytes of `model.safetensors.index.json`.
pub(crate) fn index_bytes(plan: &ShardPlan) -> Vec<u8> {
    #[derive(Serialize)]
    struct Index<'a> {
        metadata: BTreeMap<&'a str, u64>,
        weight_map: &'a BTreeMap<String, String>,
    }
    let index = Index {
        metadata: BTreeMap::from([("total_size", plan.total)]),
        weight_map: &plan.weight_map,
    };
    serde_json::to_vec_pretty(&index).expect("serializable")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(n: usize) -> Vec<HfTensor> {
        (0..n)
            .map(|i| HfTensor {
                name: format!("model.layers.{i}.mlp.experts.{i}.gate_proj.weight"),
                shape: vec![1],
                src_dtype: DType::BF16,
                pieces: Vec::new(),
                post: super::super::spec::Post::None,
                from_file: None,
                quant: None,
                with_previous: false,
            })
            .collect()
    }

    /// Each planned file, with zeros for data, as safetensors parses it.
    fn parses(plan: &ShardPlan) {
        for s in &plan.shards {
            let mut buf = (s.header.len() as u64).to_le_bytes().to_vec();
            buf.extend_from_slice(&s.header);
            buf.resize(buf.len() + s.data_len as usize, 0);
            let st = safetensors::SafeTensors::deserialize(&buf).expect("safetensors opens it");
            assert_eq!(st.len(), s.tensors.len());
        }
    }

    #[test]
    fn headers_stay_under_the_budget() {
        let t = tiny(1000);
        let plan = shard_plan(&t, None, 5_000_000_000, 8192).unwrap();
        assert!(plan.shards.len() > 1);
        assert!(plan.shards.iter().all(|s| s.header.len() <= 8192));
        assert_eq!(plan.weight_map.len(), 1000);
        parses(&plan);
        // Order and coverage: the shards are consecutive runs of the tensor list.
        let all: Vec<usize> = plan.shards.iter().flat_map(|s| s.tensors.clone()).collect();
        assert_eq!(all, (0..1000).collect::<Vec<_>>());
    }

    #[test]
    fn a_million_tensors_never_make_a_header_safetensors_refuses() {
        // The case: ~1.2M tensors under the default 5 GB shard size wrote a 136.7 MB header.
        let t = tiny(1_200_000);
        let plan = shard_plan(&t, None, 5_000_000_000, HEADER_BUDGET).unwrap();
        assert!(plan.shards.len() >= 2);
        assert!(plan.shards.iter().all(|s| s.header.len() <= HEADER_BUDGET));
        parses(&plan);
    }
}
