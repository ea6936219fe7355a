//! The README's example: a block with a local loss, cut off from the top by a detach,
//! trained for a few steps on the CPU. `cargo run --example quickstart`.

use erase::graph::{make_trainable, partition, DType, Graph, OptimizerConfig};
use erase::ops::Buffer;
use erase::runtime::{CpuConfig, CpuSession};

fn main() -> anyhow::Result<()> {
    let mut g = Graph::new(DType::F32);
    let x = g.input("x", &[256, 13], DType::F32)?;
    let y = g.input("y", &[256], DType::F32)?;
    // linear + ReLU as one op: the ReLU runs in the GEMM's epilogue on a GPU
    let h = g.scoped("block", |g| g.linear_relu(x, 64))?;
    let head = g.scoped("block_head", |g| g.linear(h, 1))?;
    let aux = g.bce_with_logits(head, y)?;
    g.loss(aux, 1.0)?; // the block's local loss
    let cut = g.detach(h)?; // nothing flows back across the cut
    let top = g.scoped("top", |g| g.linear(cut, 1))?;
    let main = g.bce_with_logits(top, y)?;
    g.loss(main, 1.0)?;
    let training = make_trainable(&mut g, &OptimizerConfig::default())?;

    let part = partition(&g, &training.grads);
    for p in &part.programs {
        let after = g.node(part.forward[p.ready_after]).name.clone();
        println!(
            "backward program '{}': {} nodes, ready after '{after}'",
            p.name,
            p.nodes.len()
        );
    }

    let mut s = CpuSession::new(&g, CpuConfig::default())?;
    for step in 0..50u64 {
        let xs: Vec<f32> = (0..256 * 13)
            .map(|i| (((i as u64 * 7 + step) % 17) as f32 - 8.0) / 8.0)
            .collect();
        let ys: Vec<f32> = (0..256).map(|i| f32::from(xs[i * 13] > 0.0)).collect();
        s.feed(x, Buffer::F32(xs))?;
        s.feed(y, Buffer::F32(ys))?;
        s.run()?;
        if step % 10 == 9 {
            println!(
                "step {:2}: main loss {:.4}, block loss {:.4}",
                step + 1,
                s.scalar(main)?,
                s.scalar(aux)?
            );
        }
    }
    Ok(())
}
