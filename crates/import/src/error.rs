//! The crate's one error type.

use std::fmt;
use std::path::PathBuf;

/// Why a model could not be read, imported or fetched.
#[derive(Debug)]
#[non_exhaustive]
pub enum ImportError {
    /// Reading or writing `path` failed.
    Io { path: PathBuf, source: std::io::Error },
    /// `path` is not what it should be; `problem` says how.
    Format { path: PathBuf, problem: String },
    /// The file uses something the import does not handle; `field` names it.
    Unsupported { field: String, value: String },
    /// Running an external step (pip download, unzip) failed.
    Fetch { step: String, problem: String },
}

impl ImportError {
    pub(crate) fn format(path: impl Into<PathBuf>, problem: impl Into<String>) -> Self {
        ImportError::Format { path: path.into(), problem: problem.into() }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ImportError::Io { path: path.into(), source }
    }
}

impl fmt::Display for ImportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ImportError::Io { path, source } => write!(f, "{}: {source}", path.display()),
            ImportError::Format { path, problem } => write!(f, "{}: {problem}", path.display()),
            ImportError::Unsupported { field, value } => write!(f, "unsupported {field}: {value}"),
            ImportError::Fetch { step, problem } => write!(f, "{step} failed: {problem}"),
        }
    }
}

impl std::error::Error for ImportError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ImportError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}
