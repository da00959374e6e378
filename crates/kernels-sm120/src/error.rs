use std::fmt;

/// What went wrong, with enough context to act on.
#[derive(Debug)]
#[non_exhaustive]
pub enum KernelError {
    /// A CUDA library could not be loaded, or no device is present.
    NoDevice(String),
    /// NVRTC rejected a source; the message carries its log.
    Compile { source: String, arch: String, log: String },
    /// A wrapper was called with arguments that do not fit the kernel.
    Shape(String),
    /// The driver or cuBLAS reported an error.
    Cuda(String),
}

impl KernelError {
    pub(crate) fn shape(msg: impl Into<String>) -> KernelError {
        KernelError::Shape(msg.into())
    }
}

impl fmt::Display for KernelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KernelError::NoDevice(m) => write!(f, "no usable CUDA device: {m}"),
            KernelError::Compile { source, arch, log } => {
                write!(f, "NVRTC failed on {source} for {arch}:\n{log}")
            }
            KernelError::Shape(m) => write!(f, "bad kernel arguments: {m}"),
            KernelError::Cuda(m) => write!(f, "CUDA error: {m}"),
        }
    }
}

impl std::error::Error for KernelError {}

impl From<cudarc::driver::DriverError> for KernelError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        KernelError::Cuda(format!("{e:?}"))
    }
}

impl From<cudarc::cublas::result::CublasError> for KernelError {
    fn from(e: cudarc::cublas::result::CublasError) -> Self {
        KernelError::Cuda(format!("cuBLAS: {e:?}"))
    }
}
