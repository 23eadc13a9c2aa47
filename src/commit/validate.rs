//! Pure validation of a save's parts: the checks of DCP's `_validate_global_plan` and Megatron's
//! `validate_sharding_integrity` (bounds, overlaps, coverage, dtype/shape agreement, ShardedObject
//! completeness), done on the parts alone, without storage or a collective.
//!
//! A merge folds each part into a [`Fold`] as soon as it is read and drops it: keys are interned
//! once, and a chunk is kept as its dimensions and where its item is (no strings), so a save of
//! millions of chunks merges in a bounded, compact index. [`Fold::finish`] runs the checks that need
//! every part and gives the [`Global`] index, from which `.metadata` and the checksum sidecar are
//! written.

use std::collections::HashMap;
use std::sync::Mutex;

use rayon::prelude::*;

use super::part::{ObjectShard, ObjectView, PartItems, RankPart, TensorView};
use crate::error::{Error, Result};
use crate::format::dtype::DType;
use crate::format::metadata::{check_bounds, check_layout_boxes, volume, MetadataSource};
use crate::format::pickle::FxBuildHasher;
use crate::format::sidecar;

/// Where one item is: its rank, the index of its file in that rank's part, the byte offset and
/// length of its archive, its CRC-32 and its payload's block CRC-32s ([`crate::blockcrc`]).
#[derive(Clone, Debug)]
struct Item {
    rank: u32,
    file: u32,
    offset: u64,
    length: u64,
    crc32: u32,
    blocks: Box<[u32]>,
}

#[derive(Debug)]
enum Kind {
    Tensor {
        dtype: DType,
        dtype_name: Box<str>,
        shape: Box<[u64]>,
        first_rank: u32,
        /// Per chunk, its offsets then its sizes (`2 * shape.len()` values).
        dims: Vec<u64>,
        items: Vec<Item>,
    },
    Object {
        item: Item,
        shard: Option<ObjectShard>,
    },
}

#[derive(Debug)]
struct Key {
    fqn: Box<str>,
    kind: Kind,
}

#[derive(Default)]
struct Index {
    ids: HashMap<Box<str>, u32, FxBuildHasher>,
    keys: Vec<Key>,
}

/// The parts of a save folded as they are read; [`Fold::add_part`] may be called from several
/// threads at once, in any rank order.
#[derive(Default)]
pub struct Fold(Mutex<Index>);

impl Fold {
    /// Folds the items of `part` (a part without its items, as [`super::part::decode_part_items`]
    /// gives it). The checks that need only this part and the keys seen so far run here.
    ///
    /// Errors: [`Error::Validation`] naming keys and ranks (an item whose file the part does not
    /// list, an unknown dtype, a dtype or global shape another rank disagrees with, a chunk
    /// outside its global shape, a byte object saved twice, a key both tensor and object).
    pub fn add_part(&self, part: &RankPart, (tensors, objects): PartItems<'_>) -> Result<()> {
        let rank = part.rank;
        let file = |i: u32| -> Result<u32> {
            if (i as usize) < part.files.len() {
                Ok(i)
            } else {
                Err(Error::Validation(format!(
                    "rank {rank}: item refers to file #{i}, which the part does not list"
                )))
            }
        };
        let mut index = self.0.lock().unwrap_or_else(|e| e.into_inner());
        for t in &tensors {
            let item = Item {
                rank,
                file: file(t.file)?,
                offset: t.offset,
                length: t.length,
                crc32: t.crc32,
                blocks: t.blocks.as_slice().into(),
            };
            index.add_tensor(rank, t, item)?;
        }
        for o in objects {
            let item = Item {
                rank,
                file: file(o.file)?,
                offset: o.offset,
                length: o.length,
                crc32: o.crc32,
                blocks: Box::default(),
            };
            index.add_object(o, item)?;
        }
        Ok(())
    }

    /// Runs the checks that need every part (bounds, overlaps and coverage per key, ShardedObject
    /// completeness, agreement on the Megatron flag, `common.pt`) and gives the global index, keys
    /// sorted, each key's chunks in rank order (within a rank, in its part's order). `parts` are
    /// the folded parts (their items are not read).
    ///
    /// Errors: [`Error::Validation`] naming keys and ranks.
    pub fn finish(self, parts: &[RankPart]) -> Result<Global> {
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
        let mut keys = self.0.into_inner().unwrap_or_else(|e| e.into_inner()).keys;
        keys.par_sort_unstable_by(|a, b| a.fqn.cmp(&b.fqn));
        // Tensors: rank order, then bounds, overlaps and coverage, per key in parallel.
        keys.par_iter_mut().try_for_each(|k| match &mut k.kind {
            Kind::Tensor {
                shape, dims, items, ..
            } => {
                let n = 2 * shape.len();
                if !items.windows(2).all(|w| w[0].rank <= w[1].rank) {
                    let mut order: Vec<usize> = (0..items.len()).collect();
                    order.sort_by_key(|&i| items[i].rank);
                    *dims = order
                        .iter()
                        .flat_map(|&i| dims[i * n..(i + 1) * n].iter().copied())
                        .collect();
                    *items = order.iter().map(|&i| items[i].clone()).collect();
                }
                let half = shape.len();
                check_layout_boxes(
                    &k.fqn,
                    shape,
                    items.len(),
                    &|i| (&dims[i * n..i * n + half], &dims[i * n + half..(i + 1) * n]),
                    &|i| format!("rank {}", items[i].rank),
                )
                .map_err(Error::Validation)
            }
            Kind::Object { .. } => Ok(()),
        })?;
        check_sharded_objects(keys.iter().filter_map(|k| match &k.kind {
            Kind::Object {
                item,
                shard: Some(s),
            } => Some((item.rank, s)),
            _ => None,
        }))?;
        let mut files: Vec<Vec<String>> = Vec::new();
        for p in parts {
            let r = p.rank as usize;
            if files.len() <= r {
                files.resize(r + 1, Vec::new());
            }
            files[r] = p.files.iter().map(|f| f.name.clone()).collect();
        }
        let mut first_file = Vec::with_capacity(files.len() + 1);
        first_file.push(0);
        for f in &files {
            first_file.push(first_file.last().unwrap() + f.len());
        }
        Ok(Global {
            keys,
            files,
            first_file,
        })
    }
}

impl Index {
    fn id(&mut self, fqn: &str, new: impl FnOnce() -> Kind) -> (u32, bool) {
        if let Some(&id) = self.ids.get(fqn) {
            return (id, false);
        }
        let id = self.keys.len() as u32;
        self.ids.insert(fqn.into(), id);
        self.keys.push(Key {
            fqn: fqn.into(),
            kind: new(),
        });
        (id, true)
    }

    fn add_tensor(&mut self, rank: u32, t: &TensorView, item: Item) -> Result<()> {
        let dtype = match self.ids.get(t.fqn).map(|&id| &self.keys[id as usize].kind) {
            Some(Kind::Tensor {
                dtype_name, dtype, ..
            }) if **dtype_name == *t.dtype => *dtype,
            _ => DType::from_torch_name(t.dtype)?,
        };
        let (id, _) = self.id(t.fqn, || Kind::Tensor {
            dtype,
            dtype_name: t.dtype.into(),
            shape: t.global_shape.to_vec().into(),
            first_rank: rank,
            dims: Vec::new(),
            items: Vec::new(),
        });
        let key = &mut self.keys[id as usize];
        let Kind::Tensor {
            dtype_name,
            shape,
            first_rank,
            dims,
            items,
            ..
        } = &mut key.kind
        else {
            return Err(Error::Validation(format!(
                "key {} is both a tensor and a byte object",
                t.fqn
            )));
        };
        if **dtype_name != *t.dtype || **shape != *t.global_shape {
            return Err(Error::Validation(format!(
                "key {}: rank {} saves it as {} {:?}, rank {} as {} {:?}",
                t.fqn, first_rank, dtype_name, shape, rank, t.dtype, &*t.global_shape
            )));
        }
        // Bounds now: the chunks of a key are stored with the key's number of dimensions.
        check_bounds(&key.fqn, shape, &t.offsets, &t.sizes, &|| {
            format!("rank {rank}")
        })
        .map_err(Error::Validation)?;
        dims.extend_from_slice(&t.offsets);
        dims.extend_from_slice(&t.sizes);
        items.push(item);
        Ok(())
    }

    fn add_object(&mut self, o: ObjectView, item: Item) -> Result<()> {
        let rank = item.rank;
        let (id, new) = self.id(o.fqn, || Kind::Object {
            item,
            shard: o.shard.clone(),
        });
        if new {
            return Ok(());
        }
        match &self.keys[id as usize].kind {
            Kind::Object { item: other, .. } => Err(Error::Validation(format!(
                "byte object {} is written by ranks {} and {}; exactly one main replica may save it",
                o.fqn, other.rank, rank
            ))),
            Kind::Tensor { .. } => Err(Error::Validation(format!(
                "key {} is both a tensor and a byte object",
                o.fqn
            ))),
        }
    }
}

/// The global index of a save, validated: what `.metadata` and the checksum sidecar are written
/// from ([`MetadataSource`], [`Global::checksums`]).
#[derive(Debug)]
pub struct Global {
    keys: Vec<Key>,
    /// File names of each rank's part, by rank.
    files: Vec<Vec<String>>,
    /// Per rank, the id of its first file when all ranks' files are numbered in rank order (and
    /// the number of files last): the file ids of [`MetadataSource::file_id`].
    first_file: Vec<usize>,
}

impl Global {
    /// Number of tensor chunks and of byte objects.
    pub fn counts(&self) -> (usize, usize) {
        self.keys.iter().fold((0, 0), |(t, o), k| match &k.kind {
            Kind::Tensor { items, .. } => (t + items.len(), o),
            Kind::Object { .. } => (t, o + 1),
        })
    }

    /// Number of keys saved as tensors.
    pub fn tensor_keys(&self) -> usize {
        self.keys
            .iter()
            .filter(|k| matches!(k.kind, Kind::Tensor { .. }))
            .count()
    }

    fn item(&self, key: usize, chunk: usize) -> &Item {
        match &self.keys[key].kind {
            Kind::Tensor { items, .. } => &items[chunk],
            Kind::Object { item, .. } => item,
        }
    }

    /// The checksum sidecar ([`sidecar::Checksums`]), keys in sorted order, handed to `out` piece
    /// by piece (about 1 MiB each) as it is encoded ([`sidecar::frame`]).
    ///
    /// Errors: [`Error::InvalidArgument`] if it cannot be encoded; those of `out`.
    pub fn write_checksums(
        &self,
        save_id: &str,
        out: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let (t, o) = self.counts();
        let (mut buf, tail) = sidecar::frame(save_id, t + o, crate::blockcrc::BLOCK_BYTES)?;
        for k in 0..self.keys.len() {
            let chunks = self.tensor(k).map(|(_, _, n)| n);
            for c in 0..chunks.unwrap_or(1) {
                let (relative_path, offset, length) = self.storage(k, c);
                let item = sidecar::ItemRef {
                    fqn: self.fqn(k),
                    offsets: chunks.map(|_| self.chunk(k, c).0),
                    relative_path,
                    offset,
                    length,
                    crc32: self.item(k, c).crc32,
                    blocks: &self.item(k, c).blocks,
                };
                sidecar::encode_item(&mut buf, &item)?;
                if buf.len() >= 1 << 20 {
                    out(&buf)?;
                    buf.clear();
                }
            }
        }
        buf.extend_from_slice(&tail);
        out(&buf)
    }
}

impl MetadataSource for Global {
    fn keys(&self) -> usize {
        self.keys.len()
    }
    fn fqn(&self, key: usize) -> &str {
        &self.keys[key].fqn
    }
    fn tensor(&self, key: usize) -> Option<(DType, &[u64], usize)> {
        match &self.keys[key].kind {
            Kind::Tensor {
                dtype,
                shape,
                items,
                ..
            } => Some((*dtype, shape, items.len())),
            Kind::Object { .. } => None,
        }
    }
    fn chunk(&self, key: usize, chunk: usize) -> (&[u64], &[u64]) {
        match &self.keys[key].kind {
            Kind::Tensor { shape, dims, .. } => {
                let n = shape.len();
                let d = &dims[chunk * 2 * n..(chunk + 1) * 2 * n];
                (&d[..n], &d[n..])
            }
            Kind::Object { .. } => (&[], &[]),
        }
    }
    fn storage(&self, key: usize, chunk: usize) -> (&str, u64, u64) {
        let i = self.item(key, chunk);
        (
            &self.files[i.rank as usize][i.file as usize],
            i.offset,
            i.length,
        )
    }
    fn files(&self) -> usize {
        self.first_file.last().copied().unwrap_or(0)
    }
    fn file_id(&self, key: usize, chunk: usize) -> Option<usize> {
        let i = self.item(key, chunk);
        Some(self.first_file[i.rank as usize] + i.file as usize)
    }
}

/// Validates whole parts and builds their global index ([`Fold`] over parts held in memory).
///
/// Errors: as [`Fold::add_part`] and [`Fold::finish`].
pub fn build_global(parts: &[RankPart]) -> Result<Global> {
    let fold = Fold::default();
    for p in parts {
        let items = (
            p.tensors.iter().map(TensorView::from).collect(),
            p.objects.iter().map(ObjectView::from).collect(),
        );
        fold.add_part(p, items)?;
    }
    fold.finish(parts)
}

/// Every ShardedObject key must be saved at every offset of its global shape, exactly once.
fn check_sharded_objects<'a>(objects: impl Iterator<Item = (u32, &'a ObjectShard)>) -> Result<()> {
    let mut by_key: HashMap<&str, (Vec<u64>, Vec<Vec<u64>>)> = HashMap::new();
    for (rank, s) in objects {
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
        // More than 2^64 shards cannot have been saved: counts as incomplete.
        let total = volume(&shape).map_or(u128::MAX, u128::from);
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
            publisher: String::new(),
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
                    blocks: vec![],
                })
                .collect(),
            objects: vec![],
            common: None,
        }
    }

    #[test]
    fn a_complete_layout_merges() {
        let g = build_global(&[part(0, &[("w", 0, 2)]), part(1, &[("w", 2, 2)])]).unwrap();
        assert_eq!(g.counts(), (2, 0));
        assert_eq!(
            g.tensor(0).map(|(_, shape, n)| (shape.to_vec(), n)),
            Some((vec![4], 2))
        );
    }

    /// Each way parts can disagree, and the message that names it (a table: the exact error per
    /// case, not only that there is one).
    #[test]
    fn disagreeing_parts_are_refused_naming_keys_and_ranks() {
        let dtype = || {
            let mut p = part(1, &[("w", 2, 2)]);
            p.tensors[0].dtype = "torch.bfloat16".into();
            p
        };
        let flag = || {
            let mut p = part(1, &[("w", 2, 2)]);
            p.megatron = true;
            p
        };
        let outside = || {
            let mut p = part(1, &[("w", 2, 2)]);
            p.tensors[0].offsets = vec![3];
            p
        };
        let object = |rank| {
            let mut p = part(rank, &[("w", 2 * rank as u64, 2)]);
            p.objects.push(crate::commit::part::ObjectRecord {
                fqn: "o".into(),
                shard: None,
                file: 0,
                offset: 0,
                length: 1,
                crc32: 0,
            });
            p
        };
        let cases: [(&str, Vec<RankPart>, &str); 6] = [
            (
                "overlap",
                vec![part(0, &[("w", 0, 3)]), part(1, &[("w", 2, 2)])],
                "key w: rank 0 and rank 1 both save overlapping chunks (offsets [0] sizes [3] and offsets [2] sizes [2])",
            ),
            (
                "gap",
                vec![part(0, &[("w", 0, 1)]), part(1, &[("w", 2, 2)])],
                "key w: the saved chunks cover 3 of 4 elements of global shape [4] (coverage gap)",
            ),
            (
                "dtype",
                vec![part(0, &[("w", 0, 2)]), dtype()],
                "key w: rank 0 saves it as torch.float32 [4], rank 1 as torch.bfloat16 [4]",
            ),
            (
                "flag",
                vec![part(0, &[("w", 0, 2)]), flag()],
                "rank 1 disagrees with rank 0 on the Megatron layout flag",
            ),
            (
                "bounds",
                vec![part(0, &[("w", 0, 2)]), outside()],
                "key w: rank 1 saves chunk offsets [3] sizes [2], outside the global shape [4]",
            ),
            (
                "object twice",
                vec![object(0), object(1)],
                "byte object o is written by ranks 0 and 1; exactly one main replica may save it",
            ),
        ];
        for (what, parts, want) in cases {
            match build_global(&parts) {
                Err(Error::Validation(m)) => assert!(m.contains(want), "{what}: {m}"),
                Err(e) => panic!("{what}: not a validation error: {e}"),
                Ok(_) => panic!("{what}: merged"),
            }
        }
    }

    /// Parts folded in any order give the `.metadata` of the chunks in rank order, and a sidecar
    /// that reads back as [`sidecar::Checksums`] with every item.
    #[test]
    fn folded_parts_emit_the_metadata_and_sidecar_of_their_chunks() {
        use crate::commit::part::ObjectRecord;
        use crate::format::metadata::{
            emit_metadata, emit_metadata_from, Chunk, Entry, StorageInfo,
        };
        use crate::format::sidecar::{Checksums, ItemChecksum};
        let mut parts: Vec<RankPart> = (0..3)
            .map(|r| part(r, &[("w", 0, 0), ("b", 0, 0)]))
            .collect();
        for p in &mut parts {
            let r = p.rank as u64;
            p.tensors[0].global_shape = vec![6, 70_000];
            p.tensors[0].offsets = vec![2 * r, 0];
            p.tensors[0].sizes = vec![2, 70_000];
            p.tensors[0].offset = 5_000_000_000 + r;
            p.tensors[0].crc32 = r as u32;
            p.tensors[0].blocks = vec![r as u32, 7];
            p.tensors[1].offsets = vec![r];
            p.tensors[1].sizes = vec![if r == 2 { 2 } else { 1 }];
        }
        parts[1].objects.push(ObjectRecord {
            fqn: "o".into(),
            shard: None,
            file: 0,
            offset: 3,
            length: 4,
            crc32: 9,
        });
        // Arrival order 2, 0, 1.
        let fold = Fold::default();
        for i in [2, 0, 1] {
            let p = &parts[i];
            let items = (
                p.tensors.iter().map(TensorView::from).collect(),
                p.objects.iter().map(ObjectView::from).collect(),
            );
            fold.add_part(p, items).unwrap();
        }
        let g = fold.finish(&parts).unwrap();

        let mut want = std::collections::BTreeMap::new();
        let mut items = Vec::new();
        for key in ["b", "o", "w"] {
            let mut chunks = Vec::new();
            for p in &parts {
                let path = p.files[0].name.clone();
                for t in p.tensors.iter().filter(|t| t.fqn == key) {
                    chunks.push(Chunk {
                        offsets: t.offsets.clone(),
                        sizes: t.sizes.clone(),
                        storage: StorageInfo {
                            relative_path: path.clone(),
                            offset: t.offset,
                            length: t.length,
                        },
                    });
                    items.push(ItemChecksum {
                        fqn: key.into(),
                        offsets: Some(t.offsets.clone()),
                        relative_path: path.clone(),
                        offset: t.offset,
                        length: t.length,
                        crc32: t.crc32,
                        blocks: t.blocks.clone(),
                    });
                }
                for o in p.objects.iter().filter(|o| o.fqn == key) {
                    let storage = StorageInfo {
                        relative_path: path.clone(),
                        offset: o.offset,
                        length: o.length,
                    };
                    want.insert(key.to_string(), Entry::Bytes { storage });
                    items.push(ItemChecksum {
                        fqn: key.into(),
                        offsets: None,
                        relative_path: path.clone(),
                        offset: o.offset,
                        length: o.length,
                        crc32: o.crc32,
                        blocks: vec![],
                    });
                }
            }
            if !chunks.is_empty() {
                let shape = parts[0].tensors.iter().find(|t| t.fqn == key).unwrap();
                want.insert(
                    key.to_string(),
                    Entry::Tensor {
                        dtype: DType::F32,
                        global_shape: shape.global_shape.clone(),
                        chunks,
                    },
                );
            }
        }
        assert_eq!(emit_metadata_from(&g), emit_metadata(&want));
        let mut sidecar = Vec::new();
        g.write_checksums("s", &mut |b| Ok(sidecar.extend_from_slice(b)))
            .unwrap();
        let sums: Checksums = rmp_serde::from_slice(&sidecar).unwrap();
        assert_eq!(
            sums,
            Checksums {
                save_id: "s".into(),
                items,
                block_bytes: crate::blockcrc::BLOCK_BYTES,
            }
        );
    }

    #[test]
    fn an_item_pointing_past_the_files_list_is_refused() {
        let mut p = part(0, &[("w", 0, 4)]);
        p.tensors[0].file = 5;
        assert!(build_global(&[p])
            .unwrap_err()
            .to_string()
            .contains("file #5"));
    }
}
