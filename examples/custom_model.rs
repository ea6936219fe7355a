//! A model of your own behind the whole `erase-ctr` command line: a two-tower model (a
//! "user" tower over the first half of the fields and the dense features, an "item"
//! tower over the rest, scored by their dot product), each tower a block that the
//! `detached` and `erase` variants cut off with a local loss. Train, evaluate, bench and
//! plan it exactly as the bundled model:
//!
//! ```sh
//! cargo run --release --example custom_model -- train --steps 300
//! cargo run --release --example custom_model -- plan --preset spec
//! ```

use std::sync::Arc;

use erase::graph::{Graph, Tensor};
use erase::model::api::{Blocks, Model, ModelInputs};
use erase::model::ctr::CtrConfig;
use erase::model::zoo::mlp;

pub struct TwoTower;

impl Model for TwoTower {
    fn name(&self) -> &str {
        "two-tower"
    }

    fn build(
        &self,
        g: &mut Graph,
        x: &ModelInputs,
        cfg: &CtrConfig,
        blocks: &mut Blocks,
    ) -> anyhow::Result<Tensor> {
        let f = cfg.num_sparse;
        let half = (f / 2).max(1);
        let user_fields = g.slice(x.fields, 1, 0, half)?;
        let item_fields = g.slice(x.fields, 1, half, f - half)?;
        let mut user_in = g.flatten(user_fields)?;
        if let Some(d) = x.dense {
            user_in = g.concat(&[user_in, d], 1)?;
        }
        let item_in = g.flatten(item_fields)?;
        let user = g.scoped("user", |g| mlp(g, user_in, &[256, x.dim], false))?;
        let user = blocks.mark(g, "user", user)?;
        let item = g.scoped("item", |g| mlp(g, item_in, &[256, x.dim], false))?;
        let item = blocks.mark(g, "item", item)?;
        g.scoped("top", |g| -> anyhow::Result<Tensor> {
            // the score: <user, item>, as one pairwise dot of the two towers
            let u = g.reshape(user, &[x.batch, 1, x.dim])?;
            let i = g.reshape(item, &[x.batch, 1, x.dim])?;
            let pair = g.concat(&[u, i], 1)?;
            let dot = g.pairwise_dot(pair)?;
            Ok(g.reshape(dot, &[x.batch])?)
        })
    }
}

fn main() -> std::process::ExitCode {
    erase::cli::main_with(Arc::new(TwoTower))
}
