//! Merge cost at scale: `world_size` ranks each publish a part with `chunks` tensor chunks, then one
//! merger collects, validates and commits them. Run: `cargo bench --bench merge_parts -- 8192 1000`
//! (defaults: 2048 ranks x 200 chunks). Prints seconds per phase and the `.metadata` size.

use std::time::{Duration, Instant};

use rayon::prelude::*;
use shardwise::format::metadata::emit_metadata;
use shardwise::rendezvous::{
    build_global, collect_parts, merge, write_part, FileRecord, RankPart, TensorRecord, PART_FORMAT,
};

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let world = *args.first().unwrap_or(&2048) as u32;
    let chunks = *args.get(1).unwrap_or(&200);
    let dir = tempfile::tempdir().unwrap();
    let t0 = Instant::now();
    (0..world).into_par_iter().for_each(|rank| {
        let name = format!("__{rank}_0.distcp");
        std::fs::write(dir.path().join(&name), b"x").unwrap();
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
            })
            .collect();
        let part = RankPart {
            format: PART_FORMAT,
            save_id: "bench".into(),
            rank,
            world_size: world,
            megatron: false,
            files: vec![FileRecord { name, size: 1 }],
            tensors,
            objects: Vec::new(),
            common: None,
        };
        write_part(dir.path(), &part).unwrap();
    });
    let publish_s = t0.elapsed().as_secs_f64();
    let t = Instant::now();
    let parts = collect_parts(dir.path(), "bench", world, Duration::from_secs(60)).unwrap();
    let collect_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let global = build_global(dir.path(), &parts).unwrap();
    let validate_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let meta = emit_metadata(&global);
    let emit_s = t.elapsed().as_secs_f64();
    println!("phases: read parts {collect_s:.2}s, validate {validate_s:.2}s, pickle .metadata {emit_s:.2}s ({} bytes)", meta.len());
    let t1 = Instant::now();
    let summary = merge(dir.path(), "bench", world, Duration::from_secs(60)).unwrap();
    let merge_s = t1.elapsed().as_secs_f64();
    println!(
        "ranks {world}, chunks/rank {chunks}: publish {publish_s:.2}s (all ranks, this machine), merge+validate+commit {merge_s:.2}s, \
         {} chunks, .metadata {:.1} MiB",
        summary.tensor_chunks,
        summary.metadata_bytes as f64 / (1 << 20) as f64
    );
}
