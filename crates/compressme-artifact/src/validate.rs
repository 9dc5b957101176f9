//! Validation: what [`crate::Artifact::open`] checks before reading a payload byte: the
//! format name and version, the recipe's digest and fields, the recipe and the payload
//! tensors one to one, and the decoded-size limits. Every size here comes from the file,
//! so every operation on one is checked.
#![deny(clippy::arithmetic_side_effects)]

use std::collections::HashSet;
use std::path::Path;

use compressme_quant::Format;

use crate::convert::row_view;
use crate::recipe::{
    FORMAT_KEY, FORMAT_NAME, READABLE, RECIPE_KEY, RECIPE_SHA_KEY, Recipe, SOURCE_HEADER_KEY,
    StorageRecipe, TensorRecipe, VERSION_KEY, VERSION_SOURCE_HEADER, VERSION_XXH3, sha256_hex,
};
use crate::st::{Dtype, EXPANSION_FLOOR, Entry, Limits, SafetensorsFile, parse_header};
use crate::{Error, Result};

/// Payload name of a lossless tensor's block store.
#[must_use]
pub fn blocks_name(tensor: &str) -> String {
    format!("cm.blocks/{tensor}")
}
/// Payload name of a quantized tensor's codes.
#[must_use]
pub fn codes_name(tensor: &str) -> String {
    format!("cm.codes/{tensor}")
}
/// Payload name of a quantized tensor's scales.
#[must_use]
pub fn scales_name(tensor: &str) -> String {
    format!("cm.scales/{tensor}")
}
/// Payload name of an `int4-g*` tensor's minimums.
#[must_use]
pub fn mins_name(tensor: &str) -> String {
    format!("cm.mins/{tensor}")
}

/// A version-3 artifact's record of its source file's header: its tensors (sorted by
/// offset), matched one to one with the recipe's (the text stays in `__metadata__`).
#[derive(Debug, Clone)]
pub(crate) struct SourceHeader {
    /// Its tensors, by offset.
    pub(crate) entries: Vec<Entry>,
}

/// The recipe of the safetensors file at `path`, checked: the format name and version,
/// the recipe's digest, its fields, every tensor against its payload, no stray payload,
/// the decoded-size `limits`, and (version 3) the source header against its digest and
/// the recipe.
pub(crate) fn recipe(
    path: &Path,
    file: &SafetensorsFile,
    limits: &Limits,
) -> Result<(Recipe, Option<SourceHeader>)> {
    let md = file.metadata();
    let not = |reason: &str| Error::NotArtifact {
        path: path.to_path_buf(),
        reason: reason.into(),
    };
    if md.get(FORMAT_KEY).map(String::as_str) != Some(FORMAT_NAME) {
        return Err(not("no `format: compressme-artifact` in __metadata__"));
    }
    let version = md
        .get(VERSION_KEY)
        .ok_or_else(|| not("no compressme.version in __metadata__"))?;
    if !READABLE.iter().any(|v| v.to_string() == *version) {
        return Err(Error::UnsupportedVersion {
            path: path.to_path_buf(),
            found: version.clone(),
            supported: READABLE.map(|v| v.to_string()).join(", "),
        });
    }
    let bad = |reason: String| Error::Recipe {
        path: path.to_path_buf(),
        reason,
    };
    let json = md
        .get(RECIPE_KEY)
        .ok_or_else(|| not("no compressme.recipe in __metadata__"))?;
    let recorded = md
        .get(RECIPE_SHA_KEY)
        .ok_or_else(|| not("no compressme.recipe_sha256 in __metadata__"))?;
    if *recorded != sha256_hex(json.as_bytes()) {
        return Err(Error::Digest {
            tensor: "(recipe)".into(),
            what: "the recipe in __metadata__".into(),
        });
    }
    let recipe: Recipe =
        serde_json::from_str(json).map_err(|e| bad(format!("not a valid recipe: {e}")))?;
    if recipe.format != FORMAT_NAME || recipe.version.to_string() != *version {
        return Err(bad(format!(
            "recipe says {} version {}, metadata says version {version}",
            recipe.format, recipe.version
        )));
    }
    if !file.header_padded() {
        return Err(not(
            "the header is not padded with spaces to a multiple of 8 bytes",
        ));
    }
    let mut used = HashSet::new();
    let mut seen = HashSet::new();
    let mut previous: Option<&str> = None;
    for t in &recipe.tensors {
        if !seen.insert(t.name.as_str()) {
            return Err(bad(format!("tensor `{}` listed twice", t.name)));
        }
        if previous.is_some_and(|p| p > t.name.as_str()) {
            return Err(bad(format!(
                "tensors are not sorted by name (`{}` after `{}`)",
                t.name,
                previous.unwrap_or_default()
            )));
        }
        previous = Some(t.name.as_str());
        check_tensor(file, t, recipe.version, &mut used).map_err(bad)?;
    }
    if let Some(stray) = file.entries().iter().find(|e| !used.contains(&e.name)) {
        return Err(bad(format!(
            "payload tensor `{}` is not in the recipe",
            stray.name
        )));
    }
    check_decoded(path, file, &recipe, limits)?;
    let source = source_header(path, file, &recipe, limits)?;
    Ok((recipe, source))
}

/// The source header: absent before version 3, present in version 3, either in version
/// 4; when present, its text's SHA-256 the recipe's, parsed strictly for the data section the recipe's tensors decode to, and
/// naming the recipe's tensors with their dtypes and shapes, each once.
fn source_header(
    path: &Path,
    file: &SafetensorsFile,
    recipe: &Recipe,
    limits: &Limits,
) -> Result<Option<SourceHeader>> {
    let bad = |reason: String| Error::Recipe {
        path: path.to_path_buf(),
        reason,
    };
    let text = file.metadata().get(SOURCE_HEADER_KEY);
    let digest = recipe.source_header_sha256.as_ref();
    // none before version 3, one in version 3, either way in version 4
    let optional = recipe.version >= VERSION_XXH3 && text.is_none() && digest.is_none();
    if recipe.version < VERSION_SOURCE_HEADER || optional {
        if text.is_some() || digest.is_some() {
            return Err(bad(format!(
                "version {} has no source header (`{SOURCE_HEADER_KEY}`, `source_header_sha256`)",
                recipe.version
            )));
        }
        return Ok(None);
    }
    let (Some(text), Some(digest)) = (text, digest) else {
        return Err(bad(format!(
            "version {} needs `{SOURCE_HEADER_KEY}` in __metadata__ and the recipe's \
             `source_header_sha256`",
            recipe.version
        )));
    };
    if sha256_hex(text.as_bytes()) != *digest {
        return Err(Error::Digest {
            tensor: "(source header)".into(),
            what: format!("`{SOURCE_HEADER_KEY}` in __metadata__"),
        });
    }
    let data_len = recipe
        .tensors
        .iter()
        .try_fold(0u64, |a, t| decoded_bytes(t).and_then(|d| a.checked_add(d)))
        .ok_or_else(|| bad("the tensors' sizes overflow".into()))?;
    let parsed = parse_header(path, text.as_bytes(), data_len, limits)
        .map_err(|e| bad(format!("the source header: {e}")))?;
    if parsed.entries.len() != recipe.tensors.len() {
        return Err(bad(format!(
            "the source header names {} tensors, the recipe {}",
            parsed.entries.len(),
            recipe.tensors.len()
        )));
    }
    for e in &parsed.entries {
        let same = recipe
            .tensors
            .binary_search_by(|t| t.name.as_str().cmp(e.name.as_str()))
            .ok()
            .and_then(|i| recipe.tensors.get(i))
            .is_some_and(|t| t.dtype == e.dtype.name() && t.shape == e.shape);
        if !same {
            return Err(bad(format!(
                "the source header's tensor `{}` ({} {:?}) is not the recipe's",
                e.name,
                e.dtype.name(),
                e.shape
            )));
        }
    }
    Ok(Some(SourceHeader {
        entries: parsed.entries,
    }))
}

/// What a recipe entry decodes to, in bytes (`None` when that overflows).
pub(crate) fn decoded_bytes(t: &TensorRecipe) -> Option<u64> {
    let size = Dtype::parse(&t.dtype).map_or(1, Dtype::size) as u64;
    t.shape
        .iter()
        .try_fold(size, |a, &d| a.checked_mul(d as u64))
}

/// The decoded-size limits, from the recipe's shapes and the payload's sizes, before any
/// payload is read.
pub(crate) fn check_decoded(
    path: &Path,
    file: &SafetensorsFile,
    recipe: &Recipe,
    limits: &Limits,
) -> Result<()> {
    let mut total = 0u64;
    for t in &recipe.tensors {
        let too_large = |what: String, got: u64, limit: u64| Error::TooLarge {
            path: path.to_path_buf(),
            what,
            got,
            limit,
        };
        let decoded = decoded_bytes(t).ok_or_else(|| {
            too_large(
                format!("tensor `{}` decoded", t.name),
                u64::MAX,
                limits.max_decoded_tensor,
            )
        })?;
        if decoded > limits.max_decoded_tensor {
            return Err(too_large(
                format!("tensor `{}` decoded", t.name),
                decoded,
                limits.max_decoded_tensor,
            ));
        }
        total = total.saturating_add(decoded);
        if total > limits.max_decoded_total {
            return Err(too_large(
                "the artifact decoded".into(),
                total,
                limits.max_decoded_total,
            ));
        }
        let stored = payload_names(t)
            .iter()
            .filter_map(|n| file.entry(n))
            .fold(0u64, |a, e| a.saturating_add(e.len()));
        if decoded > EXPANSION_FLOOR && decoded > stored.saturating_mul(limits.max_expansion) {
            return Err(Error::Expansion {
                path: path.to_path_buf(),
                tensor: t.name.clone(),
                decoded,
                stored,
                limit: limits.max_expansion,
            });
        }
    }
    Ok(())
}

/// The payload tensors a recipe entry owns.
pub(crate) fn payload_names(t: &TensorRecipe) -> Vec<String> {
    match &t.storage {
        StorageRecipe::Dense => vec![t.name.clone()],
        StorageRecipe::Lossless { .. } => vec![blocks_name(&t.name)],
        StorageRecipe::Quant { .. } => vec![
            codes_name(&t.name),
            scales_name(&t.name),
            mins_name(&t.name),
        ],
    }
}

/// One recipe entry against the payload, without reading any payload.
fn check_tensor(
    file: &SafetensorsFile,
    t: &TensorRecipe,
    version: u32,
    used: &mut HashSet<String>,
) -> std::result::Result<(), String> {
    let n = &t.name;
    let dtype = Dtype::parse(&t.dtype).ok_or(format!("tensor `{n}`: unknown dtype {}", t.dtype))?;
    let numel = t
        .shape
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d as u64))
        .ok_or(format!("tensor `{n}`: shape {:?} overflows", t.shape))?;
    let dense_len = numel
        .checked_mul(dtype.size() as u64)
        .ok_or(format!("tensor `{n}`: too large"))?;
    let entry = |name: &str, want: Option<Dtype>| -> std::result::Result<Entry, String> {
        let e = file
            .entry(name)
            .ok_or(format!("tensor `{n}`: payload `{name}` is missing"))?;
        // payload tensors (all but a dense tensor's own) are one-dimensional
        if name != n && e.shape.len() != 1 {
            return Err(format!(
                "payload `{name}` has shape {:?}, not one dimension",
                e.shape
            ));
        }
        if let Some(d) = want
            && e.dtype != d
        {
            return Err(format!(
                "payload `{name}` is {}, expected {}",
                e.dtype.name(),
                d.name()
            ));
        }
        Ok(e.clone())
    };
    let hex_len = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    let hex_ok = |s: &str| hex_len(s, 64);
    match &t.storage {
        StorageRecipe::Dense => {
            let e = entry(n, Some(dtype))?;
            if e.shape != t.shape {
                return Err(format!(
                    "tensor `{n}`: payload shape {:?}, recipe {:?}",
                    e.shape, t.shape
                ));
            }
            if !t.sha256.as_deref().is_some_and(hex_ok) || t.xxh3_128.is_some() {
                return Err(format!(
                    "tensor `{n}`: dense storage needs a SHA-256 and no xxh3_128"
                ));
            }
            used.insert(n.clone());
        }
        StorageRecipe::Lossless {
            block_rows,
            rows,
            row_bytes,
            element_size,
            block_sha256,
            index_sha256,
            ..
        } => {
            let e = entry(&blocks_name(n), Some(Dtype::U8))?;
            let (r, rb) = row_view(dtype, &t.shape);
            if (r, rb) != (*rows, *row_bytes) || *element_size != dtype.size().max(1) {
                return Err(format!(
                    "tensor `{n}`: row view {rows} x {row_bytes} (element {element_size}) does not fit {:?} {}",
                    t.shape, t.dtype
                ));
            }
            if *block_rows == 0 {
                return Err(format!("tensor `{n}`: block_rows is 0"));
            }
            let blocks = rows.div_ceil(*block_rows as u64);
            if version == 1 {
                // every block's digest, and no index digest
                if block_sha256.len() as u64 != blocks
                    || !block_sha256.iter().all(|s| hex_ok(s))
                    || index_sha256.is_some()
                {
                    return Err(format!(
                        "tensor `{n}`: {} block digests for {blocks} blocks (version 1)",
                        block_sha256.len()
                    ));
                }
            } else if !index_sha256.as_deref().is_some_and(hex_ok) || !block_sha256.is_empty() {
                // the index digest, which seals the block digests, and no list of them
                return Err(format!(
                    "tensor `{n}`: version {version} needs the block store's index_sha256 and no block_sha256"
                ));
            }
            // the whole-tensor digest: XXH3-128 from version 4 on, SHA-256 before
            if version >= VERSION_XXH3 {
                if !t.xxh3_128.as_deref().is_some_and(|s| hex_len(s, 32)) || t.sha256.is_some() {
                    return Err(format!(
                        "tensor `{n}`: version {version} lossless storage needs an xxh3_128 (32 hex digits) and no sha256"
                    ));
                }
            } else if !t.sha256.as_deref().is_some_and(hex_ok) || t.xxh3_128.is_some() {
                return Err(format!(
                    "tensor `{n}`: version {version} lossless storage needs a SHA-256 and no xxh3_128"
                ));
            }
            // a block store is at most its dense bytes plus per-block overhead
            let es = *element_size as u64;
            let bound = dense_len
                .saturating_add(4096)
                .saturating_add(blocks.saturating_mul(es.saturating_mul(8).saturating_add(52)))
                .saturating_add(es.saturating_mul(2048));
            if e.len() > bound {
                return Err(format!(
                    "tensor `{n}`: {} bytes of blocks for {dense_len} dense",
                    e.len()
                ));
            }
            used.insert(e.name);
        }
        StorageRecipe::Quant {
            format,
            rows,
            cols,
            payload_sha256,
        } => {
            if !hex_ok(payload_sha256) {
                return Err(format!("tensor `{n}`: no payload SHA-256"));
            }
            if t.sha256.is_some() || t.xxh3_128.is_some() {
                return Err(format!(
                    "tensor `{n}`: a quantized tensor has no whole-tensor digest (its payload_sha256 seals it)"
                ));
            }
            let f = Format::parse(format).map_err(|e| format!("tensor `{n}`: {e}"))?;
            if !dtype.is_float()
                || (*rows as u64).checked_mul(*cols as u64) != Some(numel)
                || t.shape.first() != Some(rows)
            {
                return Err(format!(
                    "tensor `{n}`: quantized as {rows} x {cols}, shape {:?} {}",
                    t.shape, t.dtype
                ));
            }
            let codes = entry(&codes_name(n), Some(Dtype::U8))?;
            if (*rows as u64).checked_mul(f.row_code_bytes(*cols) as u64) != Some(codes.len()) {
                return Err(format!(
                    "tensor `{n}`: {} code bytes for {rows} x {cols} {f}",
                    codes.len()
                ));
            }
            used.insert(codes.name);
            let (per_row, group) = match f.group() {
                Some(g) => (cols.div_ceil(g), true),
                None if matches!(f, Format::F16 | Format::Bf16) => (0, false),
                None => (1, false),
            };
            let want = (*rows as u64)
                .checked_mul(per_row as u64)
                .ok_or(format!("tensor `{n}`: {rows} x {per_row} scales overflow"))?;
            let count = |e: &Entry| {
                e.shape
                    .iter()
                    .try_fold(1u64, |a, &d| a.checked_mul(d as u64))
            };
            let sdt = if group { Dtype::F16 } else { Dtype::F32 };
            if want > 0 {
                let s = entry(&scales_name(n), Some(sdt))?;
                if count(&s) != Some(want) {
                    return Err(format!(
                        "tensor `{n}`: {:?} scales, expected {want}",
                        s.shape
                    ));
                }
                used.insert(s.name);
            }
            if matches!(f, Format::Int4Block(_)) {
                let m = entry(&mins_name(n), Some(Dtype::F16))?;
                if count(&m) != Some(want) {
                    return Err(format!(
                        "tensor `{n}`: {:?} minimums, expected {want}",
                        m.shape
                    ));
                }
                used.insert(m.name);
            }
        }
    }
    Ok(())
}
