//! Bad models and bad data give errors that name the node, never a panic.

use erase::graph::{make_trainable, DType, Graph, OptimizerConfig};
use erase::ops::Buffer;
use erase::runtime::{CpuConfig, CpuSession};

#[test]
fn ids_out_of_range_are_an_error_naming_the_node_and_bag() {
    let mut g = Graph::new(DType::F32);
    let rows = [10usize, 20];
    let table = g.embedding_tables("emb", &rows, 4).unwrap();
    let ids = g.input("ids", &[4], DType::I32).unwrap();
    let offsets = g.input("offsets", &[5], DType::I32).unwrap();
    let e = g.scoped("sparse", |g| {
        g.embedding_bag(table, ids, offsets, &rows).unwrap()
    });
    let s = g.sum(e).unwrap();
    g.loss(s, 1.0).unwrap();
    make_trainable(&mut g, &OptimizerConfig::default()).unwrap();
    let mut sess = CpuSession::new(
        &g,
        CpuConfig {
            threads: 1,
            seed: 0,
        },
    )
    .unwrap();
    sess.feed(offsets, Buffer::I32(vec![0, 1, 2, 3, 4]))
        .unwrap();
    // id 15 is fine for field 1 (20 rows) but out of range for field 0 (10 rows)
    sess.feed(ids, Buffer::I32(vec![3, 15, 1, 15])).unwrap();
    sess.run().unwrap();
    sess.feed(ids, Buffer::I32(vec![3, 15, 15, 1])).unwrap();
    let before = sess.get(table).unwrap().clone();
    let err = sess.run().unwrap_err().to_string();
    assert_eq!(
        err,
        "embedding_bag node 'sparse/embedding_bag0': id 15 in bag 2 (example 1, field 0) \
         is out of range for that field's table of 10 rows"
    );
    assert_eq!(
        sess.get(table),
        Some(&before),
        "a failed step must not change the table"
    );
    sess.feed(ids, Buffer::I32(vec![3, 15, 1, -2])).unwrap();
    let err = sess.run().unwrap_err().to_string();
    assert!(err.contains("id -2 in bag 3 (example 1, field 1)"), "{err}");
    // a wrongly sized feed is refused with the tensor's name
    let err = sess
        .feed(ids, Buffer::I32(vec![1, 2]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("'ids'") && err.contains("[4] i32"), "{err}");
}

#[test]
fn a_presorted_update_refuses_occurrences_that_are_not_the_batchs() {
    use erase::graph::{Op, Shape};
    use erase::ops::{execute, NodeCall};
    // two fields of 3 and 4 rows, two examples of one id each: rows 1, 3+2, 0, 3+0
    let field_rows = vec![3usize, 4];
    let ids = Buffer::I32(vec![1, 2, 0, 0]);
    let offsets = Buffer::I32(vec![0, 1, 2, 3, 4]);
    let dpooled = Buffer::F32(vec![0.5; 4 * 2]);
    let shapes = [
        Shape::new(&[4]),
        Shape::new(&[5]),
        Shape::new(&[2, 2, 2]),
        Shape::new(&[4]),
        Shape::new(&[4]),
    ];
    let op = Op::RowwiseAdagrad {
        lr: 0.1,
        eps: 1e-8,
        field_rows: field_rows.clone(),
    };
    let run = |rows: Vec<i32>, bags: Vec<i32>| {
        let call = NodeCall {
            op: &op,
            name: "emb.rowwise_adagrad",
            in_shapes: shapes.iter().collect(),
            out_shapes: vec![],
            bf16_gemm: false,
        };
        let (rows, bags) = (Buffer::I32(rows), Buffer::I32(bags));
        let mut upd = [Buffer::F32(vec![1.0; 7 * 2]), Buffer::F32(vec![0.0; 7])];
        execute(
            &call,
            &[&ids, &offsets, &dpooled, &rows, &bags],
            &mut [],
            &mut upd,
        )
        .map(|()| upd)
        .map_err(|e| e.to_string())
    };
    // the sort's own output: (row, bag) in order
    let ok = run(vec![0, 1, 3, 5], vec![2, 0, 3, 1]).unwrap();
    assert_ne!(
        ok[0],
        Buffer::F32(vec![1.0; 7 * 2]),
        "the update moved no row"
    );
    // out of row order, a bag past the batch, a row outside its bag's field
    for (rows, bags, what) in [
        (
            vec![1, 0, 3, 5],
            vec![0, 2, 3, 1],
            "occurrence 1 (row 0, bag 2)",
        ),
        (
            vec![0, 1, 3, 5],
            vec![2, 0, 3, 9],
            "occurrence 3 (row 5, bag 9)",
        ),
        (
            vec![0, 1, 3, 5],
            vec![2, 0, 3, 0],
            "occurrence 3 (row 5, bag 0)",
        ),
    ] {
        let err = run(rows, bags).unwrap_err();
        assert!(
            err.contains("emb.rowwise_adagrad") && err.contains(what),
            "{err}"
        );
    }
    let err = run(vec![0, 1], vec![2, 0]).unwrap_err();
    assert!(err.contains("2 sorted rows and 2 bags for 4 ids"), "{err}");
}
