//! Replays the cargo-fuzz corpora (`fuzz/corpus/<target>/`) through the same entry points as the
//! fuzz targets, plus deterministic mutations of each input (truncations and byte flips). Any
//! panic fails the test; the parsers must return an error instead. Open-ended fuzzing runs with
//! `cargo +nightly fuzz run <target>` (see `fuzz/`).

use std::path::PathBuf;

use shardwise_hf::fuzzing;

fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    let mut inputs: Vec<Vec<u8>> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| std::fs::read(e.unwrap().path()).unwrap())
        .collect();
    inputs.sort();
    assert!(!inputs.is_empty(), "empty corpus {}", dir.display());
    inputs
}

/// Deterministic variants of `seed`: 48 truncations and 200 single-byte changes.
fn mutations(seed: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let n = seed.len();
    for k in 0..48 {
        out.push(seed[..n * k / 48].to_vec());
    }
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15 ^ n as u64;
    for _ in 0..200 {
        if n == 0 {
            break;
        }
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let mut m = seed.to_vec();
        let at = (x % n as u64) as usize;
        m[at] = match x >> 60 {
            0..=5 => m[at] ^ (1 << ((x >> 32) % 8)),
            6..=10 => 0xff,
            _ => 0,
        };
        out.push(m);
    }
    out
}

fn replay(target: &str, f: fn(&[u8])) {
    for seed in corpus(target) {
        f(&seed);
        for m in mutations(&seed) {
            f(&m);
        }
    }
}

#[test]
fn unpickle_corpus_never_panics() {
    replay("unpickle", fuzzing::unpickle);
}

#[test]
fn archive_corpus_never_panics() {
    replay("archive", fuzzing::archive);
}

#[test]
fn metadata_corpus_never_panics() {
    replay("metadata", fuzzing::metadata);
}

#[test]
fn safetensors_header_corpus_never_panics() {
    replay("safetensors_header", fuzzing::safetensors_header);
}

#[test]
fn hf_index_corpus_never_panics() {
    replay("hf_index", fuzzing::hf_index);
}

#[test]
fn hf_config_corpus_never_panics() {
    replay("hf_config", fuzzing::hf_config);
}
