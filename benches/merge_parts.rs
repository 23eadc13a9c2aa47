//! Merge cost at scale: `world_size` ranks each publish a part with `chunks` tensor chunks, then one
//! merger collects, validates and commits them. Run: `cargo bench --bench merge_parts -- 8192 1000`
//! (defaults: 2048 ranks x 200 chunks). Prints seconds per phase and the `.metadata` size, then the
//! same as one `JSON {...}` line. The parts are those of `common::publish_parts` (shared with the
//! divan benchmarks in `hot_paths.rs`).

mod common;

use std::time::{Duration, Instant};

use shardwise::format::metadata::emit_metadata;
use shardwise::commit::validate::build_global;
use shardwise::commit::wait::{collect_parts, Freshness};
use shardwise::commit::merge;
use shardwise::storage::Location;

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let world = *args.first().unwrap_or(&2048) as u32;
    let chunks = *args.get(1).unwrap_or(&200);
    let dir = tempfile::tempdir().unwrap();
    let loc = Location::local(dir.path());
    let t0 = Instant::now();
    common::publish_parts(dir.path(), world, chunks);
    let publish_s = t0.elapsed().as_secs_f64();
    let t = Instant::now();
    let parts = collect_parts(&loc, common::SAVE_ID, world, Duration::from_secs(60), &Freshness::from_now()).unwrap();
    let collect_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let global = build_global(&parts).unwrap();
    let validate_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let meta = emit_metadata(&global);
    let emit_s = t.elapsed().as_secs_f64();
    println!("phases: read parts {collect_s:.2}s, validate {validate_s:.2}s, pickle .metadata {emit_s:.2}s ({} bytes)", meta.len());
    let t1 = Instant::now();
    let summary = merge(&loc, common::SAVE_ID, world, Duration::from_secs(60), &Freshness::from_now()).unwrap();
    let merge_s = t1.elapsed().as_secs_f64();
    println!(
        "ranks {world}, chunks/rank {chunks}: publish {publish_s:.2}s (all ranks, this machine), merge+validate+commit {merge_s:.2}s, \
         {} chunks, .metadata {:.1} MiB",
        summary.tensor_chunks,
        summary.metadata_bytes as f64 / (1 << 20) as f64
    );
    // One machine-readable line for python/benchmarks/growth.py.
    println!(
        "JSON {{\"ranks\": {world}, \"chunks_per_rank\": {chunks}, \"read_s\": {collect_s}, \"validate_s\": {validate_s}, \
         \"emit_s\": {emit_s}, \"merge_s\": {merge_s}, \"metadata_bytes\": {}}}",
        summary.metadata_bytes
    );
}
