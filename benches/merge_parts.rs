//! Merge cost at scale: `world_size` ranks each publish a part with `chunks` tensor chunks, then one
//! merger collects, validates and commits them. Run: `cargo bench --bench merge_parts -- 8192 1000`
//! (defaults: 2048 ranks x 200 chunks). Prints seconds per phase and the `.metadata` size, then the
//! same as one `JSON {...}` line. The parts are those of `common::publish_parts` (shared with the
//! divan benchmarks in `hot_paths.rs`).

mod common;

use std::time::{Duration, Instant};

use shardwise::commit::merge;
use shardwise::commit::validate::Fold;
use shardwise::commit::wait::{collect_parts, Freshness};
use shardwise::format::metadata::write_metadata;
use shardwise::storage::Location;

/// CPU seconds of this process so far (all threads): on a shared machine, wall time also counts
/// the other processes' turns.
fn cpu_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

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
    // The merge's phases one by one, without writing anything.
    let (t, c) = (Instant::now(), cpu_s());
    let fold = Fold::default();
    let parts = collect_parts(
        &loc,
        common::SAVE_ID,
        world,
        Duration::from_secs(60),
        &Freshness::any_part(),
        &|p, items| fold.add_part(p, items),
    )
    .unwrap();
    let collect_s = t.elapsed().as_secs_f64();
    let collect_cpu = cpu_s() - c;
    let (t, c) = (Instant::now(), cpu_s());
    let global = fold.finish(&parts).unwrap();
    let validate_s = t.elapsed().as_secs_f64();
    let validate_cpu = cpu_s() - c;
    // The sidecar and `.metadata` are encoded as the merge encodes them, into a CRC only (the
    // merge streams them to storage), so that neither is held here either.
    let crc_of = |write: &dyn Fn(&mut dyn FnMut(&[u8]) -> shardwise::error::Result<()>)| {
        let (mut crc, mut len) = (crc32fast::Hasher::new(), 0usize);
        write(&mut |b| {
            crc.update(b);
            len += b.len();
            Ok(())
        });
        (len, crc.finalize())
    };
    let (t, c) = (Instant::now(), cpu_s());
    let (sums_bytes, _) = crc_of(&|out| global.write_checksums(common::SAVE_ID, out).unwrap());
    let sums_s = t.elapsed().as_secs_f64();
    let sums_cpu = cpu_s() - c;
    let (t, c) = (Instant::now(), cpu_s());
    let (meta_bytes, meta_crc) = crc_of(&|out| write_metadata(&global, out).unwrap());
    let emit_s = t.elapsed().as_secs_f64();
    let emit_cpu = cpu_s() - c;
    println!(
        "phases (wall s / CPU s): read+fold parts {collect_s:.2}/{collect_cpu:.2}, validate \
         {validate_s:.2}/{validate_cpu:.2}, encode checksums {sums_s:.2}/{sums_cpu:.2} ({sums_bytes} bytes), \
         pickle .metadata {emit_s:.2}/{emit_cpu:.2} ({meta_bytes} bytes, CRC-32 {meta_crc:08x})"
    );
    drop((global, parts));
    let (t1, c1) = (Instant::now(), cpu_s());
    let summary = merge(
        &loc,
        common::SAVE_ID,
        world,
        Duration::from_secs(60),
        &Freshness::any_part(),
    )
    .unwrap();
    let merge_s = t1.elapsed().as_secs_f64();
    let merge_cpu = cpu_s() - c1;
    // The committed file is the pickle of the phases above, byte for byte (read in pieces, not
    // held: the peak RSS is the merge's).
    let mut written = crc32fast::Hasher::new();
    let mut file = std::fs::File::open(dir.path().join(".metadata")).unwrap();
    let mut buf = vec![0u8; 8 << 20];
    loop {
        let n = std::io::Read::read(&mut file, &mut buf).unwrap();
        if n == 0 {
            break;
        }
        written.update(&buf[..n]);
    }
    assert_eq!(written.finalize(), meta_crc, "the committed .metadata");
    println!(
        "ranks {world}, chunks/rank {chunks}: publish {publish_s:.2}s (all ranks, this machine), merge+validate+commit {merge_s:.2}s ({merge_cpu:.2} CPU s), \
         {} chunks, .metadata {:.1} MiB",
        summary.tensor_chunks,
        summary.metadata_bytes as f64 / (1 << 20) as f64
    );
    // One machine-readable line for python/benchmarks/growth.py.
    println!(
        "JSON {{\"ranks\": {world}, \"chunks_per_rank\": {chunks}, \"read_s\": {collect_s}, \"validate_s\": {validate_s}, \
         \"checksums_s\": {sums_s}, \"emit_s\": {emit_s}, \"merge_s\": {merge_s}, \"metadata_bytes\": {}}}",
        summary.metadata_bytes
    );
}
