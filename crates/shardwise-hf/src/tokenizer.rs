//! The tokenizer of a converted folder: Megatron-LM after 0.19 saves the run's tokenizer assets
//! into `<checkpoint>/tokenizer/` (Megatron-LM #6280), or the user names a folder (`--tokenizer
//! DIR`, e.g. the original HF release). Its tokenizer files are copied beside the weights, so
//! `AutoTokenizer.from_pretrained` loads the converted folder as it is.

use std::path::Path;

use shardwise::error::{Error, Result};
use shardwise::storage::Location;

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

/// `(name, bytes)` of the tokenizer files directly under `rel_dir` of `loc` (see
/// [`is_tokenizer_file`]), sorted by name: `<checkpoint>/tokenizer/` of a local or object-store
/// checkpoint (an absent folder gives none), or `--tokenizer DIR` through [`given_tokenizer`]. Only
/// regular files are read: a symlink (which could lead out of an untrusted checkpoint) or a
/// subfolder is left alone (storage's `list` does not follow links).
///
/// Errors: [`Error::InvalidArgument`] for tokenizer files over [`MAX_BYTES`] together, or one that
/// vanishes between the listing and its read; storage errors.
pub(crate) fn tokenizer_files(loc: &Location, rel_dir: &str) -> Result<Vec<(String, Vec<u8>)>> {
    let (listed, _) = loc.list(rel_dir)?;
    let mut out = Vec::new();
    let mut total = 0u64;
    for f in listed.into_iter().filter(|f| is_tokenizer_file(&f.name)) {
        total += f.size;
        if total > MAX_BYTES {
            return Err(Error::InvalidArgument(format!(
                "{}: the tokenizer files are over {MAX_BYTES} bytes together",
                loc.path_of(rel_dir).display()
            )));
        }
        let rel = format!("{rel_dir}/{}", f.name);
        let bytes = loc.read(&rel)?.ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{}: removed while it was being copied",
                loc.path_of(&rel).display()
            ))
        })?;
        out.push((f.name, bytes));
    }
    out.sort();
    Ok(out)
}

/// The tokenizer files of `--tokenizer DIR` (a local folder that must exist and hold a tokenizer).
///
/// Errors: [`Error::InvalidArgument`] for a folder that is absent or holds no tokenizer file, and
/// [`tokenizer_files`]' errors.
pub(crate) fn given_tokenizer(dir: &Path) -> Result<Vec<(String, Vec<u8>)>> {
    if !dir.is_dir() {
        return Err(Error::InvalidArgument(format!(
            "--tokenizer {}: no such folder",
            dir.display()
        )));
    }
    let out = tokenizer_files(&Location::local(dir), ".")?;
    if out.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "--tokenizer {}: no tokenizer file there (tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.json, ...)",
            dir.display()
        )));
    }
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
        let got = given_tokenizer(&dir).unwrap();
        assert_eq!(got, vec![("tokenizer.json".to_string(), b"{}".to_vec())]);
        // A checkpoint's tokenizer/ folder, through storage: the same files.
        let parent = Location::local(dir.parent().unwrap());
        let name = dir.file_name().unwrap().to_str().unwrap();
        assert_eq!(tokenizer_files(&parent, name).unwrap(), got);
        // Absent: none for <checkpoint>/tokenizer, refused for --tokenizer.
        assert!(tokenizer_files(&Location::local(&dir), "none")
            .unwrap()
            .is_empty());
        let e = given_tokenizer(&dir.join("none")).unwrap_err().to_string();
        assert!(e.contains("no such folder"), "{e}");
        let e = given_tokenizer(&dir.join("sub")).unwrap_err().to_string();
        assert!(e.contains("no tokenizer file there"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
