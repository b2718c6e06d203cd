//! Output of the programs: aligned text tables, CSV and JSON files, the
//! sweep's SVG plot, and progress bars with an ETA.

use std::fmt;

use indicatif::{ProgressBar, ProgressStyle};
use plotters::prelude::*;
use serde::Serialize;

/// Alignment of a table column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Align {
    /// Pad on the right (labels).
    Left,
    /// Pad on the left (numbers).
    Right,
}

/// A text table whose columns are as wide as their widest cell (header
/// included), counted in characters, so long labels never shift the columns
/// after them. Cells are preformatted strings; `Display` renders it.
#[derive(Debug, Clone, Default)]
pub struct Table {
    columns: Vec<(String, Align)>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column headers and alignments.
    pub fn new(columns: &[(&str, Align)]) -> Self {
        Table {
            columns: columns.iter().map(|&(h, a)| (h.to_string(), a)).collect(),
            rows: Vec::new(),
        }
    }

    /// Append a row. Missing cells render empty; extra cells are an error
    /// of the caller and panic.
    pub fn row<S: Into<String>>(&mut self, cells: impl IntoIterator<Item = S>) {
        let cells: Vec<String> = cells.into_iter().map(Into::into).collect();
        assert!(
            cells.len() <= self.columns.len(),
            "row of {} cells in a table of {} columns",
            cells.len(),
            self.columns.len()
        );
        self.rows.push(cells);
    }

    /// The number of rows (headers excluded).
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether the table has no rows.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    fn widths(&self) -> Vec<usize> {
        self.columns
            .iter()
            .enumerate()
            .map(|(i, (h, _))| {
                self.rows
                    .iter()
                    .filter_map(|r| r.get(i))
                    .map(|c| c.chars().count())
                    .chain([h.chars().count()])
                    .max()
                    .unwrap_or(0)
            })
            .collect()
    }
}

impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let widths = self.widths();
        let line = |f: &mut fmt::Formatter<'_>, cells: &mut dyn Iterator<Item = &str>| {
            let mut out = String::new();
            for (i, (w, (_, align))) in widths.iter().zip(&self.columns).enumerate() {
                let c = cells.next().unwrap_or("");
                if i > 0 {
                    out.push(' ');
                }
                let pad = " ".repeat(w.saturating_sub(c.chars().count()));
                match align {
                    Align::Left => {
                        out.push_str(c);
                        out.push_str(&pad);
                    }
                    Align::Right => {
                        out.push_str(&pad);
                        out.push_str(c);
                    }
                }
            }
            writeln!(f, "{}", out.trim_end())
        };
        line(f, &mut self.columns.iter().map(|(h, _)| h.as_str()))?;
        for r in &self.rows {
            line(f, &mut r.iter().map(String::as_str))?;
        }
        Ok(())
    }
}

/// One CSV field: quoted (with `"` doubled) when it holds a comma, a quote
/// or a line break.
pub fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// CSV of serializable records: one header line with `columns`, then one
/// line per record with those fields of its JSON form, in that order
/// (strings as text, numbers as `serde_json` prints them, `null` empty).
pub fn csv<T: Serialize>(columns: &[&str], rows: &[T]) -> Result<String, serde_json::Error> {
    let mut s = columns
        .iter()
        .map(|c| csv_field(c))
        .collect::<Vec<_>>()
        .join(",");
    s.push('\n');
    for r in rows {
        let v = serde_json::to_value(r)?;
        let fields: Vec<String> = columns
            .iter()
            .map(|c| match v.get(c) {
                None | Some(serde_json::Value::Null) => String::new(),
                Some(serde_json::Value::String(t)) => csv_field(t),
                Some(other) => csv_field(&other.to_string()),
            })
            .collect();
        s.push_str(&fields.join(","));
        s.push('\n');
    }
    Ok(s)
}

/// Pretty-printed JSON of a serializable value, with a final newline.
pub fn json<T: Serialize>(value: &T) -> Result<String, serde_json::Error> {
    let mut s = serde_json::to_string_pretty(value)?;
    s.push('\n');
    Ok(s)
}

/// A progress bar on stderr counting `total` `unit`s, with elapsed time, ETA
/// and the current item as its message. Hidden when stderr is not a
/// terminal.
pub fn progress(total: u64, unit: &str) -> ProgressBar {
    let template = format!(
        "[{{bar:30}}] {{pos}}/{{len}} {unit}  {{elapsed:>4}} elapsed  ETA {{eta:>4}}  {{wide_msg}}"
    );
    let style = ProgressStyle::with_template(&template)
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("#> ");
    ProgressBar::new(total).with_style(style)
}

/// One point of the sweep's plot.
#[derive(Debug, Clone, PartialEq)]
pub struct PlotPoint {
    /// Series (one colour each): the corpus domain.
    pub domain: String,
    /// Text beside the point: the cache configuration.
    pub label: String,
    /// Effective bits per element.
    pub bits: f64,
    /// Δppl against full precision (clipped below at 1e-4 on the log axis).
    pub delta: f64,
}

/// Lowest Δppl of the plot's y axis; smaller (and negative) values sit on it.
const Y_FLOOR: f64 = 1e-4;

/// The Pareto front of points (fewer bits, lower Δppl): sorted by bits, each
/// point kept when no point with at most as many bits has a Δppl as low.
pub fn pareto_front(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let mut p: Vec<(f64, f64)> = points
        .iter()
        .copied()
        .filter(|(x, y)| x.is_finite() && !y.is_nan())
        .collect();
    p.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
    let mut front: Vec<(f64, f64)> = Vec::new();
    for q in p {
        if front.last().is_none_or(|l| q.1 < l.1) {
            front.push(q);
        }
    }
    front
}

/// The sweep's plot as an SVG document: Δppl (log scale, values at or below
/// 1e-4 clipped to it) against effective bits, one colour per domain, every
/// point labelled with its configuration, and each domain's Pareto front as
/// a line.
pub fn sweep_svg(title: &str, points: &[PlotPoint]) -> Result<String, String> {
    const COLOURS: [RGBColor; 4] = [
        RGBColor(0x1f, 0x77, 0xb4),
        RGBColor(0xd6, 0x27, 0x28),
        RGBColor(0x2c, 0xa0, 0x2c),
        RGBColor(0x94, 0x67, 0xbd),
    ];
    let clip = |d: f64| if d.is_nan() { d } else { d.max(Y_FLOOR) };
    let pts: Vec<&PlotPoint> = points.iter().filter(|p| p.bits.is_finite()).collect();
    let x_max = pts.iter().map(|p| p.bits).fold(2.0, f64::max).ceil() + 0.5;
    let x_min = pts.iter().map(|p| p.bits).fold(x_max, f64::min).floor() - 0.5;
    let y_max = pts
        .iter()
        .map(|p| clip(p.delta))
        .filter(|d| d.is_finite())
        .fold(0.1, f64::max)
        .log10()
        .ceil();
    let y_max = 10f64.powf(y_max.max(-1.0) + 0.3);
    let mut domains: Vec<&str> = Vec::new();
    for p in &pts {
        if !domains.contains(&p.domain.as_str()) {
            domains.push(&p.domain);
        }
    }
    let e = |e: &dyn fmt::Display| e.to_string();
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (960, 600)).into_drawing_area();
        root.fill(&WHITE).map_err(|x| e(&x))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 16))
            .margin(16)
            .x_label_area_size(40)
            .y_label_area_size(64)
            .build_cartesian_2d(x_min..x_max, (Y_FLOOR * 0.7..y_max).log_scale())
            .map_err(|x| e(&x))?;
        chart
            .configure_mesh()
            .x_desc("effective bits per element (K and V averaged)")
            .y_desc("Δppl vs full precision (log; ≤1e-4 clipped)")
            .x_label_formatter(&|x| format!("{x}"))
            .y_label_formatter(&|y| format!("{y:.0e}"))
            .light_line_style(WHITE)
            .draw()
            .map_err(|x| e(&x))?;
        for (di, d) in domains.iter().enumerate() {
            let colour = COLOURS[di % COLOURS.len()];
            // Alternate domains label above and below their points, so two
            // domains' labels at the same bits do not print over each other.
            let label_dy = if di % 2 == 0 { -12 } else { 4 };
            let mine: Vec<&&PlotPoint> = pts.iter().filter(|p| p.domain == *d).collect();
            let front = pareto_front(
                &mine
                    .iter()
                    .map(|p| (p.bits, clip(p.delta)))
                    .collect::<Vec<_>>(),
            );
            chart
                .draw_series(LineSeries::new(front, colour.stroke_width(2)))
                .map_err(|x| e(&x))?
                .label(format!("{d} (line: Pareto front)"))
                .legend(move |(x, y)| {
                    EmptyElement::at((x, y))
                        + Circle::new((6, 0), 4, colour.filled())
                        + PathElement::new([(-4, 0), (16, 0)], colour.stroke_width(2))
                });
            chart
                .draw_series(mine.iter().filter(|p| !p.delta.is_nan()).map(|p| {
                    EmptyElement::at((p.bits, clip(p.delta)))
                        + Circle::new((0, 0), 4, colour.mix(0.8).filled())
                        + Text::new(
                            p.label.clone(),
                            (6, label_dy),
                            ("sans-serif", 12).into_font().color(&colour),
                        )
                }))
                .map_err(|x| e(&x))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK.mix(0.4))
            .draw()
            .map_err(|x| e(&x))?;
        root.present().map_err(|x| e(&x))?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_columns_fit_the_longest_label() {
        let mut t = Table::new(&[("config", Align::Left), ("ppl", Align::Right)]);
        t.row(["short", "1.0"]);
        t.row(["a much longer configuration label", "12.25"]);
        let s = t.to_string();
        let lines: Vec<&str> = s.lines().collect();
        // The last column is right-aligned: every line ends at the same column.
        let w = "a much longer configuration label".len() + 1 + "12.25".len();
        assert!(lines.iter().all(|l| l.chars().count() == w), "{s}");
        assert!(lines[1].starts_with("short "));
    }

    #[test]
    fn csv_quotes_and_orders_fields() {
        #[derive(Serialize)]
        struct R {
            b: f64,
            a: &'static str,
        }
        let s = csv(
            &["a", "b"],
            &[R {
                b: 0.5,
                a: "x, \"y\"",
            }],
        )
        .unwrap();
        assert_eq!(s, "a,b\n\"x, \"\"y\"\"\",0.5\n");
    }

    #[test]
    fn pareto_front_keeps_the_improving_points() {
        let f = pareto_front(&[(4.0, 0.1), (8.0, 0.01), (5.0, 0.2), (3.0, 1.0), (9.0, 0.05)]);
        assert_eq!(f, vec![(3.0, 1.0), (4.0, 0.1), (8.0, 0.01)]);
    }

    #[test]
    fn sweep_svg_labels_points_and_draws_fronts() {
        let p = |domain: &str, label: &str, bits, delta| PlotPoint {
            domain: domain.into(),
            label: label.into(),
            bits,
            delta,
        };
        let svg = sweep_svg(
            "t",
            &[
                p("austen", "K8/V8 pt32", 9.0, 0.065),
                p("austen", "K4/V4 KIVI", 5.0, 0.16),
                p("austen", "K4/V4 worse", 5.5, 0.5),
                p("code", "K8/V8 pt32", 9.0, -0.003),
                p("code", "K4/V4 KIVI", 5.0, 0.14),
            ],
        )
        .unwrap();
        if let Some(path) = std::env::var_os("KVQ_EVAL_SVG") {
            std::fs::write(path, &svg).unwrap();
        }
        assert!(svg.starts_with("<svg"), "{svg}");
        for label in ["K8/V8 pt32", "K4/V4 KIVI", "K4/V4 worse", "austen", "code"] {
            assert!(svg.contains(label), "no label {label}");
        }
        // One front per domain.
        assert!(svg.matches("<polyline").count() >= 2, "{svg}");
    }
}
