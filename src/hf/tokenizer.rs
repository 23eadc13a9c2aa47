//! The tokenizer of a converted folder: Megatron-LM after 0.19 saves the run's tokenizer assets
//! into `<checkpoint>/tokenizer/` (Megatron-LM #6280), or the user names a folder (`--tokenizer
//! DIR`, e.g. the original HF release). Its tokenizer files are copied beside the weights, so
//! `AutoTokenizer.from_pretrained` loads the converted folder as it is.

use std::path::Path;

use crate::error::{Error, Result};

/// The largest tokenizer folder copied, in bytes (the largest tokenizers in use are tens of MB).
const MAX_BYTES: u64 = 1 << 30;

/// Whether `name` is a file of a tokenizer folder: what `save_pretrained` of a transformers
/// tokenizer writes (`tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json`,
/// `added_tokens.json`, `chat_template.jinja` / `.json`, and a slow tokenizer's vocabulary:
/// `vocab.json`, `merges.txt`, `vocab.txt`, `tokenizer.model`, `spiece.model`, `*.tiktoken`), and a
/// release's `generation_config.json`. Weights, indexes and `config.json` never are.
fn is_tokenizer_file(name: &str) -> bool {
    name.starts_with("tokenizer")
        || name.starts_with("chat_template.")
        || name.ends_with(".tiktoken")
        || matches!(
            name,
            "special_tokens_map.json"
                | "added_tokens.json"
                | "vocab.json"
                | "vocab.txt"
                | "merges.txt"
                | "spiece.model"
                | "generation_config.json"
        )
}

/// `(name, bytes)` of the tokenizer files directly in `dir` (see [`is_tokenizer_file`]), sorted
/// by name. Only regular files are read: a symlink (which could lead out of an untrusted
/// checkpoint) or a subfolder is left alone. `given`: `dir` is `--tokenizer DIR` (it must exist
/// and hold a tokenizer); otherwise it is `<checkpoint>/tokenizer/`, and an absent folder gives
/// none.
///
/// Errors: [`Error::InvalidArgument`] for a `--tokenizer` folder that is absent or holds no
/// tokenizer file, or tokenizer files over [`MAX_BYTES`] together; [`Error::Io`].
pub(crate) fn tokenizer_files(dir: &Path, given: bool) -> Result<Vec<(String, Vec<u8>)>> {
    let rd = match std::fs::read_dir(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !given => return Ok(Vec::new()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::InvalidArgument(format!(
                "--tokenizer {}: no such folder",
                dir.display()
            )))
        }
        Err(e) => return Err(Error::io("read directory", dir)(e)),
        Ok(rd) => rd,
    };
    let mut out = Vec::new();
    let mut total = 0u64;
    for e in rd {
        let e = e.map_err(Error::io("read directory", dir))?;
        let name = e.file_name().to_string_lossy().into_owned();
        let path = e.path();
        let meta = std::fs::symlink_metadata(&path).map_err(Error::io("stat", &path))?;
        if !meta.file_type().is_file() || !is_tokenizer_file(&name) {
            continue;
        }
        total += meta.len();
        if total > MAX_BYTES {
            return Err(Error::InvalidArgument(format!(
                "{}: the tokenizer files are over {MAX_BYTES} bytes together",
                dir.display()
            )));
        }
        out.push((
            name,
            std::fs::read(&path).map_err(Error::io("read", &path))?,
        ));
    }
    if given && out.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "--tokenizer {}: no tokenizer file there (tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.json, ...)",
            dir.display()
        )));
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_tokenizer_files_are_copied() {
        for n in [
            "tokenizer.json",
            "tokenizer_config.json",
            "tokenizer.model",
            "special_tokens_map.json",
            "chat_template.jinja",
            "merges.txt",
            "qwen.tiktoken",
            "generation_config.json",
        ] {
            assert!(is_tokenizer_file(n), "{n}");
        }
        for n in [
            "config.json",
            "model.safetensors",
            "model.safetensors.index.json",
            "README.md",
        ] {
            assert!(!is_tokenizer_file(n), "{n}");
        }
    }

    #[test]
    fn a_folder_gives_its_tokenizer_files_and_nothing_else() {
        let dir = std::env::temp_dir().join(format!("sw-tok-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("tokenizer.json"), b"{}").unwrap();
        std::fs::write(dir.join("config.json"), b"{}").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", dir.join("vocab.json")).unwrap();
        let got = tokenizer_files(&dir, true).unwrap();
        assert_eq!(got, vec![("tokenizer.json".to_string(), b"{}".to_vec())]);
        // Absent: none for <checkpoint>/tokenizer, refused for --tokenizer.
        assert!(tokenizer_files(&dir.join("none"), false)
            .unwrap()
            .is_empty());
        let e = tokenizer_files(&dir.join("none"), true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no such folder"), "{e}");
        let e = tokenizer_files(&dir.join("sub"), true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no tokenizer file there"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
