//! Entry points shared by the cargo-fuzz targets (`fuzz/`) and the corpus replay test
//! (`crates/shardwise-hf/tests/fuzz_corpus.rs`): each parses untrusted bytes and must return, never panic, hang or
//! abort on an allocation sized by the input.

/// The symbolic unpickler.
pub fn unpickle(data: &[u8]) {
    let _ = crate::format::unpickle::unpickle(data);
}

/// The zip reader and the tensor item decoder.
pub fn archive(data: &[u8]) {
    let _ = crate::format::archive::records(data);
    let _ = crate::format::archive::stored_tensor(data);
}

/// The `.metadata` decoder, sequential and split into batches decoded in parallel (small and
/// large batches): the three must agree, value for value and error for error.
pub fn metadata(data: &[u8]) {
    use crate::format::read_metadata::read_metadata_split;
    use crate::format::split::Sizes;
    let whole = read_metadata_split(data, None);
    for max_bytes in [256, usize::MAX] {
        let split = read_metadata_split(
            data,
            Some(Sizes {
                min_bytes: 1,
                max_bytes,
            }),
        );
        assert_eq!(
            whole, split,
            "split decode (batches <= {max_bytes} bytes) differs"
        );
    }
}
