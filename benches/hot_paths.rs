//! Hot paths of a save, with divan: `cargo bench --bench hot_paths` (all), or a filter such as
//! `cargo bench --bench hot_paths -- metadata`. Sizes fit a 2-core, 24 GiB machine; `merge_parts`
//! (a plain harness over the same inputs) takes the 8,192 x 1,000 case that is too large to sample.
//!
//! * `encode_items`: torch.save archive of every item (zip records + `data.pkl` pickle) and the CRC-32
//!   of its payload, for 256 MiB of payload cut into items of 64 KiB .. 16 MiB (throughput per byte,
//!   so GiB/s is directly the cost per GiB).
//! * `encode_headers`: the same without payload, 100,000 items (the per-item fixed cost).
//! * `payload_crc`: the writer's CRC pass over 256 MiB in 8 MiB pieces (its `PIECE_BYTES`), plain
//!   (one CRC-32 per piece, combined: the writer before block CRCs) and with 1 MiB block CRCs
//!   (`shardwise::blockcrc`: pieces hashed in sub-ranges cut at block boundaries, combined into
//!   the payload and block CRCs). The difference is the CPU cost of block CRCs on a save.
//! * `write_rank_file`: one rank's `.distcp` of 1 GiB of in-memory shards, fsync included.
//! * `metadata_emit` / `metadata_parse`: a `.metadata` of 1,000,000 chunks (1,000 keys x 1,000).
//! * `merge`: read, validate and commit the parts of 1,024 ranks x 100 chunks and 8,192 x 25.

mod common;

use divan::counter::{BytesCount, ItemsCount};
use divan::{black_box, Bencher};
use shardwise::format::dtype::DType;
use shardwise::format::metadata::emit_metadata;
use shardwise::format::read_metadata::read_metadata;
use shardwise::format::zip::ArchiveLayout;

fn main() {
    divan::main();
}

const ENCODE_TOTAL: usize = 256 << 20;

#[divan::bench(args = [64 << 10, 1 << 20, 16 << 20], sample_count = 5, sample_size = 1)]
fn encode_items(bencher: Bencher, piece: usize) {
    let buf = common::host_shards(ENCODE_TOTAL, piece);
    let rows = (piece / 4 / 1024) as u64;
    bencher
        .counter(BytesCount::new(ENCODE_TOTAL))
        .bench_local(|| {
            let mut total = 0u64;
            for (i, data) in buf.chunks(piece).enumerate() {
                let id = format!("{:040}", i);
                let l = ArchiveLayout::for_tensor(DType::F32, &[rows, 1024], &id);
                let suffix = l.suffix(crc32fast::hash(data));
                total += l.prefix.len() as u64 + suffix.len() as u64;
            }
            black_box(total)
        });
}

#[divan::bench(args = ["plain", "blocks"], sample_count = 7, sample_size = 1)]
fn payload_crc(bencher: Bencher, how: &str) {
    const PIECE: usize = 8 << 20;
    let buf = common::host_shards(ENCODE_TOTAL, PIECE);
    bencher
        .counter(BytesCount::new(ENCODE_TOTAL))
        .bench_local(|| match how {
            "plain" => {
                let mut crc = crc32fast::Hasher::new();
                for piece in buf.chunks(PIECE) {
                    let mut h = crc32fast::Hasher::new();
                    h.update(piece);
                    crc.combine(&h);
                }
                black_box(crc.finalize());
            }
            _ => {
                let mut crc = shardwise::blockcrc::PayloadCrc::default();
                for (k, piece) in buf.chunks(PIECE).enumerate() {
                    let p = shardwise::blockcrc::hash_piece(0, (k * PIECE) as u64, piece);
                    crc.add_piece(&p);
                }
                black_box(crc.finish());
            }
        });
}

#[divan::bench(sample_count = 5, sample_size = 1)]
fn encode_headers(bencher: Bencher) {
    const N: usize = 100_000;
    bencher.counter(ItemsCount::new(N)).bench_local(|| {
        let mut total = 0usize;
        for i in 0..N {
            let id = format!("{:040}", i);
            let l = ArchiveLayout::for_tensor(DType::BF16, &[4, 4096], &id);
            total += l.prefix.len() + l.suffix(0).len();
        }
        black_box(total)
    });
}

#[divan::bench(args = [1usize], sample_count = 3, sample_size = 1)]
fn write_rank_file(bencher: Bencher, gib: usize) {
    let total = gib << 30;
    let piece = 16 << 20;
    let buf = common::host_shards(total, piece);
    let chunks = common::chunks_of(&buf, piece);
    let dir = tempfile::tempdir().unwrap();
    let loc = shardwise::storage::Location::local(dir.path());
    let go = std::sync::atomic::AtomicBool::new(false);
    let how = shardwise::writer::WriteOptions {
        seed: 0,
        digest: false,
        stop: &go,
    };
    bencher.counter(BytesCount::new(total)).bench_local(|| {
        let sink = loc.create_data("__0_0.distcp").unwrap();
        shardwise::writer::write_rank(sink, &chunks, &[], None, how).unwrap()
    });
}

#[divan::bench(sample_count = 3, sample_size = 1)]
fn metadata_emit(bencher: Bencher) {
    let map = common::metadata_map(1000, 1000);
    bencher
        .counter(ItemsCount::new(1_000_000usize))
        .bench_local(|| emit_metadata(&map).len());
}

#[divan::bench(sample_count = 3, sample_size = 1)]
fn metadata_parse(bencher: Bencher) {
    let bytes = emit_metadata(&common::metadata_map(1000, 1000));
    bencher
        .counter(ItemsCount::new(1_000_000usize))
        .bench_local(|| read_metadata(&bytes).unwrap().entries.len());
}

#[divan::bench(args = [(1024u32, 100u64), (8192, 25)], sample_count = 3, sample_size = 1)]
fn merge(bencher: Bencher, (world, chunks): (u32, u64)) {
    bencher
        .counter(ItemsCount::new(world as u64 * chunks))
        .with_inputs(|| {
            let dir = tempfile::tempdir().unwrap();
            common::publish_parts(dir.path(), world, chunks);
            dir
        })
        .bench_local_values(|dir| {
            shardwise::commit::merge(
                &shardwise::storage::Location::local(dir.path()),
                common::SAVE_ID,
                world,
                std::time::Duration::from_secs(60),
                &shardwise::commit::wait::Freshness::any_part(),
            )
            .unwrap();
            dir // removed outside the timing
        });
}
