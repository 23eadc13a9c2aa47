//! `.metadata` parse time, for profiling the decoder on a real torch-written file:
//! `cargo bench --bench metadata_parse -- /tmp/md_grid/.metadata [reps]` (files from
//! `python/benchmarks/metadata_parse.py make`). Prints wall and CPU seconds of each repetition of
//! `read_metadata` on the memory-mapped file, the number of chunks, and peak RSS.

use std::time::Instant;

use shardwise::format::metadata::Entry;
use shardwise::format::read_metadata::read_metadata;

/// CPU seconds of this process so far (all threads).
fn cpu_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn peak_rss_mib() -> f64 {
    // SAFETY: a valid out-pointer.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    ru.ru_maxrss as f64 / 1024.0
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let path = args
        .first()
        .expect("usage: metadata_parse <.metadata> [reps]");
    let reps: usize = args.get(1).and_then(|r| r.parse().ok()).unwrap_or(3);
    let file = std::fs::File::open(path).unwrap();
    // SAFETY: a read-only mapping of a file nobody writes during the benchmark.
    let map = unsafe { memmap2::Mmap::map(&file).unwrap() };
    // The first step of the parse alone: the opcode walk that finds the batches decoded in
    // parallel (`format::split`), with the sizes `read_metadata` uses.
    let (t, c) = (Instant::now(), cpu_s());
    let plan = shardwise::format::split::plan(&map, shardwise::format::split::Sizes::METADATA);
    let batches = plan.as_ref().map_or(0, |p| p.batches.len());
    println!(
        "plan: {batches} batches, {:.3} s wall, {:.3} s CPU",
        t.elapsed().as_secs_f64(),
        cpu_s() - c
    );
    drop(plan);
    for _ in 0..reps {
        let (t, c) = (Instant::now(), cpu_s());
        let md = read_metadata(&map).unwrap();
        let (wall, cpu) = (t.elapsed().as_secs_f64(), cpu_s() - c);
        let chunks: usize = md
            .entries
            .values()
            .map(|e| match e {
                Entry::Tensor { chunks, .. } => chunks.len(),
                Entry::Bytes { .. } => 1,
            })
            .sum();
        println!(
            "{} bytes, {} keys, {chunks} chunks: {wall:.3} s wall, {cpu:.3} s CPU, peak RSS {:.0} MiB",
            map.len(),
            md.entries.len(),
            peak_rss_mib()
        );
    }
}
