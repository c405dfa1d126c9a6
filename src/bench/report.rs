//! ep-bench results: one row per (mode, operation), passed from rank 0 to the launcher as a
//! tagged line, printed as one table, JSON or CSV, and plotted as SVG over a sweep.

use std::fmt::Write;

/// One measured operation.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EpRow {
    /// "normal", "normal-hier" (DeepEP's hierarchy, host backend) or "low-latency".
    pub mode: String,
    /// "dispatch", "combine", "dispatch+hook", "combine+hook".
    pub op: String,
    /// "host" or "gpu".
    pub backend: String,
    pub ranks: usize,
    pub tokens: usize,
    pub hidden: usize,
    /// DeepEP's definition: bytes of the tokens this rank sends (dispatch) / receives (combine)
    /// per second, at the median time.
    pub gbps: f64,
    pub median_us: f64,
    pub p99_us: f64,
    pub bytes: u64,
}

const TAG: &str = "@ep ";

impl EpRow {
    /// The line rank 0 prints for the launcher.
    pub fn to_line(&self) -> String {
        format!(
            "{TAG}{}|{}|{}|{}|{}|{}|{}|{}|{}|{}",
            self.mode,
            self.op,
            self.backend,
            self.ranks,
            self.tokens,
            self.hidden,
            self.gbps,
            self.median_us,
            self.p99_us,
            self.bytes
        )
    }

    /// Parses [`to_line`](Self::to_line) output; `None` for any other line.
    pub fn parse(line: &str) -> Option<EpRow> {
        let f: Vec<&str> = line.strip_prefix(TAG)?.split('|').collect();
        if f.len() != 10 {
            return None;
        }
        Some(EpRow {
            mode: f[0].to_string(),
            op: f[1].to_string(),
            backend: f[2].to_string(),
            ranks: f[3].parse().ok()?,
            tokens: f[4].parse().ok()?,
            hidden: f[5].parse().ok()?,
            gbps: f[6].parse().ok()?,
            median_us: f[7].parse().ok()?,
            p99_us: f[8].parse().ok()?,
            bytes: f[9].parse().ok()?,
        })
    }
}

/// The human table.
pub fn table(rows: &[EpRow]) -> String {
    // Column widths follow the longest entry ("dispatch (graph)", "nccl+permute").
    let op = rows.iter().map(|r| r.op.len()).max().unwrap_or(0).max(14);
    let back = rows.iter().map(|r| r.backend.len()).max().unwrap_or(0).max(5);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<12} {:<op$} {:<back$} {:>5} {:>6} {:>6} | {:>9} {:>12} {:>12}",
        "mode", "op", "back", "ranks", "tokens", "hidden", "GB/s", "median us", "p99 us"
    );
    for r in rows {
        let _ = writeln!(
            s,
            "{:<12} {:<op$} {:<back$} {:>5} {:>6} {:>6} | {:>9.3} {:>12.1} {:>12.1}",
            r.mode, r.op, r.backend, r.ranks, r.tokens, r.hidden, r.gbps, r.median_us, r.p99_us
        );
    }
    s
}

/// CSV with a header row.
pub fn csv(rows: &[EpRow]) -> String {
    let mut s = String::from("mode,op,backend,ranks,tokens,hidden,gbps,median_us,p99_us,bytes\n");
    for r in rows {
        let _ = writeln!(
            s,
            "{},{},{},{},{},{},{},{},{},{}",
            r.mode,
            r.op,
            r.backend,
            r.ranks,
            r.tokens,
            r.hidden,
            r.gbps,
            r.median_us,
            r.p99_us,
            r.bytes
        );
    }
    s
}

/// A JSON array of objects (field names as in the CSV header).
pub fn json(rows: &[EpRow]) -> String {
    let esc = |v: &str| v.replace('\\', "\\\\").replace('"', "\\\"");
    let num = |v: f64| if v.is_finite() { format!("{v}") } else { "null".into() };
    let items: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "{{\"mode\":\"{}\",\"op\":\"{}\",\"backend\":\"{}\",\"ranks\":{},\"tokens\":{},\
                 \"hidden\":{},\"gbps\":{},\"median_us\":{},\"p99_us\":{},\"bytes\":{}}}",
                esc(&r.mode),
                esc(&r.op),
                esc(&r.backend),
                r.ranks,
                r.tokens,
                r.hidden,
                num(r.gbps),
                num(r.median_us),
                num(r.p99_us),
                r.bytes
            )
        })
        .collect();
    format!("[{}]\n", items.join(",\n "))
}

/// An SVG line chart of median microseconds against `x` ("tokens" or "ranks"), one line per
/// (mode, op).
pub fn svg_plot(rows: &[EpRow], x: &str) -> String {
    let xv = |r: &EpRow| if x == "ranks" { r.ranks as f64 } else { r.tokens as f64 };
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for r in rows {
        let key = format!("{} {}", r.mode, r.op);
        let pt = (xv(r), r.median_us);
        match series.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push(pt),
            None => series.push((key, vec![pt])),
        }
    }
    for (_, v) in &mut series {
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    let (w, h, m) = (720.0, 420.0, 60.0);
    let xs = rows.iter().map(xv);
    let (x0, x1) = (xs.clone().fold(f64::MAX, f64::min), xs.fold(f64::MIN, f64::max));
    let y1 = rows.iter().map(|r| r.median_us).fold(0.0, f64::max).max(1e-9);
    let sx = |v: f64| m + (v - x0) / (x1 - x0).max(1e-9) * (w - 2.0 * m);
    let sy = |v: f64| h - m - v / y1 * (h - 2.0 * m);
    let colors = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"];
    let mut s = String::new();
    let _ = writeln!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">"
    );
    let _ = writeln!(s, "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>");
    let _ = writeln!(
        s,
        "<line x1=\"{m}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/><line x1=\"{m}\" y1=\"{m}\" x2=\"{m}\" y2=\"{}\" stroke=\"black\"/>",
        h - m,
        w - m,
        h - m,
        h - m
    );
    let _ =
        writeln!(s, "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{x}</text>", w / 2.0, h - 15.0);
    let _ = writeln!(s, "<text x=\"15\" y=\"{}\" transform=\"rotate(-90 15 {})\" text-anchor=\"middle\">median us</text>", h / 2.0, h / 2.0);
    for i in 0..=4 {
        let v = y1 * i as f64 / 4.0;
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{v:.0}</text>",
            m - 5.0,
            sy(v) + 4.0
        );
    }
    let mut ticks: Vec<f64> = rows.iter().map(xv).collect();
    ticks.sort_by(f64::total_cmp);
    ticks.dedup();
    for t in ticks {
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{t}</text>",
            sx(t),
            h - m + 16.0
        );
    }
    for (i, (name, pts)) in series.iter().enumerate() {
        let c = colors[i % colors.len()];
        let path: Vec<String> =
            pts.iter().map(|&(a, b)| format!("{:.1},{:.1}", sx(a), sy(b))).collect();
        let _ = writeln!(
            s,
            "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"2\" points=\"{}\"/>",
            path.join(" ")
        );
        for &(a, b) in pts {
            let _ = writeln!(
                s,
                "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"{c}\"/>",
                sx(a),
                sy(b)
            );
        }
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{}\" fill=\"{c}\">{name}</text>",
            w - m - 150.0,
            m + 16.0 * i as f64
        );
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(op: &str, tokens: usize, us: f64) -> EpRow {
        EpRow {
            mode: "normal".into(),
            op: op.into(),
            backend: "host".into(),
            ranks: 4,
            tokens,
            hidden: 7168,
            gbps: 1.5,
            median_us: us,
            p99_us: us * 2.0,
            bytes: 42,
        }
    }

    #[test]
    fn rows_roundtrip_and_render() {
        let rows =
            vec![row("dispatch", 128, 10.0), row("dispatch", 512, 30.0), row("combine", 128, 20.0)];
        for r in &rows {
            assert_eq!(EpRow::parse(&r.to_line()).as_ref(), Some(r));
        }
        assert!(EpRow::parse("selftest ok").is_none());
        assert_eq!(csv(&rows).lines().count(), 4);
        assert!(json(&rows).starts_with("[{\"mode\":\"normal\",\"op\":\"dispatch\""));
        assert!(table(&rows).contains("dispatch"));
        let svg = svg_plot(&rows, "tokens");
        assert!(svg.starts_with("<svg") && svg.matches("<polyline").count() == 2, "{svg}");
    }
}
