//! Writes a benchmark report's table and chart beside it (`REPORT.md`, `REPORT.svg`) from
//! the report alone, as `compressme bench` does at the end of a run: for a report whose
//! recorded fields were brought up to date from a replay's fresh report.
//! `cargo run --release -p compressme-benches --example render_report -- results/offline.json`
use std::path::Path;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .ok_or("usage: render_report REPORT.json")?;
    let path = Path::new(&path);
    let report: compressme_offline::Report = serde_json::from_str(&std::fs::read_to_string(path)?)?;
    std::fs::write(
        path.with_extension("md"),
        compressme_offline::markdown(&report),
    )?;
    std::fs::write(
        path.with_extension("svg"),
        compressme_offline::svg_chart(&report)?,
    )?;
    println!(
        "wrote {} and {}",
        path.with_extension("md").display(),
        path.with_extension("svg").display()
    );
    Ok(())
}
