//! A small SVG line chart: latency percentiles and goodput against offered load, one colour per target.

use std::fmt::Write as _;

use crate::PointResult;

const COLOURS: &[&str] = &["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"];

/// A line: its name, its dash pattern, and the value it takes at a point.
type Series<'a> = (&'a str, &'a str, fn(&PointResult) -> f64);

struct Panel<'a> {
    title: &'a str,
    y_label: &'a str,
    series: Vec<Series<'a>>,
}

/// Two panels side by side: TTFT p50/p99 and E2E p99 (ms), then goodput and requests/s.
pub fn chart(results: &[PointResult], x_label: &str) -> String {
    let targets: Vec<String> = {
        let mut t: Vec<String> = Vec::new();
        for r in results {
            if !t.contains(&r.target) {
                t.push(r.target.clone());
            }
        }
        t
    };
    let panels = [
        Panel {
            title: "latency",
            y_label: "ms",
            series: vec![
                ("TTFT p50", "", |r| r.ttft.p50_ms()),
                ("TTFT p99", "6,3", |r| r.ttft.p99_ms()),
                ("E2E p99", "2,3", |r| r.e2e.p99_ms()),
            ],
        },
        Panel {
            title: "throughput",
            y_label: "requests/s",
            series: vec![
                ("goodput", "", |r| r.goodput_per_s()),
                ("completed", "6,3", |r| r.requests_per_s()),
            ],
        },
    ];
    let (w, h, pad) = (460.0, 320.0, 55.0);
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" font-family="sans-serif" font-size="11">"#,
        w * 2.0 + 20.0,
        h + 40.0 + 16.0 * targets.len() as f64
    );
    let xs: Vec<f64> = results.iter().map(|r| r.x).collect();
    let (x0, x1) = (xs.iter().cloned().fold(f64::INFINITY, f64::min), xs.iter().cloned().fold(0.0, f64::max));
    for (pi, p) in panels.iter().enumerate() {
        let ox = pi as f64 * (w + 20.0);
        let ymax = results
            .iter()
            .flat_map(|r| p.series.iter().map(move |(_, _, f)| f(r)))
            .fold(0.0f64, f64::max)
            .max(1e-9)
            * 1.1;
        let px = |x: f64| ox + pad + (x - x0) / (x1 - x0).max(1e-9) * (w - pad - 10.0);
        let py = |y: f64| h - pad + 20.0 - y / ymax * (h - pad - 10.0);
        let _ = write!(s, r#"<text x="{}" y="14" font-weight="bold">{}</text>"#, ox + pad, p.title);
        let _ = write!(
            s,
            r#"<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="black"/>"#,
            px(x0),
            py(0.0),
            px(x1),
            py(0.0)
        );
        let _ = write!(
            s,
            r#"<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="black"/>"#,
            px(x0),
            py(0.0),
            px(x0),
            py(ymax)
        );
        for k in 0..=4 {
            let y = ymax * k as f64 / 4.0;
            let _ = write!(
                s,
                r#"<text x="{}" y="{}" text-anchor="end">{:.0}</text>"#,
                px(x0) - 4.0,
                py(y) + 4.0,
                y
            );
        }
        let mut seen = Vec::new();
        for r in results {
            if !seen.contains(&r.x) {
                seen.push(r.x);
                let _ = write!(
                    s,
                    r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
                    px(r.x),
                    py(0.0) + 14.0,
                    r.x
                );
            }
        }
        let _ = write!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">{x_label}</text>"#,
            ox + w / 2.0,
            py(0.0) + 30.0
        );
        let _ = write!(
            s,
            r#"<text x="{}" y="{}" transform="rotate(-90 {} {})">{}</text>"#,
            ox + 12.0,
            h / 2.0,
            ox + 12.0,
            h / 2.0,
            p.y_label
        );
        for (ti, t) in targets.iter().enumerate() {
            let colour = COLOURS[ti % COLOURS.len()];
            for (name, dash, f) in &p.series {
                let pts: Vec<String> = results
                    .iter()
                    .filter(|r| &r.target == t)
                    .map(|r| format!("{:.1},{:.1}", px(r.x), py(f(r))))
                    .collect();
                let _ = write!(
                    s,
                    r#"<polyline fill="none" stroke="{colour}" stroke-width="1.8" stroke-dasharray="{dash}" points="{}"><title>{t} {name}</title></polyline>"#,
                    pts.join(" ")
                );
            }
        }
        let mut ly = h + 24.0;
        for (name, dash, _) in &p.series {
            let _ = write!(
                s,
                r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="gray" stroke-width="1.8" stroke-dasharray="{dash}"/><text x="{}" y="{}">{name}</text>"#,
                ox + pad,
                ox + pad + 24.0,
                ox + pad + 28.0,
                ly + 4.0
            );
            ly += 14.0;
        }
    }
    let mut ly = h + 24.0;
    for (ti, t) in targets.iter().enumerate() {
        let _ = write!(
            s,
            r#"<rect x="{}" y="{}" width="10" height="10" fill="{}"/><text x="{}" y="{}">{t}</text>"#,
            w + 20.0 + 220.0,
            ly - 6.0,
            COLOURS[ti % COLOURS.len()],
            w + 20.0 + 234.0,
            ly + 3.0
        );
        ly += 16.0;
    }
    s.push_str("</svg>\n");
    s
}
