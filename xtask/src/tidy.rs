//! House rules checked by `cargo test` (and `cargo xtask tidy`):
//! - every internal dependency edge is one that `docs/ARCHITECTURE.md` draws;
//! - every workspace member is in that drawing;
//! - every library crate opens with a `//!` doc that has an example;
//! - the umbrella crate's `lib.rs` only re-exports (logic lives in the focused crates).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

type Graph = BTreeMap<String, BTreeSet<String>>;

fn read(path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))
}

/// The allowed graph: lines `crate: dep dep ...` between the crate-graph markers.
pub(crate) fn allowed_graph(architecture: &str) -> Result<Graph, String> {
    let start = architecture
        .find("<!-- crate-graph:begin -->")
        .ok_or("docs/ARCHITECTURE.md has no crate-graph:begin marker")?;
    let end = architecture
        .find("<!-- crate-graph:end -->")
        .ok_or("docs/ARCHITECTURE.md has no crate-graph:end marker")?;
    let mut g = Graph::new();
    for line in architecture.get(start..end).unwrap_or("").lines() {
        let Some((name, deps)) = line.split_once(':') else {
            continue;
        };
        let name = name.trim();
        if name.is_empty() || name.contains(' ') || name.starts_with("<!--") {
            continue;
        }
        g.insert(
            name.to_string(),
            deps.split_whitespace().map(str::to_string).collect(),
        );
    }
    Ok(g)
}

/// Workspace members (paths) from the root manifest's `members = [...]`.
fn members(root_manifest: &str) -> Vec<String> {
    let Some(start) = root_manifest.find("members = [") else {
        return Vec::new();
    };
    let rest = root_manifest.get(start..).unwrap_or("");
    let body = rest.split(']').next().unwrap_or("");
    body.split('"')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

/// The package name and the internal (`compressme*`) dependencies of one manifest,
/// normal, dev and build dependencies alike.
pub(crate) fn internal_deps(manifest: &str) -> (String, BTreeSet<String>) {
    let mut name = String::new();
    let mut section = String::new();
    let mut deps = BTreeSet::new();
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line.to_string();
            continue;
        }
        if section == "[package]" && line.starts_with("name") {
            name = line.split('"').nth(1).unwrap_or("").to_string();
        }
        if section.ends_with("dependencies]") && line.starts_with("compressme") {
            let dep: String = line
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '-' || *c == '_')
                .collect();
            deps.insert(dep);
        }
    }
    (name, deps)
}

pub(crate) fn check(root: &Path) -> Result<(), String> {
    let graph = allowed_graph(&read(&root.join("docs/ARCHITECTURE.md"))?)?;
    let mut problems = Vec::new();
    for member in members(&read(&root.join("Cargo.toml"))?) {
        let dir = root.join(&member);
        let (name, deps) = internal_deps(&read(&dir.join("Cargo.toml"))?);
        match graph.get(&name) {
            None => problems.push(format!(
                "crate `{name}` ({member}) is missing from the graph in docs/ARCHITECTURE.md"
            )),
            Some(allowed) => {
                for dep in deps.difference(allowed) {
                    problems.push(format!(
                        "`{name}` depends on `{dep}`, an edge docs/ARCHITECTURE.md does not draw"
                    ));
                }
            }
        }
        let lib = dir.join("src/lib.rs");
        if member.starts_with("crates/") {
            let src = read(&lib)?;
            if !src.starts_with("//!") {
                problems.push(format!(
                    "{} does not open with a `//!` crate doc",
                    lib.display()
                ));
            }
            if !src.contains("//! # Example") {
                problems.push(format!(
                    "{} has no `# Example` in its crate doc",
                    lib.display()
                ));
            }
            if name == "compressme" {
                for line in src.lines().map(str::trim) {
                    let allowed = line.is_empty()
                        || line.starts_with("//")
                        || line.starts_with("#!")
                        || line.starts_with("pub use ");
                    if !allowed {
                        problems.push(format!(
                            "the umbrella crate's lib.rs holds more than re-exports: `{line}`"
                        ));
                    }
                }
            }
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("\n"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workspace_is_tidy() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .unwrap_or(Path::new("."));
        if let Err(e) = check(root) {
            panic!("{e}");
        }
    }

    #[test]
    fn an_undrawn_edge_is_caught() {
        let graph = allowed_graph(
            "<!-- crate-graph:begin -->\ncompressme-shuffle:\ncompressme-blockstore: compressme-shuffle\n<!-- crate-graph:end -->",
        )
        .unwrap_or_default();
        let (name, deps) = internal_deps(
            "[package]\nname = \"compressme-shuffle\"\n[dependencies]\ncompressme-blockstore.workspace = true\n",
        );
        assert_eq!(name, "compressme-shuffle");
        let extra: Vec<_> = deps.difference(&graph[&name]).collect();
        assert_eq!(extra, vec!["compressme-blockstore"]);
        assert!(graph["compressme-blockstore"].contains("compressme-shuffle"));
    }
}
