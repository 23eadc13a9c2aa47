//! Golden tests: our torch.save archives must be byte-identical to the ones real torch wrote in
//! `tests/fixtures/dcp/torch-2.3.1` and `torch-2.5.1` (those versions write no
//! `.format_version` record, which our max-compat profile also leaves out).

mod common;
use common::fixtures;

use std::io::Read;

use shardwise::format::dtype::DType;
use shardwise::format::zip::ArchiveLayout;

fn record(blob: &[u8], name: &str) -> Vec<u8> {
    let mut z = zip::ZipArchive::new(std::io::Cursor::new(blob.to_vec())).unwrap();
    let mut f = z.by_name(name).unwrap();
    let mut out = Vec::new();
    f.read_to_end(&mut out).unwrap();
    out
}

#[test]
fn tensor_archives_match_torch_byte_for_byte() {
    let mut compared = 0;
    for version in ["torch-2.3.1", "torch-2.5.1"] {
        let dir = fixtures().join("dcp").join(version);
        let expected: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
        let distcp = std::fs::read(dir.join("__0_0.distcp")).unwrap();
        for (key, k) in expected["keys"].as_object().unwrap() {
            if k["kind"] != "tensor" {
                continue;
            }
            let chunk = &k["chunks"][0];
            let stored = &chunk["stored_tensor"];
            let shape: Vec<u64> = stored["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap())
                .collect();
            let stride: Vec<u64> = stored["stride"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap())
                .collect();
            if stride != shardwise::format::zip::contiguous_strides(&shape) {
                continue; // the `transposed` fixture: torch keeps a non-contiguous stride, we never write one
            }
            let (off, len) = (
                chunk["storage"]["offset"].as_u64().unwrap(),
                chunk["storage"]["length"].as_u64().unwrap(),
            );
            let blob = &distcp[off as usize..(off + len) as usize];
            let payload = record(blob, "archive/data/0");
            let sid = String::from_utf8(record(blob, "archive/.data/serialization_id")).unwrap();
            let dtype = DType::from_torch_name(stored["dtype"].as_str().unwrap()).unwrap();
            let layout = ArchiveLayout::for_tensor(dtype, &shape, &sid);
            let mut ours = layout.prefix.clone();
            ours.extend_from_slice(&payload);
            ours.extend_from_slice(&layout.suffix(crc32fast::hash(&payload)));
            assert_eq!(ours.len() as u64, layout.len(), "{version} {key}: length");
            assert!(
                ours == blob,
                "{version} {key}: archive differs from torch's"
            );
            compared += 1;
        }
    }
    assert!(compared >= 30, "only {compared} tensors compared");
}
