//! Outputs: a markdown summary and SVG charts (hand-written SVG: no fonts or system libraries needed).

use std::fmt::Write as _;

use crate::experiment::{human_bytes, ExperimentResult};

const COLORS: [&str; 10] = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];

fn kib(b: f64) -> String {
    format!("{:.1}", b / 1024.0)
}

/// The markdown summary of one experiment.
pub fn markdown(r: &ExperimentResult) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# {}{}\n", r.scenario, if r.ci { " (CI scale)" } else { "" });
    if !r.description.is_empty() {
        let _ = writeln!(s, "{}\n", r.description);
    }
    let _ = writeln!(s, "{}.\n", r.speed_summary());
    let _ = writeln!(
        s,
        "| scheme | size | failures | CCT µs | bound µs | CCT over bound | busiest NIC µs | max switch queue KiB | max queue between switches KiB | avg switch queue KiB | retx | timeouts | drops (buffer/failed) | ECN marks | p99 reorder | reroute µs |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for row in &r.summary {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.1}{} | {:.1} | {:+.1}% | {:.1} | {} | {} | {} | {:.0} | {:.0} | {:.0}/{:.0} | {:.0} | {} | {} |",
            row.scheme,
            if row.size > 0 { human_bytes(row.size) } else { "-".into() },
            if row.failures { "yes" } else { "no" },
            row.cct_us,
            if row.completed < row.runs { " (unfinished)" } else { "" },
            row.bound_us,
            row.cct_increase_pct,
            row.nic_load_us,
            kib(row.max_queue_bytes),
            kib(row.max_fabric_queue_bytes),
            kib(row.avg_queue_bytes),
            row.retransmissions,
            row.timeouts,
            row.drops_overflow,
            row.drops_failed,
            row.ecn_marks,
            row.ooo_p99,
            row.reroute_us.map_or("-".into(), |x| format!("{x:.0}")),
        );
    }
    if let Some(first) = r.summary.first() {
        let _ = writeln!(s, "\nLargest queue per layer (KiB) and utilisation:\n");
        let layers: Vec<&String> = first.layer_max_queue.keys().collect();
        let _ = write!(s, "| scheme | size | failures |");
        for l in &layers {
            let _ = write!(s, " {l} queue | {l} util |");
        }
        let _ = writeln!(s);
        let _ = writeln!(s, "|---|---|---|{}", "---|---|".repeat(layers.len()));
        for row in &r.summary {
            let _ = write!(
                s,
                "| {} | {} | {} |",
                row.scheme,
                if row.size > 0 { human_bytes(row.size) } else { "-".into() },
                if row.failures { "yes" } else { "no" }
            );
            for l in &layers {
                let _ = write!(
                    s,
                    " {} | {:.2} |",
                    kib(row.layer_max_queue.get(*l).copied().unwrap_or(0.0)),
                    row.layer_utilisation.get(*l).copied().unwrap_or(0.0)
                );
            }
            let _ = writeln!(s);
        }
    }
    if !r.queue_slope.is_empty() {
        let _ = writeln!(s, "\nSlope of log(largest queue between switches) over log(message size):\n");
        let _ = writeln!(s, "| scheme | slope |\n|---|---|");
        for (k, v) in &r.queue_slope {
            let _ = writeln!(s, "| {k} | {v:.2} |");
        }
    }
    if !r.paper.is_empty() {
        let _ = writeln!(s, "\nWhat the paper reports:\n");
        for (k, v) in &r.paper {
            let _ = writeln!(s, "- **{k}**: {v}");
        }
    }
    s
}

struct Svg {
    s: String,
}

impl Svg {
    fn new(w: f64, h: f64, title: &str) -> Self {
        let mut s = String::new();
        let _ = write!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="11"><rect width="100%" height="100%" fill="white"/><text x="{}" y="18" text-anchor="middle" font-size="14">{}</text>"#,
            w / 2.0,
            esc(title)
        );
        Self { s }
    }

    fn text(&mut self, x: f64, y: f64, anchor: &str, t: &str) {
        let _ = write!(self.s, r#"<text x="{x:.1}" y="{y:.1}" text-anchor="{anchor}">{}</text>"#, esc(t));
    }

    fn colored_text(&mut self, x: f64, y: f64, anchor: &str, color: &str, t: &str) {
        let _ = write!(self.s, r#"<text x="{x:.1}" y="{y:.1}" text-anchor="{anchor}" fill="{color}">{}</text>"#, esc(t));
    }

    fn line(&mut self, x1: f64, y1: f64, x2: f64, y2: f64, color: &str) {
        let _ = write!(self.s, r#"<line x1="{x1:.1}" y1="{y1:.1}" x2="{x2:.1}" y2="{y2:.1}" stroke="{color}"/>"#);
    }

    /// The notes naming what an axis left out, one line each from `y` down.
    fn notes(&mut self, x: f64, y: f64, notes: &[String]) {
        for (i, n) in notes.iter().enumerate() {
            let _ = write!(self.s, r##"<text x="{x:.1}" y="{:.1}" font-size="10" fill="#555">{}</text>"##, y + 13.0 * i as f64, esc(n));
        }
    }

    fn finish(mut self) -> String {
        self.s.push_str("</svg>\n");
        self.s
    }
}

/// A tick label with about three significant digits.
fn tick(v: f64) -> String {
    let a = v.abs();
    if a >= 100.0 || a == 0.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

fn esc(t: &str) -> String {
    t.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// A value more than this many times the typical one (the lower median of every series' extent) is an
/// outlier: it would squeeze the other series into a small part of the axis.
const OUTLIER_FACTOR: f64 = 5.0;

/// The upper end of a linear axis over series whose largest values (extents) are `extents`, and the
/// series it leaves out.
#[derive(Debug, Clone, PartialEq)]
pub struct AxisChoice {
    /// The axis' upper end.
    pub hi: f64,
    /// Series (by index into `extents`) whose extent lies beyond `hi`: drawn clipped at the axis' end,
    /// with a note giving their value.
    pub clipped: Vec<usize>,
}

/// The smallest "round" number at least `v` whose quarters are round too (1, 1.2, 1.6, 2, 2.4, 3, 4,
/// 5, 6 or 8 times a power of ten), so an axis of four intervals has readable ticks.
pub fn nice_ceil(v: f64) -> f64 {
    if !(v > 0.0 && v.is_finite()) {
        return v;
    }
    let p = 10f64.powf(v.log10().floor());
    let m = v / p;
    let step = [1.0, 1.2, 1.6, 2.0, 2.4, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0].into_iter().find(|&s| s >= m * (1.0 - 1e-9)).unwrap_or(10.0);
    step * p
}

/// Choose the upper end of a linear axis so that no single outlier sets it: when at most a quarter of
/// the series (at least one) reach beyond `OUTLIER_FACTOR` times the typical extent (the lower median
/// of the positive extents), the axis ends a little above the largest other extent and those series
/// are clipped. Otherwise (no outlier, or values that spread evenly over a wide range) the axis spans
/// every value. The end is rounded up with [`nice_ceil`].
pub fn choose_axis(extents: &[f64]) -> AxisChoice {
    let max = nice_ceil(extents.iter().copied().fold(0.0f64, f64::max));
    let mut pos: Vec<f64> = extents.iter().copied().filter(|v| *v > 0.0 && v.is_finite()).collect();
    pos.sort_by(f64::total_cmp);
    if pos.len() < 2 {
        return AxisChoice { hi: max, clipped: Vec::new() };
    }
    let typical = pos[(pos.len() - 1) / 2];
    let limit = typical * OUTLIER_FACTOR;
    let clipped: Vec<usize> = (0..extents.len()).filter(|&i| extents[i] > limit).collect();
    if clipped.is_empty() || clipped.len() > (extents.len() / 4).max(1) {
        return AxisChoice { hi: max, clipped: Vec::new() };
    }
    let rest = extents.iter().copied().filter(|v| *v <= limit).fold(0.0f64, f64::max);
    let hi = nice_ceil(rest * 1.1);
    if clipped.iter().any(|&i| extents[i] <= hi) {
        // The rounded axis would hold the outlier anyway.
        return AxisChoice { hi: max, clipped: Vec::new() };
    }
    AxisChoice { hi, clipped }
}

/// Grouped bars: one group per label, one bar per series. A bar beyond the axis (see [`choose_axis`])
/// is cut at the top with a white break, labelled with its value, and named in a note.
pub fn bar_chart(title: &str, ylabel: &str, groups: &[String], series: &[(String, Vec<f64>)]) -> String {
    let (w, t, b) = (760.0, 40.0, 60.0);
    let (l, r) = (70.0, 160.0);
    let bars: Vec<(usize, usize, f64)> = series
        .iter()
        .enumerate()
        .flat_map(|(si, s)| (0..groups.len()).map(move |gi| (si, gi, s.1.get(gi).copied().unwrap_or(0.0))))
        .collect();
    let axis = choose_axis(&bars.iter().map(|x| x.2).collect::<Vec<_>>());
    let notes: Vec<String> = axis
        .clipped
        .iter()
        .map(|&i| {
            let (si, gi, v) = bars[i];
            let group = if groups.len() > 1 { format!(" ({})", groups[gi]) } else { String::new() };
            format!("clipped: {}{group}: {} ({ylabel}), beyond the axis (ends at {})", series[si].0, tick(v), tick(axis.hi))
        })
        .collect();
    let h = 420.0 + 13.0 * notes.len() as f64;
    let mut svg = Svg::new(w, h, title);
    let max = axis.hi.max(1e-9);
    let min = series.iter().flat_map(|s| s.1.iter().copied()).fold(0.0f64, f64::min);
    let span = max - min;
    let bottom = h - b - 13.0 * notes.len() as f64;
    let y = |v: f64| t + (bottom - t) * (1.0 - (v.min(max) - min) / span);
    svg.line(l, t, l, bottom, "black");
    svg.line(l, y(0.0), w - r, y(0.0), "black");
    for i in 0..=4 {
        let v = min + span * i as f64 / 4.0;
        svg.text(l - 5.0, y(v) + 4.0, "end", &tick(v));
        svg.line(l, y(v), w - r, y(v), "#e0e0e0");
    }
    svg.text(14.0, t - 10.0, "start", ylabel);
    let gw = (w - l - r) / groups.len().max(1) as f64;
    let bw = gw * 0.8 / series.len().max(1) as f64;
    for (i, &(si, gi, v)) in bars.iter().enumerate() {
        let gx = l + gw * gi as f64 + gw * 0.1;
        let (y0, y1) = (y(0.0), y(v));
        let x = gx + bw * si as f64;
        let color = COLORS[si % COLORS.len()];
        let _ = write!(
            svg.s,
            r#"<rect x="{x:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{color}"/>"#,
            y0.min(y1),
            bw * 0.95,
            (y0 - y1).abs(),
        );
        if axis.clipped.contains(&i) {
            // A white zig-zag across the bar just below the top marks the cut.
            let (zy, zw) = (y1 + 8.0, bw * 0.95);
            let _ = write!(
                svg.s,
                r#"<polyline fill="none" stroke="white" stroke-width="2.5" points="{:.1},{:.1} {:.1},{:.1} {:.1},{:.1} {:.1},{:.1}"/>"#,
                x,
                zy + 3.0,
                x + zw / 3.0,
                zy - 3.0,
                x + 2.0 * zw / 3.0,
                zy + 3.0,
                x + zw,
                zy - 3.0
            );
            svg.colored_text(x + zw / 2.0, y1 - 4.0, "middle", color, &tick(v));
        }
    }
    for (gi, g) in groups.iter().enumerate() {
        svg.text(l + gw * gi as f64 + gw * 0.5, bottom + 16.0, "middle", g);
    }
    legend(&mut svg, w - r + 10.0, t, series.iter().map(|s| s.0.as_str()));
    svg.notes(l, bottom + 38.0, &notes);
    svg.finish()
}

fn legend<'a>(svg: &mut Svg, x: f64, y: f64, names: impl Iterator<Item = &'a str>) {
    for (i, n) in names.enumerate() {
        let yy = y + 16.0 * i as f64;
        let _ = write!(svg.s, r#"<rect x="{x:.1}" y="{:.1}" width="10" height="10" fill="{}"/>"#, yy, COLORS[i % COLORS.len()]);
        svg.text(x + 14.0, yy + 9.0, "start", n);
    }
}

/// The two axes of a linear line chart over `series`: x and y each chosen by [`choose_axis`] over the
/// series' largest x and largest y, and the notes naming the series they cut.
struct LineAxes {
    x0: f64,
    x1: f64,
    y0: f64,
    y1: f64,
    /// Per series: cut by the x axis, by the y axis.
    cut: Vec<(bool, bool)>,
    notes: Vec<String>,
}

fn line_axes(xlabel: &str, ylabel: &str, series: &[(String, Vec<(f64, f64)>)]) -> LineAxes {
    let pts = || series.iter().flat_map(|s| s.1.iter().copied());
    let x0 = pts().map(|p| p.0).fold(f64::MAX, f64::min);
    let y0 = pts().map(|p| p.1).fold(0.0f64, f64::min);
    let xs: Vec<f64> = series.iter().map(|s| s.1.iter().map(|p| p.0).fold(f64::MIN, f64::max)).collect();
    let ys: Vec<f64> = series.iter().map(|s| s.1.iter().map(|p| p.1).fold(f64::MIN, f64::max)).collect();
    let (ax, ay) = (choose_axis(&xs), choose_axis(&ys));
    let mut notes = Vec::new();
    for &i in &ax.clipped {
        notes.push(format!("clipped: {} goes on to {} ({xlabel}), beyond the axis (ends at {})", series[i].0, tick(xs[i]), tick(ax.hi)));
    }
    for &i in &ay.clipped {
        notes.push(format!("clipped: {} reaches {} ({ylabel}), beyond the axis (ends at {})", series[i].0, tick(ys[i]), tick(ay.hi)));
    }
    let cut = (0..series.len()).map(|i| (ax.clipped.contains(&i), ay.clipped.contains(&i))).collect();
    let x0 = if x0 == f64::MAX { 0.0 } else { x0 };
    let x1 = if ax.hi > x0 { ax.hi } else { x0 + 1.0 };
    let y1 = if ay.hi > y0 { ay.hi } else { y0 + 1.0 };
    LineAxes { x0, x1, y0, y1, cut, notes }
}

/// The points of a series drawn on axes ending at `x1` and `y1`: points beyond `x1` are left out (the
/// line ends at the axis, interpolated), values above `y1` are drawn at `y1`.
fn clip_points(p: &[(f64, f64)], x1: f64, y1: f64) -> Vec<(f64, f64)> {
    let mut out = Vec::with_capacity(p.len());
    for (i, &(x, y)) in p.iter().enumerate() {
        if x > x1 {
            if let Some(&(px, py)) = i.checked_sub(1).and_then(|j| p.get(j)) {
                if px < x1 {
                    out.push((x1, py + (y - py) * (x1 - px) / (x - px)));
                }
            }
            break;
        }
        out.push((x, y));
    }
    out.into_iter().map(|(x, y)| (x, y.min(y1))).collect()
}

/// Lines: one per series of (x, y) points; `log` puts both axes on log scales. On linear axes no single
/// outlier sets an axis ([`choose_axis`]): a series reaching beyond it is cut at the axis' end, marked
/// with an arrow, and named in a note under the chart.
pub fn line_chart(title: &str, xlabel: &str, ylabel: &str, series: &[(String, Vec<(f64, f64)>)], log: bool) -> String {
    let (w, t, b0) = (760.0, 40.0, 60.0);
    let (l, r) = (70.0, 160.0);
    let tf = |v: f64| if log { v.max(1e-9).log10() } else { v };
    let (x0, x1, y0, y1, cut, notes) = if log {
        let pts = series.iter().flat_map(|s| s.1.iter().copied());
        let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
        for (x, y) in pts {
            x0 = x0.min(tf(x));
            x1 = x1.max(tf(x));
            y0 = y0.min(tf(y));
            y1 = y1.max(tf(y));
        }
        if x1 <= x0 {
            x1 = x0 + 1.0;
        }
        if y1 <= y0 {
            y1 = y0 + 1.0;
        }
        (x0, x1, y0, y1, vec![(false, false); series.len()], Vec::new())
    } else {
        let a = line_axes(xlabel, ylabel, series);
        (a.x0, a.x1, a.y0, a.y1, a.cut, a.notes)
    };
    let h = 420.0 + 13.0 * notes.len() as f64;
    let b = b0 + 13.0 * notes.len() as f64;
    let mut svg = Svg::new(w, h, title);
    let px = |x: f64| l + (w - l - r) * (tf(x) - x0) / (x1 - x0);
    let py = |y: f64| t + (h - t - b) * (1.0 - (tf(y) - y0) / (y1 - y0));
    svg.line(l, t, l, h - b, "black");
    svg.line(l, h - b, w - r, h - b, "black");
    for i in 0..=4 {
        let fy = y0 + (y1 - y0) * i as f64 / 4.0;
        let v = if log { 10f64.powf(fy) } else { fy };
        let yy = t + (h - t - b) * (1.0 - i as f64 / 4.0);
        svg.text(l - 5.0, yy + 4.0, "end", &tick(v));
        svg.line(l, yy, w - r, yy, "#e0e0e0");
        let fx = x0 + (x1 - x0) * i as f64 / 4.0;
        let vx = if log { 10f64.powf(fx) } else { fx };
        let xx = l + (w - l - r) * i as f64 / 4.0;
        svg.text(xx, h - b + 16.0, "middle", &tick(vx));
    }
    svg.text(14.0, t - 10.0, "start", ylabel);
    svg.text((l + w - r) / 2.0, h - b + 36.0, "middle", xlabel);
    for (i, (_, p)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let p = if log { p.clone() } else { clip_points(p, x1, y1) };
        let d: Vec<String> = p.iter().map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y))).collect();
        let _ = write!(svg.s, r#"<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{}"/>"#, d.join(" "));
        if cut[i].0 {
            if let Some(&(x, y)) = p.last() {
                svg.colored_text(px(x) + 2.0, py(y) - 3.0, "start", color, "→");
            }
        }
    }
    legend(&mut svg, w - r + 10.0, t, series.iter().map(|s| s.0.as_str()));
    svg.notes(l, h - b + 52.0, &notes);
    svg.finish()
}

/// Small multiples: one panel per series, stacked, sharing the axes (chosen as in [`line_chart`]), so
/// that series which overlap in one panel can each be read. A series beyond an axis is cut at its end,
/// marked with an arrow, and named in its panel and in a note.
pub fn line_panels(title: &str, xlabel: &str, ylabel: &str, series: &[(String, Vec<(f64, f64)>)]) -> String {
    let (w, l, r, t) = (760.0, 70.0, 30.0, 52.0);
    let (ph, gap) = (70.0, 18.0);
    let a = line_axes(xlabel, ylabel, series);
    let n = series.len().max(1) as f64;
    let h = t + n * (ph + gap) + 40.0 + 13.0 * a.notes.len() as f64;
    let mut svg = Svg::new(w, h, title);
    svg.text(14.0, t - 10.0, "start", ylabel);
    let px = |x: f64| l + (w - l - r) * (x - a.x0) / (a.x1 - a.x0);
    for (i, (name, p)) in series.iter().enumerate() {
        let top = t + i as f64 * (ph + gap);
        let bot = top + ph;
        let py = |y: f64| top + ph * (1.0 - (y - a.y0) / (a.y1 - a.y0));
        let color = COLORS[i % COLORS.len()];
        svg.line(l, top, l, bot, "black");
        svg.line(l, bot, w - r, bot, "black");
        svg.line(l, top, w - r, top, "#e0e0e0");
        svg.line(l, (top + bot) / 2.0, w - r, (top + bot) / 2.0, "#e0e0e0");
        svg.text(l - 5.0, top + 4.0, "end", &tick(a.y1));
        svg.text(l - 5.0, bot + 4.0, "end", &tick(a.y0));
        let cut = a.cut[i];
        let label = match cut {
            (true, _) => format!("{name} (goes on beyond the axis →)"),
            (false, true) => format!("{name} (clipped at the top)"),
            _ => name.clone(),
        };
        svg.colored_text(l + 6.0, top - 3.0, "start", color, &label);
        let p = clip_points(p, a.x1, a.y1);
        let d: Vec<String> = p.iter().map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y))).collect();
        let _ = write!(svg.s, r#"<polyline fill="none" stroke="{color}" stroke-width="1.2" points="{}"/>"#, d.join(" "));
        if cut.0 {
            if let Some(&(x, y)) = p.last() {
                svg.colored_text(px(x) + 2.0, py(y) - 3.0, "start", color, "→");
            }
        }
    }
    let axis_y = t + n * (ph + gap) - gap;
    for i in 0..=4 {
        let v = a.x0 + (a.x1 - a.x0) * i as f64 / 4.0;
        svg.text(px(v), axis_y + 14.0, "middle", &tick(v));
    }
    svg.text((l + w - r) / 2.0, axis_y + 30.0, "middle", xlabel);
    svg.notes(l, axis_y + 46.0, &a.notes);
    svg.finish()
}

/// The charts of one experiment as (file suffix, SVG text).
pub fn charts(r: &ExperimentResult) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut schemes: Vec<String> = Vec::new();
    let mut groups: Vec<(u64, bool)> = Vec::new();
    for row in &r.summary {
        if !schemes.contains(&row.scheme) {
            schemes.push(row.scheme.clone());
        }
        if !groups.contains(&(row.size, row.failures)) {
            groups.push((row.size, row.failures));
        }
    }
    let labels: Vec<String> = groups
        .iter()
        .map(|&(s, f)| format!("{}{}", if s > 0 { human_bytes(s) } else { "run".into() }, if f { " +fail" } else { "" }))
        .collect();
    let val = |f: &dyn Fn(&crate::experiment::SummaryRow) -> f64| -> Vec<(String, Vec<f64>)> {
        schemes.iter().map(|s| (s.clone(), groups.iter().map(|&(size, fail)| r.row(s, size, fail).map_or(0.0, f)).collect())).collect()
    };
    out.push((
        "cct".into(),
        bar_chart(&format!("{}: CCT over the lower bound", r.scenario), "CCT increase, %", &labels, &val(&|x| x.cct_increase_pct)),
    ));
    out.push((
        "queue".into(),
        bar_chart(&format!("{}: largest switch queue", r.scenario), "KiB", &labels, &val(&|x| x.max_queue_bytes / 1024.0)),
    ));
    if !r.queue_slope.is_empty() {
        let series: Vec<(String, Vec<(f64, f64)>)> = schemes
            .iter()
            .map(|s| {
                (
                    format!("{s} (slope {:.2})", r.queue_slope.get(s).copied().unwrap_or(0.0)),
                    r.summary
                        .iter()
                        .filter(|x| &x.scheme == s && x.failures == r.summary[0].failures)
                        .map(|x| (x.size as f64 / 1024.0, x.max_fabric_queue_bytes.max(1.0) / 1024.0))
                        .collect(),
                )
            })
            .collect();
        out.push((
            "queue-vs-size".into(),
            line_chart(
                &format!("{}: max queue vs message size", r.scenario),
                "message size, KiB (log)",
                "max queue between switches, KiB (log)",
                &series,
                true,
            ),
        ));
    }
    // Queue over time for the first group: the largest queue of any switch layer per sample.
    if let Some(&(size, fail)) = groups.first() {
        let series: Vec<(String, Vec<(f64, f64)>)> = schemes
            .iter()
            .filter_map(|s| {
                let run = r.runs.iter().find(|x| &x.scheme == s && x.size == size && x.failures == fail)?;
                let sw: Vec<usize> = run.layers.iter().enumerate().filter(|(_, l)| !l.layer.starts_with("host")).map(|(i, _)| i).collect();
                Some((
                    s.clone(),
                    run.queue_series.iter().map(|(t, v)| (*t, sw.iter().map(|&i| v[i]).max().unwrap_or(0) as f64 / 1024.0)).collect(),
                ))
            })
            .collect();
        if series.iter().any(|s| !s.1.is_empty()) {
            out.push((
                "queue-time".into(),
                line_panels(&format!("{}: largest switch queue over time ({})", r.scenario, labels[0]), "time, µs", "KiB", &series),
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The numbers of the value-axis tick labels of a chart's SVG.
    fn tick_values(svg: &str) -> Vec<f64> {
        svg.split(r#"text-anchor="end">"#).skip(1).filter_map(|s| s.split('<').next()?.parse::<f64>().ok()).collect()
    }

    #[test]
    fn one_outlier_does_not_set_the_axis_and_is_named() {
        let a = choose_axis(&[72_131.0, 1_407.8, 1_408.8, 2_473.3, 1_410.1, 1_408.5, 1_415.4, 1_422.4]);
        assert_eq!(a.clipped, vec![0]);
        assert!(a.hi >= 2_473.3 && a.hi <= 3_000.0, "{a:?}");
    }

    #[test]
    fn similar_or_evenly_spread_series_keep_the_full_axis() {
        assert_eq!(choose_axis(&[10.0, 12.0, 30.0, 11.0]), AxisChoice { hi: 30.0, clipped: vec![] });
        // Half the values are large: no single outlier, nothing is hidden.
        let a = choose_axis(&[1.0, 2.0, 100.0, 200.0]);
        assert!(a.clipped.is_empty() && a.hi >= 200.0, "{a:?}");
        assert_eq!(choose_axis(&[5.0]).clipped, Vec::<usize>::new());
        assert!(choose_axis(&[]).clipped.is_empty());
        // An outlier that the rounded axis would hold anyway is not clipped.
        assert_eq!(choose_axis(&[3_609.0, 700.0, 3_000.0, 650.0, 600.0]), AxisChoice { hi: 4_000.0, clipped: vec![] });
    }

    #[test]
    fn axis_ends_are_round() {
        assert_eq!(nice_ceil(2_720.6), 3_000.0);
        assert_eq!(nice_ceil(781.0), 800.0);
        assert_eq!(nice_ceil(3.96), 4.0);
        assert_eq!(nice_ceil(100.0), 100.0);
        assert_eq!(nice_ceil(0.0), 0.0);
    }

    #[test]
    fn a_time_series_that_runs_far_longer_is_cut_and_noted() {
        let flat = |end: f64| (0..=100).map(|i| (end * i as f64 / 100.0, 400.0)).collect::<Vec<_>>();
        let series = vec![("ECMP".to_string(), flat(72_000.0)), ("spray".to_string(), flat(1_400.0)), ("OFAN".to_string(), flat(1_420.0))];
        for svg in [line_chart("t", "time, µs", "KiB", &series, false), line_panels("t", "time, µs", "KiB", &series)] {
            assert!(svg.contains("clipped: ECMP goes on to 72000"), "{svg}");
            assert!(!svg.contains("clipped: spray") && !svg.contains("clipped: OFAN"));
            // The x axis ends near the others' end, not at 72 ms.
            let xmax =
                svg.split(r#"text-anchor="middle">"#).filter_map(|s| s.split('<').next()?.parse::<f64>().ok()).fold(0.0f64, f64::max);
            assert!((1_420.0..=2_000.0).contains(&xmax), "x axis ends at {xmax}");
        }
        // Without the outlier nothing is clipped and the axis covers every series.
        let svg = line_chart("t", "time, µs", "KiB", &series[1..], false);
        assert!(!svg.contains("clipped"));
    }

    #[test]
    fn an_outlier_bar_is_cut_labelled_and_noted() {
        let series: Vec<(String, Vec<f64>)> = [("ECMP", 5_146.0), ("flowlet", 2.4), ("spray", 2.5), ("RR", 2.6), ("DR", 2.9)]
            .iter()
            .map(|(n, v)| (n.to_string(), vec![*v]))
            .collect();
        let svg = bar_chart("t", "CCT increase, %", &["run".to_string()], &series);
        assert!(svg.contains("clipped: ECMP: 5146 (CCT increase, %)"), "{svg}");
        let ymax = tick_values(&svg).into_iter().fold(0.0f64, f64::max);
        assert!((2.9..=4.0).contains(&ymax), "y axis ends at {ymax}");
        // The bar's value is written on it.
        assert!(svg.contains(">5146</text>"));
    }
}
