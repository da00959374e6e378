use std::fmt;
use std::path::PathBuf;

/// Why a model could not be loaded or run.
#[derive(Debug)]
#[non_exhaustive]
pub enum ModelError {
    /// Reading or writing `path` failed.
    Io { path: PathBuf, source: std::io::Error },
    /// `path` is not what it should be; `problem` says how.
    Format { path: PathBuf, problem: String },
    /// The model uses something this engine does not implement; `field` names it.
    Unsupported { field: String, value: String },
    /// A weight format name other than `f32`, `bf16`, `q8` or `q4`.
    UnknownWeightFormat { value: String },
    /// Input that does not fit the model (a token id past the vocabulary, a position past the context).
    InvalidInput { problem: String },
    /// A template or tokenizer failure on valid files (rendering a chat, decoding ids).
    Text { problem: String },
    /// The accelerator failed (no device, a driver or kernel error).
    Device { problem: String },
}

impl ModelError {
    pub(crate) fn format(path: impl Into<PathBuf>, problem: impl Into<String>) -> Self {
        ModelError::Format { path: path.into(), problem: problem.into() }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io { path: path.into(), source }
    }
}

impl fmt::Display for ModelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ModelError::Io { path, source } => write!(f, "{}: {source}", path.display()),
            ModelError::Format { path, problem } => write!(f, "{}: {problem}", path.display()),
            ModelError::Unsupported { field, value } => write!(f, "unsupported {field}: {value}"),
            ModelError::UnknownWeightFormat { value } => {
                write!(f, "unknown weight format {value:?}: f32, bf16, q8 or q4")
            }
            ModelError::InvalidInput { problem } => write!(f, "invalid input: {problem}"),
            ModelError::Text { problem } => write!(f, "text processing failed: {problem}"),
            ModelError::Device { problem } => write!(f, "device error: {problem}"),
        }
    }
}

impl std::error::Error for ModelError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ModelError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}
