"""The results of a scenario as a markdown table and SVG charts, drawn by hand (no plotting library).

Charts: ``chart.svg`` (CCT per workload and policy against the lower bound; bytes per spine per policy;
CCT under each fault relative to the fault-free run) and ``timeline-<fault>-<policy>.svg`` (bytes per
spine over time around the fault).
"""

from __future__ import annotations

from html import escape
from . import metrics

PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
           "#bab0ac"]


def fmt_ms(s) -> str:
    """Seconds as milliseconds, or a dash."""
    return "-" if s is None else f"{1000 * s:.1f}"


def fmt_pct(x) -> str:
    """A fraction as a percentage, or a dash."""
    return "-" if x is None else f"{100 * x:.1f} %"


def run_row(r: dict, base: dict | None) -> dict:
    """The table's view of one run."""
    rec = r.get("recovery") or {}
    ratio = None
    if base and base.get("cct_s") and r.get("cct_s"):
        ratio = r["cct_s"] / base["cct_s"]
    retrans = None
    st = r.get("prism_stats") or {}
    keys = [k for k in st if "retrans" in k.lower()]
    if keys:
        retrans = sum(st[k] for k in keys)
    ttr = "-"
    if r.get("fault") and rec:
        last = fmt_ms(rec.get("ttr_s")) if rec.get("recovered") else "never"
        ttr = f"{fmt_ms(rec.get('reroute_s')) if rec.get('reroute_s') is not None else 'never'} / {last}"
        if rec.get("residual_share") is not None:
            ttr += f" ({100 * rec['residual_share']:.0f} %)"
        by = metrics.dead_path_recovery(r) if (r.get("fault") or {}).get("kind") in ("blackhole", "nic_blackhole") else None
        if by and by.get("residual_share") is not None:
            rtt = metrics.run_rtt_s(base)
            rr = by.get("reroute_s")
            fo = by.get("first_off_s")
            ttr += (f"; bytes: {fmt_ms(rr) if rr is not None else 'never'}"
                    + (f" = {rr / rtt:.1f} RTTs" if (rr is not None and rtt) else "")
                    + (f", first off {fmt_ms(fo)}" + (f" = {fo / rtt:.1f} RTTs" if rtt else "")
                       if fo is not None and fo != rr else "")
                    + f" ({100 * by['residual_share']:.0f} %)")
    if (r.get("fault") or {}).get("heal_after_s") is not None:
        ttr += f"; {revival_text(r, base)}"
    bal = r.get("balance") or {}
    return {
        "workload": r["workload"]["name"], "policy": r["policy"]["name"],
        "fault": (r.get("fault") or {}).get("name", "-"),
        "ok": "yes" if r.get("ok") else "NO",
        "cct_ms": fmt_ms(r.get("cct_s")),
        "bound_ms": fmt_ms((r.get("lower_bound") or {}).get("seconds")),
        "cct_over_bound": "-" if not r.get("cct_over_bound") else f"{r['cct_over_bound']:.2f}",
        "link_split": link_split_cell(r),
        "vs_no_fault": "-" if ratio is None else f"{ratio:.2f}",
        "fault_bound": fault_bound_cell(r, base),
        "spine_imbalance": fmt_pct(bal.get("spine_imbalance")),
        "uplink_imbalance": fmt_pct(max((v for v in (bal.get("leaf_uplink_imbalance") or {}).values() if v is not None),
                                        default=None)),
        "moment_imbalance": fmt_pct((bal.get("windowed_uplink") or {}).get("max")),
        "flow_imbalance": fmt_pct((r.get("flows") or {}).get("mean_imbalance")),
        "qdisc_drops": str(r.get("qdisc_drops_total", "-")),
        "host_drops": str(r.get("host_qdisc_drops_total", "-")),
        "peak_backlog_kb": "-" if not r.get("backlog_peak") else f"{r['backlog_peak'].get('max_bytes', 0) / 1024:.0f}",
        "retrans": "-" if retrans is None else f"{retrans:g}",
        "rtt_ms": fmt_ms(metrics.run_rtt_s(r)),
        "ttr_ms": ttr,
    }


def link_split_cell(r: dict) -> str:
    """CCT/bound split in two: the busiest link's time for what it carried over the bound (headers,
    control and uneven spreading), times CCT over that time (how long the link stood idle)."""
    lb, cl = r.get("link_time_over_bound"), r.get("cct_over_link_time")
    if not lb or not cl:
        return "-"
    return f"{lb:.2f} x {cl:.2f} ({r['link_time']['busiest']['link']})"


def revival_text(r: dict, base: dict | None) -> str:
    """How a healed link came back into use, in words (empty for runs without a heal)."""
    if (r.get("fault") or {}).get("heal_after_s") is None:
        return ""
    if r.get("heal_at_s") is None:
        return "the fault never healed"
    rv = r.get("revival") or {}
    rtt = metrics.run_rtt_s(base)
    got = rv.get("revived_s")
    txt = f"healed at {r['heal_at_s']:.2f} s; "
    txt += ((f"the link carried half its earlier share again after {1000 * got:.0f} ms"
             + (f" = {got / rtt:.1f} RTTs" if rtt else ""))
            if got is not None else "the link never carried half its earlier share again")
    if rv.get("share_after") is not None:
        txt += f"; from 0.3 s after the heal it carried {100 * rv['share_after']:.0f} % of its earlier share"
    if rv.get("traffic_after_heal_s") is not None:
        txt += f" (traffic went on {1000 * rv['traffic_after_heal_s']:.0f} ms after the heal)"
    return txt


COLUMNS = [("workload", "workload"), ("policy", "policy"), ("fault", "fault"), ("ok", "data ok"),
           ("cct_ms", "CCT ms"), ("bound_ms", "bound ms"), ("cct_over_bound", "CCT/bound"),
           ("link_split", "= busiest link's bytes/bound x CCT/its time (link)"),
           ("vs_no_fault", "CCT/no-fault"),
           ("fault_bound", "bound under the fault ms (least CCT/no-fault it allows; CCT over it)"), ("spine_imbalance", "spine imbalance"),
           ("uplink_imbalance", "worst leaf uplink imbalance"), ("moment_imbalance", "same, per 100 ms"),
           ("flow_imbalance", "per-flow imbalance"), ("qdisc_drops", "fabric drops"), ("host_drops", "NIC drops"),
           ("peak_backlog_kb", "peak queue KB"), ("retrans", "retrans"), ("rtt_ms", "mean RTT ms"),
           ("ttr_ms", "reroute / last dead pkt ms (dead path rate left); by bytes: reroute ms = RTTs of the fault-free run (rate left)")]


def fault_bound_cell(r: dict, base: dict | None) -> str:
    """The lower bound with the fault's links broken when they broke; the least CCT/no-fault ratio it
    allows (over the fault-free run's CCT); the run's CCT over it."""
    lbf = r.get("lower_bound_fault")
    if not lbf:
        return "-"
    fb = lbf.get("seconds")
    if not lbf.get("finishes", True) or not fb:
        return "none: the broken fabric cannot finish it"
    cell = fmt_ms(fb)
    floor = metrics.fault_floor(r, base)
    if floor is not None:
        cell += f" (x{floor:.2f}"
        cell += f"; {r['cct_over_fault_bound']:.2f})" if r.get("cct_over_fault_bound") else ")"
    return cell


def baseline_of(r: dict, runs: list[dict]) -> dict | None:
    """The fault-free run of the same workload and policy."""
    if not r.get("fault"):
        return None
    for b in runs:
        if not b.get("fault") and b["workload"]["name"] == r["workload"]["name"] and b["policy"]["name"] == r["policy"]["name"]:
            return b
    return None


def markdown_table(runs: list[dict]) -> str:
    """Every run as one row."""
    rows = [run_row(r, baseline_of(r, runs)) for r in runs]
    head = "| " + " | ".join(t for _, t in COLUMNS) + " |"
    sep = "|" + "|".join("---" for _ in COLUMNS) + "|"
    body = ["| " + " | ".join(row[k] for k, _ in COLUMNS) + " |" for row in rows]
    return "\n".join([head, sep] + body)


def checks_table(checks: list) -> str:
    """The checks as a markdown table."""
    lines = ["| check | result | detail |", "|---|---|---|"]
    for c in checks:
        lines.append(f"| {c.name} | {'PASS' if c.ok else 'FAIL'} | {c.detail.replace('|', '/')} |")
    return "\n".join(lines)


# --- SVG -----------------------------------------------------------------------------------------------

class Svg:
    """A minimal SVG canvas."""

    def __init__(self, w: int, h: int):
        self.w, self.h = w, h
        self.parts: list[str] = []

    def rect(self, x, y, w, h, fill, title: str = ""):
        """A filled rectangle with an optional tooltip."""
        t = f"<title>{escape(title)}</title>" if title else ""
        self.parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0):.1f}" height="{max(h, 0):.1f}" fill="{fill}">{t}</rect>')

    def line(self, x1, y1, x2, y2, stroke="#333", width=1.0, dash: str = ""):
        """A straight line, optionally dashed."""
        d = f' stroke-dasharray="{dash}"' if dash else ""
        self.parts.append(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{stroke}" stroke-width="{width}"{d}/>')

    def text(self, x, y, s, size=11, anchor="start", weight="normal", rotate: float = 0.0, fill="#222"):
        """A text label (escaped)."""
        rot = f' transform="rotate({rotate} {x:.1f} {y:.1f})"' if rotate else ""
        self.parts.append(f'<text x="{x:.1f}" y="{y:.1f}" font-family="sans-serif" font-size="{size}" '
                          f'text-anchor="{anchor}" font-weight="{weight}" fill="{fill}"{rot}>{escape(str(s))}</text>')

    def polyline(self, pts, stroke, width=1.5):
        """An open line through the points."""
        p = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
        self.parts.append(f'<polyline points="{p}" fill="none" stroke="{stroke}" stroke-width="{width}"/>')

    def render(self) -> str:
        """The SVG document."""
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.w}" height="{self.h}" '
                f'viewBox="0 0 {self.w} {self.h}"><rect width="100%" height="100%" fill="white"/>'
                + "".join(self.parts) + "</svg>\n")


def nice_max(v: float) -> float:
    """A round axis maximum at or above v."""
    if v <= 0:
        return 1.0
    import math

    e = 10 ** math.floor(math.log10(v))
    for m in (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10):
        if m * e >= v:
            return m * e
    return 10 * e


def bar_panel(svg: Svg, x0, y0, w, h, title: str, groups: list[str], series: list[str],
              values: dict[tuple[str, str], float | None], ylabel: str, marks: dict[str, float] | None = None,
              fmt=lambda v: f"{v:.0f}", ref: float | None = None):
    """Grouped bars: one group per `groups` entry, one bar per `series` entry; `marks` draws a dashed line
    per group (e.g. the lower bound); `ref` a horizontal line across the panel (e.g. 1.0 or 2.0)."""
    svg.text(x0 + w / 2, y0 + 14, title, size=13, anchor="middle", weight="bold")
    top, bottom, left = y0 + 30, y0 + h - 40, x0 + 50
    right = x0 + w - 10
    vals = [v for v in values.values() if v is not None] + list((marks or {}).values()) + ([ref] if ref else [])
    ymax = nice_max(max(vals) if vals else 1.0)
    sy = lambda v: bottom - (bottom - top) * (v / ymax)  # noqa: E731
    for k in range(5):
        v = ymax * k / 4
        svg.line(left, sy(v), right, sy(v), stroke="#ddd")
        svg.text(left - 4, sy(v) + 4, f"{v:.6g}", size=10, anchor="end")
    svg.text(x0 + 12, (top + bottom) / 2, ylabel, size=11, anchor="middle", rotate=-90)
    if not groups:
        return
    gw = (right - left) / len(groups)
    bw = min(28.0, 0.8 * gw / max(1, len(series)))
    for gi, g in enumerate(groups):
        gx = left + gi * gw + (gw - bw * len(series)) / 2
        for si, s in enumerate(series):
            v = values.get((g, s))
            if v is None:
                continue
            svg.rect(gx + si * bw, sy(v), bw - 2, bottom - sy(v), PALETTE[si % len(PALETTE)], f"{g} {s}: {fmt(v)}")
        if marks and g in marks:
            svg.line(left + gi * gw + 4, sy(marks[g]), left + (gi + 1) * gw - 4, sy(marks[g]), stroke="#000", width=1.5, dash="4,3")
        svg.text(left + gi * gw + gw / 2, bottom + 14, g, size=10, anchor="middle")
    if ref is not None:
        svg.line(left, sy(ref), right, sy(ref), stroke="#c00", width=1.2, dash="6,3")
    svg.line(left, bottom, right, bottom)
    lx = left
    for si, s in enumerate(series):
        svg.rect(lx, bottom + 24, 10, 10, PALETTE[si % len(PALETTE)])
        svg.text(lx + 13, bottom + 33, s, size=10)
        lx += 18 + 7 * len(s)


def chart(runs: list[dict], balance_workload: str, title: str) -> str:
    """The summary chart: CCT per workload and policy (with the lower bound), bytes per spine per policy
    on the balance workload, each leaf's uplink imbalance moment by moment, and CCT under each fault
    relative to the fault-free run."""
    plain = [r for r in runs if not r.get("fault")]
    faulty = [r for r in runs if r.get("fault")]
    wls = list(dict.fromkeys(r["workload"]["name"] for r in plain))
    pols = list(dict.fromkeys(r["policy"]["name"] for r in runs))
    w, ph = 980, 300
    svg = Svg(w, 40 + 4 * (ph + 20))
    svg.text(w / 2, 24, title, size=15, anchor="middle", weight="bold")
    cct = {(r["workload"]["name"], r["policy"]["name"]): (1000 * r["cct_s"] if r.get("cct_s") else None) for r in plain}
    bound = {r["workload"]["name"]: 1000 * r["lower_bound"]["seconds"] for r in plain if r.get("lower_bound")}
    bar_panel(svg, 0, 40, w, ph, "Collective completion time per policy (dashed: lower bound)", wls, pols, cct, "CCT (ms)",
              marks=bound)
    bal = [r for r in plain if r["workload"]["name"] == balance_workload]
    spines = max((len(r["balance"]["spine_bytes"]) for r in bal), default=0)
    shares = {}
    for r in bal:
        for s, v in enumerate(r["balance"]["spine_share"]):
            shares[(r["policy"]["name"], f"spine {s}")] = 100 * v
    bar_panel(svg, 0, 40 + ph + 20, w, ph, f"Share of spine bytes per spine, {balance_workload} (red: even)",
              [r["policy"]["name"] for r in bal], [f"spine {s}" for s in range(spines)], shares, "% of spine bytes",
              ref=(100.0 / spines if spines else None))
    ratio = {}
    fnames = list(dict.fromkeys(r["fault"]["name"] for r in faulty))
    for r in faulty:
        b = baseline_of(r, runs)
        if b and b.get("cct_s") and r.get("cct_s"):
            ratio[(r["fault"]["name"], r["policy"]["name"])] = r["cct_s"] / b["cct_s"]
    moment = {}
    for r in plain:
        v = (r["balance"].get("windowed_uplink") or {}).get("max")
        if v is not None:
            moment[(r["workload"]["name"], r["policy"]["name"])] = 100 * v
    bar_panel(svg, 0, 40 + 2 * (ph + 20), w, ph, "Worst leaf's uplink imbalance moment by moment (100 ms windows; red: 10 %)",
              wls, pols, moment, "imbalance (%)", ref=10.0)
    bar_panel(svg, 0, 40 + 3 * (ph + 20), w, ph, "CCT under each fault / CCT without it (red: 2x)", fnames, pols,
              ratio, "CCT ratio", fmt=lambda v: f"{v:.1f}", ref=2.0)
    return svg.render()


def timeline_chart(r: dict) -> str:
    """Bytes onto each leaf-spine link per interval around a fault (red dashed vertical: the fault; green
    dashed vertical: its heal, if it healed; thick red line: the broken link)."""
    tl = r.get("timeline") or {}
    t = tl.get("t", [])
    links = tl.get("links", {})
    w, h = 900, 340
    svg = Svg(w, h)
    step = int(round(1000 * tl.get("step_s", 0.05)))
    svg.text(w / 2, 20, f"{r['label']}: bytes onto each leaf-spine link per {step} ms", size=13, anchor="middle",
             weight="bold")
    if not t or not links:
        return svg.render()
    left, right, top, bottom = 60, w - 120, 35, h - 50
    ymax = nice_max(max((max(v) for v in links.values() if v), default=1) / 1e6)
    tmin, tmax = min(t), max(t)
    sx = lambda x: left + (right - left) * ((x - tmin) / ((tmax - tmin) or 1))  # noqa: E731
    sy = lambda v: bottom - (bottom - top) * (v / ymax)  # noqa: E731
    for k in range(5):
        v = ymax * k / 4
        svg.line(left, sy(v), right, sy(v), stroke="#ddd")
        svg.text(left - 4, sy(v) + 4, f"{v:.2f}", size=10, anchor="end")
    svg.text(14, (top + bottom) / 2, "MB per interval", size=11, anchor="middle", rotate=-90)
    for k in range(6):
        x = tmin + (tmax - tmin) * k / 5
        svg.text(sx(x), bottom + 14, f"{x:.2f}", size=10, anchor="middle")
    svg.text((left + right) / 2, bottom + 30, "seconds since data started", size=11, anchor="middle")
    bad = tl.get("fault_link")
    for i, (name, vals) in enumerate(sorted(links.items())):
        color = "#d62728" if name == bad else PALETTE[i % len(PALETTE)]
        svg.polyline([(sx(x), sy(v / 1e6)) for x, v in zip(t, vals)], color, width=2.5 if name == bad else 1.2)
        svg.text(right + 8, top + 12 + 13 * i, name + (" (broken)" if name == bad else ""), size=10, fill=color)
    if tl.get("fault_t") is not None:
        svg.line(sx(tl["fault_t"]), top, sx(tl["fault_t"]), bottom, stroke="#c00", width=1.5, dash="5,3")
        svg.text(sx(tl["fault_t"]) + 4, top + 10, "fault", size=10, fill="#c00")
    if r.get("heal_at_s") is not None:
        svg.line(sx(r["heal_at_s"]), top, sx(r["heal_at_s"]), bottom, stroke="#080", width=1.5, dash="5,3")
        svg.text(sx(r["heal_at_s"]) + 4, top + 10, "healed", size=10, fill="#080")
    svg.line(left, bottom, right, bottom)
    return svg.render()
