#!/usr/bin/env python3
"""Plots what scripts/bench-kernel.sh measured (its TSV) as one SVG with two panels: time of a
cold load (wall, kernel, `nft -f` of the same ruleset, re-apply) and memory (the daemon's VmRSS
and VmHWM, the peak of `--once` and of `nft -f`), each against the number of elements, on
log-log axes. Standard library only, so it runs wherever the benchmark does.

Usage: scripts/plot-performance.py results.tsv out.svg
"""
import csv
import math
import sys

W, H = 1010, 420
PANEL_W, PANEL_H = 400, 300
MARGIN_L, MARGIN_T = 70, 50
COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]


def ticks(lo, hi):
    """Powers of ten (and 2x, 5x) covering [lo, hi]."""
    out = []
    e = math.floor(math.log10(lo))
    while 10 ** e <= hi * 1.0001:
        for m in (1, 2, 5):
            v = m * 10 ** e
            if lo / 1.0001 <= v <= hi * 1.0001:
                out.append(v)
        e += 1
    return out


def fmt(v):
    if v >= 1000:
        return f"{v / 1000:g}k"
    return f"{v:g}"


def panel(x0, title, xlabel, ylabel, series):
    """series: [(label, [(x, y), ...])]; returns SVG elements."""
    pts = [p for _, s in series for p in s if p[1] > 0]
    xs = [p[0] for p in pts]
    ys = [p[1] for p in pts]
    xlo, xhi = min(xs) / 1.5, max(xs) * 1.5
    ylo, yhi = min(ys) / 2, max(ys) * 2

    def px(x):
        return x0 + (math.log10(x) - math.log10(xlo)) / (math.log10(xhi) - math.log10(xlo)) * PANEL_W

    def py(y):
        return MARGIN_T + PANEL_H - (math.log10(y) - math.log10(ylo)) / (math.log10(yhi) - math.log10(ylo)) * PANEL_H

    out = [
        f'<text x="{x0 + PANEL_W / 2}" y="{MARGIN_T - 20}" text-anchor="middle" font-weight="bold">{title}</text>',
        f'<rect x="{x0}" y="{MARGIN_T}" width="{PANEL_W}" height="{PANEL_H}" fill="none" stroke="#444"/>',
        f'<text x="{x0 + PANEL_W / 2}" y="{MARGIN_T + PANEL_H + 38}" text-anchor="middle">{xlabel}</text>',
        f'<text transform="translate({x0 - 50},{MARGIN_T + PANEL_H / 2}) rotate(-90)" text-anchor="middle">{ylabel}</text>',
    ]
    for t in ticks(xlo, xhi):
        out.append(f'<line x1="{px(t):.1f}" y1="{MARGIN_T}" x2="{px(t):.1f}" y2="{MARGIN_T + PANEL_H}" stroke="#ddd"/>')
        out.append(f'<text x="{px(t):.1f}" y="{MARGIN_T + PANEL_H + 16}" text-anchor="middle" font-size="11">{fmt(t)}</text>')
    for t in ticks(ylo, yhi):
        out.append(f'<line x1="{x0}" y1="{py(t):.1f}" x2="{x0 + PANEL_W}" y2="{py(t):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{x0 - 6}" y="{py(t) + 4:.1f}" text-anchor="end" font-size="11">{fmt(t)}</text>')
    for i, (label, s) in enumerate(series):
        c = COLOURS[i % len(COLOURS)]
        s = sorted(p for p in s if p[1] > 0)
        if not s:
            continue
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in s)
        out.append(f'<polyline points="{path}" fill="none" stroke="{c}" stroke-width="2"/>')
        for x, y in s:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3.5" fill="{c}"/>')
        ly = MARGIN_T + 14 + 16 * i
        out.append(f'<line x1="{x0 + 10}" y1="{ly - 4}" x2="{x0 + 30}" y2="{ly - 4}" stroke="{c}" stroke-width="2"/>')
        out.append(f'<text x="{x0 + 36}" y="{ly}" font-size="12">{label}</text>')
    return out


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    with open(sys.argv[1], newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    if not rows:
        sys.exit(f"{sys.argv[1]}: no rows")

    def col(name, scale=1.0):
        return [(float(r["elements"]), float(r[name]) * scale) for r in rows if r.get(name) not in (None, "", "-")]

    time = panel(MARGIN_L, "Load the whole ruleset", "elements", "seconds", [
        ("nodeproxy --once, cold: wall", col("cold_wall_s")),
        ("of which the kernel", col("cold_kernel_ms", 1e-3)),
        ("nft -f of the same ruleset", col("nft_wall_s")),
        ("re-apply (adopt), wall", col("reapply_wall_s")),
    ])
    mem = panel(MARGIN_L + PANEL_W + 110, "Memory", "elements", "MiB", [
        ("daemon VmRSS after churn", col("daemon_rss_kib", 1 / 1024)),
        ("daemon VmHWM (start-up)", col("daemon_hwm_kib", 1 / 1024)),
        ("nodeproxy --once, peak", col("cold_rss_kib", 1 / 1024)),
        ("nft -f, peak", col("nft_rss_kib", 1 / 1024)),
    ])
    sizes = ", ".join(f'{r["services"]}×{r["endpoints"]}' for r in rows)
    svg = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="13">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
        *time,
        *mem,
        f'<text x="{W / 2}" y="{H - 10}" text-anchor="middle" font-size="11" fill="#555">services × endpoints: {sizes} (scripts/bench-kernel.sh)</text>',
        "</svg>",
    ]
    with open(sys.argv[2], "w") as f:
        f.write("\n".join(svg) + "\n")


if __name__ == "__main__":
    main()
