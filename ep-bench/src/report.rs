//! ep-bench results: one row per (mode, operation) carrying the run's settings, passed from rank
//! 0 to the launcher as a tagged JSON line, printed as one table, written as JSON or CSV (serde),
//! and plotted as SVG over a sweep.

use std::fmt::Write;

use serde::{Deserialize, Deserializer, Serialize};

/// fabric-ep's version (its Cargo.toml).
pub const VERSION: &str = fabric_ep::VERSION;

/// The commit the binary was built from (build.rs: `FEP_GIT_COMMIT`, else `git rev-parse HEAD`,
/// else "unknown").
pub const GIT_COMMIT: &str = env!("FEP_GIT_COMMIT");

/// One measured operation, with every setting of the run that produced it, so a row read alone
/// (a JSON object, a CSV line) says what was measured and by which build.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EpRow {
    /// "normal", "normal-hier" (DeepEP's hierarchy) or "low-latency".
    pub mode: String,
    /// "dispatch", "combine", "dispatch+hook", "combine+hook", "dispatch (cached)", ...
    pub op: String,
    /// "host", "gpu" or "nccl+permute" (the NCCL baseline on the same inputs).
    pub backend: String,
    pub ranks: usize,
    pub tokens: usize,
    pub hidden: usize,
    /// DeepEP's definition: bytes of the tokens this rank sends (dispatch) / receives (combine)
    /// per second, at the median time. JSON: null when not finite.
    #[serde(deserialize_with = "f64_or_nan")]
    pub gbps: f64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub median_us: f64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub p99_us: f64,
    pub bytes: u64,
    /// Nodes the ranks were split into (ranks per node = ranks / nodes).
    pub nodes: usize,
    /// libfabric provider (of the proxy lane on the GPU backend).
    pub provider: String,
    pub topk: usize,
    pub experts: usize,
    /// Dispatch payload: "fp8" (e4m3, one fp32 scale per 128 channels) or "bf16"; combine is
    /// always bf16.
    pub dtype: String,
    /// GPU backend: each rank's SM budget (blocks per kernel); none on the host backend and for
    /// NCCL's rows (NCCL picks its own).
    pub sms: Option<usize>,
    /// Timed iterations.
    pub iters: usize,
    /// GPU backend: the device's name.
    pub gpu: Option<String>,
    /// fabric-ep's version ([`VERSION`]).
    pub version: String,
    /// The build's commit ([`GIT_COMMIT`]).
    pub git_commit: String,
}

fn f64_or_nan<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

impl Default for EpRow {
    /// No measurement, this build's version and commit.
    fn default() -> Self {
        EpRow {
            mode: String::new(),
            op: String::new(),
            backend: String::new(),
            ranks: 0,
            tokens: 0,
            hidden: 0,
            gbps: f64::NAN,
            median_us: f64::NAN,
            p99_us: f64::NAN,
            bytes: 0,
            nodes: 1,
            provider: String::new(),
            topk: 0,
            experts: 0,
            dtype: String::new(),
            sms: None,
            iters: 0,
            gpu: None,
            version: VERSION.to_string(),
            git_commit: GIT_COMMIT.to_string(),
        }
    }
}

/// A run's settings, shared by its rows ([`EpRow::with`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunSettings {
    /// Ranks per node of the split the run used (a row's nodes = its ranks / this, rounded up).
    pub ranks_per_node: usize,
    pub provider: String,
    pub topk: usize,
    pub experts: usize,
    /// Dispatch payload in fp8 (else bf16).
    pub fp8: bool,
    pub iters: usize,
    /// GPU backend: the device's name.
    pub gpu: Option<String>,
    /// GPU backend: the SM budget of a rank in normal mode and in low-latency mode.
    pub sms_normal: Option<usize>,
    pub sms_low_latency: Option<usize>,
}

const TAG: &str = "@ep ";

impl EpRow {
    /// The line rank 0 prints for the launcher: the tag, then the row as one JSON object.
    pub fn to_line(&self) -> String {
        format!("{TAG}{}", serde_json::to_string(self).expect("a row serialises"))
    }

    /// This row with the run's settings (`sms` from the row's mode; none for NCCL's rows).
    pub fn with(mut self, s: &RunSettings) -> Self {
        self.nodes = self.ranks.div_ceil(s.ranks_per_node.clamp(1, self.ranks.max(1)));
        self.provider = s.provider.clone();
        self.topk = s.topk;
        self.experts = s.experts;
        self.dtype = if s.fp8 { "fp8" } else { "bf16" }.to_string();
        self.iters = s.iters;
        self.gpu = s.gpu.clone();
        self.sms = match self.backend.as_str() {
            "nccl+permute" => None,
            _ if self.mode.starts_with("low-latency") => s.sms_low_latency,
            _ => s.sms_normal,
        };
        self
    }

    /// Parses [`to_line`](Self::to_line) output; `None` for any other line.
    pub fn parse(line: &str) -> Option<EpRow> {
        serde_json::from_str(line.strip_prefix(TAG)?).ok()
    }
}

/// The human table.
pub fn table(rows: &[EpRow]) -> String {
    // Column widths follow the longest entry ("dispatch (graph)", "nccl+permute").
    let op = rows.iter().map(|r| r.op.len()).max().unwrap_or(0);
    let back = rows.iter().map(|r| r.backend.len()).max().unwrap_or(0);
    let mut t = TableStream::new(op, back);
    let mut s = t.header();
    for r in rows {
        s.push_str(&t.line(r));
    }
    s
}

/// The table a row at a time, for rows printed as they finish: the header before the first
/// row, then one line per row, in columns fixed up front (at least those [`table`] uses for
/// the same rows, when `op` / `back` are their longest op and backend).
#[derive(Clone, Debug)]
pub struct TableStream {
    op: usize,
    back: usize,
    started: bool,
}

impl TableStream {
    /// Columns for ops of up to `op` characters and backends of up to `back`.
    pub fn new(op: usize, back: usize) -> Self {
        TableStream { op: op.max(14), back: back.max(5), started: false }
    }

    /// The header line (also printed by the first [`line`](Self::line) when not yet).
    pub fn header(&mut self) -> String {
        self.started = true;
        let (op, back) = (self.op, self.back);
        format!(
            "{:<12} {:<op$} {:<back$} {:>5} {:>6} {:>6} | {:>9} {:>12} {:>12}\n",
            "mode", "op", "back", "ranks", "tokens", "hidden", "GB/s", "median us", "p99 us"
        )
    }

    /// `r`'s line, after the header when it is the first.
    pub fn line(&mut self, r: &EpRow) -> String {
        let mut s = if self.started { String::new() } else { self.header() };
        let (op, back) = (self.op, self.back);
        let _ = writeln!(
            s,
            "{:<12} {:<op$} {:<back$} {:>5} {:>6} {:>6} | {:>9.3} {:>12.1} {:>12.1}",
            r.mode, r.op, r.backend, r.ranks, r.tokens, r.hidden, r.gbps, r.median_us, r.p99_us
        );
        s
    }
}

/// CSV with a header row (the field names of [`EpRow`]); a missing value is an empty field.
pub fn csv(rows: &[EpRow]) -> String {
    let mut w = csv::Writer::from_writer(Vec::new());
    for r in rows {
        w.serialize(r).expect("a row serialises");
    }
    let mut out = String::from_utf8(w.into_inner().expect("flush to memory")).expect("UTF-8");
    if rows.is_empty() {
        // serde writes the header with the first row; an empty run still gets one.
        let one = csv(&[EpRow::default()]);
        out = one.lines().next().map(|h| format!("{h}\n")).unwrap_or_default();
    }
    out
}

/// A JSON array of row objects (field names as in the CSV header; null for a non-finite
/// figure or a setting that does not apply).
pub fn json(rows: &[EpRow]) -> String {
    let mut s = serde_json::to_string_pretty(rows).expect("rows serialise");
    s.push('\n');
    s
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
            nodes: 2,
            provider: "tcp;ofi_rxm".into(),
            topk: 8,
            experts: 256,
            dtype: "fp8".into(),
            iters: 20,
            ..EpRow::default()
        }
    }

    #[test]
    fn rows_roundtrip_and_render() {
        let mut rows =
            vec![row("dispatch", 128, 10.0), row("dispatch", 512, 30.0), row("combine", 128, 20.0)];
        rows[2].sms = Some(32);
        rows[2].gpu = Some("NVIDIA H200, \"quoted\"".into());
        for r in &rows {
            assert_eq!(EpRow::parse(&r.to_line()).as_ref(), Some(r));
        }
        assert!(EpRow::parse("selftest ok").is_none());
        assert!(EpRow::parse("@ep not json").is_none());
        let nan = EpRow { gbps: f64::NAN, ..row("combine", 1, 1.0) };
        let back = EpRow::parse(&nan.to_line()).expect("a NaN figure travels as null");
        assert!(back.gbps.is_nan() && back.median_us == 1.0);

        // CSV: a header of every field, one line per row, quoting where needed, empty for none.
        let c = csv(&rows);
        let lines: Vec<&str> = c.lines().collect();
        assert_eq!(lines.len(), 4, "{c}");
        assert_eq!(
            lines[0],
            "mode,op,backend,ranks,tokens,hidden,gbps,median_us,p99_us,bytes,nodes,provider,\
             topk,experts,dtype,sms,iters,gpu,version,git_commit"
        );
        assert!(
            lines[1].starts_with(
                "normal,dispatch,host,4,128,7168,1.5,10.0,20.0,42,2,tcp;ofi_rxm,8,256,fp8,,20,,"
            ),
            "{}",
            lines[1]
        );
        assert!(lines[3].contains(",32,20,\"NVIDIA H200, \"\"quoted\"\"\","), "{}", lines[3]);
        assert!(lines[1].ends_with(&format!(",{VERSION},{GIT_COMMIT}")), "{}", lines[1]);
        assert_eq!(csv(&[]).trim_end(), lines[0]);

        // JSON: every setting per row, parsed back equal.
        let j: Vec<EpRow> = serde_json::from_str(&json(&rows)).unwrap();
        assert_eq!(j, rows);
        let v: serde_json::Value = serde_json::from_str(&json(&rows)).unwrap();
        assert_eq!(v[0]["provider"], "tcp;ofi_rxm");
        assert_eq!(v[0]["sms"], serde_json::Value::Null);
        assert_eq!(v[2]["sms"], 32);
        assert!(!GIT_COMMIT.is_empty() && v[1]["git_commit"] == GIT_COMMIT);

        let st = RunSettings {
            ranks_per_node: 3,
            provider: "efa".into(),
            topk: 6,
            experts: 64,
            fp8: false,
            iters: 7,
            gpu: Some("H".into()),
            sms_normal: Some(24),
            sms_low_latency: Some(66),
        };
        let n = row("dispatch", 1, 1.0).with(&st);
        assert_eq!((n.nodes, n.provider.as_str(), n.topk, n.experts), (2, "efa", 6, 64));
        assert_eq!(
            (n.dtype.as_str(), n.iters, n.sms, n.gpu.as_deref()),
            ("bf16", 7, Some(24), Some("H"))
        );
        let ll = EpRow { mode: "low-latency".into(), ..row("combine", 1, 1.0) }.with(&st);
        assert_eq!(ll.sms, Some(66));
        let nccl = EpRow { backend: "nccl+permute".into(), ..row("combine", 1, 1.0) }.with(&st);
        assert_eq!(nccl.sms, None);

        assert!(table(&rows).contains("dispatch"));
        // Streamed a row at a time in the same columns: the same text.
        let mut t = TableStream::new(0, 0);
        let streamed: String = rows.iter().map(|r| t.line(r)).collect();
        assert_eq!(streamed, table(&rows));
        assert_eq!(streamed.lines().count(), rows.len() + 1);
        let wide = EpRow { op: "dispatch (cached)".into(), ..row("dispatch", 1, 1.0) };
        let mut t = TableStream::new(17, 12);
        assert_eq!(
            t.line(&wide),
            table(&[EpRow { backend: "nccl+permute".into(), ..wide.clone() }])
                .replace("nccl+permute", "host        ")
        );
        let svg = svg_plot(&rows, "tokens");
        assert!(svg.starts_with("<svg") && svg.matches("<polyline").count() == 2, "{svg}");
    }
}
