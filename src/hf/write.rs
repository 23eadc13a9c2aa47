//! The output: the shard plan (which HF tensors go to which file), safetensors headers
//! (`safetensors` crate format), the data written in parallel at precomputed offsets, and
//! `model.safetensors.index.json` as `transformers` writes it.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use rayon::prelude::*;
use serde::Serialize;

use super::plan::{read_hf_tensor, HfTensor};
use crate::error::{Error, Result};
use crate::format::dtype::DType;
use crate::reader::Checkpoint;
use crate::storage::{atomic_write, DataFile};

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

/// Shards greedy in tensor order, each at most `max_shard_bytes` of data (a larger tensor gets
/// its own file); `out_dtype` is the output dtype (None: as stored).
pub(crate) fn shard_plan(
    tensors: &[HfTensor],
    out_dtype: Option<DType>,
    max_shard_bytes: u64,
) -> Result<ShardPlan> {
    let dtype = |t: &HfTensor| out_dtype.unwrap_or(t.src_dtype);
    let nbytes = |t: &HfTensor| t.shape.iter().product::<u64>() * dtype(t).itemsize();
    let mut groups: Vec<Vec<usize>> = vec![Vec::new()];
    let mut size = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        let n = nbytes(t);
        if size > 0 && size + n > max_shard_bytes {
            groups.push(Vec::new());
            size = 0;
        }
        groups.last_mut().unwrap().push(i);
        size += n;
    }
    let mut shards = Vec::with_capacity(groups.len());
    for idx in groups {
        let mut infos = Vec::with_capacity(idx.len());
        let mut at = 0usize;
        for &i in &idx {
            let t = &tensors[i];
            let n = nbytes(t) as usize;
            infos.push((
                t.name.clone(),
                safetensors::tensor::TensorInfo {
                    dtype: st_dtype(dtype(t))?,
                    shape: t.shape.iter().map(|&d| d as usize).collect(),
                    data_offsets: (at, at + n),
                },
            ));
            at += n;
        }
        let meta = safetensors::tensor::Metadata::new(
            Some(HashMap::from([("format".to_string(), "pt".to_string())])),
            infos,
        )
        .map_err(|e| Error::InvalidArgument(format!("safetensors header: {e}")))?;
        let mut header = serde_json::to_vec(&meta)
            .map_err(|e| Error::InvalidArgument(format!("safetensors header: {e}")))?;
        header.resize(header.len().next_multiple_of(8), b' ');
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
            plan.weight_map
                .insert(tensors[i].name.clone(), name.clone());
        }
        plan.total += plan.shards[k].data_len;
    }
    Ok(plan)
}

/// Writes the shard files of `plan` into `dir`: headers first, then every tensor read, converted
/// to `out_dtype` and written at its offset by `threads` workers; files are synced.
/// `progress(bytes)` is called as tensors are written. Returns the data bytes written.
pub(crate) fn write_shards(
    ckpt: &Checkpoint,
    tensors: &[HfTensor],
    plan: &ShardPlan,
    out_dtype: Option<DType>,
    threads: usize,
    dir: &Path,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<u64> {
    let mut place: Vec<(usize, u64)> = vec![(0, 0); tensors.len()];
    let mut files = Vec::with_capacity(plan.shards.len());
    for (k, s) in plan.shards.iter().enumerate() {
        let data_start = 8 + s.header.len() as u64;
        let f = DataFile::create(&dir.join(plan.file_name(k)), data_start + s.data_len)?;
        f.write_at(&(s.header.len() as u64).to_le_bytes(), 0)?;
        f.write_at(&s.header, 8)?;
        let mut off = 0u64;
        for &i in &s.tensors {
            place[i] = (k, data_start + off);
            let t = &tensors[i];
            off += t.shape.iter().product::<u64>() * out_dtype.unwrap_or(t.src_dtype).itemsize();
        }
        files.push(f);
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build()
        .map_err(|e| Error::InvalidArgument(format!("thread pool: {e}")))?;
    let total: u64 = pool.install(|| {
        tensors
            .par_iter()
            .enumerate()
            .map(|(i, t)| -> Result<u64> {
                let item = t.src_dtype.itemsize();
                let mut buf = vec![0u8; (t.shape.iter().product::<u64>() * item) as usize];
                read_hf_tensor(ckpt, t, &mut buf)?;
                let out = out_dtype.unwrap_or(t.src_dtype);
                let bytes = if out == t.src_dtype {
                    buf
                } else {
                    convert(&buf, t.src_dtype, out)?
                };
                let (k, off) = place[i];
                files[k].write_at(&bytes, off)?;
                progress(bytes.len() as u64);
                Ok(bytes.len() as u64)
            })
            .sum::<Result<u64>>()
    })?;
    for f in &files {
        f.sync()?;
    }
    Ok(total)
}

/// Writes `model.safetensors.index.json` into `dir` (atomically).
pub(crate) fn write_index(dir: &Path, plan: &ShardPlan) -> Result<()> {
    #[derive(Serialize)]
    struct Index<'a> {
        metadata: BTreeMap<&'a str, u64>,
        weight_map: &'a BTreeMap<String, String>,
    }
    let index = Index {
        metadata: BTreeMap::from([("total_size", plan.total)]),
        weight_map: &plan.weight_map,
    };
    atomic_write(
        &dir.join(INDEX),
        &serde_json::to_vec_pretty(&index).expect("serializable"),
    )
}
