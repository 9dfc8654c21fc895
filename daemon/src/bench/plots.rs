//! The figures of `azsdp bench`: PNGs laid out like Figures 6-10 of the
//! AZ-SDP paper (latency and throughput; overlap; page faults; hot-spot and
//! multi-stream; fan-in and fan-out), drawn from the run's results.
//!
//! Text is rendered by ab_glyph with the DejaVu faces built into the
//! binary, so no font library or installed font is needed.

use std::path::{Path, PathBuf};
use std::sync::Once;

use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;

use super::Row;

/// How an axis maps values to the drawing.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Scale {
    Linear,
    /// Powers of two, labelled as byte sizes (1, 64, 4K, 1M).
    Bytes,
    /// Powers of ten (latencies from microseconds to milliseconds).
    Log10,
}

impl Scale {
    fn to_axis(self, v: f64) -> f64 {
        match self {
            Scale::Linear => v,
            Scale::Bytes => v.max(1.0).log2(),
            Scale::Log10 => v.max(1e-9).log10(),
        }
    }

    fn label(self, at: f64) -> String {
        match self {
            Scale::Linear => trim(at),
            Scale::Bytes => bytes_label(2f64.powf(at).round() as u64),
            Scale::Log10 => trim(10f64.powf(at)),
        }
    }
}

fn trim(v: f64) -> String {
    if v >= 100.0 || v == v.round() {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn bytes_label(b: u64) -> String {
    match b {
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}M", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}K", b >> 10),
        b => b.to_string(),
    }
}

/// One panel: curves per mode, or one bar per mode.
struct Panel {
    title: String,
    x_desc: &'static str,
    y_desc: &'static str,
    x: Scale,
    y: Scale,
    /// (mode, points in data units); a bar panel has one point per mode.
    series: Vec<(String, Vec<(f64, f64)>)>,
    /// Horizontal reference lines (memcpy bandwidth).
    references: Vec<(String, f64)>,
    /// The range of each point's runs, where it had several: (mode,
    /// [(x, lo, hi)]), drawn as error bars.
    ranges: Vec<(String, Vec<ErrorRange>)>,
    bars: bool,
}

/// (x, lowest, highest) of one point's runs.
type ErrorRange = (f64, f64, f64);

/// What every figure says beside its data.
#[derive(Clone, Debug, Default)]
pub struct Context {
    /// Host, date, commit, configuration, quick or full.
    pub footer: String,
    /// (test, mode, size) -> (lowest, highest) of the runs behind a median.
    pub ranges: std::collections::HashMap<(String, String, u64), (f64, f64)>,
}

/// Height of the strip under each chart that holds its legend (never
/// drawn over the data).
const LEGEND_H: u32 = 46;

/// The modes in the order the legend shows them, each with its colour.
fn colour(mode: &str) -> RGBColor {
    match mode {
        "tcp" => RGBColor(90, 90, 90),
        "bsdp" => RGBColor(31, 119, 180),
        "zsdp" => RGBColor(255, 127, 14),
        "azsdp-bow" => RGBColor(44, 160, 44),
        "azsdp-cow" => RGBColor(214, 39, 40),
        "azsdp" => RGBColor(148, 103, 189),
        _ => RGBColor(140, 86, 75),
    }
}

/// The rows of `test` grouped by mode, with `x` and `y` taken from each.
fn curves(
    rows: &[Row],
    modes: &[&str],
    keep: impl Fn(&Row) -> bool,
    x: impl Fn(&Row) -> f64,
) -> Vec<(String, Vec<(f64, f64)>)> {
    modes
        .iter()
        .filter_map(|m| {
            let mut pts: Vec<(f64, f64)> = rows
                .iter()
                .filter(|r| r.mode == *m && keep(r))
                .map(|r| (x(r), r.value))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            (!pts.is_empty()).then(|| (m.to_string(), pts))
        })
        .collect()
}

fn bars(rows: &[Row], modes: &[&str], test: &str) -> Vec<(String, Vec<(f64, f64)>)> {
    curves(rows, modes, |r| r.test == test, |_| 0.0)
}

type DrawResult = Result<(), String>;

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

fn draw_panel(whole: &DrawingArea<BitMapBackend<'_>, Shift>, p: &Panel) -> DrawResult {
    let (_, h) = whole.dim_in_pixel();
    let (area, legend) = whole.split_vertically(h.saturating_sub(LEGEND_H));
    let area = &area;
    let pts = p.series.iter().flat_map(|(_, v)| v.iter());
    let ys: Vec<f64> = pts
        .clone()
        .map(|&(_, y)| y)
        .chain(p.references.iter().map(|r| r.1))
        .chain(p.ranges.iter().flat_map(|(_, v)| v.iter().map(|r| r.2)))
        .collect();
    if ys.is_empty() {
        return Ok(());
    }
    let (x0, x1) = if p.bars {
        (-0.5, p.series.len() as f64 - 0.5)
    } else {
        let xs: Vec<f64> = pts.map(|&(x, _)| p.x.to_axis(x)).collect();
        let lo = xs.iter().copied().fold(f64::MAX, f64::min);
        let hi = xs.iter().copied().fold(f64::MIN, f64::max);
        let pad = ((hi - lo) * 0.04).max(0.5);
        (lo - pad, hi + pad)
    };
    let (y0, y1) = match p.y {
        Scale::Linear => (0.0, ys.iter().copied().fold(0.0, f64::max) * 1.12 + 1e-9),
        _ => {
            let lo = ys.iter().map(|&y| p.y.to_axis(y)).fold(f64::MAX, f64::min);
            let hi = ys.iter().map(|&y| p.y.to_axis(y)).fold(f64::MIN, f64::max);
            (lo.floor(), hi.ceil().max(lo.floor() + 1.0))
        }
    };
    let mut chart = ChartBuilder::on(area)
        .caption(&p.title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(60)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(err)?;
    let names: Vec<String> = p.series.iter().map(|s| s.0.clone()).collect();
    let (xs, ys_scale) = (p.x, p.y);
    let x_fmt = move |v: &f64| {
        if p.bars {
            let i = v.round();
            if (v - i).abs() < 0.01 && i >= 0.0 {
                return names.get(i as usize).cloned().unwrap_or_default();
            }
            return String::new();
        }
        // Counts and microseconds: whole numbers only.
        if xs == Scale::Linear && (v - v.round()).abs() > 1e-6 {
            return String::new();
        }
        xs.label(*v)
    };
    let y_fmt = move |v: &f64| ys_scale.label(*v);
    chart
        .configure_mesh()
        .x_desc(p.x_desc)
        .y_desc(p.y_desc)
        .x_labels(if p.bars { p.series.len() * 2 + 1 } else { 10 })
        .y_labels(if p.y == Scale::Log10 {
            (y1 - y0) as usize + 1
        } else {
            8
        })
        .x_label_formatter(&x_fmt)
        .y_label_formatter(&y_fmt)
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(err)?;
    for (i, (mode, pts)) in p.series.iter().enumerate() {
        let c = colour(mode);
        if p.bars {
            let v = p.y.to_axis(pts[0].1);
            let base = if p.y == Scale::Linear { 0.0 } else { y0 };
            let x = i as f64;
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(x - 0.35, base), (x + 0.35, v)],
                    c.filled(),
                )))
                .map_err(err)?;
            continue;
        }
        let line: Vec<(f64, f64)> = pts
            .iter()
            .map(|&(x, y)| (p.x.to_axis(x), p.y.to_axis(y)))
            .collect();
        chart
            .draw_series(LineSeries::new(line.clone(), c.stroke_width(2)))
            .map_err(err)?;
        chart
            .draw_series(line.into_iter().map(|pt| Circle::new(pt, 3, c.filled())))
            .map_err(err)?;
    }
    // Error bars: the range of the runs behind each median.
    for (mode, r) in &p.ranges {
        let c = colour(mode);
        chart
            .draw_series(r.iter().map(|&(x, lo, hi)| {
                ErrorBar::new_vertical(
                    p.x.to_axis(x),
                    p.y.to_axis(lo),
                    p.y.to_axis((lo + hi) / 2.0),
                    p.y.to_axis(hi),
                    c.stroke_width(1),
                    8,
                )
            }))
            .map_err(err)?;
    }
    for (i, (name, v)) in p.references.iter().enumerate() {
        let y = p.y.to_axis(*v);
        // Long dashes for the first line, dots for the second.
        let (dash, gap) = if i == 0 { (10, 5) } else { (2, 4) };
        chart
            .draw_series(DashedLineSeries::new(
                vec![(x0, y), (x1, y)],
                dash,
                gap,
                BLACK.stroke_width(1),
            ))
            .map_err(err)?;
        let _ = name;
    }
    if !p.bars {
        draw_legend(&legend, p)?;
    }
    Ok(())
}

/// The legend, in its own strip under the chart: a sample of each line and
/// its name, left to right, wrapping to a second row when the strip is full.
fn draw_legend(strip: &DrawingArea<BitMapBackend<'_>, Shift>, p: &Panel) -> DrawResult {
    let style = ("sans-serif", 13).into_font().color(&BLACK);
    let (width, _) = strip.dim_in_pixel();
    let left = 70i32;
    let (mut x, mut y) = (left, 10i32);
    let entries = p
        .series
        .iter()
        .map(|(mode, _)| (mode.clone(), Some(colour(mode)), 0))
        .chain(
            p.references
                .iter()
                .enumerate()
                .map(|(i, (name, _))| (name.clone(), None, i)),
        );
    for (name, colour, i) in entries {
        // 7 pixels a character at this size, the sample line and a gap.
        let w = 40 + 7 * name.chars().count() as i32;
        if x + w > width as i32 && x > left {
            x = left;
            y += 18;
        }
        match colour {
            Some(c) => {
                strip
                    .draw(&PathElement::new(
                        vec![(x, y), (x + 22, y)],
                        c.stroke_width(2),
                    ))
                    .map_err(err)?;
                strip
                    .draw(&Circle::new((x + 11, y), 3, c.filled()))
                    .map_err(err)?;
            }
            None => {
                let (dash, gap) = if i == 0 { (10, 5) } else { (2, 4) };
                strip
                    .draw(&DashedPathElement::new(
                        vec![(x, y), (x + 22, y)],
                        dash,
                        gap,
                        BLACK,
                    ))
                    .map_err(err)?;
            }
        }
        strip
            .draw(&Text::new(name, (x + 27, y - 7), style.clone()))
            .map_err(err)?;
        x += w;
    }
    Ok(())
}

/// Height of the footer that says where and how the figure was made.
const FOOTER_H: u32 = 24;

/// One PNG of `panels` side by side, with `footer` under them.
fn figure(path: &Path, panels: &[Panel], footer: &str) -> DrawResult {
    let width = 620 * panels.len().max(1) as u32;
    let root = BitMapBackend::new(path, (width, 460 + LEGEND_H + FOOTER_H)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (charts, foot) = root.split_vertically(460 + LEGEND_H);
    let areas = charts.split_evenly((1, panels.len().max(1)));
    for (a, p) in areas.iter().zip(panels) {
        draw_panel(a, p)?;
    }
    foot.draw(&Text::new(
        footer.to_string(),
        (12, 4),
        ("sans-serif", 12).into_font().color(&RGBColor(80, 80, 80)),
    ))
    .map_err(err)?;
    root.present().map_err(err)
}

fn fonts() {
    static FONTS: Once = Once::new();
    FONTS.call_once(|| {
        let _ = plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            dejavu::sans::regular(),
        );
    });
}

/// Draw every figure the rows allow into `dir`; the files written.
pub fn draw(
    dir: &Path,
    rows: &[Row],
    modes: &[&str],
    ctx: &Context,
) -> Result<Vec<PathBuf>, String> {
    fonts();
    let memcpy = |hot: u64| {
        rows.iter()
            .find(|r| r.test == "memcpy" && r.parameter == hot)
            .map(|r| r.value)
    };
    let references: Vec<(String, f64)> = [
        ("memcpy 1 MiB, warm", memcpy(0)),
        ("memcpy 1 MiB, cold", memcpy(1)),
    ]
    .into_iter()
    .filter_map(|(n, v)| Some((n.to_string(), v?)))
    .collect();
    let lines = |title: &str, test: &'static str, x: Scale, x_desc, y: Scale, y_desc| Panel {
        title: title.to_string(),
        x_desc,
        y_desc,
        x,
        y,
        series: Vec::new(),
        references: Vec::new(),
        ranges: Vec::new(),
        bars: test.is_empty(),
    };
    let mut figures: Vec<(&str, Vec<Panel>)> = Vec::new();

    let mut lat = lines(
        "(a) ping-pong latency",
        "latency",
        Scale::Bytes,
        "message size (bytes)",
        Scale::Log10,
        "one-way latency (µs)",
    );
    lat.series = curves(rows, modes, |r| r.test == "latency", |r| r.size as f64);
    let mut tput = lines(
        "(b) uni-directional throughput",
        "throughput",
        Scale::Bytes,
        "message size (bytes)",
        Scale::Linear,
        "GB/s",
    );
    tput.series = curves(rows, modes, |r| r.test == "throughput", |r| r.size as f64);
    tput.ranges = tput
        .series
        .iter()
        .map(|(mode, pts)| {
            let r = pts
                .iter()
                .filter_map(|&(x, _)| {
                    let &(lo, hi) =
                        ctx.ranges
                            .get(&("throughput".into(), mode.clone(), x as u64))?;
                    Some((x, lo, hi))
                })
                .collect();
            (mode.clone(), r)
        })
        .collect();
    tput.references = references;
    figures.push(("fig6-latency-throughput.png", vec![lat, tput]));

    let overlap: Vec<Panel> = [
        (65536u64, "(a) overlap, 64 KiB sends"),
        (1 << 20, "(b) overlap, 1 MiB sends"),
    ]
    .into_iter()
    .map(|(size, title)| {
        let mut p = lines(
            title,
            "overlap",
            Scale::Linear,
            "computation between sends (µs)",
            Scale::Linear,
            "GB/s",
        );
        p.series = curves(
            rows,
            modes,
            |r| r.test == "overlap" && r.size == size,
            |r| r.parameter as f64,
        );
        p
    })
    .collect();
    figures.push(("fig7-overlap.png", overlap));

    let mut faults = lines(
        "page faults: 1 MiB buffer rewritten every W sends",
        "page-faults",
        Scale::Bytes,
        "W (sends between rewrites)",
        Scale::Linear,
        "GB/s",
    );
    faults.series = curves(
        rows,
        modes,
        |r| r.test == "page-faults",
        |r| r.parameter as f64,
    );
    figures.push(("fig8-page-faults.png", vec![faults]));

    let mut hot = lines(
        "(a) hot-spot: 4 clients, 64 B ping-pong",
        "",
        Scale::Linear,
        "mode",
        Scale::Linear,
        "worst client's latency (µs)",
    );
    hot.series = bars(rows, modes, "hot-spot");
    let mut streams = lines(
        "(b) multi-stream throughput, 1 MiB sends",
        "multi-stream",
        Scale::Linear,
        "streams",
        Scale::Linear,
        "GB/s, all streams",
    );
    streams.series = curves(
        rows,
        modes,
        |r| r.test == "multi-stream",
        |r| r.parameter as f64,
    );
    figures.push(("fig9-hot-spot-multi-stream.png", vec![hot, streams]));

    let fan: Vec<Panel> = [
        ("fan-in", "(a) fan-in: 4 senders, 1 receiver"),
        ("fan-out", "(b) fan-out: 1 sender, 4 receivers"),
    ]
    .into_iter()
    .map(|(test, title)| {
        let mut p = lines(
            title,
            "",
            Scale::Linear,
            "mode",
            Scale::Linear,
            "total GB/s",
        );
        p.series = bars(rows, modes, test);
        p
    })
    .collect();
    figures.push(("fig10-fan-in-fan-out.png", fan));

    let mut written = Vec::new();
    for (name, panels) in figures {
        if panels.iter().all(|p| p.series.is_empty()) {
            continue;
        }
        let path = dir.join(name);
        figure(&path, &panels, &ctx.footer).map_err(|e| format!("{name}: {e}"))?;
        written.push(path);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_read_as_sizes_and_round_numbers() {
        assert_eq!(Scale::Bytes.label(20.0), "1M");
        assert_eq!(Scale::Bytes.label(12.0), "4K");
        assert_eq!(Scale::Bytes.label(6.0), "64");
        assert_eq!(Scale::Log10.label(2.0), "100");
        assert_eq!(Scale::Linear.label(2.5), "2.50");
        assert_eq!(Scale::Bytes.to_axis(1024.0), 10.0);
    }

    #[test]
    fn every_figure_is_a_png_and_empty_tests_draw_nothing() {
        let dir = std::env::temp_dir().join(format!("azsdp-plots-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let row = |test, mode, size, parameter, value| Row {
            test,
            mode,
            size,
            parameter,
            value,
            unit: "GB/s",
        };
        let mut rows = Vec::new();
        for (i, mode) in ["tcp", "azsdp-bow"].into_iter().enumerate() {
            let k = i as f64 + 1.0;
            for size in [64u64, 4096, 1 << 20] {
                rows.push(row("latency", mode, size, 0, 5.0 * k + size as f64 / 1e4));
                rows.push(row("throughput", mode, size, 0, k * (size as f64).log2()));
            }
            rows.push(row("hot-spot", mode, 64, 4, 10.0 * k));
        }
        rows.push(row("memcpy", "memcpy", 1 << 20, 0, 40.0));
        let ctx = Context {
            footer: "host test, 2026-11-23, commit abc, built-in defaults, quick".into(),
            ranges: [(
                ("throughput".to_string(), "tcp".to_string(), 4096),
                (8.0, 16.0),
            )]
            .into_iter()
            .collect(),
        };
        let files = draw(&dir, &rows, &["tcp", "azsdp-bow"], &ctx).unwrap();
        let names: Vec<String> = files
            .iter()
            .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            [
                "fig6-latency-throughput.png",
                "fig9-hot-spot-multi-stream.png"
            ]
        );
        for f in &files {
            let bytes = std::fs::read(f).unwrap();
            assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{}", f.display());
            assert!(bytes.len() > 10_000, "{} has content", f.display());
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
