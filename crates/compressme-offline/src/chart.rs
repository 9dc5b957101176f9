//! Quality against stored bytes, one point per variant, drawn with plotters as SVG.

use plotters::prelude::*;

use crate::{Error, Report, Result};

fn chart_err<E: std::fmt::Display>(e: E) -> Error {
    Error::Chart(e.to_string())
}

/// An SVG chart of the report: perplexity against the module weights' stored KiB, one
/// point per variant; ours as circles, candle's formats as triangles, the shuffled
/// controls as red crosses, FP32's perplexity as a dashed line.
///
/// # Errors
/// [`Error::Chart`] when plotters fails, or the report has no variants.
pub fn svg_chart(r: &Report) -> Result<String> {
    if r.variants.is_empty() {
        return Err(Error::Chart("no variants to draw".into()));
    }
    let pts: Vec<(f64, f64)> = r
        .variants
        .iter()
        .map(|v| (v.storage.module_stored_bytes as f64 / 1024.0, v.perplexity))
        .collect();
    let (xmax, ymin, ymax) = pts.iter().fold((0f64, f64::INFINITY, 0f64), |a, p| {
        (a.0.max(p.0), a.1.min(p.1), a.2.max(p.1))
    });
    let pad = ((ymax - ymin) * 0.12).max(1e-4);
    let (y0, y1) = (ymin - pad, ymax + pad);
    let fp32 = pts.first().map_or(1.0, |p| p.1);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 560)).into_drawing_area();
        root.fill(&WHITE).map_err(chart_err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                match &r.config {
                    crate::BenchConfig::Synthetic(c) => format!(
                        "Offline benchmark: quality against stored bytes (seed {}, {} steps)",
                        c.seed, c.steps
                    ),
                    crate::BenchConfig::Real(c) => format!(
                        "Real-model benchmark: {} (reference: its Q4_1 weights in f32)",
                        std::path::Path::new(&c.model)
                            .file_name()
                            .map_or(String::new(), |n| n.to_string_lossy().into_owned())
                    ),
                },
                ("sans-serif", 18),
            )
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..xmax * 1.08, y0..y1)
            .map_err(chart_err)?;
        chart
            .configure_mesh()
            .x_desc("module weights stored, KiB")
            .y_desc("held-out perplexity (lower is better)")
            .draw()
            .map_err(chart_err)?;
        chart
            .draw_series(LineSeries::new(
                [(0.0, fp32), (xmax * 1.08, fp32)],
                BLACK.mix(0.3).stroke_width(1),
            ))
            .map_err(chart_err)?
            .label("FP32 perplexity")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], BLACK.mix(0.3)));
        let ours: Vec<(f64, f64)> = r
            .variants
            .iter()
            .zip(&pts)
            .filter(|(v, _)| !v.control && !v.name.starts_with("candle"))
            .map(|(_, p)| *p)
            .collect();
        chart
            .draw_series(ours.iter().map(|&p| Circle::new(p, 5, BLUE.filled())))
            .map_err(chart_err)?
            .label("compressme")
            .legend(|(x, y)| Circle::new((x + 8, y), 5, BLUE.filled()));
        let candle: Vec<(f64, f64)> = r
            .variants
            .iter()
            .zip(&pts)
            .filter(|(v, _)| v.name.starts_with("candle"))
            .map(|(_, p)| *p)
            .collect();
        chart
            .draw_series(
                candle
                    .iter()
                    .map(|&p| TriangleMarker::new(p, 7, GREEN.mix(0.9).filled())),
            )
            .map_err(chart_err)?
            .label("candle (llama.cpp formats)")
            .legend(|(x, y)| TriangleMarker::new((x + 8, y), 7, GREEN.mix(0.9).filled()));
        let controls: Vec<(f64, f64)> = r
            .variants
            .iter()
            .zip(&pts)
            .filter(|(v, _)| v.control)
            .map(|(_, p)| *p)
            .collect();
        chart
            .draw_series(
                controls
                    .iter()
                    .map(|&p| Cross::new(p, 6, RED.stroke_width(2))),
            )
            .map_err(chart_err)?
            .label("shuffled control (same bytes as mixed)")
            .legend(|(x, y)| Cross::new((x + 8, y), 6, RED.stroke_width(2)));
        chart
            .draw_series(r.variants.iter().zip(&pts).map(|(v, &p)| {
                EmptyElement::at(p)
                    + Text::new(
                        v.name.clone(),
                        (8, -12),
                        ("sans-serif", 11).into_font().color(&BLACK.mix(0.8)),
                    )
            }))
            .map_err(chart_err)?;
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK.mix(0.4))
            .draw()
            .map_err(chart_err)?;
        root.present().map_err(chart_err)?;
    }
    Ok(svg)
}
