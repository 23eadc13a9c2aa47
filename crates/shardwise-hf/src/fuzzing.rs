//! Entry points of the cargo-fuzz targets (`fuzz/`) and the corpus replay test
//! (`tests/fuzz_corpus.rs`): the core's parsers (re-exported from `shardwise::fuzzing`) and the
//! HF readers of this crate. Each parses untrusted bytes and must return, never panic, hang or
//! abort on an allocation sized by the input.

pub use shardwise::fuzzing::{archive, metadata, unpickle};

/// from-hf's safetensors header reader (the bytes are a whole file).
pub fn safetensors_header(data: &[u8]) {
    crate::untrusted::safetensors_header(data);
}

/// The `model.safetensors.index.json` reader.
pub fn hf_index(data: &[u8]) {
    crate::untrusted::index(data);
}

/// config.json's dimensions and their checks (the counts that size per-layer tables).
pub fn hf_config(data: &[u8]) {
    crate::untrusted::config(data);
}
