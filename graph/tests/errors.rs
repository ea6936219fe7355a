//! The graph's build errors name the op, the node and the operands (no backend needed).

use erase_graph::{DType, Graph, GraphError};

#[test]
fn shape_mismatch_names_op_node_and_both_operands() {
    let mut g = Graph::new(DType::F32);
    let x = g.input("features", &[8, 13], DType::F32).unwrap();
    let e = g.scoped("bottom", |g| {
        let h = g.linear(x, 256).unwrap();
        let w = g
            .param("proj.weight", &[64, 128], erase_graph::Init::Zeros)
            .unwrap();
        g.linear_with(h, w, None).unwrap_err()
    });
    let msg = e.to_string();
    assert!(matches!(e, GraphError::Shape { .. }), "{e:?}");
    for part in [
        "linear",
        "bottom/linear1",
        "'bottom/linear0' [8, 256]",
        "'bottom/proj.weight' [64, 128]",
    ] {
        assert!(msg.contains(part), "'{msg}' does not mention {part}");
    }

    let a = g.input("a", &[4, 3], DType::F32).unwrap();
    let b = g.input("b", &[4, 5], DType::F32).unwrap();
    let e = g.add(a, b).unwrap_err().to_string();
    assert!(
        e.contains("add") && e.contains("'a' [4, 3]") && e.contains("'b' [4, 5]"),
        "{e}"
    );
    let e = g.matmul(a, b).unwrap_err().to_string();
    assert!(
        e.contains("matmul") && e.contains("K = 3") && e.contains("K = 4"),
        "{e}"
    );
    let e = g.concat(&[a, b], 0).unwrap_err().to_string();
    assert!(
        e.contains("concat") && e.contains("differ outside axis 0"),
        "{e}"
    );
    // a residual that is not the layer's output shape
    let w = g
        .param("res.weight", &[5, 3], erase_graph::Init::Zeros)
        .unwrap();
    let e = g.linear_add_with(a, w, None, a).unwrap_err().to_string();
    assert!(
        e.contains("linear_add") && e.contains("'a' [4, 3]") && e.contains("[4, 5]"),
        "{e}"
    );
    let q = g.input("q", &[2, 5, 6], DType::F32).unwrap();
    let e = g.attention(q, q, q, 4, false).unwrap_err().to_string();
    assert!(e.contains("attention") && e.contains("4 heads"), "{e}");
    // a cross update's operands of different shapes, plain or stored in bf16 (which is
    // the plain update without bf16 copies)
    g.set_bf16_cross(true);
    let e = g.mul_add(a, a, b).unwrap_err().to_string();
    assert!(
        e.contains("mul_add") && e.contains("'b' [4, 5]") && e.contains("one shape"),
        "{e}"
    );
    let e = g.mul_add_stored(a, b, a, true).unwrap_err().to_string();
    assert!(e.contains("mul_add") && e.contains("one shape"), "{e}");

    // an update stored in bf16 read by a layer without bf16 copies: refused, saying how
    let mut g = Graph::new(DType::F32);
    g.set_bf16_copies(Some(0));
    g.set_bf16_storage(true);
    g.set_bf16_cross(true);
    let x0 = g.input("x0", &[128, 128], DType::F32).unwrap();
    let u = g.linear(x0, 128).unwrap();
    let v = g.linear_stored(u, 128).unwrap();
    assert_eq!(g.dtype(v), DType::Bf16);
    let y = g.mul_add_stored(x0, v, x0, true).unwrap();
    assert_eq!(g.dtype(y), DType::Bf16);
    assert!(
        g.linear(y, 128).is_ok(),
        "a layer with copies reads it as its copy"
    );
    let e = g.linear(y, 1).unwrap_err().to_string();
    assert!(
        e.contains("stored in bf16") && e.contains("store the update that feeds it in f32"),
        "{e}"
    );
}

#[test]
fn wrong_dtype_is_named() {
    let mut g = Graph::new(DType::F32);
    let ids = g.input("ids", &[4], DType::I32).unwrap();
    let e = g.relu(ids).unwrap_err();
    assert!(matches!(e, GraphError::DType { .. }));
    assert!(
        e.to_string().contains("relu0") && e.to_string().contains("'ids' [4] i32"),
        "{e}"
    );

    let table = g.embedding_tables("emb", &[10, 10], 4).unwrap();
    let off = g.input("offsets", &[5], DType::I32).unwrap();
    let fids = g.input("float_ids", &[4], DType::F32).unwrap();
    let e = g
        .embedding_bag(table, fids, off, &[10, 10])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("embedding_bag0") && e.contains("ids 'float_ids' [4] f32 must be i32"),
        "{e}"
    );

    let x64 = g.input("x64", &[4], DType::F64).unwrap();
    let x32 = g.input("x32", &[4], DType::F32).unwrap();
    let e = g.mul(x32, x64).unwrap_err().to_string();
    assert!(e.contains("mul0") && e.contains("f64"), "{e}");
}

#[test]
fn loss_must_be_a_scalar() {
    let mut g = Graph::new(DType::F32);
    let x = g.input("x", &[4, 2], DType::F32).unwrap();
    let h = g.scoped("head", |g| g.linear(x, 3).unwrap());
    let e = g.loss(h, 1.0).unwrap_err();
    assert_eq!(
        e.to_string(),
        "loss 'head/linear0' is not a scalar: its shape is [4, 3]; reduce it first (sum or mean)"
    );
    let m = g.mean(h).unwrap();
    assert!(g.loss(m, f64::NAN).is_err());
    g.loss(m, 1.0).unwrap();
}

#[test]
fn a_projection_for_attention_is_stored_in_bf16_only_where_the_attention_reads_it() {
    let mut g = Graph::new(DType::F32);
    g.set_bf16_copies(Some(0));
    let x = g.input("x", &[8, 27, 64], DType::F32).unwrap();
    let w = g
        .param("qkv.weight", &[192, 64], erase_graph::Init::Zeros)
        .unwrap();
    let qkv = g.linear_for_attention(x, w, None).unwrap();
    assert_eq!(g.dtype(qkv), DType::Bf16);
    let a = g.attention_packed(qkv, 2, false).unwrap();
    assert_eq!(
        g.dtype(a),
        DType::F32,
        "the attention's output is the graph's f32"
    );
    // past the fused kernels' one tile, or without copies: the f32 layer
    let long = g.input("long", &[2, 65, 64], DType::F32).unwrap();
    let qkv = g.linear_for_attention(long, w, None).unwrap();
    assert_eq!(g.dtype(qkv), DType::F32);
    let mut plain = Graph::new(DType::F32);
    let x = plain.input("x", &[8, 27, 64], DType::F32).unwrap();
    let w = plain
        .param("qkv.weight", &[192, 64], erase_graph::Init::Zeros)
        .unwrap();
    let qkv = plain.linear_for_attention(x, w, None).unwrap();
    assert_eq!(plain.dtype(qkv), DType::F32);
    // a bf16 q, k, v of a longer sequence is refused, naming the node and the limit
    let q = plain.input("q16", &[2, 65, 192], DType::Bf16).unwrap();
    let e = plain.attention_packed(q, 2, false).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, GraphError::DType { .. }), "{e:?}");
    assert!(
        msg.contains("attention") && msg.contains("q16") && msg.contains("at most 64"),
        "{msg}"
    );
}

/// What a model's code can ask for and no graph can hold is an error naming the node, not
/// an arithmetic overflow or an index out of bounds.
#[test]
fn impossible_sizes_and_names_are_errors_not_panics() {
    use erase_graph::Init;
    let mut g = Graph::new(DType::F32);
    let x = g.input("x", &[4, 6], DType::F32).unwrap();
    let e = g.slice(x, 1, usize::MAX, 1).unwrap_err().to_string();
    assert!(e.contains("slice0") && e.contains("do not fit"), "{e}");
    let e = g.reshape(x, &[(1 << 63) + 12, 2]).unwrap_err().to_string();
    assert!(
        e.contains("reshape0") && e.contains("more than a machine holds"),
        "{e}"
    );
    let e = g.linear(x, usize::MAX / 2).unwrap_err().to_string();
    assert!(e.contains("more elements than a machine holds"), "{e}");
    assert!(g
        .input("huge", &[usize::MAX, 2], DType::F32)
        .unwrap_err()
        .to_string()
        .contains("huge"));
    let e = g
        .param(
            "t",
            &[],
            Init::Tables {
                field_rows: vec![3],
            },
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("do not fit"), "{e}");
    // parameters are saved by name: one name, one parameter
    g.param("w", &[2], Init::Zeros).unwrap();
    let e = g.param("w", &[3], Init::Zeros).unwrap_err().to_string();
    assert!(e.contains("a parameter of this name exists"), "{e}");
    g.scoped("other", |g| g.param("w", &[2], Init::Zeros))
        .unwrap();
}

/// A graph computes in its float type: a cast to another float, or an elementwise op on
/// a bf16 copy, is refused when it is built, not when the step runs.
#[test]
fn other_float_types_are_refused_when_built() {
    let mut g = Graph::new(DType::F32);
    let x = g.input("x", &[4, 6], DType::F32).unwrap();
    let e = g.cast(x, DType::F64).unwrap_err().to_string();
    assert!(
        e.contains("cast0") && e.contains("graph's float type f32"),
        "{e}"
    );
    let b = g.cast(x, DType::Bf16).unwrap();
    let e = g.relu(b).unwrap_err().to_string();
    assert!(
        e.contains("relu0") && e.contains("graph's float type f32"),
        "{e}"
    );
    g.cast(b, DType::F32).unwrap();
    // an f64 reference graph may round to f32 and back
    let mut g = Graph::new(DType::F64);
    let x = g.input("x", &[4], DType::F64).unwrap();
    let r = g.cast(x, DType::F32).unwrap();
    g.cast(r, DType::F64).unwrap();
}
