use std::fmt;

/// An error found while building or transforming a graph. Every variant names the node
/// (the user's name for it, with its scope) so the message points at the model code.
#[derive(Debug, Clone, PartialEq)]
pub enum GraphError {
    /// Operand shapes that the op cannot combine.
    Shape {
        op: &'static str,
        node: String,
        detail: String,
    },
    /// An operand of the wrong element type.
    DType {
        op: &'static str,
        node: String,
        detail: String,
    },
    /// An attribute that makes no sense (a zero size, an axis out of range, ...).
    Invalid {
        op: &'static str,
        node: String,
        detail: String,
    },
    /// A loss that is not a scalar.
    LossNotScalar { node: String, shape: String },
    /// A transformation asked for something the graph does not have.
    Structure(String),
}

impl fmt::Display for GraphError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GraphError::Shape { op, node, detail } => {
                write!(f, "shape mismatch in {op} node '{node}': {detail}")
            }
            GraphError::DType { op, node, detail } => {
                write!(f, "wrong element type in {op} node '{node}': {detail}")
            }
            GraphError::Invalid { op, node, detail } => {
                write!(f, "invalid {op} node '{node}': {detail}")
            }
            GraphError::LossNotScalar { node, shape } => write!(
                f,
                "loss '{node}' is not a scalar: its shape is {shape}; reduce it first (sum or mean)"
            ),
            GraphError::Structure(s) => f.write_str(s),
        }
    }
}

impl std::error::Error for GraphError {}

pub type Result<T, E = GraphError> = std::result::Result<T, E>;
