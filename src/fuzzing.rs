//! Entry points shared by the cargo-fuzz targets (`fuzz/`) and the corpus replay test
//! (`crates/shardwise-hf/tests/fuzz_corpus.rs`): each parses untrusted bytes and must return, never panic, hang or
//! abort on an allocation sized by the input.

/// The symbolic unpickler.
pub fn unpickle(data: &[u8]) {
    let _ = crate::format::unpickle::unpickle(data);
}

/// The zip reader, the tensor item decoder and the checks of an object's tensors and globals
/// ([`archive_view`], which runs them all).
pub fn archive(data: &[u8]) {
    let _ = archive_view(data);
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

/// What shardwise reads from a torch.save archive, for the differential test against torch's own
/// reader (`python/tests/torch_reader_diff.py`, which compares it with what torch 2.15 and 2.3.1
/// read from the same bytes): the archive's folder and record names, the bytes of each record
/// `torch.load` reads by name (hex; null when absent), the tensor [`stored_tensor`] decodes (its
/// storage bytes in hex), and the globals unpickling `data.pkl` imports. `{"error": ...}` when the
/// archive is refused.
///
/// [`stored_tensor`]: crate::format::archive::stored_tensor
pub fn archive_view(blob: &[u8]) -> serde_json::Value {
    use crate::format::archive::{object_tensors, stored_tensor, Archive};
    use crate::format::globals::{scan, Pickle};
    use serde_json::json;
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let archive = match Archive::read(blob) {
        Ok(a) => a,
        Err(e) => return json!({ "error": e.0 }),
    };
    let records: serde_json::Map<String, serde_json::Value> = TORCH_READS
        .iter()
        .map(|n| {
            let got = archive.get(n).map(|r| hex(&blob[r.start..r.start + r.len]));
            (n.to_string(), json!(got))
        })
        .collect();
    let tensor = match stored_tensor(blob) {
        Ok(t) => json!({
            "dtype": t.dtype.torch_name(),
            "shape": t.shape,
            "stride": t.strides,
            "storage_offset": t.storage_offset,
            "storage": hex(&blob[t.storage.start..t.storage.start + t.storage.len]),
        }),
        Err(e) => json!({ "error": e.0 }),
    };
    let pkl = archive.data_pkl().ok();
    let globals = pkl.map(|r| {
        let s = scan(Pickle::TorchSave, &blob[r.start..r.start + r.len]);
        let storage = s
            .storages
            .iter()
            .find_map(|st| archive.storage(st).err().map(|e| e.0))
            .or_else(|| object_tensors(&archive, blob).err().map(|e| e.0));
        json!({
            "imported": s.imported,
            "refused": s.refused,
            "error": s.error.map(|e| e.0),
            "storage_error": storage,
        })
    });
    json!({
        "folder": archive.folder,
        "names": archive.records.iter().map(|r| &r.name).collect::<Vec<_>>(),
        "records": records,
        "tensor": tensor,
        "globals": globals,
    })
}

/// The records `torch.load` reads by name (torch/serialization.py `_load` and
/// `PyTorchStreamReader::init`, torch 2.3–2.15).
const TORCH_READS: &[&str] = &[
    "data.pkl",
    "byteorder",
    "version",
    ".data/version",
    ".data/serialization_id",
    ".format_version",
    ".storage_alignment",
];
