//! A structured mutation fuzzer for every kvq surface that takes outside
//! data: serialized blocks, saved caches, scheme/layout/cache constructors,
//! cache operations with arbitrary shapes and values, and the evaluation
//! crate's GGUF reader.
//!
//! ```text
//! cargo run --release -p kvq-fuzz -- all --iters 1000000   # every target
//! cargo run --release -p kvq-fuzz -- load --iters 100000 --seed 7
//! cargo run --release -p kvq-fuzz -- replay load fuzz/artifacts/load/panic-123.bin
//! cargo run --release -p kvq-fuzz -- write-seeds            # regenerate fuzz/corpus
//! ```
//!
//! Not coverage-guided (`fuzz/afl/` runs the same targets under AFL++): each
//! input is a corpus entry under a few byte-level mutations (bit flips,
//! interesting integers and floats at random offsets, deletions, insertions,
//! splices, truncation). The structured targets read their choices from the
//! same bytes, so one mutation engine serves all. As cheap feedback, an
//! input whose outcome (`Ok`, or the error's variant and message with the
//! numbers taken out) is new joins the corpus.
//!
//! A panic is a finding: its input is written to `fuzz/artifacts/<target>/`
//! and the run exits non-zero at the end. So is a call slower than a
//! second (a hang), and an allocation above 1 GiB, which the allocator
//! refuses, so the process aborts and the run fails (the seed and the
//! last progress line reproduce it).

use clap::{Parser, Subcommand};
use kvq_fuzz::{input, seeds, targets, TARGETS};
use std::collections::HashSet;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[global_allocator]
static ALLOC: kvq_fuzz::Guarded = kvq_fuzz::Guarded;

#[derive(Parser)]
#[command(about = "Structured mutation fuzzer for kvq's outside-data surfaces")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Fuzz one target (`block`, `load`, `config`, `ops`, `gguf`) or `all`.
    Run {
        target: String,
        /// Executions per target.
        #[arg(long, default_value_t = 100_000)]
        iters: u64,
        /// The run's random seed (the same seed repeats the same run).
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Corpus directory (one subdirectory per target).
        #[arg(long, default_value = "fuzz/corpus")]
        corpus: PathBuf,
    },
    /// Run one saved input through a target.
    Replay { target: String, file: PathBuf },
    /// Regenerate the seed corpus.
    WriteSeeds {
        #[arg(long, default_value = "fuzz/corpus")]
        corpus: PathBuf,
    },
}

fn main() {
    // `all` and a bare target name read as `run`.
    let mut args: Vec<String> = std::env::args().collect();
    if args.len() > 1 && (args[1] == "all" || TARGETS.contains(&args[1].as_str())) {
        args.insert(1, "run".into());
    }
    let cli = Cli::parse_from(args);
    match cli.cmd {
        Cmd::Run {
            target,
            iters,
            seed,
            corpus,
        } => {
            let list: Vec<&str> = if target == "all" {
                TARGETS.to_vec()
            } else if TARGETS.contains(&target.as_str()) {
                vec![target.as_str()]
            } else {
                eprintln!("unknown target {target}; one of {TARGETS:?} or all");
                std::process::exit(2);
            };
            quiet_panics();
            let mut failed = false;
            for t in list {
                let r = fuzz(t, iters, seed, &corpus.join(t));
                println!(
                    "{t:7} {:>9} execs  corpus {:>3} seeds + {:>3} found  {:>4} outcomes  \
                     {} panics  {} hangs  slowest {:.1} ms  {:.1} s",
                    r.execs,
                    r.seeds,
                    r.grown,
                    r.outcomes,
                    r.panics,
                    r.hangs,
                    r.slowest.as_secs_f64() * 1e3,
                    r.elapsed.as_secs_f64()
                );
                failed |= r.panics > 0 || r.hangs > 0;
            }
            if failed {
                std::process::exit(1);
            }
        }
        Cmd::Replay { target, file } => {
            let data = std::fs::read(&file).expect("readable input");
            println!("{}", targets::run(&target, &data));
        }
        Cmd::WriteSeeds { corpus } => {
            for t in TARGETS {
                let dir = corpus.join(t);
                std::fs::create_dir_all(&dir).expect("corpus directory");
                for (i, s) in seeds::seeds(t).iter().enumerate() {
                    std::fs::write(dir.join(format!("seed-{i:02}.bin")), s).expect("seed file");
                }
            }
        }
    }
}

thread_local! {
    static LAST_PANIC: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
    /// Whether a target is running (its panics are findings, kept for the
    /// report; any other panic is the fuzzer's own and printed).
    static IN_TARGET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Keep panic messages for the report instead of printing each.
fn quiet_panics() {
    std::panic::set_hook(Box::new(|info| {
        let loc = info
            .location()
            .map(|l| format!("{}:{}", l.file(), l.line()))
            .unwrap_or_default();
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        if IN_TARGET.with(|t| t.get()) {
            LAST_PANIC.with(|p| *p.borrow_mut() = format!("{msg} at {loc}"));
        } else {
            eprintln!("kvq-fuzz panicked: {msg} at {loc}");
        }
    }));
}

struct Report {
    execs: u64,
    seeds: usize,
    grown: usize,
    outcomes: usize,
    panics: u64,
    hangs: u64,
    slowest: Duration,
    elapsed: Duration,
}

/// The corpus of `dir`, or the built-in seeds when it is missing.
fn load_corpus(target: &str, dir: &Path) -> Vec<Vec<u8>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    files.sort();
    let from_files: Vec<Vec<u8>> = files.iter().filter_map(|f| std::fs::read(f).ok()).collect();
    if from_files.is_empty() {
        seeds::seeds(target)
    } else {
        from_files
    }
}

fn fuzz(target: &str, iters: u64, seed: u64, dir: &Path) -> Report {
    const MAX_CORPUS: usize = 512;
    let mut corpus = load_corpus(target, dir);
    let seeds = corpus.len();
    let mut rng = input::Rng::new(seed ^ fnv(target.as_bytes()));
    let mut seen = HashSet::new();
    let (mut panics, mut hangs, mut slowest) = (0, 0, Duration::ZERO);
    let t0 = Instant::now();
    let step = (iters / 10).max(1);
    for i in 0..iters {
        if i > 0 && i % step == 0 {
            eprintln!("  {target}: {i} of {iters} (seed {seed})");
        }
        let x = input::mutate(&mut rng, &corpus);
        let start = Instant::now();
        IN_TARGET.with(|t| t.set(true));
        let r = std::panic::catch_unwind(AssertUnwindSafe(|| targets::run(target, &x)));
        IN_TARGET.with(|t| t.set(false));
        let dt = start.elapsed();
        slowest = slowest.max(dt);
        match r {
            Ok(outcome) => {
                if dt > Duration::from_secs(1) {
                    hangs += 1;
                    save(target, "hang", i, &x, &format!("{dt:?}"));
                }
                if seen.insert(outcome) && corpus.len() < MAX_CORPUS {
                    corpus.push(x);
                }
            }
            Err(_) => {
                panics += 1;
                let msg = LAST_PANIC.with(|p| p.borrow().clone());
                save(target, "panic", i, &x, &msg);
            }
        }
    }
    Report {
        execs: iters,
        seeds,
        grown: corpus.len() - seeds,
        outcomes: seen.len(),
        panics,
        hangs,
        slowest,
        elapsed: t0.elapsed(),
    }
}

fn save(target: &str, kind: &str, i: u64, x: &[u8], msg: &str) {
    let dir = Path::new("fuzz/artifacts").join(target);
    let _ = std::fs::create_dir_all(&dir);
    let f = dir.join(format!("{kind}-{i}.bin"));
    let _ = std::fs::write(&f, x);
    eprintln!(
        "{target}: {kind} at execution {i}: {msg} (input {})",
        f.display()
    );
}

fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}
