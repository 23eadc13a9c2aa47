//! Prints what shardwise reads from torch.save archives (`shardwise::fuzzing::archive_view`), one
//! JSON line per file, for the differential test against torch's reader
//! (`python/tests/torch_reader_diff.py`). Files are given as paths, or as directories whose files
//! are read in name order.
//!
//! Run: cargo run --release --example archive_view -- PATH...

use std::io::Write;
use std::path::PathBuf;

fn main() {
    let mut files: Vec<PathBuf> = Vec::new();
    for arg in std::env::args_os().skip(1) {
        let p = PathBuf::from(arg);
        if p.is_dir() {
            let mut inner: Vec<PathBuf> = std::fs::read_dir(&p)
                .expect("a readable directory")
                .map(|e| e.expect("a directory entry").path())
                .filter(|f| f.is_file())
                .collect();
            inner.sort();
            files.extend(inner);
        } else {
            files.push(p);
        }
    }
    let out = std::io::stdout();
    let mut out = out.lock();
    for f in files {
        let blob = std::fs::read(&f).expect("a readable file");
        let line = serde_json::json!({
            "file": f.file_name().map(|n| n.to_string_lossy().into_owned()),
            "view": shardwise::fuzzing::archive_view(&blob),
        });
        writeln!(out, "{line}").expect("stdout");
    }
}
