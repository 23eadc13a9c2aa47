//! Pure validation of a save's parts: the checks of DCP's `_validate_global_plan` and Megatron's
//! `validate_sharding_integrity` (bounds, overlaps, coverage, dtype/shape agreement, ShardedObject
//! completeness), done on the parts alone, without storage or a collective.

use std::collections::{BTreeMap, HashMap};

use rayon::prelude::*;

use super::part::{ObjectRecord, RankPart};
use super::{Checksums, ItemChecksum};
use crate::error::{Error, Result};
use crate::format::dtype::DType;
use crate::format::metadata::{check_layout, volume, Chunk, Entry, StorageInfo};

/// Validates the parts and builds the global entries; the checks of DCP's
/// `_validate_global_plan` and Megatron's `validate_sharding_integrity`, done without a collective.
///
/// Errors: [`Error::Validation`] naming keys and ranks.
pub fn build_global(parts: &[RankPart]) -> Result<BTreeMap<String, Entry>> {
    struct Agg {
        dtype: String,
        shape: Vec<u64>,
        first_rank: u32,
        chunks: Vec<(u32, Chunk)>,
    }
    let megatron = parts.first().map(|p| p.megatron).unwrap_or(false);
    if let Some(p) = parts.iter().find(|p| p.megatron != megatron) {
        return Err(Error::Validation(format!(
            "rank {} disagrees with rank 0 on the Megatron layout flag",
            p.rank
        )));
    }
    if megatron && !parts.iter().any(|p| p.common.is_some()) {
        return Err(Error::Validation(
            "no rank wrote common.pt (Megatron loaders require it)".into(),
        ));
    }

    let mut tensors: HashMap<&str, Agg> = HashMap::new();
    let mut objects: HashMap<&str, (u32, &ObjectRecord, StorageInfo)> = HashMap::new();
    for p in parts {
        let file_name = |i: u32| -> Result<&str> {
            p.files
                .get(i as usize)
                .map(|f| f.name.as_str())
                .ok_or_else(|| {
                    Error::Validation(format!(
                        "rank {}: item refers to file #{i}, which the part does not list",
                        p.rank
                    ))
                })
        };
        for t in &p.tensors {
            DType::from_torch_name(&t.dtype)?;
            let storage = StorageInfo {
                relative_path: file_name(t.file)?.to_string(),
                offset: t.offset,
                length: t.length,
            };
            let agg = tensors.entry(t.fqn.as_str()).or_insert_with(|| Agg {
                dtype: t.dtype.clone(),
                shape: t.global_shape.clone(),
                first_rank: p.rank,
                chunks: Vec::new(),
            });
            if agg.dtype != t.dtype || agg.shape != t.global_shape {
                return Err(Error::Validation(format!(
                    "key {}: rank {} saves it as {} {:?}, rank {} as {} {:?}",
                    t.fqn, agg.first_rank, agg.dtype, agg.shape, p.rank, t.dtype, t.global_shape
                )));
            }
            agg.chunks.push((
                p.rank,
                Chunk {
                    offsets: t.offsets.clone(),
                    sizes: t.sizes.clone(),
                    storage,
                },
            ));
        }
        for o in &p.objects {
            let storage = StorageInfo {
                relative_path: file_name(o.file)?.to_string(),
                offset: o.offset,
                length: o.length,
            };
            if let Some((other, _, _)) = objects.get(o.fqn.as_str()) {
                return Err(Error::Validation(format!(
                    "byte object {} is written by ranks {other} and {}; exactly one main replica may save it",
                    o.fqn, p.rank
                )));
            }
            if tensors.contains_key(o.fqn.as_str()) {
                return Err(Error::Validation(format!(
                    "key {} is both a tensor and a byte object",
                    o.fqn
                )));
            }
            objects.insert(o.fqn.as_str(), (p.rank, o, storage));
        }
    }
    if let Some(k) = objects.keys().find(|k| tensors.contains_key(*k)) {
        return Err(Error::Validation(format!(
            "key {k} is both a tensor and a byte object"
        )));
    }

    // Tensors: bounds, overlaps and coverage, per key in parallel.
    let mut checked: Vec<(String, Entry)> = tensors
        .into_par_iter()
        .map(|(fqn, agg)| {
            let refs: Vec<&Chunk> = agg.chunks.iter().map(|(_, c)| c).collect();
            check_layout(fqn, &agg.shape, &refs, &|i| {
                format!("rank {}", agg.chunks[i].0)
            })
            .map_err(Error::Validation)?;
            let dtype = DType::from_torch_name(&agg.dtype)?;
            let chunks = agg.chunks.into_iter().map(|(_, c)| c).collect();
            Ok((
                fqn.to_string(),
                Entry::Tensor {
                    dtype,
                    global_shape: agg.shape,
                    chunks,
                },
            ))
        })
        .collect::<Result<_>>()?;

    check_sharded_objects(objects.values().map(|(r, o, _)| (*r, *o)))?;
    checked.extend(
        objects
            .into_iter()
            .map(|(k, (_, _, storage))| (k.to_string(), Entry::Bytes { storage })),
    );
    Ok(checked.into_iter().collect())
}

/// Every ShardedObject key must be saved at every offset of its global shape, exactly once.
fn check_sharded_objects<'a>(objects: impl Iterator<Item = (u32, &'a ObjectRecord)>) -> Result<()> {
    let mut by_key: HashMap<&str, (Vec<u64>, Vec<Vec<u64>>)> = HashMap::new();
    for (rank, o) in objects {
        let Some(s) = &o.shard else { continue };
        let e = by_key
            .entry(s.key.as_str())
            .or_insert_with(|| (s.global_shape.clone(), Vec::new()));
        if e.0 != s.global_shape {
            return Err(Error::Validation(format!(
                "ShardedObject {}: rank {rank} uses global shape {:?}, another rank {:?}",
                s.key, s.global_shape, e.0
            )));
        }
        e.1.push(s.global_offset.clone());
    }
    for (key, (shape, offsets)) in by_key {
        let total = volume(&shape);
        if offsets.len() as u128 != total {
            let have: std::collections::HashSet<&Vec<u64>> = offsets.iter().collect();
            let mut missing = Vec::new();
            let mut idx = vec![0u64; shape.len()];
            'outer: for _ in 0..total.min(1 << 20) {
                if !have.contains(&idx) && missing.len() < 8 {
                    missing.push(idx.clone());
                }
                for d in (0..shape.len()).rev() {
                    idx[d] += 1;
                    if idx[d] < shape[d] {
                        continue 'outer;
                    }
                    idx[d] = 0;
                }
            }
            return Err(Error::Validation(format!(
                "ShardedObject {key}: {} of {total} shards saved for global shape {shape:?}; missing offsets {missing:?}",
                offsets.len()
            )));
        }
    }
    Ok(())
}

pub fn checksums(save_id: &str, parts: &[RankPart]) -> Checksums {
    let mut items = Vec::new();
    for p in parts {
        let name = |i: u32| {
            p.files
                .get(i as usize)
                .map(|f| f.name.clone())
                .unwrap_or_default()
        };
        for t in &p.tensors {
            items.push(ItemChecksum {
                fqn: t.fqn.clone(),
                offsets: Some(t.offsets.clone()),
                relative_path: name(t.file),
                offset: t.offset,
                length: t.length,
                crc32: t.crc32,
            });
        }
        for o in &p.objects {
            items.push(ItemChecksum {
                fqn: o.fqn.clone(),
                offsets: None,
                relative_path: name(o.file),
                offset: o.offset,
                length: o.length,
                crc32: o.crc32,
            });
        }
    }
    Checksums {
        save_id: save_id.to_string(),
        items,
    }
}


#[cfg(test)]
mod tests {
    use super::*;
    use crate::commit::part::{FileRecord, TensorRecord, PART_FORMAT};

    fn part(rank: u32, chunks: &[(&str, u64, u64)]) -> RankPart {
        RankPart {
            format: PART_FORMAT,
            save_id: "s".into(),
            rank,
            world_size: 2,
            megatron: false,
            published_at_ns: 1,
            files: vec![FileRecord {
                name: format!("__{rank}_0.distcp"),
                size: 100,
                stamp: String::new(),
                sha256: None,
            }],
            tensors: chunks
                .iter()
                .map(|&(fqn, off, len)| TensorRecord {
                    fqn: fqn.into(),
                    dtype: "torch.float32".into(),
                    global_shape: vec![4],
                    offsets: vec![off],
                    sizes: vec![len],
                    file: 0,
                    offset: 0,
                    length: 10,
                    crc32: 0,
                })
                .collect(),
            objects: vec![],
            common: None,
        }
    }

    #[test]
    fn a_complete_layout_merges() {
        let g = build_global(&[part(0, &[("w", 0, 2)]), part(1, &[("w", 2, 2)])]).unwrap();
        match &g["w"] {
            Entry::Tensor { chunks, .. } => assert_eq!(chunks.len(), 2),
            _ => panic!("not a tensor"),
        }
    }

    #[test]
    fn overlap_gap_and_disagreement_are_refused_naming_ranks() {
        let overlap = build_global(&[part(0, &[("w", 0, 3)]), part(1, &[("w", 2, 2)])]);
        assert!(overlap.unwrap_err().to_string().contains("rank"));
        let gap = build_global(&[part(0, &[("w", 0, 1)]), part(1, &[("w", 2, 2)])]);
        assert!(gap.is_err());
        let mut other = part(1, &[("w", 2, 2)]);
        other.tensors[0].dtype = "torch.bfloat16".into();
        let e = build_global(&[part(0, &[("w", 0, 2)]), other]).unwrap_err();
        assert!(e.to_string().contains("rank 1"), "{e}");
        let mut flag = part(1, &[("w", 2, 2)]);
        flag.megatron = true;
        assert!(build_global(&[part(0, &[("w", 0, 2)]), flag]).is_err());
    }

    #[test]
    fn an_item_pointing_past_the_files_list_is_refused() {
        let mut p = part(0, &[("w", 0, 4)]);
        p.tensors[0].file = 5;
        assert!(build_global(&[p]).unwrap_err().to_string().contains("file #5"));
    }
}
