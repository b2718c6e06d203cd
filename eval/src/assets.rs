//! Locations of the evaluation assets (see `scripts/fetch-assets.sh`).

use std::path::PathBuf;

/// File name of the model.
pub const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// File name of the second model, Gemma 3 270M (fetched only with
/// `scripts/fetch-assets.sh --gemma`: it ships under the Gemma Terms of Use).
pub const GEMMA: &str = "gemma-3-270m-q4_k_m.gguf";
/// File name of the prose corpus.
pub const AUSTEN: &str = "austen.txt";
/// File name of the code corpus.
pub const CODE: &str = "python-stdlib.txt";

/// The assets directory: `$KVQ_ASSETS` if set, else `<repo>/assets`.
pub fn dir() -> PathBuf {
    std::env::var_os("KVQ_ASSETS")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::repo_root().join("assets"))
}

/// Path of an asset file.
pub fn path(name: &str) -> PathBuf {
    dir().join(name)
}

/// Whether all three asset files exist.
pub fn present() -> bool {
    [MODEL, AUSTEN, CODE].iter().all(|f| path(f).is_file())
}

/// Resolve a model name (`smollm2`, `gemma`) or a path to a file path.
pub fn model(name: &std::path::Path) -> PathBuf {
    match name.to_str() {
        Some("smollm2" | "smollm") => path(MODEL),
        Some("gemma" | "gemma3") => path(GEMMA),
        _ => name.to_path_buf(),
    }
}

/// Resolve a corpus name (`austen`, `code`) or a path to a file path.
pub fn corpus(name: &str) -> PathBuf {
    match name {
        "austen" | "prose" => path(AUSTEN),
        "code" | "python" => path(CODE),
        other => PathBuf::from(other),
    }
}

/// Make sure the assets are present: if they are not and `fetch` is set,
/// run `scripts/fetch-assets.sh` (pip + apt, checked by sha256).
pub fn ensure(fetch: bool) -> Result<(), String> {
    if present() {
        return Ok(());
    }
    if !fetch {
        return Err("assets missing: run scripts/fetch-assets.sh".into());
    }
    eprintln!("assets missing: running scripts/fetch-assets.sh");
    run_fetch(&[], present)
}

/// Run `scripts/fetch-assets.sh args`; `Err` unless it succeeds and `done()`.
fn run_fetch(args: &[&str], done: impl Fn() -> bool) -> Result<(), String> {
    let script = crate::repo_root().join("scripts/fetch-assets.sh");
    let st = std::process::Command::new("bash")
        .arg(&script)
        .args(args)
        .status()
        .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
    if !st.success() || !done() {
        return Err(format!(
            "{} {} failed ({st})",
            script.display(),
            args.join(" ")
        ));
    }
    Ok(())
}

/// [`ensure`], and for the Gemma model also `scripts/fetch-assets.sh
/// --gemma` when `model` is the Gemma asset and missing.
pub fn ensure_model(model: &std::path::Path, fetch: bool) -> Result<(), String> {
    ensure(fetch)?;
    if model.is_file() || model != path(GEMMA) {
        return Ok(());
    }
    if !fetch {
        return Err("Gemma 3 missing: run scripts/fetch-assets.sh --gemma".into());
    }
    eprintln!("Gemma 3 missing: running scripts/fetch-assets.sh --gemma");
    run_fetch(&["--gemma"], || model.is_file())
}
