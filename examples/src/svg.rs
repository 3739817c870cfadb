//! A hand-written SVG figure: KV memory reserved and running sequences over simulated
//! time, one line per policy. No plotting dependency: two panels of polylines, axes with
//! round ticks and a legend are a hundred lines.

use std::fmt::Write as _;

use crate::sim::SeriesPoint;

/// One policy's series.
pub struct Line<'a> {
    /// Legend label.
    pub label: &'a str,
    /// Points in time order.
    pub points: &'a [SeriesPoint],
}

const COLORS: [&str; 6] = [
    "#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b",
];
const W: f64 = 900.0;
const PANEL_H: f64 = 260.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
const GAP: f64 = 60.0;
const MAX_POINTS: usize = 1500;

/// A "nice" tick step (1, 2 or 5 × 10^k) giving about 5 ticks up to `max`.
fn tick_step(max: f64) -> f64 {
    if max <= 0.0 || !max.is_finite() {
        return 1.0;
    }
    let raw = max / 5.0;
    let p = 10f64.powf(raw.log10().floor());
    let m = raw / p;
    p * if m <= 1.0 {
        1.0
    } else if m <= 2.0 {
        2.0
    } else if m <= 5.0 {
        5.0
    } else {
        10.0
    }
}

/// Reduces a step series to at most `MAX_POINTS` buckets in time, keeping each bucket's
/// maximum (so peaks stay visible). O(n).
fn downsample(
    points: &[SeriesPoint],
    t_max: f64,
    f: impl Fn(&SeriesPoint) -> f64,
) -> Vec<(f64, f64)> {
    if points.len() <= MAX_POINTS {
        return points.iter().map(|p| (p.t_s, f(p))).collect();
    }
    let mut out: Vec<(f64, f64)> = Vec::with_capacity(MAX_POINTS + 1);
    let width = t_max / MAX_POINTS as f64;
    let mut bucket = usize::MAX;
    for p in points {
        let b = ((p.t_s / width) as usize).min(MAX_POINTS - 1);
        let v = f(p);
        if b == bucket {
            if let Some(last) = out.last_mut() {
                last.1 = last.1.max(v);
            }
        } else {
            bucket = b;
            out.push((b as f64 * width, v));
        }
    }
    if let Some(p) = points.last() {
        out.push((p.t_s, f(p)));
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn panel(
    svg: &mut String,
    lines: &[Line<'_>],
    top: f64,
    t_max: f64,
    title: &str,
    y_label: &str,
    y_max: f64,
    hline: Option<(f64, &str)>,
    f: &dyn Fn(&SeriesPoint) -> f64,
    dashed: Option<&dyn Fn(&SeriesPoint) -> f64>,
) {
    let plot_w = W - LEFT - RIGHT;
    let x = |t: f64| LEFT + t / t_max * plot_w;
    let y = |v: f64| top + PANEL_H - v / y_max * PANEL_H;
    let _ = writeln!(
        svg,
        r#"<text x="{LEFT}" y="{:.1}" font-size="14" font-weight="bold">{title}</text>"#,
        top - 10.0
    );
    let _ = writeln!(
        svg,
        r##"<rect x="{LEFT}" y="{top}" width="{plot_w}" height="{PANEL_H}" fill="none" stroke="#444"/>"##
    );
    let ys = tick_step(y_max);
    let mut v = 0.0;
    while v <= y_max + 1e-9 {
        let yy = y(v);
        let _ = writeln!(
            svg,
            r##"<line x1="{LEFT}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" font-size="11" text-anchor="end">{}</text>"##,
            W - RIGHT,
            LEFT - 5.0,
            yy + 4.0,
            trim(v)
        );
        v += ys;
    }
    let xs = tick_step(t_max);
    let mut t = 0.0;
    while t <= t_max + 1e-9 {
        let xx = x(t);
        let _ = writeln!(
            svg,
            r##"<line x1="{xx:.1}" y1="{top}" x2="{xx:.1}" y2="{:.1}" stroke="#eee"/><text x="{xx:.1}" y="{:.1}" font-size="11" text-anchor="middle">{}</text>"##,
            top + PANEL_H,
            top + PANEL_H + 15.0,
            trim(t)
        );
        t += xs;
    }
    let _ = writeln!(
        svg,
        r#"<text x="18" y="{:.1}" font-size="12" transform="rotate(-90 18 {:.1})" text-anchor="middle">{y_label}</text>"#,
        top + PANEL_H / 2.0,
        top + PANEL_H / 2.0
    );
    if let Some((h, label)) = hline {
        let yy = y(h);
        let _ = writeln!(
            svg,
            r##"<line x1="{LEFT}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#000" stroke-dasharray="6 4"/><text x="{:.1}" y="{:.1}" font-size="11" text-anchor="end">{label}</text>"##,
            W - RIGHT,
            W - RIGHT - 4.0,
            yy - 4.0
        );
    }
    for (i, l) in lines.iter().enumerate() {
        // Earlier policies are drawn wider so identical curves stay visible underneath.
        let width = (2.8 - 0.5 * i as f64).max(1.0);
        let color = COLORS[i % COLORS.len()];
        if let Some(g) = dashed {
            let d = path(&downsample(l.points, t_max, g), &x, &y);
            let _ = writeln!(
                svg,
                r#"<polyline fill="none" stroke="{color}" stroke-width="{width:.1}" stroke-opacity="0.6" stroke-dasharray="5 3" points="{d}"/>"#
            );
        }
        let d = path(&downsample(l.points, t_max, f), &x, &y);
        let _ = writeln!(
            svg,
            r#"<polyline fill="none" stroke="{color}" stroke-width="{width:.1}" stroke-opacity="0.85" points="{d}"/>"#
        );
    }
}

fn path(pts: &[(f64, f64)], x: &dyn Fn(f64) -> f64, y: &dyn Fn(f64) -> f64) -> String {
    let mut d = String::with_capacity(pts.len() * 14);
    for &(t, v) in pts {
        let _ = write!(d, "{:.1},{:.1} ", x(t), y(v));
    }
    d.truncate(d.trim_end().len());
    d
}

fn trim(v: f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// The whole figure: memory reserved (GB, with the budget as a dashed line) on top,
/// running sequences below, over simulated seconds; `title` above. O(points).
pub fn render(title: &str, lines: &[Line<'_>], budget_bytes: u64) -> String {
    let t_max = lines
        .iter()
        .filter_map(|l| l.points.last().map(|p| p.t_s))
        .fold(0.0, f64::max)
        .max(1e-9);
    let budget_gb = budget_bytes as f64 / 1e9;
    let mem_max = budget_gb * 1.05;
    let run_max = lines
        .iter()
        .flat_map(|l| l.points.iter().map(|p| f64::from(p.running)))
        .fold(1.0, f64::max)
        * 1.05;
    let h = TOP + 2.0 * PANEL_H + GAP + 80.0;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" viewBox="0 0 {W} {h}" font-family="sans-serif">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="{LEFT}" y="18" font-size="13">{}</text>"#,
        escape(title)
    );
    panel(
        &mut svg,
        lines,
        TOP + 10.0,
        t_max,
        "KV memory reserved (solid) and holding tokens (dashed)",
        "GB",
        mem_max,
        Some((budget_gb, "KV budget")),
        &|p| p.reserved_bytes as f64 / 1e9,
        Some(&|p: &SeriesPoint| p.stored_bytes as f64 / 1e9),
    );
    let top2 = TOP + 10.0 + PANEL_H + GAP;
    panel(
        &mut svg,
        lines,
        top2,
        t_max,
        "Running sequences",
        "sequences",
        run_max,
        None,
        &|p| f64::from(p.running),
        None,
    );
    let ly = top2 + PANEL_H + 48.0;
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle">simulated time (s)</text>"#,
        LEFT + (W - LEFT - RIGHT) / 2.0,
        ly - 14.0
    );
    for (i, l) in lines.iter().enumerate() {
        let lx = LEFT + i as f64 * 170.0;
        let _ = writeln!(
            svg,
            r#"<line x1="{lx}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{c}" stroke-width="3"/><text x="{:.1}" y="{:.1}" font-size="12">{}</text>"#,
            ly + 8.0,
            lx + 24.0,
            ly + 8.0,
            lx + 30.0,
            ly + 12.0,
            escape(l.label),
            c = COLORS[i % COLORS.len()]
        );
    }
    svg.push_str("</svg>\n");
    svg
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round() {
        assert_eq!(tick_step(54.0), 20.0);
        assert_eq!(tick_step(10.0), 2.0);
        assert_eq!(tick_step(3600.0), 1000.0);
        assert_eq!(tick_step(0.0), 1.0);
    }

    #[test]
    fn renders_one_polyline_per_policy_per_panel_and_downsamples() {
        let pts: Vec<SeriesPoint> = (0..10_000)
            .map(|i| SeriesPoint {
                t_s: f64::from(i) * 0.01,
                reserved_bytes: u64::from(i as u32 % 100) * 1_000_000_000,
                stored_bytes: 0,
                running: i as u32 % 7,
            })
            .collect();
        let svg = render(
            "a <b>",
            &[
                Line {
                    label: "contiguous",
                    points: &pts,
                },
                Line {
                    label: "paged",
                    points: &pts[..10],
                },
            ],
            100_000_000_000,
        );
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("<polyline").count(), 6);
        assert!(svg.contains("a &lt;b&gt;"));
        let longest = svg
            .lines()
            .filter(|l| l.starts_with("<polyline"))
            .map(|l| l.matches(',').count())
            .max()
            .unwrap();
        assert!(longest <= MAX_POINTS + 1, "{longest}");
        let d = downsample(&pts, 100.0, |p| f64::from(p.running));
        assert!(d.iter().any(|&(_, v)| v == 6.0));
    }
}
