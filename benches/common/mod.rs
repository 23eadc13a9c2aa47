//! Inputs shared by the benchmarks: simulated rank parts for the merge, a `.metadata` map of many
//! chunks, host shards for the writer. One definition each, used by `hot_paths.rs` (divan) and
//! `merge_parts.rs` (one-shot, for sizes too large to sample repeatedly).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;

use rayon::prelude::*;
use shardwise::commit::liveness::now_ns;
use shardwise::commit::part::{write_part, FileRecord, RankPart, TensorRecord, PART_FORMAT};
use shardwise::format::dtype::DType;
use shardwise::format::metadata::{Chunk, Entry, StorageInfo};
use shardwise::storage::Location;
use shardwise::writer::{Payload, TensorChunk};

/// Save id of the simulated parts.
pub const SAVE_ID: &str = "bench";

/// Every one of `world` ranks publishes a part with `chunks` bf16 chunks (one per key, rows
/// `rank*4..rank*4+4` of a `[world*4, 4096]` tensor), as `shardwise.megatron.save` would.
pub fn publish_parts(dir: &Path, world: u32, chunks: u64) {
    (0..world).into_par_iter().for_each(|rank| {
        let name = format!("__{rank}_0.distcp");
        std::fs::write(dir.join(&name), b"x").unwrap();
        let loc = Location::local(dir);
        let stamp = loc.stamp(&name).unwrap().unwrap();
        let tensors = (0..chunks)
            .map(|k| TensorRecord {
                fqn: format!("decoder.layers.{k}.mlp.linear_fc1.weight"),
                dtype: "bfloat16".into(),
                global_shape: vec![world as u64 * 4, 4096],
                offsets: vec![rank as u64 * 4, 0],
                sizes: vec![4, 4096],
                file: 0,
                offset: k * 1000,
                length: 1000,
                crc32: 0,
                blocks: vec![],
            })
            .collect();
        let part = RankPart {
            format: PART_FORMAT,
            save_id: SAVE_ID.into(),
            rank,
            world_size: world,
            megatron: false,
            published_at_ns: now_ns(),
            publisher: String::new(),
            files: vec![FileRecord {
                name,
                size: 1,
                stamp,
                sha256: None,
            }],
            tensors,
            objects: Vec::new(),
            common: None,
        };
        write_part(&loc, &part).unwrap();
    });
}

/// A global `.metadata` map of `keys` bf16 tensors of `chunks_per_key` chunks each, spread over
/// `chunks_per_key` rank files.
pub fn metadata_map(keys: usize, chunks_per_key: usize) -> BTreeMap<String, Entry> {
    (0..keys)
        .map(|k| {
            let chunks = (0..chunks_per_key)
                .map(|c| Chunk {
                    offsets: vec![c as u64 * 4, 0],
                    sizes: vec![4, 4096],
                    storage: StorageInfo {
                        relative_path: format!("__{c}_0.distcp"),
                        offset: (k as u64) * 32_960,
                        length: 32_960,
                    },
                })
                .collect();
            (
                format!("decoder.layers.{k}.self_attention.linear_qkv.weight"),
                Entry::Tensor {
                    dtype: DType::BF16,
                    global_shape: vec![chunks_per_key as u64 * 4, 4096],
                    chunks,
                },
            )
        })
        .collect()
}

/// `total` bytes of host memory (not all zero, so no filesystem shortcut) cut into fp32 chunks of
/// `piece` bytes each.
pub fn host_shards(total: usize, piece: usize) -> Vec<u8> {
    assert!(total % piece == 0 && piece % 4 == 0);
    let mut buf = vec![0u8; total];
    buf.par_chunks_mut(1 << 20).enumerate().for_each(|(i, c)| {
        c.iter_mut()
            .enumerate()
            .for_each(|(j, b)| *b = (i * 31 + j) as u8)
    });
    buf
}

/// The chunks of [`host_shards`] as writer input: one `[piece/4/1024, 1024]` fp32 tensor each.
pub fn chunks_of(buf: &[u8], piece: usize) -> Vec<TensorChunk<'_>> {
    let rows = (piece / 4 / 1024) as u64;
    buf.chunks(piece)
        .enumerate()
        .map(|(i, data)| TensorChunk {
            fqn: format!("layer.{i}.weight"),
            dtype: DType::F32,
            global_shape: vec![rows, 1024],
            offsets: vec![0, 0],
            sizes: vec![rows, 1024],
            data: Payload::Host(data),
        })
        .collect()
}
