use erase_ops::OpError;

/// Errors of the runtime. Each names the tensor or node concerned.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Op(#[from] OpError),
    #[error("cannot feed '{tensor}': {msg}")]
    Feed { tensor: String, msg: String },
    #[error("tensor '{0}' has no value: feed the input or run the node that makes it")]
    NotComputed(String),
    #[error("device: {0}")]
    Device(String),
}
