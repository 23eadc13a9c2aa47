//! Storage conformance: one function, [`conformance`], states what the commit protocol and the data
//! plane need from a backend, and runs on every backend: a local directory, `memory://`, and any
//! object-store URL listed in `SHARDWISE_STORAGE_TEST_URLS` (comma-separated prefixes, e.g. an S3
//! or GCS emulator's `s3://bucket/run` with its credentials and endpoint in the environment; each
//! run works under a fresh sub-prefix).
//!
//! The rules (object_store's `integration.rs` does the same for its stores):
//! - create-if-absent (`write_new`) lets exactly one of racing writers create a file, and leaves
//!   the winner's bytes;
//! - `write` replaces whole; `read`/`size`/`exists`/`stamp` of an absent file say absent, and a
//!   rewrite changes the stamp;
//! - data files written through a [`DataSink`] read back through a [`DataSource`]: ranged reads
//!   at any offset, short only at the end of the file;
//! - `list` gives the files directly under a directory and its subdirectories (a missing one lists
//!   empty); `remove` of an absent file and `remove_dir` are fine;
//! - `rename` replaces its target where files can be replaced atomically, and is refused elsewhere.

use std::sync::{Arc, Barrier};

use shardwise::storage::{DataSink, Location};

/// Writes `bytes` as data file `rel` through the location's sink (positioned writes in two
/// halves, out of order; or a stream of 5 MiB parts and a last short one).
fn write_data(loc: &Location, rel: &str, bytes: &[u8]) {
    match loc.create_data(rel).unwrap() {
        DataSink::Positioned(f) => {
            f.reserve(bytes.len() as u64).unwrap();
            let half = bytes.len() / 2;
            f.write_at(&bytes[half..], half as u64).unwrap();
            f.write_at(&bytes[..half], 0).unwrap();
            f.sync().unwrap();
        }
        DataSink::Stream(mut up) => {
            let part = 5 << 20;
            if bytes.len() <= part {
                up.single(bytes.to_vec()).unwrap();
            } else {
                for p in bytes.chunks(part) {
                    up.part(p.to_vec()).unwrap();
                }
                up.finish().unwrap();
            }
        }
    }
}

/// The conformance checks, on an empty location `loc`.
pub fn conformance(loc: &Location) {
    loc.create_dir().unwrap();

    // Create-if-absent: of 8 racing writers exactly one creates, and its bytes stay.
    let writers = 8;
    let barrier = Arc::new(Barrier::new(writers));
    let won: Vec<(usize, bool)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..writers)
            .map(|i| {
                let barrier = barrier.clone();
                s.spawn(move || {
                    barrier.wait();
                    (
                        i,
                        loc.write_new("race/marker", vec![i as u8; 100 + i])
                            .unwrap(),
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let winners: Vec<usize> = won.iter().filter(|w| w.1).map(|w| w.0).collect();
    assert_eq!(
        winners.len(),
        1,
        "{loc}: exactly one creator, got {winners:?}"
    );
    let w = winners[0];
    assert_eq!(
        loc.read("race/marker").unwrap(),
        Some(vec![w as u8; 100 + w])
    );
    assert!(!loc.write_new("race/marker", b"late".to_vec()).unwrap());

    // Whole files: absent, written, replaced.
    assert_eq!(loc.read("f.bin").unwrap(), None);
    assert_eq!(loc.size("f.bin").unwrap(), None);
    assert_eq!(loc.stamp("f.bin").unwrap(), None);
    assert!(!loc.exists("f.bin"));
    loc.write("f.bin", b"first".to_vec()).unwrap();
    let first = loc.stamp("f.bin").unwrap().expect("a stamp");
    assert_eq!(loc.size("f.bin").unwrap(), Some(5));
    // Local stamps hold the modification time in ns: a rewrite within the same tick of a coarse
    // clock must still differ by size.
    loc.write("f.bin", b"second!".to_vec()).unwrap();
    assert_eq!(loc.read("f.bin").unwrap(), Some(b"second!".to_vec()));
    assert_ne!(
        loc.stamp("f.bin").unwrap().unwrap(),
        first,
        "{loc}: a rewrite changes the stamp"
    );

    // Data plane: sink then source, ranged reads anywhere, short only at the end.
    let data: Vec<u8> = (0..(11u32 << 20) + 12_345)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    write_data(loc, "__0_0.distcp", &data);
    let src = loc.open_data("__0_0.distcp").unwrap();
    assert_eq!(src.len(), data.len() as u64);
    for (at, n) in [
        (0usize, 1usize),
        (1, 4096),
        (5 << 20, 3 << 20),
        (data.len() - 7, 7),
    ] {
        let mut buf = vec![0u8; n];
        assert_eq!(
            src.read_at(at as u64, &mut buf).unwrap(),
            n,
            "{loc} at {at}"
        );
        assert_eq!(buf, &data[at..at + n], "{loc} at {at}");
        let got = src.read_range(at as u64..(at + n) as u64).unwrap();
        assert_eq!(&got[..], &data[at..at + n], "{loc} range at {at}");
    }
    let mut tail = vec![0u8; 100];
    assert_eq!(src.read_at(data.len() as u64 - 10, &mut tail).unwrap(), 10);
    assert_eq!(&tail[..10], &data[data.len() - 10..]);
    assert_eq!(src.read_at(data.len() as u64 + 5, &mut tail).unwrap(), 0);
    let missing = loc.open_data("__9_9.distcp").err().expect("a missing file");
    assert!(
        matches!(&missing, shardwise::Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound),
        "{loc}: {missing}"
    );
    // An empty data file.
    write_data(loc, "__1_0.distcp", &[]);
    assert!(loc.open_data("__1_0.distcp").unwrap().is_empty());

    // Listing.
    loc.write("d/a", b"a".to_vec()).unwrap();
    loc.write("d/sub/b", b"bb".to_vec()).unwrap();
    let (files, dirs) = loc.list("d").unwrap();
    let names: Vec<(String, u64)> = files.into_iter().map(|f| (f.name, f.size)).collect();
    assert_eq!(names, vec![("a".to_string(), 1)], "{loc}");
    assert_eq!(dirs, vec!["sub".to_string()], "{loc}");
    let (files, dirs) = loc.list("nowhere").unwrap();
    assert!(files.is_empty() && dirs.is_empty());

    // Removal.
    loc.remove("d/a").unwrap();
    loc.remove("d/a").unwrap();
    assert!(!loc.exists("d/a"));
    loc.remove_dir("d").unwrap();
    assert!(!loc.exists("d/sub/b"));
    assert_eq!(loc.list("d").unwrap().0.len(), 0);

    // Rename: atomic replacement where the backend has it, refused elsewhere.
    loc.write("g.bin", b"new".to_vec()).unwrap();
    let renamed = loc.rename("g.bin", "f.bin");
    if loc.can_replace_atomically() {
        renamed.unwrap();
        assert_eq!(loc.read("f.bin").unwrap(), Some(b"new".to_vec()));
        assert!(!loc.exists("g.bin"));
    } else {
        assert!(
            matches!(renamed, Err(shardwise::Error::InvalidArgument(_))),
            "{loc}: {renamed:?}"
        );
    }
}

/// A fresh sub-prefix (or directory) of `base` per run.
fn fresh(base: &str) -> Location {
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    Location::parse(&format!(
        "{}/conformance-{}-{nonce}",
        base.trim_end_matches('/'),
        std::process::id()
    ))
    .unwrap()
}

#[test]
fn local_directory() {
    let dir = tempfile::tempdir().unwrap();
    conformance(&Location::local(&dir.path().join("ckpt")));
}

#[test]
fn memory_store() {
    conformance(&fresh("memory://conformance"));
}

/// The object stores named in `SHARDWISE_STORAGE_TEST_URLS` (none by default).
#[test]
fn stores_from_the_environment() {
    let urls = std::env::var("SHARDWISE_STORAGE_TEST_URLS").unwrap_or_default();
    for base in urls.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        conformance(&fresh(base));
    }
}
