//! Decodes a DCP `.metadata` pickle, as data, into [`Entry`] values (the same types the writer
//! emits). Handles torch 2.3–2.15 (`StorageMeta`, 5- and 6-tuple `TensorProperties`, pathlib
//! variants, `transform_descriptors`), torch ≤2.2's `_shard` classes, and Megatron's variants
//! (`mcore_data`, `MCoreMetadata`, `all_local_plans`), which are recognised by class name and
//! field, never by running their code (dcp-format.md §3, megatron-torch-dist.md §1.5).

use std::collections::{BTreeMap, HashMap};

use crate::format::dtype::DType;
use crate::format::metadata::{Chunk, Entry, StorageInfo};
use crate::format::unpickle::{unpickle, Value};

/// A decoding failure, with the path of the offending field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetadataError(pub String);

type R<T> = Result<T, MetadataError>;

fn bad<T>(msg: impl Into<String>) -> R<T> {
    Err(MetadataError(msg.into()))
}

/// What `.metadata` describes.
#[derive(Debug, Clone, Default)]
pub struct CheckpointMetadata {
    /// Keys in sorted order. A tensor chunk whose storage entry is missing from `storage_data` has
    /// `relative_path` empty (reported by `verify`).
    pub entries: BTreeMap<String, Entry>,
    /// `transform_descriptors` per item (`stream.zstd/1`, ...), keyed like `storage_data`.
    pub transforms: HashMap<(String, Option<Vec<u64>>), Vec<String>>,
    /// The pickled top-level class (`torch...Metadata` or Megatron's `MCoreMetadata`).
    pub class: String,
    /// Megatron ≤0.15 `mcore_data[key]['nd_reformulated_orig_global_shape']`.
    pub nd_reformulated: BTreeMap<String, Vec<u64>>,
}

fn class_name(v: &Value) -> Option<String> {
    match v {
        Value::Object(o) => o.class.global().map(|(m, n)| format!("{m}.{n}")),
        _ => None,
    }
}

/// The BUILD state of an object, or the object itself when it is a plain dict.
fn state(v: &Value) -> Option<Value> {
    match v {
        Value::Object(o) => o.state.borrow().clone(),
        Value::Dict(_) => Some(v.clone()),
        _ => None,
    }
}

fn dict_pairs(v: &Value, what: &str) -> R<Vec<(Value, Value)>> {
    match v {
        Value::Dict(d) => Ok(d.borrow().clone()),
        other => bad(format!("{what} is {}, not a dict", other.kind())),
    }
}

/// `torch.Size((..))`, or a plain tuple/list of ints.
fn size(v: &Value, what: &str) -> R<Vec<u64>> {
    let items = match v {
        Value::Call(c) if c.0.global().is_some_and(|(_, n)| n == "Size") => {
            c.1.items()
                .and_then(|a| a.first().and_then(|t| t.items()))
                .ok_or_else(|| MetadataError(format!("{what}: bad torch.Size")))?
        }
        other => other
            .items()
            .ok_or_else(|| MetadataError(format!("{what} is {}, not a shape", other.kind())))?,
    };
    items
        .iter()
        .map(|x| {
            x.as_int()
                .and_then(|i| u64::try_from(i).ok())
                .ok_or_else(|| MetadataError(format!("{what}: {} is not a dimension", x.kind())))
        })
        .collect()
}

fn dtype_of(props: &Value, fqn: &str) -> R<DType> {
    // 2.3+: the state is the tuple (dtype, layout, requires_grad, memory_format, pin_memory[, strides]).
    let st = match props {
        Value::Object(o) => o.state.borrow().clone(),
        _ => None,
    }
    .ok_or_else(|| MetadataError(format!("{fqn}: TensorProperties without state")))?;
    let dtype = match &st {
        Value::Tuple(t) if t.len() == 5 || t.len() == 6 => t[0].clone(),
        Value::Dict(_) => st
            .get("dtype")
            .ok_or_else(|| MetadataError(format!("{fqn}: TensorProperties without dtype")))?,
        other => return bad(format!("{fqn}: TensorProperties state is {}", other.kind())),
    };
    match dtype.global() {
        Some(("torch", name)) => {
            DType::from_torch_name(name).map_err(|e| MetadataError(format!("{fqn}: {e}")))
        }
        _ => bad(format!("{fqn}: dtype is {}", dtype.kind())),
    }
}

/// Decodes `.metadata` bytes.
///
/// Errors: [`MetadataError`] for a pickle that is malformed or whose structure is not DCP metadata.
pub fn read_metadata(bytes: &[u8]) -> R<CheckpointMetadata> {
    let top = unpickle(bytes).map_err(|e| MetadataError(format!("not a readable pickle: {e}")))?;
    let class = class_name(&top).ok_or_else(|| {
        MetadataError(format!(
            "top-level value is {}, not a Metadata object",
            top.kind()
        ))
    })?;
    if !(class.ends_with(".Metadata") || class.ends_with(".MCoreMetadata")) {
        return bad(format!(
            "top-level class is {class}, not torch.distributed.checkpoint.metadata.Metadata"
        ));
    }
    let st = state(&top).ok_or_else(|| MetadataError("Metadata without state".into()))?;
    let sdm = st
        .get("state_dict_metadata")
        .ok_or_else(|| MetadataError("Metadata without state_dict_metadata".into()))?;

    let mut storage: HashMap<(String, Option<Vec<u64>>), StorageInfo> = HashMap::new();
    let mut transforms = HashMap::new();
    if let Some(sd) = st.get("storage_data") {
        for (k, v) in dict_pairs(&sd, "storage_data")? {
            let ks = state(&k)
                .ok_or_else(|| MetadataError(format!("storage_data key is {}", k.kind())))?;
            let fqn = ks
                .get("fqn")
                .and_then(|f| f.as_str().map(String::from))
                .ok_or_else(|| MetadataError("MetadataIndex without fqn".into()))?;
            let offset = match ks.get("offset") {
                None | Some(Value::None) => None,
                Some(o) => Some(size(&o, &format!("{fqn}: MetadataIndex.offset"))?),
            };
            let vs = state(&v)
                .ok_or_else(|| MetadataError(format!("{fqn}: storage info is {}", v.kind())))?;
            let path = vs
                .get("relative_path")
                .and_then(|p| p.as_str().map(String::from))
                .ok_or_else(|| MetadataError(format!("{fqn}: relative_path is not a string")))?;
            let num = |name: &str| -> R<u64> {
                vs.get(name)
                    .and_then(|x| x.as_int())
                    .and_then(|i| u64::try_from(i).ok())
                    .ok_or_else(|| {
                        MetadataError(format!("{fqn}: {name} is not a non-negative int"))
                    })
            };
            let info = StorageInfo {
                relative_path: path,
                offset: num("offset")?,
                length: num("length")?,
            };
            if let Some(list) = vs.get("transform_descriptors").and_then(|t| t.items()) {
                let names: Vec<String> = list
                    .iter()
                    .filter_map(|d| d.as_str().map(String::from))
                    .collect();
                if !names.is_empty() {
                    transforms.insert((fqn.clone(), offset.clone()), names);
                }
            }
            storage.insert((fqn, offset), info);
        }
    }

    let mut entries = BTreeMap::new();
    for (k, v) in dict_pairs(&sdm, "state_dict_metadata")? {
        let fqn = k
            .as_str()
            .ok_or_else(|| MetadataError(format!("state_dict_metadata key is {}", k.kind())))?
            .to_string();
        let cls = class_name(&v).unwrap_or_default();
        let missing = || StorageInfo {
            relative_path: String::new(),
            offset: 0,
            length: 0,
        };
        if cls.ends_with(".BytesStorageMetadata") {
            let storage = storage
                .get(&(fqn.clone(), None))
                .cloned()
                .unwrap_or_else(missing);
            entries.insert(fqn, Entry::Bytes { storage });
        } else if cls.ends_with(".TensorStorageMetadata") {
            let ts = state(&v).ok_or_else(|| {
                MetadataError(format!("{fqn}: TensorStorageMetadata without state"))
            })?;
            let props = ts
                .get("properties")
                .ok_or_else(|| MetadataError(format!("{fqn}: no properties")))?;
            let dtype = dtype_of(&props, &fqn)?;
            let global_shape = size(
                &ts.get("size")
                    .ok_or_else(|| MetadataError(format!("{fqn}: no size")))?,
                &format!("{fqn}: size"),
            )?;
            let chunk_list = ts
                .get("chunks")
                .and_then(|c| c.items())
                .ok_or_else(|| MetadataError(format!("{fqn}: chunks is not a list")))?;
            let mut chunks = Vec::with_capacity(chunk_list.len());
            for c in &chunk_list {
                let cs = state(c)
                    .ok_or_else(|| MetadataError(format!("{fqn}: chunk is {}", c.kind())))?;
                let offsets = size(
                    &cs.get("offsets").unwrap_or(Value::None),
                    &format!("{fqn}: chunk offsets"),
                )?;
                let sizes = size(
                    &cs.get("sizes").unwrap_or(Value::None),
                    &format!("{fqn}: chunk sizes"),
                )?;
                let storage = storage
                    .get(&(fqn.clone(), Some(offsets.clone())))
                    .cloned()
                    .unwrap_or_else(missing);
                chunks.push(Chunk {
                    offsets,
                    sizes,
                    storage,
                });
            }
            entries.insert(
                fqn,
                Entry::Tensor {
                    dtype,
                    global_shape,
                    chunks,
                },
            );
        } else {
            return bad(format!(
                "{fqn}: unknown storage metadata class {:?} ({})",
                cls,
                v.kind()
            ));
        }
    }

    let mut nd_reformulated = BTreeMap::new();
    if let Some(mcore) = st.get("mcore_data") {
        for (k, v) in dict_pairs(&mcore, "mcore_data").unwrap_or_default() {
            if let (Some(key), Some(shape)) =
                (k.as_str(), v.get("nd_reformulated_orig_global_shape"))
            {
                if let Ok(s) = size(&shape, key) {
                    nd_reformulated.insert(key.to_string(), s);
                }
            }
        }
    }
    Ok(CheckpointMetadata {
        entries,
        transforms,
        class,
        nd_reformulated,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::metadata::emit_metadata;

    #[test]
    fn reads_back_what_the_writer_emits() {
        let mut entries = BTreeMap::new();
        let info = |o| StorageInfo {
            relative_path: "__0_0.distcp".into(),
            offset: o,
            length: 10,
        };
        entries.insert(
            "w".to_string(),
            Entry::Tensor {
                dtype: DType::BF16,
                global_shape: vec![4, 2],
                chunks: vec![
                    Chunk {
                        offsets: vec![0, 0],
                        sizes: vec![2, 2],
                        storage: info(0),
                    },
                    Chunk {
                        offsets: vec![2, 0],
                        sizes: vec![2, 2],
                        storage: info(10),
                    },
                ],
            },
        );
        entries.insert(
            "o/shard_0_1".to_string(),
            Entry::Bytes { storage: info(20) },
        );
        let md = read_metadata(&emit_metadata(&entries)).unwrap();
        assert_eq!(md.entries, entries);
        assert_eq!(md.class, "torch.distributed.checkpoint.metadata.Metadata");
    }

    #[test]
    fn reads_a_metadata_of_more_than_a_million_stack_items() {
        // storage_data of 600,000 chunks puts 1,200,000 items above one MARK (over the fixed
        // stack bound that small inputs get).
        let n = 600_000u64;
        let chunks = (0..n)
            .map(|i| Chunk {
                offsets: vec![i],
                sizes: vec![1],
                storage: StorageInfo {
                    relative_path: "__0_0.distcp".into(),
                    offset: i * 10,
                    length: 10,
                },
            })
            .collect();
        let mut entries = BTreeMap::new();
        entries.insert(
            "w".to_string(),
            Entry::Tensor {
                dtype: DType::F32,
                global_shape: vec![n],
                chunks,
            },
        );
        let md = read_metadata(&emit_metadata(&entries)).unwrap();
        assert_eq!(md.entries, entries);
    }
}
