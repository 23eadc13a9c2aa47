//! Files written as a stream whose length is not known in advance: the commit's `.metadata` and
//! checksum sidecar (1.2 GB and 0.6 GB at 8,192 ranks x 1,000 chunks). The bytes go to storage
//! while they are encoded, so the durable write overlaps the encoding and no whole-file buffer is
//! held; the file becomes visible only when [`Staged::publish`]ed, in one step, under the rules of
//! [`Location::write`] (replace) and [`Location::write_new`] (create only if absent).
//!
//! - Local: a temporary file beside the target, written by a writer thread in 8 MiB blocks with
//!   `O_DIRECT`, then fsynced; publishing renames (or hard-links) it into place. On the dev VM a
//!   buffered write of 1 GiB plus fsync ran at 372 MB/s (the page-cache copy alone cost ~3 s of CPU
//!   of a merge at 8,192 ranks), the same with `O_DIRECT` at 2.1 GB/s (`dd ... oflag=direct`).
//!   Filesystems that refuse `O_DIRECT` (tmpfs) get plain writes.
//! - Object store, replace: a multipart upload ([`super::remote::Upload`]); the object is there
//!   once finished (stores cannot stage an object and switch it in later).
//! - Object store, create only if absent: only a single PUT can be conditional, so the bytes are
//!   buffered and PUT when published.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::PathBuf;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::thread::JoinHandle;

use super::local::{create_dir_all, publish_temp, temp_name};
use super::remote::{Remote, Upload};
use super::Location;
use crate::error::{Error, Result};
use crate::failpoint::{hit, Op};

/// Bytes per block handed to the local writer thread (and per `O_DIRECT` write).
const BLOCK: usize = 8 << 20;
/// Alignment of `O_DIRECT` buffers, offsets and lengths: a page, a multiple of every logical
/// block size in use (512 B, 4 KiB).
const ALIGN: usize = 4096;
/// Blocks in circulation per local stream: one being filled, the others queued or being written.
const BLOCKS: usize = 3;

/// How a streamed file is published.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Replace the file if it exists ([`Location::write`]).
    Replace,
    /// Create it only if it does not exist ([`Location::write_new`]).
    CreateNew,
}

/// A file being written ([`Location::create_streamed`]): [`StreamSink::write`] its bytes in order,
/// then [`StreamSink::finish`]. Dropped unfinished, it leaves nothing behind (local: the temporary
/// file is removed; object store: the upload is aborted).
pub struct StreamSink<'a> {
    kind: SinkKind<'a>,
}

enum SinkKind<'a> {
    Local(LocalStream),
    Upload {
        upload: Upload<'a>,
        buf: Vec<u8>,
        sent: bool,
    },
    Buffer {
        remote: &'a Remote,
        rel: String,
        buf: Vec<u8>,
    },
}

/// A streamed file whose bytes are all durable, not yet published under its name (except an
/// object-store [`Mode::Replace`] upload, there once finished). Dropped unpublished, it leaves
/// nothing behind where it can.
pub struct Staged<'a> {
    kind: StagedKind<'a>,
}

enum StagedKind<'a> {
    Local {
        tmp: PathBuf,
        path: PathBuf,
        mode: Mode,
        published: bool,
    },
    Written,
    Buffer {
        remote: &'a Remote,
        rel: String,
        buf: Vec<u8>,
    },
}

impl Location {
    /// Starts writing file `rel` as a stream, published later as `mode` says (see the module doc).
    ///
    /// Errors: [`Error::Io`] when the local temporary file cannot be created;
    /// [`Error::InvalidArgument`] for a key the store refuses.
    pub fn create_streamed(&self, rel: &str, mode: Mode) -> Result<StreamSink<'_>> {
        let kind = match (self, mode) {
            (Location::Local(dir), _) => {
                let path = dir.join(rel);
                if let Some(parent) = path.parent() {
                    create_dir_all(parent)?;
                }
                SinkKind::Local(LocalStream::create(path, mode)?)
            }
            (Location::Remote(r), Mode::Replace) => SinkKind::Upload {
                upload: r.upload(rel)?,
                buf: Vec::new(),
                sent: false,
            },
            (Location::Remote(r), Mode::CreateNew) => SinkKind::Buffer {
                remote: r,
                rel: rel.to_string(),
                buf: Vec::new(),
            },
        };
        Ok(StreamSink { kind })
    }
}

impl<'a> StreamSink<'a> {
    /// Appends `bytes` to the file.
    ///
    /// Errors: [`Error::Io`] / [`Error::Remote`] of an earlier write that failed in the background,
    /// or of this one.
    pub fn write(&mut self, bytes: &[u8]) -> Result<()> {
        match &mut self.kind {
            SinkKind::Local(s) => s.write(bytes),
            SinkKind::Upload { upload, buf, sent } => {
                buf.extend_from_slice(bytes);
                let part = upload.part_bytes();
                while buf.len() >= part {
                    let rest = buf.split_off(part);
                    upload.part(std::mem::replace(buf, rest))?;
                    *sent = true;
                }
                Ok(())
            }
            SinkKind::Buffer { buf, .. } => {
                buf.extend_from_slice(bytes);
                Ok(())
            }
        }
    }

    /// Makes every byte written durable (local: written and fsynced under the temporary name;
    /// object store: the upload completed, or the bytes held for the conditional PUT).
    ///
    /// Errors: as [`StreamSink::write`].
    pub fn finish(self) -> Result<Staged<'a>> {
        let kind = match self.kind {
            SinkKind::Local(s) => s.finish()?,
            SinkKind::Upload {
                mut upload,
                buf,
                sent,
            } => {
                if sent {
                    if !buf.is_empty() {
                        upload.part(buf)?;
                    }
                    upload.finish()?;
                } else {
                    upload.single(buf)?;
                }
                StagedKind::Written
            }
            SinkKind::Buffer { remote, rel, buf } => StagedKind::Buffer { remote, rel, buf },
        };
        Ok(Staged { kind })
    }
}

impl Staged<'_> {
    /// Publishes the file under its name: replacing it ([`Mode::Replace`]), or only if absent
    /// ([`Mode::CreateNew`]: `Ok(false)` when it already existed, and nothing changed). Local: a
    /// rename (or hard link) and a directory fsync.
    ///
    /// Errors: [`Error::Io`] / [`Error::Remote`].
    pub fn publish(mut self) -> Result<bool> {
        match &mut self.kind {
            StagedKind::Local {
                tmp,
                path,
                mode,
                published,
            } => {
                *published = true;
                publish_temp(tmp, path, *mode == Mode::Replace)
            }
            StagedKind::Written => Ok(true),
            StagedKind::Buffer { remote, rel, buf } => remote.put_new(rel, std::mem::take(buf)),
        }
    }
}

impl Drop for Staged<'_> {
    fn drop(&mut self) {
        if let StagedKind::Local {
            tmp,
            published: false,
            ..
        } = &self.kind
        {
            hit(Op::Unlink, tmp);
            let _ = std::fs::remove_file(tmp);
        }
    }
}

/// An 8 MiB buffer whose bytes start at an [`ALIGN`]ed address (no reallocation ever moves it).
struct Block {
    mem: Vec<u8>,
    start: usize,
    len: usize,
}

impl Block {
    fn new() -> Block {
        let mem = vec![0u8; BLOCK + ALIGN];
        let start = mem.as_ptr().align_offset(ALIGN);
        Block { mem, start, len: 0 }
    }

    /// Copies what fits of `bytes`; returns how many.
    fn push(&mut self, bytes: &[u8]) -> usize {
        let n = bytes.len().min(BLOCK - self.len);
        let at = self.start + self.len;
        self.mem[at..at + n].copy_from_slice(&bytes[..n]);
        self.len += n;
        n
    }

    /// The bytes to write: the filled ones, zero-padded to [`ALIGN`] for `O_DIRECT` (the file is
    /// cut to its length at the end).
    fn padded(&mut self) -> &[u8] {
        let end = self.len.next_multiple_of(ALIGN);
        self.mem[self.start + self.len..self.start + end].fill(0);
        &self.mem[self.start..self.start + end]
    }
}

/// A local temporary file written by a writer thread (see the module doc).
struct LocalStream {
    tmp: PathBuf,
    path: PathBuf,
    mode: Mode,
    file: std::sync::Arc<File>,
    /// The block being filled, and the file offset it starts at.
    block: Block,
    at: u64,
    allocated: usize,
    to_writer: Option<SyncSender<(Block, u64)>>,
    from_writer: Receiver<Block>,
    writer: Option<JoinHandle<Result<()>>>,
}

impl LocalStream {
    fn create(path: PathBuf, mode: Mode) -> Result<LocalStream> {
        let tmp = temp_name(&path);
        hit(Op::Create, &tmp);
        let open = |flags: i32| {
            OpenOptions::new()
                .write(true)
                .create_new(true)
                .custom_flags(flags)
                .open(&tmp)
        };
        let file = match open(libc::O_DIRECT) {
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => open(0),
            other => other,
        }
        .map_err(Error::io("create", &tmp))?;
        let file = std::sync::Arc::new(file);
        let (to_writer, jobs) = sync_channel::<(Block, u64)>(BLOCKS - 1);
        let (done, from_writer) = sync_channel::<Block>(BLOCKS);
        let writer = {
            let (file, path) = (file.clone(), tmp.clone());
            std::thread::Builder::new()
                .name("shardwise-stream".into())
                .spawn(move || -> Result<()> {
                    for (mut block, at) in jobs {
                        hit(Op::Write, &path);
                        write_block(&file, block.padded(), at)
                            .map_err(Error::io("write", &path))?;
                        block.len = 0;
                        let _ = done.send(block);
                    }
                    Ok(())
                })
                .map_err(Error::io("start the writer thread for", &tmp))?
        };
        Ok(LocalStream {
            tmp,
            path,
            mode,
            file,
            block: Block::new(),
            at: 0,
            allocated: 1,
            to_writer: Some(to_writer),
            from_writer,
            writer: Some(writer),
        })
    }

    fn write(&mut self, mut bytes: &[u8]) -> Result<()> {
        while !bytes.is_empty() {
            let n = self.block.push(bytes);
            bytes = &bytes[n..];
            if self.block.len == BLOCK {
                self.send()?;
            }
        }
        Ok(())
    }

    /// Hands the full block to the writer and takes an empty one.
    fn send(&mut self) -> Result<()> {
        let next = if self.allocated < BLOCKS {
            self.allocated += 1;
            Block::new()
        } else {
            match self.from_writer.recv() {
                Ok(b) => b,
                Err(_) => return Err(self.writer_error()),
            }
        };
        let full = std::mem::replace(&mut self.block, next);
        let len = full.len as u64;
        let sent = self.to_writer.as_ref().map(|t| t.send((full, self.at)));
        if !matches!(sent, Some(Ok(()))) {
            return Err(self.writer_error());
        }
        self.at += len;
        Ok(())
    }

    /// The error that stopped the writer thread.
    fn writer_error(&mut self) -> Error {
        self.to_writer = None;
        match self.writer.take().map(|w| w.join()) {
            Some(Ok(Err(e))) => e,
            _ => Error::Io {
                op: "write",
                path: self.tmp.clone(),
                source: std::io::Error::other("the writer thread stopped"),
            },
        }
    }

    fn finish(mut self) -> Result<StagedKind<'static>> {
        let len = self.at + self.block.len as u64;
        if self.block.len > 0 {
            self.send()?;
        }
        self.to_writer = None;
        if let Some(w) = self.writer.take() {
            match w.join() {
                Ok(r) => r?,
                Err(_) => return Err(self.writer_error()),
            }
        }
        let tmp = std::mem::take(&mut self.tmp);
        let sync = (|| {
            hit(Op::Write, &tmp);
            self.file.set_len(len)?;
            hit(Op::Fsync, &tmp);
            self.file.sync_all()
        })();
        if let Err(e) = sync {
            hit(Op::Unlink, &tmp);
            let _ = std::fs::remove_file(&tmp);
            return Err(Error::io("fsync", &tmp)(e));
        }
        Ok(StagedKind::Local {
            tmp,
            path: std::mem::take(&mut self.path),
            mode: self.mode,
            published: false,
        })
    }
}

impl Drop for LocalStream {
    fn drop(&mut self) {
        self.to_writer = None;
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
        // Empty once `finish` handed the file on.
        if !self.tmp.as_os_str().is_empty() {
            hit(Op::Unlink, &self.tmp);
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// `pwrite` of all of `buf` at `at`; a filesystem that takes `O_DIRECT` at open but refuses the
/// alignment of a write gets the file switched to plain writes, and the write retried.
fn write_block(file: &File, buf: &[u8], at: u64) -> std::io::Result<()> {
    match file.write_all_at(buf, at) {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            let fd = file.as_raw_fd();
            // SAFETY: plain fcntl calls on an open descriptor.
            let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
            if flags < 0 || flags & libc::O_DIRECT == 0 {
                return Err(e);
            }
            // SAFETY: as above.
            if unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_DIRECT) } < 0 {
                return Err(e);
            }
            file.write_all_at(buf, at)
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Streams of every length class (empty, short, one block, blocks and a tail) read back as
    /// written, appear only when published, and follow the replace / create-new rules.
    #[test]
    fn a_stream_is_published_whole_and_once() {
        let dir = tempfile::tempdir().unwrap();
        let loc = Location::local(dir.path());
        let lens = [0, 5, BLOCK, 2 * BLOCK + 4097];
        for len in lens {
            let rel = format!("d/f{len}");
            let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let mut s = loc.create_streamed(&rel, Mode::Replace).unwrap();
            for piece in bytes.chunks(3 << 20) {
                s.write(piece).unwrap();
            }
            let staged = s.finish().unwrap();
            assert!(!loc.exists(&rel), "not visible before it is published");
            assert!(staged.publish().unwrap());
            assert!(loc.read(&rel).unwrap().unwrap() == bytes, "{len} bytes");
        }
        let mut s = loc.create_streamed("d/f5", Mode::Replace).unwrap();
        s.write(b"replaced").unwrap();
        assert!(s.finish().unwrap().publish().unwrap());
        assert_eq!(loc.read("d/f5").unwrap().unwrap(), b"replaced");
        let mut s = loc.create_streamed("d/f5", Mode::CreateNew).unwrap();
        s.write(b"other").unwrap();
        assert!(
            !s.finish().unwrap().publish().unwrap(),
            "exists: not created"
        );
        assert_eq!(loc.read("d/f5").unwrap().unwrap(), b"replaced");
        // Dropped unfinished or unpublished: no temporary file is left.
        let mut s = loc.create_streamed("d/g", Mode::Replace).unwrap();
        s.write(&[1; 100]).unwrap();
        drop(s.finish().unwrap());
        let mut s = loc.create_streamed("d/h", Mode::Replace).unwrap();
        s.write(&[1; BLOCK + 1]).unwrap();
        drop(s);
        let left = std::fs::read_dir(dir.path().join("d")).unwrap().count();
        assert_eq!(left, lens.len(), "only the published files");
    }

    /// Object stores: a replace is a (multipart) upload, a create-new a conditional PUT.
    #[test]
    fn a_stream_to_an_object_store_follows_the_same_rules() {
        let loc = Location::parse(&format!(
            "memory://stream-tests/{}",
            crate::commit::liveness::now_ns()
        ))
        .unwrap();
        let bytes: Vec<u8> = (0..(70u32 << 20)).map(|i| (i % 253) as u8).collect();
        let mut s = loc.create_streamed("f", Mode::Replace).unwrap();
        for piece in bytes.chunks(5 << 20) {
            s.write(piece).unwrap();
        }
        assert!(s.finish().unwrap().publish().unwrap());
        assert!(loc.read("f").unwrap().unwrap() == bytes);
        let mut s = loc.create_streamed("g", Mode::CreateNew).unwrap();
        s.write(b"one").unwrap();
        let staged = s.finish().unwrap();
        assert!(!loc.exists("g"), "held until published");
        assert!(staged.publish().unwrap());
        let mut s = loc.create_streamed("g", Mode::CreateNew).unwrap();
        s.write(b"two").unwrap();
        assert!(!s.finish().unwrap().publish().unwrap());
        assert_eq!(loc.read("g").unwrap().unwrap(), b"one");
    }
}
