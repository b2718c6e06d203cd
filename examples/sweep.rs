//! The sweep: perplexity of SmolLM2-135M with kvq caches of many K/V schemes,
//! on prose (Jane Austen) and code (the Python standard library).
//!
//! ```text
//! cargo run --release --example sweep -- [--full] [--tokens N] [--window 512]
//!     [--domains austen,code] [--path prefill|decode] [--residual R] [--sinks S]
//!     [--out results] [--no-fetch] [--only SUBSTR,SUBSTR]
//! ```
//!
//! Fetches the assets with `scripts/fetch-assets.sh` when they are missing
//! (pip + apt, checked by sha256). For every domain and configuration it
//! runs the studies' protocol (non-overlapping 512-token windows, each from
//! an empty cache) and reports effective bits, compression against an f16
//! cache, perplexity, Δppl against the full-precision cache, and the mean
//! attention KL of the first window (exact vs quantized attention over the
//! real Q/K/V, via `kvq::metrics`). Writes `sweep.csv`, `sweep.json` and
//! `sweep.svg` (Δppl against effective bits) into `--out`.
//!
//! The default grid (10 configurations × 2 domains × 4096 tokens) takes about
//! ten minutes on 2 cores; `--full` sweeps bits 2–8 × axis × group.

#[path = "common/mod.rs"]
mod common;

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use common::capture::{Capture, Recorder};
use common::gguf::Gguf;
use common::kvq_store::{CacheSpec, KvqStore};
use common::model::{Hooks, Model};
use common::ppl::{perplexity, EvalPath, PplOptions};
use common::tokenizer::Tokenizer;
use kvq::{Axis, Group, QuantScheme};

struct Args {
    full: bool,
    opts: PplOptions,
    domains: Vec<String>,
    residual: usize,
    sinks: usize,
    out: PathBuf,
    fetch: bool,
    only: Option<String>,
}

const USAGE: &str = "usage: sweep [--full] [--tokens N] [--window N] [--domains austen,code] \
[--path prefill|decode] [--residual R] [--sinks S] [--out DIR] [--no-fetch] [--only SUBSTR,SUBSTR]";

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        full: false,
        opts: PplOptions {
            n_tokens: 4096,
            ..PplOptions::default()
        },
        domains: vec!["austen".into(), "code".into()],
        residual: 0,
        sinks: 0,
        out: PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("results"),
        fetch: true,
        only: None,
    };
    let mut tokens_set = false;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        let num = |s: String| s.parse::<usize>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--full" => a.full = true,
            "--tokens" => {
                a.opts.n_tokens = num(val()?)?;
                tokens_set = true;
            }
            "--window" => a.opts.window = num(val()?)?,
            "--domains" => a.domains = val()?.split(',').map(str::to_string).collect(),
            "--path" => a.opts.path = val()?.parse::<EvalPath>()?,
            "--residual" => a.residual = num(val()?)?,
            "--sinks" => a.sinks = num(val()?)?,
            "--out" => a.out = val()?.into(),
            "--no-fetch" => a.fetch = false,
            "--only" => a.only = Some(val()?),
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    if a.full && !tokens_set {
        a.opts.n_tokens = 8192;
    }
    Ok(a)
}

/// One cache configuration of the grid.
#[derive(Debug, Clone)]
struct Config {
    name: String,
    spec: CacheSpec,
}

fn s(bits: u8, axis: Axis, group: Group) -> QuantScheme {
    QuantScheme::new(bits, axis, group).expect("grid schemes are valid")
}

fn grid(full: bool, residual: usize, sinks: usize) -> Vec<Config> {
    let mk = |name: String, k: Option<QuantScheme>, v: Option<QuantScheme>| Config {
        name,
        spec: CacheSpec {
            keys: k,
            values: v,
            residual,
            sinks,
            int8: false,
        },
    };
    let pt = |b, g| s(b, Axis::PerToken, g);
    let pc = |b, g| s(b, Axis::PerChannel, g);
    let mut g = vec![mk("fp32 (baseline)".into(), None, None)];
    if !full {
        let g32 = Group::Size(32);
        let g64 = Group::Size(64);
        g.push(mk("K8/V8 pt32".into(), Some(pt(8, g32)), Some(pt(8, g32))));
        g.push(mk(
            "K4/V4 KIVI pc32/pt32".into(),
            Some(pc(4, g32)),
            Some(pt(4, g32)),
        ));
        // The same cache read through the opt-in int8 kernels (int8 query;
        // int8 weights where one query per KV head reaches them).
        let mut kivi_i8 = mk(
            "K4/V4 KIVI pc32/pt32 int8 kernels".into(),
            Some(pc(4, g32)),
            Some(pt(4, g32)),
        );
        kivi_i8.spec.int8 = true;
        g.push(kivi_i8);
        g.push(mk("K4/V4 pt32".into(), Some(pt(4, g32)), Some(pt(4, g32))));
        g.push(mk(
            "K4/V4 pt-vector".into(),
            Some(pt(4, Group::Vector)),
            Some(pt(4, Group::Vector)),
        ));
        g.push(mk("K6/V4 pt64".into(), Some(pt(6, g64)), Some(pt(4, g64))));
        g.push(mk("K4/V6 pt64".into(), Some(pt(4, g64)), Some(pt(6, g64))));
        g.push(mk("K4/V8 pt32".into(), Some(pt(4, g32)), Some(pt(8, g32))));
        g.push(mk(
            "K2/V2 KIVI pc32/pt32".into(),
            Some(pc(2, g32)),
            Some(pt(2, g32)),
        ));
        g.push(mk(
            "K3/V3 KIVI pc32/pt32".into(),
            Some(pc(3, g32)),
            Some(pt(3, g32)),
        ));
        return g;
    }
    for kb in [2u8, 3, 4, 6, 8] {
        for vb in [2u8, 3, 4, 6, 8] {
            for (gname, grp) in [("32", Group::Size(32)), ("head", Group::Head)] {
                g.push(mk(
                    format!("K{kb}/V{vb} pt{gname}"),
                    Some(pt(kb, grp)),
                    Some(pt(vb, grp)),
                ));
            }
            g.push(mk(
                format!("K{kb}/V{vb} KIVI pc32/pt32"),
                Some(pc(kb, Group::Size(32))),
                Some(pt(vb, Group::Size(32))),
            ));
        }
    }
    for b in [2u8, 3, 4] {
        g.push(mk(
            format!("K{b}/V{b} pt-vector"),
            Some(pt(b, Group::Vector)),
            Some(pt(b, Group::Vector)),
        ));
    }
    g
}

/// Effective bits of a K/V pair (16 for an f16-equivalent full-precision tensor).
fn effective_bits(spec: &CacheSpec, n_kv: usize, hd: usize) -> f64 {
    let eb = |s: Option<QuantScheme>| {
        s.map_or(16.0, |s| {
            s.layout(n_kv, hd).map_or(f64::NAN, |l| l.effective_bits())
        })
    };
    (eb(spec.keys) + eb(spec.values)) / 2.0
}

struct Row {
    domain: String,
    config: String,
    eff_bits: f64,
    compression: f64,
    ppl: f64,
    ppl_second_half: f64,
    delta: f64,
    delta_second_half: f64,
    kl: f64,
    seconds: f64,
}

/// A one-line progress bar with ETA on stderr.
struct Progress {
    total: usize,
    done: usize,
    start: Instant,
}

impl Progress {
    fn tick(&mut self, what: &str) {
        self.done += 1;
        let el = self.start.elapsed().as_secs_f64();
        let eta = el / self.done as f64 * (self.total - self.done) as f64;
        let width = 30;
        let filled = width * self.done / self.total.max(1);
        eprint!(
            "\r[{}{}] {}/{} windows  {:>5.0}s elapsed  ETA {:>5.0}s  {:<40.40}",
            "#".repeat(filled),
            " ".repeat(width - filled),
            self.done,
            self.total,
            el,
            eta,
            what
        );
        let _ = std::io::stderr().flush();
    }
}

fn ensure_assets(fetch: bool) -> Result<(), String> {
    if common::assets::present() {
        return Ok(());
    }
    if !fetch {
        return Err("assets missing: run scripts/fetch-assets.sh".into());
    }
    eprintln!("assets missing: running scripts/fetch-assets.sh");
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/fetch-assets.sh");
    let st = std::process::Command::new("bash")
        .arg(&script)
        .status()
        .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
    if !st.success() || !common::assets::present() {
        return Err(format!("{} failed ({st})", script.display()));
    }
    Ok(())
}

/// The first `n` tokens of a corpus (tokenizing only a prefix of the text:
/// the pre-tokenizer is local, so the first tokens do not depend on the cut).
fn corpus_tokens(
    tok: &Tokenizer,
    name: &str,
    n: usize,
) -> Result<Vec<u32>, Box<dyn std::error::Error>> {
    let text = std::fs::read_to_string(common::assets::corpus(name))?;
    let mut cut = (n * 16).min(text.len());
    loop {
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        let prefix = match text[..cut].rfind('\n') {
            Some(i) if cut < text.len() => &text[..i + 1],
            _ => &text[..cut],
        };
        let ids = tok.encode(prefix)?;
        if ids.len() > n + 64 || cut == text.len() {
            return Ok(ids);
        }
        cut = (cut * 2).min(text.len());
    }
}

fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    ensure_assets(args.fetch)?;
    let t0 = Instant::now();
    let gguf = Gguf::open(common::assets::path(common::assets::MODEL))?;
    let tok = Tokenizer::from_gguf(&gguf)?;
    let model = Model::from_gguf(&gguf)?;
    drop(gguf);
    let cfg = model.cfg.clone();
    let (n_layers, n_kv, hd, n_q) = (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.n_heads);
    let mut configs = grid(args.full, args.residual, args.sinks);
    if let Some(only) = &args.only {
        // Keep the baseline: Δppl needs it.
        configs.retain(|c| {
            c.spec.keys.is_none() && c.spec.values.is_none()
                || only.split(',').any(|o| c.name.contains(o))
        });
    }
    eprintln!(
        "SmolLM2-135M: {n_layers} layers, {n_q}/{n_kv} heads, head_dim {hd}; loaded in {:.1}s; \
         {} configs x {} domains x {} tokens ({:?} path, residual {}, sinks {})",
        t0.elapsed().as_secs_f64(),
        configs.len(),
        args.domains.len(),
        args.opts.n_tokens,
        args.opts.path,
        args.residual,
        args.sinks
    );
    let windows = args.opts.n_tokens / args.opts.window;
    let mut progress = Progress {
        total: windows * configs.len() * args.domains.len(),
        done: 0,
        start: Instant::now(),
    };
    let mut rows = Vec::new();
    for domain in &args.domains {
        let tokens = corpus_tokens(&tok, domain, args.opts.n_tokens)?;
        // Full-precision Q/K/V of the first window, for the attention KL.
        let first = &tokens[..args.opts.window];
        let mut rec = Recorder::new(n_layers, n_q, n_kv, hd, first);
        {
            let mut store = KvqStore::new(n_layers, n_kv, hd, CacheSpec::FULL)?;
            let mut hooks = Hooks {
                observer: Some(&mut rec),
                ..Hooks::default()
            };
            common::ppl::window_nll(&model, first, &mut store, &mut hooks, EvalPath::Prefill)?;
        }
        let cap = rec.capture;
        let mut base: Option<(f64, f64)> = None;
        for c in &configs {
            let mut store = KvqStore::new(n_layers, n_kv, hd, c.spec)?;
            let t = Instant::now();
            let label = format!("{domain}: {}", c.name);
            let report = perplexity(
                &model,
                &tokens,
                &mut store,
                &mut Hooks::default(),
                &args.opts,
                |_, _| progress.tick(&label),
            )?;
            let (ppl, ppl2) = (report.all.ppl(), report.second_half.ppl());
            let (b, b2) = *base.get_or_insert((ppl, ppl2));
            let eb = effective_bits(&c.spec, n_kv, hd);
            rows.push(Row {
                domain: domain.clone(),
                config: c.name.clone(),
                eff_bits: eb,
                compression: 16.0 / eb,
                ppl,
                ppl_second_half: ppl2,
                delta: ppl - b,
                delta_second_half: ppl2 - b2,
                kl: attention_kl(&cap, &c.spec, n_q, n_kv, hd)?,
                seconds: t.elapsed().as_secs_f64(),
            });
        }
    }
    eprintln!();
    print_table(&rows, &args);
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(args.out.join("sweep.csv"), csv(&rows))?;
    std::fs::write(args.out.join("sweep.json"), json(&rows, &args))?;
    std::fs::write(args.out.join("sweep.svg"), svg(&rows))?;
    println!(
        "\nwrote {}/sweep.{{csv,json,svg}} in {:.0}s",
        args.out.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Mean attention KL (nats per query position and head, over all layers)
/// between exact attention and attention over K/V quantized with `spec`
/// (every token quantized: no residual window), on the captured first
/// window with a causal mask.
fn attention_kl(
    cap: &Capture,
    spec: &CacheSpec,
    n_q: usize,
    n_kv: usize,
    hd: usize,
) -> Result<f64, Box<dyn std::error::Error>> {
    use kvq::metrics::{layer_errors, AttnShape, MetricsConfig};
    use kvq::{KvQuantizer, UniformQuantizer};
    if spec.keys.is_none() && spec.values.is_none() {
        return Ok(0.0);
    }
    let shape = AttnShape::new(n_q, n_kv, hd)?;
    let cfg = MetricsConfig::new().with_causal(0);
    let hat = |x: &[f32], s: Option<QuantScheme>| -> Result<Vec<f32>, kvq::Error> {
        match s {
            None => Ok(x.to_vec()),
            Some(s) => UniformQuantizer::new(s, n_kv, hd)?.roundtrip(x, x.len() / (n_kv * hd)),
        }
    };
    let mut total = 0.0;
    for l in &cap.layers {
        let (kh, vh) = (hat(&l.k, spec.keys)?, hat(&l.v, spec.values)?);
        total += layer_errors(shape, l.q.as_slice(), &l.k, &l.v, &kh, &vh, &cfg)?
            .summary
            .mean
            .kl;
    }
    Ok(total / cap.layers.len() as f64)
}

fn print_table(rows: &[Row], args: &Args) {
    println!(
        "\nSmolLM2-135M-Instruct, {} tokens per domain in windows of {} ({:?}), residual {}, sinks {}",
        args.opts.n_tokens, args.opts.window, args.opts.path, args.residual, args.sinks
    );
    println!(
        "{:<7} {:<24} {:>8} {:>7} {:>10} {:>9} {:>10} {:>9} {:>10}",
        "domain", "config", "eff.bits", "x f16", "ppl", "Δppl", "ppl 2nd½", "Δ 2nd½", "attn KL"
    );
    for r in rows {
        println!(
            "{:<7} {:<24} {:>8.3} {:>7.2} {:>10.4} {:>+9.4} {:>10.4} {:>+9.4} {:>10.2e}",
            r.domain,
            r.config,
            r.eff_bits,
            r.compression,
            r.ppl,
            r.delta,
            r.ppl_second_half,
            r.delta_second_half,
            r.kl
        );
    }
}

fn csv(rows: &[Row]) -> String {
    let mut s = String::from("domain,config,effective_bits,compression_vs_f16,ppl,delta_ppl,ppl_second_half,delta_ppl_second_half,attention_kl,seconds\n");
    for r in rows {
        let _ = writeln!(
            s,
            "{},\"{}\",{:.4},{:.4},{:.6},{:.6},{:.6},{:.6},{:.6e},{:.2}",
            r.domain,
            r.config,
            r.eff_bits,
            r.compression,
            r.ppl,
            r.delta,
            r.ppl_second_half,
            r.delta_second_half,
            r.kl,
            r.seconds
        );
    }
    s
}

fn json(rows: &[Row], args: &Args) -> String {
    let mut s = format!(
        "{{\n  \"model\": \"SmolLM2-135M-Instruct.Q4_1.gguf\",\n  \"tokens\": {},\n  \"window\": {},\n  \"path\": \"{:?}\",\n  \"residual\": {},\n  \"sinks\": {},\n  \"rows\": [\n",
        args.opts.n_tokens, args.opts.window, args.opts.path, args.residual, args.sinks
    );
    for (i, r) in rows.iter().enumerate() {
        let _ = writeln!(
            s,
            "    {{\"domain\": \"{}\", \"config\": \"{}\", \"effective_bits\": {:.4}, \"compression_vs_f16\": {:.4}, \"ppl\": {:.6}, \"delta_ppl\": {:.6}, \"ppl_second_half\": {:.6}, \"delta_ppl_second_half\": {:.6}, \"attention_kl\": {:.6e}, \"seconds\": {:.2}}}{}",
            r.domain,
            r.config,
            r.eff_bits,
            r.compression,
            r.ppl,
            r.delta,
            r.ppl_second_half,
            r.delta_second_half,
            r.kl,
            r.seconds,
            if i + 1 < rows.len() { "," } else { "" }
        );
    }
    s.push_str("  ]\n}\n");
    s
}

/// Δppl against effective bits, one colour per domain, log-scaled y.
fn svg(rows: &[Row]) -> String {
    let (w, h, m) = (760.0, 480.0, 60.0);
    let pts: Vec<&Row> = rows.iter().filter(|r| r.eff_bits < 15.0).collect();
    let x_max = pts.iter().map(|r| r.eff_bits).fold(2.0, f64::max).ceil() + 0.5;
    let x_min = pts.iter().map(|r| r.eff_bits).fold(x_max, f64::min).floor() - 0.5;
    let y = |d: f64| d.max(1e-4).log10();
    let y_min = -4.0;
    let y_max = pts.iter().map(|r| y(r.delta)).fold(-1.0, f64::max).ceil();
    let px = |x: f64| m + (x - x_min) / (x_max - x_min) * (w - 2.0 * m);
    let py = |v: f64| h - m - (v - y_min) / (y_max - y_min) * (h - 2.0 * m);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{}\" y=\"20\" text-anchor=\"middle\" font-size=\"14\">SmolLM2-135M: Δppl vs effective bits (kvq cache)</text>\n",
        w / 2.0
    );
    let _ = writeln!(
        s,
        "<line x1=\"{m}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>",
        h - m,
        w - m,
        h - m
    );
    let _ = writeln!(
        s,
        "<line x1=\"{m}\" y1=\"{m}\" x2=\"{m}\" y2=\"{}\" stroke=\"black\"/>",
        h - m
    );
    let mut xt = x_min.ceil();
    while xt <= x_max {
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{xt}</text>",
            px(xt),
            h - m + 16.0
        );
        xt += 1.0;
    }
    let mut yt = y_min;
    while yt <= y_max {
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">1e{yt}</text><line x1=\"{m}\" y1=\"{:.1}\" x2=\"{}\" y2=\"{:.1}\" stroke=\"#ddd\"/>",
            m - 6.0,
            py(yt) + 4.0,
            py(yt),
            w - m,
            py(yt)
        );
        yt += 1.0;
    }
    let _ = writeln!(s, "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">effective bits per element (K and V averaged)</text>", w / 2.0, h - 15.0);
    let _ = writeln!(s, "<text x=\"15\" y=\"{}\" transform=\"rotate(-90 15 {})\" text-anchor=\"middle\">Δppl vs full precision (log; ≤1e-4 clipped)</text>", h / 2.0, h / 2.0);
    let colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];
    let mut domains: Vec<&str> = Vec::new();
    for r in &pts {
        if !domains.contains(&r.domain.as_str()) {
            domains.push(&r.domain);
        }
    }
    for (di, d) in domains.iter().enumerate() {
        let c = colours[di % colours.len()];
        let _ = writeln!(
            s,
            "<circle cx=\"{}\" cy=\"{}\" r=\"5\" fill=\"{c}\"/><text x=\"{}\" y=\"{}\">{d}</text>",
            w - m - 80.0,
            m + 16.0 * di as f64,
            w - m - 70.0,
            m + 4.0 + 16.0 * di as f64
        );
        for r in pts.iter().filter(|r| r.domain == *d) {
            let _ = writeln!(
                s,
                "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"4\" fill=\"{c}\" fill-opacity=\"0.8\"><title>{}: {} Δppl {:+.4}</title></circle>",
                px(r.eff_bits),
                py(y(r.delta)),
                d,
                r.config,
                r.delta
            );
        }
    }
    s.push_str("</svg>\n");
    s
}

fn main() -> ExitCode {
    common::init_threads();
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
