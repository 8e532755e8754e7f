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
    let _ = writeln!(
        s,
        "{} runs, {:.1} M events in {:.1} s wall ({:.2} M events/s).\n",
        r.runs.len(),
        r.events as f64 / 1e6,
        r.wall_s,
        r.events_per_s / 1e6
    );
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
    w: f64,
    h: f64,
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
        Self { s, w, h }
    }

    fn text(&mut self, x: f64, y: f64, anchor: &str, t: &str) {
        let _ = write!(self.s, r#"<text x="{x:.1}" y="{y:.1}" text-anchor="{anchor}">{}</text>"#, esc(t));
    }

    fn line(&mut self, x1: f64, y1: f64, x2: f64, y2: f64, color: &str) {
        let _ = write!(self.s, r#"<line x1="{x1:.1}" y1="{y1:.1}" x2="{x2:.1}" y2="{y2:.1}" stroke="{color}"/>"#);
    }

    fn finish(mut self) -> String {
        let _ = self.w;
        let _ = self.h;
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

/// Grouped bars: one group per label, one bar per series.
pub fn bar_chart(title: &str, ylabel: &str, groups: &[String], series: &[(String, Vec<f64>)]) -> String {
    let (w, h) = (760.0, 420.0);
    let (l, r, t, b) = (70.0, 160.0, 40.0, 60.0);
    let mut svg = Svg::new(w, h, title);
    let max = series.iter().flat_map(|s| s.1.iter().copied()).fold(0.0f64, f64::max).max(1e-9);
    let min = series.iter().flat_map(|s| s.1.iter().copied()).fold(0.0f64, f64::min);
    let span = max - min;
    let y = |v: f64| t + (h - t - b) * (1.0 - (v - min) / span);
    svg.line(l, t, l, h - b, "black");
    svg.line(l, y(0.0), w - r, y(0.0), "black");
    for i in 0..=4 {
        let v = min + span * i as f64 / 4.0;
        svg.text(l - 5.0, y(v) + 4.0, "end", &tick(v));
        svg.line(l, y(v), w - r, y(v), "#e0e0e0");
    }
    svg.text(14.0, t - 10.0, "start", ylabel);
    let gw = (w - l - r) / groups.len().max(1) as f64;
    let bw = gw * 0.8 / series.len().max(1) as f64;
    for (gi, g) in groups.iter().enumerate() {
        let gx = l + gw * gi as f64 + gw * 0.1;
        for (si, (_, vals)) in series.iter().enumerate() {
            let v = vals.get(gi).copied().unwrap_or(0.0);
            let (y0, y1) = (y(0.0), y(v));
            let _ = write!(
                svg.s,
                r#"<rect x="{:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{}"/>"#,
                gx + bw * si as f64,
                y0.min(y1),
                bw * 0.95,
                (y0 - y1).abs(),
                COLORS[si % COLORS.len()]
            );
        }
        svg.text(gx + gw * 0.4, h - b + 16.0, "middle", g);
    }
    legend(&mut svg, w - r + 10.0, t, series.iter().map(|s| s.0.as_str()));
    svg.finish()
}

fn legend<'a>(svg: &mut Svg, x: f64, y: f64, names: impl Iterator<Item = &'a str>) {
    for (i, n) in names.enumerate() {
        let yy = y + 16.0 * i as f64;
        let _ = write!(svg.s, r#"<rect x="{x:.1}" y="{:.1}" width="10" height="10" fill="{}"/>"#, yy, COLORS[i % COLORS.len()]);
        svg.text(x + 14.0, yy + 9.0, "start", n);
    }
}

/// Lines: one per series of (x, y) points; `log` puts both axes on log scales.
pub fn line_chart(title: &str, xlabel: &str, ylabel: &str, series: &[(String, Vec<(f64, f64)>)], log: bool) -> String {
    let (w, h) = (760.0, 420.0);
    let (l, r, t, b) = (70.0, 160.0, 40.0, 60.0);
    let mut svg = Svg::new(w, h, title);
    let tf = |v: f64| if log { v.max(1e-9).log10() } else { v };
    let pts = series.iter().flat_map(|s| s.1.iter().copied());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for (x, y) in pts {
        x0 = x0.min(tf(x));
        x1 = x1.max(tf(x));
        y0 = y0.min(tf(y));
        y1 = y1.max(tf(y));
    }
    if !log {
        y0 = y0.min(0.0);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    if y1 <= y0 {
        y1 = y0 + 1.0;
    }
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
    svg.text((l + w - r) / 2.0, h - 20.0, "middle", xlabel);
    for (i, (_, p)) in series.iter().enumerate() {
        let d: Vec<String> = p.iter().map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y))).collect();
        let _ =
            write!(svg.s, r#"<polyline fill="none" stroke="{}" stroke-width="1.5" points="{}"/>"#, COLORS[i % COLORS.len()], d.join(" "));
    }
    legend(&mut svg, w - r + 10.0, t, series.iter().map(|s| s.0.as_str()));
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
                line_chart(&format!("{}: largest switch queue over time ({})", r.scenario, labels[0]), "time, µs", "KiB", &series, false),
            ));
        }
    }
    out
}
