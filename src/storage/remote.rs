//! Object stores (`s3://`, `gs://`, `az://`, `memory://`) through the `object_store` crate, driven
//! from synchronous code by one private tokio runtime per process.
//!
//! Credentials, regions and endpoints come from each cloud's standard environment variables
//! (`AWS_ACCESS_KEY_ID`, `AWS_ENDPOINT_URL`, `AWS_ALLOW_HTTP`, `GOOGLE_SERVICE_ACCOUNT`,
//! `AZURE_STORAGE_ACCOUNT_NAME`, ...: the builders' `from_env`). Our own knobs, also from the
//! environment: `SHARDWISE_MULTIPART_BYTES` (part size of data uploads, default 32 MiB, at least
//! 5 MiB), `SHARDWISE_MULTIPART_CONCURRENCY` (parts in flight per upload, default 8) and
//! `SHARDWISE_RETRY_TIMEOUT_S` (how long transient errors are retried with backoff, default 60 s).
//!
//! Every request is bounded ([`Bound`]): one HTTP attempt by `request` (object_store's
//! `ClientOptions::with_timeout`, connect included), its retries by `retry`
//! (`RetryConfig::retry_timeout`), and the whole call, retries and backoff included, by a timer of
//! ours ([`Bound::limit`]) that drops the request (and its connection) when it fires. A caller with
//! a timeout (`timeout_s` of save, merge, load, verify, to-hf) narrows both to it
//! ([`Remote::with_timeout`]). After a call ran into its bound, the calls that follow within the
//! next bound (the cleanup of a failed save: abort an upload, remove a partial file, publish
//! `FAILED`) get [`CLEANUP`] each until one succeeds, so a stalled store fails a save within
//! about its bound instead of once per cleanup step.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::TryStreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{
    BackoffConfig, ClientConfigKey, MultipartUpload, ObjectStore, ObjectStoreExt, PutMode,
    PutOptions, PutPayload, RetryConfig,
};

use crate::error::{Error, Result};
use crate::failpoint::{hit, Op};

/// One runtime for all object-store I/O of the process: object_store's HTTP clients need a
/// reactor, and our callers (Python threads, rayon workers) are synchronous.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .thread_name("shardwise-io")
            .enable_all()
            .build()
            .expect("cannot start the tokio runtime for object-store I/O")
    })
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    runtime().block_on(f)
}

fn env_num(name: &str, default: u64) -> Result<u64> {
    match std::env::var(name) {
        Err(_) => Ok(default),
        Ok(v) => v.trim().parse().map_err(|_| {
            Error::InvalidArgument(format!("{name}={v:?} is not a non-negative integer"))
        }),
    }
}

/// Smallest part of a multipart upload that S3, GCS and Azure all accept (but the last part).
pub const MIN_PART_BYTES: u64 = 5 << 20;

/// Time bounds of object-store requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Bound {
    /// One HTTP attempt, from connecting to the last byte of the answer.
    pub request: Duration,
    /// No retry of a failed attempt starts after this long.
    pub retry: Duration,
}

/// object_store's own per-attempt default (`ClientOptions`: 30 s).
const DEFAULT_REQUEST: Duration = Duration::from_secs(30);
/// Shortest per-attempt bound a caller's timeout narrows to (a small object needs one round trip).
const MIN_REQUEST: Duration = Duration::from_secs(1);
/// Bound of each call made shortly after a call ran into its bound (see the module docs).
pub const CLEANUP: Duration = Duration::from_secs(2);

impl Bound {
    /// The bound without a caller's timeout: 30 s per attempt, retries for
    /// `SHARDWISE_RETRY_TIMEOUT_S` (default 60 s).
    ///
    /// Errors: [`Error::InvalidArgument`] for a malformed `SHARDWISE_RETRY_TIMEOUT_S`.
    pub fn from_env() -> Result<Bound> {
        Ok(Bound {
            request: DEFAULT_REQUEST,
            retry: Duration::from_secs(env_num("SHARDWISE_RETRY_TIMEOUT_S", 60)?),
        })
    }

    /// This bound narrowed to a caller's `timeout`: attempts of at most `timeout` (but at least
    /// 1 s), retries for at most `timeout`.
    pub fn within(self, timeout: Duration) -> Bound {
        Bound {
            request: self.request.min(timeout).max(MIN_REQUEST),
            retry: self.retry.min(timeout),
        }
    }

    /// Longest backoff between two attempts: object_store's 15 s, or a quarter of `retry` when
    /// that is shorter, so that the last sleep does not overshoot a short bound.
    fn max_backoff(&self) -> Duration {
        (self.retry / 4).clamp(Duration::from_millis(100), Duration::from_secs(15))
    }

    /// The longest one call may take, its retries and backoff included: `retry` (after which no
    /// attempt starts) + one `request` + one backoff + 1 s.
    pub fn limit(&self) -> Duration {
        self.retry + self.request + self.max_backoff() + Duration::from_secs(1)
    }

    fn retry_config(&self) -> RetryConfig {
        RetryConfig {
            backoff: BackoffConfig {
                max_backoff: self.max_backoff(),
                ..BackoffConfig::default()
            },
            max_retries: 10,
            retry_timeout: self.retry,
        }
    }

    /// `(key, value)` of the client options that carry the per-attempt bounds, as the builders'
    /// `with_config` takes them (durations in milliseconds, humantime syntax).
    fn client_options(&self) -> [(ClientConfigKey, String); 2] {
        let ms = |d: Duration| format!("{}ms", d.as_millis().max(1));
        [
            (ClientConfigKey::Timeout, ms(self.request)),
            (
                ClientConfigKey::ConnectTimeout,
                ms(self.request.min(Duration::from_secs(5))),
            ),
        ]
    }
}

/// The error of a call stopped by our own timer ([`Bound::limit`]); reads as object_store's.
fn timed_out(limit: Duration) -> object_store::Error {
    object_store::Error::Generic {
        store: "shardwise",
        source: Box::new(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!(
                "no answer within {:.1}s (retries included; bounded by the caller's timeout)",
                limit.as_secs_f64()
            ),
        )),
    }
}

/// A checkpoint directory in an object store: the store, the key prefix, and upload settings.
pub struct Remote {
    store: Arc<dyn ObjectStore>,
    prefix: ObjectPath,
    /// The URL as the user gave it (for messages).
    pub url: String,
    /// Bytes per multipart part.
    pub part_bytes: usize,
    /// Parts in flight per upload.
    pub concurrency: usize,
    /// Whether the store was checked to honour create-if-absent.
    create_checked: Mutex<bool>,
    /// Time bounds of every request.
    bound: Bound,
    /// Until when calls get [`CLEANUP`] only: set when a call ran into its bound, cleared when
    /// one succeeds.
    stalled_until: Mutex<Option<Instant>>,
}

impl std::fmt::Debug for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.url)
    }
}

/// Stores of the same bucket and bound share one client (connection pool, credentials) per process.
fn store_for(url: &url::Url, bound: Bound) -> Result<Arc<dyn ObjectStore>> {
    static STORES: OnceLock<Mutex<std::collections::HashMap<String, Arc<dyn ObjectStore>>>> =
        OnceLock::new();
    // reqwest is built without a default TLS provider (no aws-lc C build): install ring's before
    // the first client is built (a no-op when the process already has one).
    let _ = rustls::crypto::ring::default_provider().install_default();
    // memory:// has no client to bound, and its objects live in the store instance: every bound
    // must reach the same one, or a read with a caller's timeout would find an empty store.
    let root = match url.scheme() {
        "memory" => format!("memory://{}", url.host_str().unwrap_or("")),
        scheme => format!(
            "{scheme}://{} {}ms {}ms",
            url.host_str().unwrap_or(""),
            bound.request.as_millis(),
            bound.retry.as_millis()
        ),
    };
    let retry = bound.retry_config();
    let mut stores = STORES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(s) = stores.get(&root) {
        return Ok(s.clone());
    }
    let bad = |e: object_store::Error| {
        Error::InvalidArgument(format!("cannot use object store {url}: {e}"))
    };
    let store: Arc<dyn ObjectStore> = match url.scheme() {
        "s3" | "s3a" => {
            use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey, S3ConditionalPut};
            let mut b = AmazonS3Builder::from_env().with_url(url.as_str()).with_retry(retry);
            for (k, v) in bound.client_options() {
                b = b.with_config(AmazonS3ConfigKey::Client(k), v);
            }
            // Create-if-absent (`If-None-Match: *`) is what makes the rendezvous safe; S3, R2 and
            // MinIO support it. Only an explicit AWS_CONDITIONAL_PUT turns it into something else.
            if std::env::var_os("AWS_CONDITIONAL_PUT").is_none() {
                b = b.with_conditional_put(S3ConditionalPut::ETagMatch);
            }
            Arc::new(b.build().map_err(bad)?)
        }
        "gs" => {
            use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
            let mut b = GoogleCloudStorageBuilder::from_env()
                .with_url(url.as_str())
                .with_retry(retry);
            for (k, v) in bound.client_options() {
                b = b.with_config(GoogleConfigKey::Client(k), v);
            }
            Arc::new(b.build().map_err(bad)?)
        }
        "az" | "abfs" | "abfss" | "azure" => {
            use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
            let mut b = MicrosoftAzureBuilder::from_env()
                .with_url(url.as_str())
                .with_retry(retry);
            for (k, v) in bound.client_options() {
                b = b.with_config(AzureConfigKey::Client(k), v);
            }
            Arc::new(b.build().map_err(bad)?)
        }
        "memory" => Arc::new(object_store::memory::InMemory::new()),
        other => {
            return Err(Error::InvalidArgument(format!(
                "unsupported URL scheme {other:?} in {url}: use a path, file://, s3://, gs://, az:// or memory://"
            )))
        }
    };
    stores.insert(root, store.clone());
    Ok(store)
}

impl Remote {
    /// Opens the checkpoint prefix named by `url` (`s3://bucket/run/iter_0000100`).
    ///
    /// Errors: [`Error::InvalidArgument`] for an unsupported scheme, a bad key or bad settings.
    pub fn open(url: &str) -> Result<Remote> {
        Remote::open_within(url, Bound::from_env()?)
    }

    /// This prefix with its requests narrowed to a caller's `timeout` ([`Bound::within`]).
    ///
    /// Errors: as [`Remote::open`].
    pub fn with_timeout(&self, timeout: Duration) -> Result<Remote> {
        Remote::open_within(&self.url, Bound::from_env()?.within(timeout))
    }

    /// The bound of this prefix's requests.
    pub fn bound(&self) -> Bound {
        self.bound
    }

    fn open_within(url: &str, bound: Bound) -> Result<Remote> {
        // Keys are used literally, as s3fs and the cloud consoles show them: a URL that a parser
        // would rewrite (query, fragment, percent-escapes, `.`/`..` segments, blanks) is refused
        // rather than saved somewhere else than the user reads from.
        let after_scheme = url.split_once("://").map_or(url, |(_, rest)| rest);
        let rewritten = after_scheme.contains(['?', '#', '%'])
            || after_scheme.chars().any(char::is_whitespace)
            || after_scheme
                .split('/')
                .skip(1)
                .any(|seg| seg == "." || seg == "..");
        if rewritten {
            return Err(Error::InvalidArgument(format!(
                "URL {url:?}: object keys may not contain '?', '#', '%', blanks or '.'/'..' segments"
            )));
        }
        if after_scheme.split('/').next().is_none_or(str::is_empty) {
            return Err(Error::InvalidArgument(format!(
                "URL {url:?} names no bucket or container (expected scheme://bucket/prefix)"
            )));
        }
        let parsed = url::Url::parse(url)
            .map_err(|e| Error::InvalidArgument(format!("bad URL {url:?}: {e}")))?;
        let part_bytes = env_num("SHARDWISE_MULTIPART_BYTES", 32 << 20)?;
        if part_bytes < MIN_PART_BYTES {
            return Err(Error::InvalidArgument(format!(
                "SHARDWISE_MULTIPART_BYTES={part_bytes} is below the {MIN_PART_BYTES}-byte minimum part of S3, GCS and Azure"
            )));
        }
        let concurrency = env_num("SHARDWISE_MULTIPART_CONCURRENCY", 8)?.max(1) as usize;
        let store = store_for(&parsed, bound)?;
        let prefix = ObjectPath::from_url_path(parsed.path())
            .map_err(|e| Error::InvalidArgument(format!("bad key in {url}: {e}")))?;
        Ok(Remote {
            store,
            prefix,
            url: url.trim_end_matches('/').to_string(),
            part_bytes: part_bytes as usize,
            concurrency,
            create_checked: Mutex::new(false),
            bound,
            stalled_until: Mutex::new(None),
        })
    }

    /// The bound of the next call: [`Bound::limit`], or [`CLEANUP`] shortly after a call ran into
    /// its bound (see the module docs).
    fn limit(&self) -> Duration {
        let mut until = self.stalled_until.lock().unwrap_or_else(|e| e.into_inner());
        match *until {
            Some(t) if Instant::now() < t => CLEANUP,
            Some(_) => {
                *until = None;
                self.bound.limit()
            }
            None => self.bound.limit(),
        }
    }

    /// Records how a call ended: a failure that took at least one attempt's bound means the store
    /// stalls (the calls of the next bound get [`CLEANUP`]); a success clears that.
    fn settle<T>(&self, r: &object_store::Result<T>, took: Duration) {
        let mut until = self.stalled_until.lock().unwrap_or_else(|e| e.into_inner());
        match r {
            Ok(_) => *until = None,
            Err(_) if took >= self.bound.request.min(CLEANUP) => {
                *until = Some(Instant::now() + self.bound.limit())
            }
            Err(_) => {}
        }
    }

    /// Runs one call to the store on the runtime, stopped after `limit` (or [`Remote::limit`]).
    fn call<T>(
        &self,
        limit: Option<Duration>,
        fut: impl std::future::Future<Output = object_store::Result<T>>,
    ) -> object_store::Result<T> {
        let own = self.limit();
        let limit = limit.map_or(own, |t| t.min(own));
        let start = Instant::now();
        // The timer is made inside the runtime (it needs its reactor); when it fires the request
        // future is dropped, which closes its connection: nothing is left waiting on it.
        let r = block_on(async { tokio::time::timeout(limit, fut).await })
            .unwrap_or_else(|_| Err(timed_out(limit)));
        self.settle(&r, start.elapsed());
        r
    }

    /// The object key of `rel` (a `/`-separated path inside the checkpoint).
    fn key(&self, rel: &str) -> Result<ObjectPath> {
        let full = if self.prefix.as_ref().is_empty() {
            rel.to_string()
        } else {
            format!("{}/{rel}", self.prefix)
        };
        ObjectPath::parse(&full)
            .map_err(|e| Error::InvalidArgument(format!("bad key {rel:?}: {e}")))
    }

    /// `rel` as the path [`hit`] names: the object's URL.
    fn path_of(&self, rel: &str) -> std::path::PathBuf {
        std::path::PathBuf::from(format!("{}/{rel}", self.url))
    }

    fn err(&self, op: &'static str, rel: &str) -> impl FnOnce(object_store::Error) -> Error + '_ {
        let url = format!("{}/{rel}", self.url);
        move |source| Error::Remote {
            op,
            url,
            source: Box::new(source),
        }
    }

    /// Writes `bytes` to `rel`, replacing any object there.
    pub fn put(&self, rel: &str, bytes: Vec<u8>) -> Result<()> {
        let key = self.key(rel)?;
        hit(Op::Put, &self.path_of(rel));
        self.call(None, self.store.put(&key, PutPayload::from(bytes)))
            .map(|_| ())
            .map_err(self.err("put", rel))
    }

    /// Creates `rel` only if absent (`PutMode::Create`): `Ok(true)` when this call created it,
    /// `Ok(false)` when it already existed. The first call per store checks that the store really
    /// refuses a second create, since a store that ignores the condition would let two mergers
    /// both commit.
    ///
    /// Errors: [`Error::Remote`], and [`Error::InvalidArgument`] for a store without conditional
    /// put (S3: set `AWS_CONDITIONAL_PUT=etag` or leave it unset; HTTP/WebDAV cannot).
    pub fn put_new(&self, rel: &str, bytes: Vec<u8>) -> Result<bool> {
        self.check_create()?;
        hit(Op::PutIfAbsent, &self.path_of(rel));
        self.create_once(rel, bytes)
    }

    fn create_once(&self, rel: &str, bytes: Vec<u8>) -> Result<bool> {
        let key = self.key(rel)?;
        let opts = PutOptions::from(PutMode::Create);
        match self.call(
            None,
            self.store.put_opts(&key, PutPayload::from(bytes), opts),
        ) {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. })
            | Err(object_store::Error::Precondition { .. }) => Ok(false),
            Err(e @ object_store::Error::NotImplemented { .. }) => Err(self.no_create(e)),
            Err(e) => Err(self.err("create", rel)(e)),
        }
    }

    fn no_create(&self, e: impl std::fmt::Display) -> Error {
        Error::InvalidArgument(format!(
            "{} cannot create objects only-if-absent ({e}); shardwise needs conditional put for \
             its metadata parts and commit markers (on S3-compatible stores: If-None-Match, \
             AWS_CONDITIONAL_PUT=etag)",
            self.url
        ))
    }

    fn check_create(&self) -> Result<()> {
        let mut checked = self
            .create_checked
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if *checked {
            return Ok(());
        }
        let probe = format!(
            ".shardwise/probe-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        );
        let first = self.create_once(&probe, b"1".to_vec())?;
        let second = self.create_once(&probe, b"2".to_vec());
        let _ = self.delete(&probe);
        match (first, second?) {
            (true, false) => {
                *checked = true;
                Ok(())
            }
            _ => Err(self.no_create("a second create of the same key succeeded")),
        }
    }

    /// The whole object, or `None` when absent.
    pub fn get(&self, rel: &str) -> Result<Option<Vec<u8>>> {
        let key = self.key(rel)?;
        let r = self.call(None, async {
            let got = self.store.get(&key).await?;
            got.bytes().await
        });
        match r {
            Ok(b) => Ok(Some(b.to_vec())),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.err("get", rel)(e)),
        }
    }

    /// Bytes `range` of `rel` (one ranged GET).
    pub fn get_range(&self, rel: &str, range: Range<u64>) -> Result<Bytes> {
        self.get_range_within(rel, range, None)
    }

    /// [`Remote::get_range`] that gives up after `timeout` (retries included) when that is
    /// shorter than the prefix's bound.
    ///
    /// Errors: [`Error::Remote`] naming the object (a timeout too).
    pub fn get_range_within(
        &self,
        rel: &str,
        range: Range<u64>,
        timeout: Option<Duration>,
    ) -> Result<Bytes> {
        let key = self.key(rel)?;
        self.call(timeout, self.store.get_range(&key, range))
            .map_err(self.err("get range", rel))
    }

    /// Size in bytes of `rel`, or `None` when absent.
    pub fn size(&self, rel: &str) -> Result<Option<u64>> {
        let key = self.key(rel)?;
        match self.call(None, self.store.head(&key)) {
            Ok(m) => Ok(Some(m.size)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.err("head", rel)(e)),
        }
    }

    /// The object's identity (see [`super::Location::stamp`]), `None` when absent.
    pub fn stamp(&self, rel: &str) -> Result<Option<String>> {
        let key = self.key(rel)?;
        match self.call(None, self.store.head(&key)) {
            Ok(m) => Ok(Some(match (m.e_tag, m.version) {
                (Some(e), _) => format!("etag:{e}"),
                (None, Some(v)) => format!("version:{v}"),
                (None, None) => format!(
                    "{}:{}",
                    m.size,
                    m.last_modified.timestamp_nanos_opt().unwrap_or(0)
                ),
            })),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.err("head", rel)(e)),
        }
    }

    /// Deletes `rel`; absent is fine.
    pub fn delete(&self, rel: &str) -> Result<()> {
        let key = self.key(rel)?;
        hit(Op::Delete, &self.path_of(rel));
        match self.call(None, self.store.delete(&key)) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.err("delete", rel)(e)),
        }
    }

    /// The objects directly under `rel_dir` (name, size in bytes, age in seconds) and the names of
    /// its sub-"directories" (common prefixes).
    pub fn list(&self, rel_dir: &str) -> Result<(Vec<super::Listed>, Vec<String>)> {
        let key = self.key(rel_dir)?;
        let listed = self
            .call(None, self.store.list_with_delimiter(Some(&key)))
            .map_err(self.err("list", rel_dir))?;
        let now = std::time::SystemTime::now();
        let files = listed
            .objects
            .into_iter()
            .filter_map(|m| {
                let name = m.location.filename()?.to_string();
                let modified = std::time::UNIX_EPOCH
                    + Duration::from_millis(m.last_modified.timestamp_millis().max(0) as u64);
                let age_s = now
                    .duration_since(modified)
                    .map_or(0.0, |d| d.as_secs_f64());
                Some(super::Listed {
                    name,
                    size: m.size,
                    age_s,
                })
            })
            .collect();
        let dirs = listed
            .common_prefixes
            .into_iter()
            .filter_map(|p| p.filename().map(str::to_string))
            .collect();
        Ok((files, dirs))
    }

    /// Deletes every object under `rel_dir/`.
    pub fn delete_all(&self, rel_dir: &str) -> Result<()> {
        let key = self.key(rel_dir)?;
        hit(Op::Delete, &self.path_of(rel_dir));
        self.call(None, async {
            let keys: Vec<ObjectPath> = self
                .store
                .list(Some(&key))
                .map_ok(|m| m.location)
                .try_collect()
                .await?;
            for k in keys {
                match self.store.delete(&k).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        })
        .map_err(self.err("delete", rel_dir))
    }

    /// Starts an upload of `rel` in parts of [`Remote::part_bytes`]; see [`Upload`].
    pub fn upload(&self, rel: &str) -> Result<Upload<'_>> {
        Ok(Upload {
            remote: self,
            rel: rel.to_string(),
            key: self.key(rel)?,
            multipart: None,
            inflight: VecDeque::new(),
        })
    }
}

/// A data object written as a sequence of parts, `concurrency` of them uploading at once while the
/// caller prepares the next. An object of one part is a single PUT; larger ones are multipart
/// uploads (no put mode exists for those, so data objects are overwritten, never conditionally
/// created: their names are unique per rank and only the commit marker decides what counts).
pub struct Upload<'r> {
    remote: &'r Remote,
    rel: String,
    key: ObjectPath,
    multipart: Option<Box<dyn MultipartUpload>>,
    /// Parts in flight, each with the time it was queued.
    inflight: VecDeque<(Instant, tokio::task::JoinHandle<object_store::Result<()>>)>,
}

impl Upload<'_> {
    /// Bytes per part of this upload ([`Remote::part_bytes`]).
    pub fn part_bytes(&self) -> usize {
        self.remote.part_bytes
    }

    /// Queues the next part (every part but the last must be at least [`MIN_PART_BYTES`]); blocks
    /// while `concurrency` parts are in flight.
    pub fn part(&mut self, bytes: Vec<u8>) -> Result<()> {
        let remote = self.remote;
        if self.multipart.is_none() {
            let key = self.key.clone();
            self.multipart = Some(
                remote
                    .call(None, remote.store.put_multipart(&key))
                    .map_err(remote.err("start upload", &self.rel))?,
            );
        }
        while self.inflight.len() >= remote.concurrency {
            self.wait_oldest()?;
        }
        let fut = self
            .multipart
            .as_mut()
            .unwrap()
            .put_part(PutPayload::from(bytes));
        // Each part is bounded on its own: it may run while the caller prepares the next ones.
        let limit = remote.limit();
        let bounded = async move {
            tokio::time::timeout(limit, fut)
                .await
                .unwrap_or_else(|_| Err(timed_out(limit)))
        };
        self.inflight
            .push_back((Instant::now(), runtime().spawn(bounded)));
        Ok(())
    }

    fn wait_oldest(&mut self) -> Result<()> {
        if let Some((queued, h)) = self.inflight.pop_front() {
            let r =
                block_on(h).unwrap_or_else(|e| Err(object_store::Error::JoinError { source: e }));
            self.remote.settle(&r, queued.elapsed());
            r.map_err(self.remote.err("upload part", &self.rel))?;
        }
        Ok(())
    }

    /// Writes `bytes` as the whole object (no part queued before).
    pub fn single(self, bytes: Vec<u8>) -> Result<()> {
        self.remote.put(&self.rel, bytes)
    }

    /// Waits for every part and completes the upload.
    pub fn finish(mut self) -> Result<()> {
        while !self.inflight.is_empty() {
            if let Err(e) = self.wait_oldest() {
                self.abort();
                return Err(e);
            }
        }
        let remote = self.remote;
        if let Some(mut m) = self.multipart.take() {
            hit(Op::Put, &remote.path_of(&self.rel));
            remote
                .call(None, m.complete())
                .map_err(remote.err("complete upload", &self.rel))?;
        }
        Ok(())
    }

    /// Abandons the upload (best effort): the store discards its parts.
    pub fn abort(&mut self) {
        for (_, h) in self.inflight.drain(..) {
            h.abort();
        }
        if let Some(mut m) = self.multipart.take() {
            // Best effort, and never longer than a cleanup: a store that does not answer keeps the
            // parts until its own lifecycle rule removes them.
            let _ = self.remote.call(Some(CLEANUP), m.abort());
        }
    }
}

impl Drop for Upload<'_> {
    fn drop(&mut self) {
        // An upload dropped without `finish` (an error on the way) must not leave parts billed.
        self.abort();
    }
}
