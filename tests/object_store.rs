//! The object-store path (`memory://`, in process) against the local one: the streamed, window by
//! window writer must produce byte-identical data files and `.metadata`, whatever the window
//! boundaries cut (archive heads, payloads and the CRC-dependent tails alike), and the reader must
//! read it back through ranged GETs.

use std::time::Duration;

use shardwise::format::dtype::DType;
use shardwise::reader::Checkpoint;
use shardwise::save::{save_rank, SaveOptions};
use shardwise::storage::Location;
use shardwise::writer::{Payload, TensorChunk};

/// 3,000 chunks of 1-8 KiB (about 14 MiB): with 5 MiB parts, some archive tail straddles a part
/// boundary.
fn payloads() -> Vec<Vec<u8>> {
    (0..3000u32)
        .map(|i| {
            let n = 256 * (1 + (i % 8) as usize); // float32 elements
            (0..n * 4)
                .map(|b| (b as u32 ^ i.wrapping_mul(2654435761)) as u8)
                .collect()
        })
        .collect()
}

fn chunks(data: &[Vec<u8>]) -> Vec<TensorChunk<'_>> {
    data.iter()
        .enumerate()
        .map(|(i, d)| {
            let n = d.len() as u64 / 4;
            TensorChunk {
                fqn: format!("layer.{i}.weight"),
                dtype: DType::F32,
                global_shape: vec![n],
                offsets: vec![0],
                sizes: vec![n],
                data: Payload::Host(d),
            }
        })
        .collect()
}

fn save(location: Location) -> shardwise::Result<()> {
    let data = payloads();
    let opts = SaveOptions {
        location,
        rank: 0,
        world_size: 1,
        save_id: "s1".into(),
        megatron: false,
        merge_rank: Some(0),
        timeout: Duration::from_secs(10),
        wait_for_commit: true,
        overwrite: false,
        integrity: false,
        derived_save_id: false,
    };
    let report = save_rank(&opts, &chunks(&data), &[], None, None)?;
    assert!(report.committed);
    Ok(())
}

#[test]
fn streamed_object_is_byte_identical_to_the_local_file() {
    // Read once by the store, at its first use in this process.
    std::env::set_var("SHARDWISE_MULTIPART_BYTES", (5u64 << 20).to_string());
    let dir = tempfile::tempdir().unwrap();
    let local = Location::local(dir.path());
    let remote = Location::parse("memory://bucket/run/iter_0000001").unwrap();
    save(local.clone()).unwrap();
    save(remote.clone()).unwrap();
    for name in ["__0_0.distcp", ".metadata", ".shardwise/s1/checksums"] {
        let a = local.read(name).unwrap().unwrap();
        let b = remote.read(name).unwrap().unwrap();
        assert!(
            a.len() > 10 << 20 || name != "__0_0.distcp",
            "{name}: {} bytes",
            a.len()
        );
        assert!(
            a == b,
            "{name} differs between the local and the object-store save"
        );
    }
    assert!(remote.exists(".shardwise/s1/COMMITTED"));

    let ckpt = Checkpoint::open(&remote).unwrap();
    let data = payloads();
    for i in [0usize, 1234, 2999] {
        let (chunk, _) = ckpt.chunk(&format!("layer.{i}.weight"), 0).unwrap();
        assert_eq!(chunk.storage(), &data[i][..]);
    }
    let report = shardwise::verify::verify(&remote, &|_| {}, &|_| {}).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!(report.sidecar_checked, 3000);

    // A second save into the committed prefix is refused, and changes nothing.
    let again = save(remote.clone());
    assert!(
        matches!(again, Err(shardwise::Error::CheckpointExists(_))),
        "{again:?}"
    );
    assert_eq!(
        remote.read("__0_0.distcp").unwrap(),
        local.read("__0_0.distcp").unwrap()
    );
}
