//! Charts as inline SVG, drawn with `plotters`' SVG backend: a line chart (values over epochs
//! or time) and a bar chart over named categories (grouped or stacked).
//!
//! The SVG is a string put straight into the page: no file, no script, no font (the browser
//! picks one; plotters only estimates text widths for its layout). plotters escapes every
//! text it writes, so names from artifacts are safe in its labels; legends are HTML, written
//! (and escaped) by the page.

use std::ops::Range;

use plotters::coord::combinators::{BindKeyPoints, WithKeyPoints};
use plotters::coord::types::{RangedCoordf64, RangedCoordi64};
use plotters::prelude::*;

/// Chart size in SVG pixels; the page scales it to its column.
const SIZE: (u32, u32) = (640, 300);
const FONT: &str = "sans-serif";
/// Text sizes as plotters takes them (the SVG gets size / 1.24).
const LABEL_SIZE: u32 = 17;
const AXIS_SIZE: u32 = 18;
/// Points drawn as markers only when a series is short enough for them to be told apart.
const MARKER_LIMIT: usize = 60;

/// Okabe–Ito: distinguishable with the common colour-vision deficiencies.
const PALETTE: [RGBColor; 7] = [
    RGBColor(0, 114, 178),
    RGBColor(230, 159, 0),
    RGBColor(0, 158, 115),
    RGBColor(213, 94, 0),
    RGBColor(86, 180, 233),
    RGBColor(204, 121, 167),
    RGBColor(120, 120, 120),
];

/// A chart could not be drawn (the section shows this instead of the chart).
#[derive(Debug, thiserror::Error)]
#[error("chart could not be drawn: {0}")]
pub struct ChartError(String);

fn err(e: impl std::fmt::Display) -> ChartError {
    ChartError(e.to_string())
}

/// The colour of the `i`-th series.
pub fn colour(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// A drawn chart: the SVG and its legend (series name, CSS colour), which the page writes as
/// HTML under the chart so it never covers the data.
pub struct Drawn {
    pub svg: String,
    pub legend: Vec<(String, String)>,
}

fn legend_of<'a>(names: impl Iterator<Item = &'a str>) -> Vec<(String, String)> {
    names
        .enumerate()
        .map(|(i, n)| {
            let RGBColor(r, g, b) = colour(i);
            (n.to_string(), format!("#{r:02x}{g:02x}{b:02x}"))
        })
        .collect()
}

/// A named list of `(x, y)` points.
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

pub struct LineChart<'a> {
    pub x_label: &'a str,
    pub y_label: &'a str,
    pub series: &'a [Series],
    /// The y axis; `None` fits the data from 0.
    pub y_range: Option<Range<f64>>,
    /// x values are whole numbers (epochs): ticks at integers only.
    pub integer_x: bool,
    pub y_format: fn(f64) -> String,
}

/// x values are drawn in thousandths on an integer axis, so that the ticks are exactly where
/// the report puts them (whole epochs, bar centres, round seconds) and not where a float
/// axis would.
const MILLI: f64 = 1000.0;

fn milli(x: f64) -> i64 {
    (x * MILLI).round() as i64
}

/// A line per series, with markers when the series is short.
pub fn line_chart(spec: &LineChart) -> Result<Drawn, ChartError> {
    let (ticks, x_range, y_range) = line_axes(spec);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let x_axis = (milli(x_range.start)..milli(x_range.end))
            .with_key_points(ticks.iter().map(|&t| milli(t)).collect());
        let mut chart = ChartBuilder::on(&root)
            .margin(14)
            .x_label_area_size(42)
            .y_label_area_size(64)
            .build_cartesian_2d(x_axis, y_range)
            .map_err(err)?;
        let x_format = |x: &i64| format_x(*x as f64 / MILLI, spec.integer_x);
        let y_format = |y: &f64| (spec.y_format)(*y);
        chart
            .configure_mesh()
            .x_desc(spec.x_label)
            .y_desc(spec.y_label)
            .label_style((FONT, LABEL_SIZE))
            .axis_desc_style((FONT, AXIS_SIZE))
            .max_light_lines(1)
            .light_line_style(RGBColor(240, 240, 240))
            .bold_line_style(RGBColor(215, 215, 215))
            .y_label_formatter(&y_format)
            .x_label_formatter(&x_format)
            .draw()
            .map_err(err)?;
        for (i, s) in spec.series.iter().enumerate() {
            let c = colour(i);
            let points: Vec<(i64, f64)> = s.points.iter().map(|&(x, y)| (milli(x), y)).collect();
            chart
                .draw_series(LineSeries::new(points.iter().copied(), c.stroke_width(2)))
                .map_err(err)?;
            if points.len() <= MARKER_LIMIT {
                let dots = points.iter().map(|&p| Circle::new(p, 4, c.filled()));
                chart.draw_series(dots).map_err(err)?;
            }
        }
        root.present().map_err(err)?;
    }
    Ok(Drawn {
        svg,
        legend: legend_of(spec.series.iter().map(|s| s.name.as_str())),
    })
}

/// Ticks and ranges of a line chart: whole epochs or round numbers on x, y from 0 (or as
/// asked).
fn line_axes(spec: &LineChart) -> (Vec<f64>, Range<f64>, Range<f64>) {
    let points = || spec.series.iter().flat_map(|s| s.points.iter());
    let (x_min, x_max) = min_max(points().map(|p| p.0)).unwrap_or((0.0, 1.0));
    let (ticks, x_range) = if spec.integer_x {
        (integer_ticks(x_min, x_max), (x_min - 0.25)..(x_max + 0.25))
    } else {
        let hi = if x_max > x_min { x_max } else { x_min + 1.0 };
        (nice_ticks(x_min, hi, 8), x_min..hi)
    };
    let y_range = spec.y_range.clone().unwrap_or_else(|| {
        let top = min_max(points().map(|p| p.1)).map_or(1.0, |(_, max)| max);
        0.0..(top * 1.1).max(1e-9)
    });
    (ticks, x_range, y_range)
}

pub struct BarChart<'a> {
    pub x_label: &'a str,
    pub y_label: &'a str,
    pub categories: &'a [String],
    /// Per series, one value per category.
    pub series: &'a [(String, Vec<f64>)],
    pub stacked: bool,
    pub y_format: fn(f64) -> String,
}

/// Bars per category, one per series side by side, or stacked.
pub fn bar_chart(spec: &BarChart) -> Result<Drawn, ChartError> {
    let n = spec.categories.len().max(1);
    let top = bar_top(spec);
    let centres: Vec<i64> = (0..n).map(|i| milli(i as f64 + 0.5)).collect();
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let mut chart = ChartBuilder::on(&root)
            .margin(14)
            .x_label_area_size(42)
            .y_label_area_size(64)
            .build_cartesian_2d((0..milli(n as f64)).with_key_points(centres), 0.0..top)
            .map_err(err)?;
        let x_format = |x: &i64| {
            let i = (*x as f64 / MILLI).floor() as usize;
            spec.categories.get(i).cloned().unwrap_or_default()
        };
        let y_format = |y: &f64| (spec.y_format)(*y);
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_desc(spec.x_label)
            .y_desc(spec.y_label)
            .label_style((FONT, LABEL_SIZE))
            .axis_desc_style((FONT, AXIS_SIZE))
            .max_light_lines(1)
            .light_line_style(RGBColor(240, 240, 240))
            .bold_line_style(RGBColor(215, 215, 215))
            .x_label_formatter(&x_format)
            .y_label_formatter(&y_format)
            .draw()
            .map_err(err)?;
        draw_bars(&mut chart, spec)?;
        root.present().map_err(err)?;
    }
    Ok(Drawn {
        svg,
        legend: legend_of(spec.series.iter().map(|(n, _)| n.as_str())),
    })
}

type Chart<'a, 'b> =
    ChartContext<'a, SVGBackend<'b>, Cartesian2d<WithKeyPoints<RangedCoordi64>, RangedCoordf64>>;

fn draw_bars(chart: &mut Chart<'_, '_>, spec: &BarChart) -> Result<(), ChartError> {
    let groups = if spec.stacked {
        1
    } else {
        spec.series.len().max(1)
    };
    let width = 0.8 / groups as f64;
    let mut base = vec![0.0; spec.categories.len()];
    for (j, (_, values)) in spec.series.iter().enumerate() {
        let c = colour(j);
        let bars = values.iter().enumerate().map(|(i, &v)| {
            let slot = if spec.stacked { 0 } else { j };
            let x0 = i as f64 + 0.1 + slot as f64 * width;
            let y0 = if spec.stacked { base[i] } else { 0.0 };
            Rectangle::new(
                [(milli(x0), y0), (milli(x0 + width * 0.92), y0 + v)],
                c.filled(),
            )
        });
        let bars: Vec<_> = bars.collect();
        chart.draw_series(bars).map_err(err)?;
        if spec.stacked {
            for (b, v) in base.iter_mut().zip(values) {
                *b += v;
            }
        }
    }
    Ok(())
}

/// The bar chart's y top: the tallest bar (or stack) and a little air.
fn bar_top(spec: &BarChart) -> f64 {
    let n = spec.categories.len();
    let tallest = if spec.stacked {
        (0..n)
            .map(|i| {
                spec.series
                    .iter()
                    .filter_map(|(_, v)| v.get(i))
                    .sum::<f64>()
            })
            .fold(0.0, f64::max)
    } else {
        spec.series
            .iter()
            .flat_map(|(_, v)| v.iter().copied())
            .fold(0.0, f64::max)
    };
    (tallest * 1.08).max(1e-9)
}

fn min_max(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    values
        .filter(|v| v.is_finite())
        .fold(None, |acc, v| match acc {
            None => Some((v, v)),
            Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
        })
}

/// Whole numbers from `lo` to `hi`, thinned to at most 12 ticks.
fn integer_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let (lo, hi) = (lo.ceil() as i64, hi.floor() as i64);
    let span = (hi - lo).max(0) as usize + 1;
    let stride = span.div_ceil(12).max(1);
    (lo..=hi).step_by(stride).map(|i| i as f64).collect()
}

/// Round ticks (1, 2 or 5 times a power of ten apart) covering `lo..=hi`, about `count`.
fn nice_ticks(lo: f64, hi: f64, count: usize) -> Vec<f64> {
    let raw = (hi - lo) / count.max(1) as f64;
    if !(raw.is_finite() && raw > 0.0) {
        return vec![lo];
    }
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|&s| s >= raw)
        .unwrap_or(10.0 * magnitude);
    let first = (lo / step).ceil() as i64;
    let last = (hi / step).floor() as i64;
    (first..=last).map(|i| i as f64 * step).collect()
}

fn format_x(x: f64, integer: bool) -> String {
    if integer {
        format!("{}", x.round() as i64)
    } else if x.abs() >= 100.0 || x.fract() == 0.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.1}")
    }
}
