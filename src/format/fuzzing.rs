//! Entry points shared by the cargo-fuzz targets (`fuzz/`) and the corpus replay test
//! (`tests/fuzz_corpus.rs`): each parses untrusted bytes and must return, never panic or hang.

/// The symbolic unpickler.
pub fn unpickle(data: &[u8]) {
    let _ = crate::format::unpickle::unpickle(data);
}

/// The zip reader and the tensor item decoder.
pub fn archive(data: &[u8]) {
    let _ = crate::format::archive::records(data);
    let _ = crate::format::archive::stored_tensor(data);
}

/// The `.metadata` decoder.
pub fn metadata(data: &[u8]) {
    let _ = crate::format::read_metadata::read_metadata(data);
}
