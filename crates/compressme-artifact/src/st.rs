//! safetensors files read and written a tensor at a time: the header is parsed with every
//! size checked against [`Limits`] before anything is allocated, tensors are read by
//! seeking, and writing streams tensors after a header computed up front.
//!
//! Every size here comes from a file, so every operation on one is checked (clippy's
//! `arithmetic_side_effects` is denied).
#![deny(clippy::arithmetic_side_effects)]

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::{Error, Result};

/// Bounds a reader enforces on sizes read from a file, before allocating.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Bytes of the JSON header (default 100 MiB).
    pub max_header: u64,
    /// Tensors in one file (default 1,000,000).
    pub max_tensors: usize,
    /// Bytes of one tensor's payload (default 64 GiB).
    pub max_tensor: u64,
    /// Bytes of the whole file (default unbounded): set it for services that accept
    /// uploads.
    pub max_total: u64,
    /// Bytes one tensor of an artifact decodes to (default 64 GiB), from its recipe's
    /// shape and dtype, checked when the artifact is opened, before any payload is read.
    pub max_decoded_tensor: u64,
    /// Bytes all tensors of an artifact decode to together (default 1 TiB), checked the
    /// same way.
    pub max_decoded_total: u64,
    /// The most a tensor that decodes to more than [`EXPANSION_FLOOR`] bytes may expand:
    /// decoded bytes over the stored bytes of its payload (default 1,024). The coder
    /// cannot produce more than about 20x except through constant byte planes, and a
    /// quantized format at most 16x (two 4-bit codes a byte against f32), so only a
    /// degenerate tensor (gigabytes of one value) or a decompression bomb meets it;
    /// raise it to accept the former.
    pub max_expansion: u64,
}

/// Decoded bytes below which a tensor is never refused for its expansion (64 MiB: a
/// bounded amount of work whatever it claims).
pub const EXPANSION_FLOOR: u64 = 64 << 20;

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_header: 100 << 20,
            max_tensors: 1_000_000,
            max_tensor: 64 << 30,
            max_total: u64::MAX,
            max_decoded_tensor: 64 << 30,
            max_decoded_total: 1 << 40,
            max_expansion: 1024,
        }
    }
}

/// The safetensors dtypes, with their element sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Dtype {
    /// bool, 1 byte.
    Bool,
    /// u8.
    U8,
    /// i8.
    I8,
    /// u16.
    U16,
    /// i16.
    I16,
    /// f16.
    F16,
    /// bf16.
    Bf16,
    /// u32.
    U32,
    /// i32.
    I32,
    /// f32.
    F32,
    /// u64.
    U64,
    /// i64.
    I64,
    /// f64.
    F64,
    /// 8-bit float, e4m3.
    F8E4m3,
    /// 8-bit float, e5m2.
    F8E5m2,
}

impl Dtype {
    const ALL: [(Self, &'static str, usize); 15] = [
        (Self::Bool, "BOOL", 1),
        (Self::U8, "U8", 1),
        (Self::I8, "I8", 1),
        (Self::U16, "U16", 2),
        (Self::I16, "I16", 2),
        (Self::F16, "F16", 2),
        (Self::Bf16, "BF16", 2),
        (Self::U32, "U32", 4),
        (Self::I32, "I32", 4),
        (Self::F32, "F32", 4),
        (Self::U64, "U64", 8),
        (Self::I64, "I64", 8),
        (Self::F64, "F64", 8),
        (Self::F8E4m3, "F8_E4M3", 1),
        (Self::F8E5m2, "F8_E5M2", 1),
    ];

    /// The name safetensors writes.
    #[must_use]
    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(d, ..)| *d == self)
            .map_or("?", |(_, n, _)| n)
    }

    /// Reads a safetensors dtype name.
    #[must_use]
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL
            .iter()
            .find(|(_, n, _)| *n == name)
            .map(|(d, ..)| *d)
    }

    /// Bytes an element.
    #[must_use]
    pub fn size(self) -> usize {
        Self::ALL
            .iter()
            .find(|(d, ..)| *d == self)
            .map_or(1, |(.., s)| *s)
    }

    /// f16, bf16, f32 or f64.
    #[must_use]
    pub fn is_float(self) -> bool {
        [Self::F16, Self::Bf16, Self::F32, Self::F64].contains(&self)
    }
}

/// One tensor of a safetensors file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Its name.
    pub name: String,
    /// Its dtype.
    pub dtype: Dtype,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Offset of its bytes from the start of the data section.
    pub begin: u64,
    /// One past its last byte.
    pub end: u64,
}

impl Entry {
    /// Bytes of data.
    #[must_use]
    pub fn len(&self) -> u64 {
        // every entry is built with begin <= end
        self.end.saturating_sub(self.begin)
    }

    /// Whether it holds no bytes.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.end == self.begin
    }
}

/// A tensor's bytes memory-mapped from its file, read-only ([`SafetensorsFile::map`]), or
/// read into memory when at most `READ_BELOW` (16 KiB).
///
/// One of the two places this crate uses `unsafe` (the other, `write_behind` and
/// `drop_behind`, asks the kernel to write a file back): a map is only sound while no
/// one else shrinks or rewrites the file. Artifacts and checkpoints are written to a temporary
/// name and renamed into place (a rename leaves an open map on the old file), so the
/// risk is another program truncating or editing a file in place while it is read: the
/// process would then fault (SIGBUS) instead of reporting an error. That is the trade
/// every memory-mapping reader (safetensors, candle) makes for not copying weights.
pub struct Mapped(Held);

/// What a [`Mapped`] holds.
enum Held {
    /// A map of the file's range.
    Map(memmap2::Mmap),
    /// A tensor of at most [`READ_BELOW`] bytes (none, too), read: cheaper than a map.
    Read(Vec<u8>),
}

/// Tensors of at most this many bytes are read, not mapped: a map costs two system
/// calls, a page fault and, on a process with several threads, a TLB shootdown on every
/// other core when it goes, more than copying a few pages (MiniLM's norms and biases are
/// 65 of its artifact's 104 entries).
const READ_BELOW: usize = 16 << 10;

impl Mapped {
    #[allow(unsafe_code)]
    fn new(file: &File, offset: u64, len: usize) -> std::io::Result<Self> {
        // SAFETY: read-only map of a range the caller checked lies within the file; see
        // the type's documentation for what a concurrent writer could do.
        let map = unsafe {
            memmap2::MmapOptions::new()
                .offset(offset)
                .len(len)
                .map(file)?
        };
        Ok(Self(Held::Map(map)))
    }

    /// The bytes as an owned buffer: a read tensor's own, a mapped one's copied.
    #[must_use]
    pub fn into_vec(self) -> Vec<u8> {
        match self.0 {
            Held::Map(m) => m.to_vec(),
            Held::Read(v) => v,
        }
    }
}

impl std::ops::Deref for Mapped {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.0 {
            Held::Map(m) => m,
            Held::Read(v) => v,
        }
    }
}

impl AsRef<[u8]> for Mapped {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl std::fmt::Debug for Mapped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Mapped({} bytes)", self.len())
    }
}

/// An open safetensors file: its header, parsed and checked.
#[derive(Debug)]
pub struct SafetensorsFile {
    path: PathBuf,
    file: File,
    data_start: u64,
    entries: Vec<Entry>,
    metadata: BTreeMap<String, String>,
    padded: bool,
    /// The header's bytes, after the length prefix.
    header: Vec<u8>,
}

/// A header parsed and checked ([`parse_header`]).
pub(crate) struct Parsed {
    /// The tensors, in file order.
    pub(crate) entries: Vec<Entry>,
    pub(crate) metadata: BTreeMap<String, String>,
    /// Padded as compressme writes it.
    pub(crate) padded: bool,
}

/// Parses a safetensors header's bytes (after the length prefix) for a data section of
/// `data_len` bytes, strictly: unique keys, every dtype, each shape's size against its
/// byte range and `limits`, and the ranges tiling the data section exactly. The entries
/// come sorted by offset.
///
/// # Errors
/// [`Error::NotSafetensors`] naming what is wrong (`path` names the file it came from),
/// [`Error::TooLarge`], [`Error::UnsupportedDtype`].
pub(crate) fn parse_header(
    path: &Path,
    header: &[u8],
    data_len: u64,
    limits: &Limits,
) -> Result<Parsed> {
    let json: StrictHeader = serde_json::from_slice(header)
        .map_err(|e| bad(path, format!("header is not a JSON object: {e}")))?;
    // padded as compressme writes it: spaces only after the object, to a multiple of 8
    let body_end = header
        .iter()
        .rposition(|&b| b != b' ')
        .map_or(0, |i| i.saturating_add(1));
    let padded = (header.len() as u64).is_multiple_of(8)
        && header.get(..body_end).is_some_and(|h| h.ends_with(b"}"));
    if json.entries.len() > limits.max_tensors {
        return Err(Error::TooLarge {
            path: path.to_path_buf(),
            what: "the tensor count".into(),
            got: json.entries.len() as u64,
            limit: limits.max_tensors as u64,
        });
    }
    let mut metadata = BTreeMap::new();
    for (k, v) in json.metadata.unwrap_or_default() {
        let s = v
            .as_str()
            .ok_or_else(|| bad(path, format!("metadata `{k}` is not a string")))?;
        metadata.insert(k, s.to_string());
    }
    let mut entries = Vec::with_capacity(json.entries.len());
    for (name, v) in json.entries {
        entries.push(parse_entry(path, name, &v, limits, data_len)?);
    }
    entries.sort_by_key(|e| (e.begin, e.end));
    let mut at = 0;
    for e in &entries {
        if e.begin != at {
            return Err(bad(
                path,
                format!(
                    "tensor `{}` starts at {} where {at} was expected (gap or overlap)",
                    e.name, e.begin
                ),
            ));
        }
        at = e.end;
    }
    if at != data_len {
        return Err(bad(
            path,
            format!("tensors cover {at} bytes of a {data_len}-byte data section"),
        ));
    }
    Ok(Parsed {
        entries,
        metadata,
        padded,
    })
}

/// A safetensors header read strictly: its keys in order, `__metadata__` apart (an
/// object of strings), and an error for any key given twice (serde_json's own maps keep
/// the last silently, which would let a file say two things about one tensor).
struct StrictHeader {
    entries: Vec<(String, Value)>,
    metadata: Option<Vec<(String, Value)>>,
}

/// A JSON object whose keys must be unique.
struct StrictObject(Vec<(String, Value)>);

fn strict_map<'de, A: serde::de::MapAccess<'de>, T>(
    mut m: A,
    mut each: impl FnMut(&str, &mut A) -> std::result::Result<Option<T>, A::Error>,
) -> std::result::Result<Vec<(String, T)>, A::Error> {
    use serde::de::Error as _;
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    while let Some(k) = m.next_key::<String>()? {
        if !seen.insert(k.clone()) {
            return Err(A::Error::custom(format!("key `{k}` appears twice")));
        }
        if let Some(v) = each(&k, &mut m)? {
            out.push((k, v));
        }
    }
    Ok(out)
}

impl<'de> serde::Deserialize<'de> for StrictObject {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = StrictObject;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                m: A,
            ) -> std::result::Result<StrictObject, A::Error> {
                strict_map(m, |_, m| m.next_value::<Value>().map(Some)).map(StrictObject)
            }
        }
        d.deserialize_map(V)
    }
}

impl<'de> serde::Deserialize<'de> for StrictHeader {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = StrictHeader;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                m: A,
            ) -> std::result::Result<StrictHeader, A::Error> {
                let mut metadata = None;
                let entries = strict_map(m, |k, m| {
                    if k == "__metadata__" {
                        metadata = Some(m.next_value::<StrictObject>()?.0);
                        Ok(None)
                    } else {
                        m.next_value::<Value>().map(Some)
                    }
                })?;
                Ok(StrictHeader { entries, metadata })
            }
        }
        d.deserialize_map(V)
    }
}

fn bad(path: &Path, reason: impl Into<String>) -> Error {
    Error::NotSafetensors {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl SafetensorsFile {
    /// Opens and checks a file: header length and JSON, every dtype, that each shape's
    /// size equals its byte range, and that the ranges tile the data section exactly.
    ///
    /// # Errors
    /// [`Error::Io`], [`Error::NotSafetensors`] naming what is wrong, [`Error::TooLarge`].
    pub fn open(path: &Path, limits: &Limits) -> Result<Self> {
        let mut file = File::open(path).map_err(io(path))?;
        let size = file.metadata().map_err(io(path))?.len();
        if size > limits.max_total {
            return Err(Error::TooLarge {
                path: path.to_path_buf(),
                what: "the file".into(),
                got: size,
                limit: limits.max_total,
            });
        }
        let mut len = [0u8; 8];
        file.read_exact(&mut len)
            .map_err(|_| bad(path, format!("{size} bytes, too short for a header length")))?;
        let n = u64::from_le_bytes(len);
        if n.checked_add(8).is_none_or(|end| end > size) {
            return Err(bad(
                path,
                format!("header of {n} bytes runs past the end ({size} bytes)"),
            ));
        }
        if n > limits.max_header {
            return Err(Error::TooLarge {
                path: path.to_path_buf(),
                what: "the header".into(),
                got: n,
                limit: limits.max_header,
            });
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact(&mut header).map_err(io(path))?;
        // the header fits the file (checked above)
        let data_len = size.saturating_sub(8).saturating_sub(n);
        let Parsed {
            entries,
            metadata,
            padded,
        } = parse_header(path, &header, data_len, limits)?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
            data_start: n.saturating_add(8),
            entries,
            metadata,
            padded,
            header,
        })
    }

    /// The header's bytes as they are in the file (after the length prefix, padding
    /// included): with the tensors' bytes laid out by their offsets, the whole file.
    #[must_use]
    pub fn header_text(&self) -> &[u8] {
        &self.header
    }

    /// Whether the header is padded as compressme writes it: `N` a multiple of 8, and
    /// only spaces (0x20) after the JSON object (an artifact reader requires it).
    #[must_use]
    pub fn header_padded(&self) -> bool {
        self.padded
    }

    /// The file's path.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The tensors, in file order.
    #[must_use]
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// The tensor called `name`.
    #[must_use]
    pub fn entry(&self, name: &str) -> Option<&Entry> {
        self.entries.iter().find(|e| e.name == name)
    }

    /// `__metadata__`.
    #[must_use]
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// Reads one tensor's bytes (a copy of [`SafetensorsFile::map`]'s).
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn read(&self, e: &Entry) -> Result<Vec<u8>> {
        Ok(self.map(e)?.into_vec())
    }

    /// One tensor's bytes in place, memory-mapped: nothing is read until it is used, and
    /// the pages go when the [`Mapped`] is dropped (a map per tensor, so a process
    /// reading a checkpoint a tensor at a time holds one tensor's pages, not the file's).
    /// A tensor of at most 16 KiB is read instead (a copy costs less than a map).
    ///
    /// # Errors
    /// [`Error::Io`], and [`Error::NotSafetensors`] when the file is now shorter than
    /// its header says (it changed since it was opened).
    pub fn map(&self, e: &Entry) -> Result<Mapped> {
        let len = usize::try_from(e.len()).map_err(|_| bad(&self.path, "tensor too large"))?;
        let at = self
            .data_start
            .checked_add(e.begin)
            .ok_or_else(|| bad(&self.path, "tensor offset overflows"))?;
        let past_end = || {
            bad(
                &self.path,
                format!(
                    "tensor `{}` runs past the end of the file (it changed)",
                    e.name
                ),
            )
        };
        if len <= READ_BELOW {
            // a file cut short since it was opened ends the read early: an error
            let mut v = vec![0; len];
            read_exact_at(&self.file, &mut v, at).map_err(|err| {
                if err.kind() == std::io::ErrorKind::UnexpectedEof {
                    past_end()
                } else {
                    io(&self.path)(err)
                }
            })?;
            return Ok(Mapped(Held::Read(v)));
        }
        // the length was checked against the file's size at open; a file cut short since
        // would fault on access instead of failing here
        let size = self.file.metadata().map_err(io(&self.path))?.len();
        if at.checked_add(e.len()).is_none_or(|end| end > size) {
            return Err(past_end());
        }
        Mapped::new(&self.file, at, len).map_err(io(&self.path))
    }
}

fn parse_entry(
    path: &Path,
    name: String,
    v: &Value,
    limits: &Limits,
    data_len: u64,
) -> Result<Entry> {
    let o = v
        .as_object()
        .ok_or_else(|| bad(path, format!("tensor `{name}` is not an object")))?;
    let dname = o
        .get("dtype")
        .and_then(Value::as_str)
        .ok_or_else(|| bad(path, format!("tensor `{name}` has no dtype")))?;
    let dtype = Dtype::parse(dname).ok_or_else(|| Error::UnsupportedDtype {
        tensor: name.clone(),
        dtype: dname.to_string(),
    })?;
    let shape = o
        .get("shape")
        .and_then(Value::as_array)
        .ok_or_else(|| bad(path, format!("tensor `{name}` has no shape")))?
        .iter()
        .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
        .collect::<Option<Vec<usize>>>()
        .ok_or_else(|| bad(path, format!("tensor `{name}` has a bad shape")))?;
    let offsets = o
        .get("data_offsets")
        .and_then(Value::as_array)
        .and_then(|a| match a.as_slice() {
            [b, e] => Some((b.as_u64()?, e.as_u64()?)),
            _ => None,
        })
        .ok_or_else(|| bad(path, format!("tensor `{name}` has bad data_offsets")))?;
    let (begin, end) = offsets;
    let len = match end.checked_sub(begin) {
        Some(len) if end <= data_len => len,
        _ => {
            return Err(bad(
                path,
                format!("tensor `{name}` spans {begin}..{end} of a {data_len}-byte data section"),
            ));
        }
    };
    let want = shape
        .iter()
        .try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d as u64));
    if want != Some(len) {
        return Err(bad(
            path,
            format!(
                "tensor `{name}`: shape {shape:?} of {} does not fill {} bytes",
                dtype.name(),
                len
            ),
        ));
    }
    if len > limits.max_tensor {
        return Err(Error::TooLarge {
            path: path.to_path_buf(),
            what: format!("tensor `{name}`"),
            got: len,
            limit: limits.max_tensor,
        });
    }
    Ok(Entry {
        name,
        dtype,
        shape,
        begin,
        end,
    })
}

/// A tensor to be written: its header fields and its byte length.
#[derive(Debug, Clone)]
pub struct Planned {
    /// Name.
    pub name: String,
    /// Dtype.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Bytes.
    pub len: u64,
}

/// The header bytes (length prefix included, padded with spaces to a multiple of 8, as
/// the safetensors crate writes) for tensors laid out back to back in the given order.
///
/// # Errors
/// [`Error::Recipe`] when the offsets overflow `u64`; otherwise never (JSON serialisation
/// of strings and numbers).
pub fn header_bytes(tensors: &[Planned], metadata: &BTreeMap<String, String>) -> Result<Vec<u8>> {
    let mut map = Map::new();
    if !metadata.is_empty() {
        map.insert(
            "__metadata__".into(),
            Value::Object(
                metadata
                    .iter()
                    .map(|(k, v)| (k.clone(), Value::String(v.clone())))
                    .collect(),
            ),
        );
    }
    let mut at = 0u64;
    for t in tensors {
        let mut o = Map::new();
        o.insert("dtype".into(), Value::String(t.dtype.name().into()));
        o.insert("shape".into(), Value::from(t.shape.clone()));
        let end = at.checked_add(t.len).ok_or_else(|| Error::Recipe {
            path: PathBuf::new(),
            reason: "tensor offsets overflow u64".into(),
        })?;
        o.insert("data_offsets".into(), Value::from(vec![at, end]));
        map.insert(t.name.clone(), Value::Object(o));
        at = end;
    }
    let mut json = serde_json::to_vec(&Value::Object(map)).map_err(|e| Error::Recipe {
        path: PathBuf::new(),
        reason: e.to_string(),
    })?;
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    Ok(out)
}

/// The temporary files of this process's [`AtomicFile`]s not yet committed or dropped.
static LIVE: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());
/// Set by [`remove_temporaries`]: the process is exiting and creates no new temporary.
static CLOSING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn live() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    LIVE.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Removes every temporary file this process's [`AtomicFile`]s still hold, and returns
/// how many it removed; from then on [`AtomicFile::create`] refuses. For a signal
/// handler (the CLI calls it on SIGINT, SIGTERM and SIGHUP before exiting): a process
/// that is stopped that way runs no destructors.
pub fn remove_temporaries() -> usize {
    let mut l = live();
    CLOSING.store(true, std::sync::atomic::Ordering::SeqCst);
    let n = l.iter().filter(|p| std::fs::remove_file(p).is_ok()).count();
    l.clear();
    n
}

/// Whether process `pid` is alive (`/proc/PID` exists); `None` where there is no `/proc`.
fn alive(pid: u32) -> Option<bool> {
    let proc = Path::new("/proc");
    proc.join("self")
        .exists()
        .then(|| proc.join(pid.to_string()).exists())
}

/// `read_exact_at` on any platform: `buf` filled from `offset`, or an error
/// (`UnexpectedEof` where the file ends first).
#[cfg(unix)]
fn read_exact_at(f: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(f, buf, offset)
}

#[cfg(windows)]
fn read_exact_at(f: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    let (mut done, mut at) = (0usize, offset);
    while let Some(rest) = buf.get_mut(done..).filter(|r| !r.is_empty()) {
        let n = std::os::windows::fs::FileExt::seek_read(f, rest, at)?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        done = done.saturating_add(n);
        at = at.saturating_add(n as u64);
    }
    Ok(())
}

/// Removes `dest`'s stale temporaries: siblings named `.{name}.tmp-{pid}` (the name
/// [`AtomicFile`] gives them) whose process is gone, such as those of a run killed with
/// SIGKILL. Nothing else is touched, and nothing where liveness cannot be told.
fn remove_stale(dest: &Path, name: &str) {
    let dir = match dest.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return;
    };
    let prefix = format!(".{name}.tmp-");
    for e in entries.flatten() {
        let file_name = e.file_name();
        let Some(pid) = file_name
            .to_str()
            .and_then(|n| n.strip_prefix(&prefix))
            .filter(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && alive(pid) == Some(false) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// The most bytes one `write` call hands the kernel. On the 2-vCPU development VM (Linux
/// 6.18, ext4) `dd` of 4 GiB took 5.0-11.7 s in 2 and 4 MiB writes and 1.1-2.1 s in 128 KiB
/// to 1 MiB writes (likely the large page-cache folios the kernel gives large writes, which
/// the VM is slow to back), and `unpack` of the 4 GiB checkpoint spent 55% of its samples
/// copying 4 MiB pieces into the page cache. zstd writes 32 KiB at a time.
pub(crate) const WRITE_CHUNK: usize = 256 << 10;

/// Bytes an [`AtomicFile`] takes between two requests to the kernel to start writing its
/// dirty pages back (Linux: `sync_file_range(SYNC_FILE_RANGE_WRITE)` over the file, which
/// queues the write-back and does not wait for it). Left to itself the kernel starts only
/// when a tenth of memory is dirty and then throttles every writer: on the development VM
/// (Linux 6.18, ext4, a disk that takes 2.1 GB/s direct) 4.3 GB written in 256 KiB calls
/// took 1.2-3.6 s and left 2.3 GB dirty, which the next large write then waited on; with a
/// request every 64 MiB, 1.6-2.2 s and nothing left dirty (`dd` in 4 MiB calls: 4.7-10.1 s
/// against 1.7-3.0).
pub(crate) const WRITE_BEHIND: u64 = 64 << 20;

/// Asks the kernel to start writing `f`'s dirty pages back, without waiting (Linux; a no-op
/// elsewhere). A hint: its failure changes nothing and is ignored.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn write_behind(f: &File) {
    use std::os::fd::AsRawFd;
    // SAFETY: sync_file_range(2) on the descriptor `f` owns, open for the whole call;
    // offset 0 and length 0 mean the whole file, and the call touches no memory of ours
    let _ = unsafe { libc::sync_file_range(f.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE) };
}

#[cfg(not(target_os = "linux"))]
fn write_behind(_: &File) {}

/// Bytes a file written with [`AtomicFile::set_drop_behind`] keeps in the page cache
/// behind its writes: older ranges are waited on and dropped.
const KEEP_BEHIND: u64 = 2 * WRITE_BEHIND;

/// Waits for the write-back of `f`'s bytes `at..at + len` and drops them from the page
/// cache (Linux; a no-op elsewhere). A hint, like [`write_behind`]: failures are ignored
/// (the kernel drops no dirty page).
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn drop_behind(f: &File, at: u64, len: u64) {
    use std::os::fd::AsRawFd;
    let (Ok(at), Ok(len)) = (i64::try_from(at), i64::try_from(len)) else {
        return;
    };
    let wait = libc::SYNC_FILE_RANGE_WAIT_BEFORE
        | libc::SYNC_FILE_RANGE_WRITE
        | libc::SYNC_FILE_RANGE_WAIT_AFTER;
    // SAFETY: two system calls on the descriptor `f` owns, open for both; they touch no
    // memory of ours
    unsafe {
        let _ = libc::sync_file_range(f.as_raw_fd(), at, len, wait);
        let _ = libc::posix_fadvise(f.as_raw_fd(), at, len, libc::POSIX_FADV_DONTNEED);
    }
}

#[cfg(not(target_os = "linux"))]
fn drop_behind(_: &File, _: u64, _: u64) {}

/// Whether a finished file is forced to the disk before it is renamed into place.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Durability {
    /// Renamed into place once complete (and, for an artifact, checked); its write-back
    /// is started as it is written (every 64 MiB) but not waited for, so, as with the
    /// files `zstd`, `cp` and the safetensors writers leave, a power failure before the
    /// write-back may lose the new file (and, on file systems that do not order a
    /// replacing rename after the data, the old file it replaced); a crash of the process
    /// never leaves a partial file under the name.
    #[default]
    Cached,
    /// `fsync` before the rename: the file is on the disk when the call returns, at the
    /// cost of waiting for its write-back (26-29 ms of a 115 ms `unpack` of MiniLM f32
    /// on the development VM, seconds for a multi-GB checkpoint).
    Synced,
}

/// The ranges (offset, length) of a file still in the page cache behind its writes, oldest
/// first, and their bytes ([`AtomicFile::set_drop_behind`]).
#[derive(Debug, Default)]
struct Behind {
    ranges: std::collections::VecDeque<(u64, u64)>,
    bytes: u64,
}

/// A file written beside its destination and renamed into place only when complete; it
/// is removed if dropped before [`AtomicFile::commit`], by [`remove_temporaries`] (on a
/// signal), or by a later `create` for the same destination once its process is gone.
#[derive(Debug)]
pub struct AtomicFile {
    tmp: PathBuf,
    dest: PathBuf,
    file: Option<File>,
    durability: Durability,
    /// Bytes written so far (write-behind is asked for at each multiple of
    /// [`WRITE_BEHIND`]); shared by the threads that write through [`Self::write_all_at`].
    written: std::sync::atomic::AtomicU64,
    /// With [`Self::set_drop_behind`]: the ranges written through [`Self::write_all_at`]
    /// still in the page cache, oldest first, and their bytes.
    behind: Option<std::sync::Mutex<Behind>>,
}

impl AtomicFile {
    /// Creates `dest`'s temporary sibling `.{name}.tmp-{pid}`, after removing stale ones
    /// of dead processes.
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn create(dest: &Path) -> Result<Self> {
        let name = dest
            .file_name()
            .map_or_else(|| "out".into(), |n| n.to_string_lossy().into_owned());
        remove_stale(dest, &name);
        let tmp = dest.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
        // created and registered under the lock [`remove_temporaries`] takes, so a signal
        // cannot fall between the two; after it, nothing new is created
        let mut l = live();
        if CLOSING.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(Error::Io {
                path: tmp,
                source: std::io::Error::new(std::io::ErrorKind::Interrupted, "interrupted"),
            });
        }
        // readable too: `shift_tail` reads back what it moves
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(io(&tmp))?;
        l.push(tmp.clone());
        drop(l);
        Ok(Self {
            tmp,
            dest: dest.to_path_buf(),
            file: Some(file),
            durability: Durability::default(),
            written: std::sync::atomic::AtomicU64::new(0),
            behind: None,
        })
    }

    /// Counts `n` bytes written, and asks for their write-back each time the count passes
    /// a multiple of [`WRITE_BEHIND`].
    fn wrote(&self, n: u64) {
        use std::sync::atomic::Ordering;
        let before = self.written.fetch_add(n, Ordering::Relaxed);
        if before / WRITE_BEHIND != before.saturating_add(n) / WRITE_BEHIND
            && let Some(f) = &self.file
        {
            write_behind(f);
        }
    }

    /// Keeps at most 128 MiB written through [`Self::write_all_at`] in the
    /// page cache: older ranges are waited on and dropped as the file grows. For a large
    /// output this process does not read back (`unpack`'s): written pages then go back to
    /// the free list as fast as they come, where a page cache filling with the whole file
    /// took pages the kernel had to find (and this VM to back) first. The cost: on a disk
    /// slower than the writer, the call's time includes all but the last 128 MiB of the
    /// disk's own write (without it the kernel throttles the writer too, once a tenth to a
    /// fifth of memory is dirty, and the disk works on after the process exits).
    pub fn set_drop_behind(&mut self) {
        self.behind = Some(std::sync::Mutex::default());
    }

    /// Records `at..at + len` as written, and drops the oldest ranges past
    /// [`KEEP_BEHIND`] (with [`Self::set_drop_behind`]).
    fn written_at(&self, at: u64, len: u64) {
        let (Some(b), Some(f)) = (&self.behind, &self.file) else {
            return;
        };
        let mut b = b.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        b.ranges.push_back((at, len));
        b.bytes = b.bytes.saturating_add(len);
        while b.bytes > KEEP_BEHIND {
            let Some((a, l)) = b.ranges.pop_front() else {
                break;
            };
            b.bytes = b.bytes.saturating_sub(l);
            drop_behind(f, a, l);
        }
    }

    /// Whether [`AtomicFile::commit`] syncs the file before the rename (not by default).
    pub fn set_durability(&mut self, d: Durability) {
        self.durability = d;
    }

    /// The temporary path (complete once written, before the rename).
    #[must_use]
    pub fn tmp_path(&self) -> &Path {
        &self.tmp
    }

    /// Appends bytes.
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn write_all(&mut self, bytes: &[u8]) -> Result<()> {
        let Some(f) = &mut self.file else {
            return Ok(());
        };
        for chunk in bytes.chunks(WRITE_CHUNK) {
            f.write_all(chunk).map_err(io(&self.tmp))?;
        }
        self.wrote(bytes.len() as u64);
        Ok(())
    }

    /// Writes bytes at `offset` (past the end, the file grows), through a shared
    /// reference: threads writing disjoint ranges of one file need no lock.
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn write_all_at(&self, offset: u64, bytes: &[u8]) -> Result<()> {
        let Some(f) = &self.file else { return Ok(()) };
        #[cfg(unix)]
        {
            let mut at = offset;
            for chunk in bytes.chunks(WRITE_CHUNK) {
                std::os::unix::fs::FileExt::write_all_at(f, chunk, at).map_err(io(&self.tmp))?;
                at = at.saturating_add(chunk.len() as u64);
            }
            self.wrote(bytes.len() as u64);
            self.written_at(offset, bytes.len() as u64);
            Ok(())
        }
        #[cfg(windows)]
        {
            let (mut done, mut at) = (0usize, offset);
            while let Some(rest) = bytes.get(done..).filter(|r| !r.is_empty()) {
                let n = std::os::windows::fs::FileExt::seek_write(f, rest, at)
                    .map_err(io(&self.tmp))?;
                if n == 0 {
                    return Err(io(&self.tmp)(std::io::ErrorKind::WriteZero.into()));
                }
                done = done.saturating_add(n);
                at = at.saturating_add(n as u64);
            }
            self.wrote(bytes.len() as u64);
            self.written_at(offset, bytes.len() as u64);
            Ok(())
        }
    }

    /// Moves to `offset` (later writes go there; a gap before it reads as zeros until
    /// written).
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn seek_to(&mut self, offset: u64) -> Result<()> {
        use std::io::Seek;
        match &mut self.file {
            Some(f) => f
                .seek(std::io::SeekFrom::Start(offset))
                .map(drop)
                .map_err(io(&self.tmp)),
            None => Ok(()),
        }
    }

    /// Moves every byte from `from` to the end of the file `by` bytes further on (last
    /// piece first, so nothing is overwritten before it is read), making room before it.
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn shift_tail(&mut self, from: u64, by: u64) -> Result<()> {
        let Some(f) = &self.file else { return Ok(()) };
        let len = f.metadata().map_err(io(&self.tmp))?.len();
        let mut buf = vec![0u8; 8 << 20];
        let mut end = len;
        while end > from {
            let start = end.saturating_sub(buf.len() as u64).max(from);
            let n = usize::try_from(end.saturating_sub(start)).unwrap_or(0);
            let piece = buf.get_mut(..n).unwrap_or(&mut []);
            read_exact_at(f, piece, start).map_err(io(&self.tmp))?;
            self.write_all_at(start.saturating_add(by), piece)?;
            end = start;
        }
        Ok(())
    }

    /// Appends the whole of another file (the kernel copies it where it can, without
    /// passing the bytes through this process).
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn append_file(&mut self, path: &Path) -> Result<u64> {
        let Some(f) = &mut self.file else {
            return Ok(0);
        };
        let mut src = File::open(path).map_err(io(path))?;
        let n = std::io::copy(&mut src, f).map_err(io(&self.tmp))?;
        self.wrote(n);
        Ok(n)
    }

    /// Flushes and syncs the temporary file (still not renamed).
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn sync(&mut self) -> Result<()> {
        if let Some(f) = &mut self.file {
            f.flush().map_err(io(&self.tmp))?;
            f.sync_all().map_err(io(&self.tmp))?;
        }
        Ok(())
    }

    /// Renames the finished file into place, after flushing it (and syncing it with
    /// [`Durability::Synced`]).
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn commit(mut self) -> Result<()> {
        if let Some(f) = &mut self.file {
            f.flush().map_err(io(&self.tmp))?;
        }
        if self.durability == Durability::Synced {
            self.sync()?;
        }
        self.file = None;
        let r = std::fs::rename(&self.tmp, &self.dest).map_err(io(&self.dest));
        if r.is_err() {
            let _ = std::fs::remove_file(&self.tmp);
        }
        live().retain(|p| p != &self.tmp);
        r
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if self.file.is_some() {
            self.file = None;
            let _ = std::fs::remove_file(&self.tmp);
            live().retain(|p| p != &self.tmp);
        }
    }
}
