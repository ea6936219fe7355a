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

/// Checks that `b` fits tensor `t` of `g` (element type and count), naming the tensor.
pub(crate) fn check_feed(
    g: &erase_graph::Graph,
    t: erase_graph::Tensor,
    b: &erase_ops::Buffer,
) -> Result<(), RuntimeError> {
    let info = g.info(t);
    if b.dtype() != info.dtype || b.len() != info.shape.numel() {
        return Err(RuntimeError::Feed {
            tensor: info.name.clone(),
            msg: format!(
                "expected {} {} ({} elements), got {} elements of {}",
                info.shape,
                info.dtype,
                info.shape.numel(),
                b.len(),
                b.dtype()
            ),
        });
    }
    Ok(())
}
