//! The field's standard CTR models behind the model API ([`super::api::Model`]), each
//! with its blocks marked for the ERASE schedule and its sizes read from [`CtrConfig`]:
//!
//! - `dlrm`: DLRM's bottom MLP, dot interaction over the fields and the bottom's output,
//!   top MLP (blocks: bottom).
//! - `dcnv2`: MLPerf's DLRM-DCNv2 shape: bottom MLP, a low-rank cross network over the
//!   concatenated fields, top MLP (blocks: bottom, cross). At the spec preset: embedding
//!   dim 128, bottom 512-256-128, three cross layers of rank 512, top 1024-1024-512-256-1.
//! - `deepfm`: the FM second-order term (the sum of the fields' pairwise dots), a
//!   first-order linear term, and a deep MLP over the embeddings (blocks: deep).

use std::sync::Arc;

use anyhow::Result;
use erase_graph::{Graph, Tensor};

use super::api::{Blocks, Model, ModelInputs};
use super::ctr::CtrConfig;

/// The zoo, in the order `--help` lists it.
pub(crate) fn models() -> Vec<Arc<dyn Model>> {
    vec![Arc::new(Dlrm), Arc::new(DcnV2), Arc::new(DeepFm)]
}

/// The zoo's model names, in the order `--help` lists them (whatever else is
/// registered): what the tests of every zoo model iterate over, so a model added to
/// the zoo (`zoo::models`) is tested without a test naming it.
pub fn names() -> Vec<String> {
    models().iter().map(|m| m.name().to_string()).collect()
}

/// Linear layers of the `widths`, ReLU after each (after the last too when `last_relu`):
/// the MLP the zoo's models are made of, for models of one's own too. Each ReLU runs in
/// its layer's GEMM epilogue (`Graph::linear_relu`): no pass of its own, and the bf16 copy
/// a next large layer reads written by the same epilogue.
pub fn mlp(g: &mut Graph, mut x: Tensor, widths: &[usize], last_relu: bool) -> Result<Tensor> {
    for (i, &w) in widths.iter().enumerate() {
        x = if last_relu || i + 1 < widths.len() {
            g.linear_relu(x, w)?
        } else {
            g.linear(x, w)?
        };
    }
    Ok(x)
}

/// The bottom MLP `num_dense -> bottom.. -> dim` as a block, and `E`: the fields with the
/// bottom's output as one more field (`[B, F + 1, dim]`), or the fields alone without
/// dense features. Returns `(E, the bottom's output)`.
fn fields_with_bottom(
    g: &mut Graph,
    x: &ModelInputs,
    cfg: &CtrConfig,
    blocks: &mut Blocks,
) -> Result<(Tensor, Option<Tensor>)> {
    fields_with_bottom_as(g, x, cfg, blocks, false)
}

/// [`fields_with_bottom`], E made by `Graph::concat_stored` where `stored` (a cross
/// network's x0 that only its bf16 layers read).
fn fields_with_bottom_as(
    g: &mut Graph,
    x: &ModelInputs,
    cfg: &CtrConfig,
    blocks: &mut Blocks,
    stored: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let Some(dense) = x.dense else {
        return Ok((x.fields, None));
    };
    let mut widths = cfg.bottom.clone();
    widths.push(x.dim);
    let b = g.scoped("bottom", |g| mlp(g, dense, &widths, true))?;
    let b = blocks.mark(g, "bottom", b)?;
    let e = g.scoped("embedding", |g| -> Result<Tensor> {
        let bf = g.reshape(b, &[x.batch, 1, x.dim])?;
        if stored {
            Ok(g.concat_stored(&[x.fields, bf], 1)?)
        } else {
            Ok(g.concat(&[x.fields, bf], 1)?)
        }
    })?;
    Ok((e, Some(b)))
}

/// `top.. -> 1`, the last layer without ReLU, as `[B]`.
fn top(g: &mut Graph, x: Tensor, widths: &[usize], batch: usize) -> Result<Tensor> {
    g.scoped("top", |g| -> Result<Tensor> {
        let mut w = widths.to_vec();
        w.push(1);
        let y = mlp(g, x, &w, false)?;
        Ok(g.reshape(y, &[batch])?)
    })
}

/// DLRM (Naumov et al. 2019; MLPerf's DLRM reference): the dots of every pair of fields.
pub struct Dlrm;

impl Model for Dlrm {
    fn name(&self) -> &str {
        "dlrm"
    }
    fn build(
        &self,
        g: &mut Graph,
        x: &ModelInputs,
        cfg: &CtrConfig,
        blocks: &mut Blocks,
    ) -> Result<Tensor> {
        let (e, b) = fields_with_bottom(g, x, cfg, blocks)?;
        let z = g.scoped("interaction", |g| g.pairwise_dot(e))?;
        let z = match b {
            Some(b) => g.scoped("interaction", |g| g.concat(&[z, b], 1))?,
            None => z,
        };
        top(g, z, &cfg.top, x.batch)
    }
}

/// DCNv2 (Wang et al. 2021) as MLPerf trains it: a low-rank cross network,
/// `x_{l+1} = x0 ⊙ (V_l (U_l x_l) + c_l) + x_l`, over the concatenated fields.
pub struct DcnV2;

impl Model for DcnV2 {
    fn name(&self) -> &str {
        "dcnv2"
    }
    fn sizes(&self, cfg: CtrConfig, spec: bool) -> CtrConfig {
        if spec {
            CtrConfig {
                dim: 128,
                bottom: vec![512, 256],
                cross_rank: 512,
                cross_layers: 3,
                top: vec![1024, 1024, 512, 256],
                ..cfg
            }
        } else {
            cfg
        }
    }
    fn build(
        &self,
        g: &mut Graph,
        x: &ModelInputs,
        cfg: &CtrConfig,
        blocks: &mut Blocks,
    ) -> Result<Tensor> {
        // x0 stored in bf16 alone where both of each cross layer's GEMMs take bf16 copies
        // (the layers then read it as their copy, and nothing reads its f32 values)
        let fields = g.shape(x.fields).dims()[1] + usize::from(x.dense.is_some());
        let width = fields * x.dim;
        let stored = g.bf16_layer(x.batch, width, cfg.cross_rank)
            && g.bf16_layer(x.batch, cfg.cross_rank, width);
        let (e, _) = fields_with_bottom_as(g, x, cfg, blocks, stored)?;
        let c = g.scoped("cross", |g| -> Result<Tensor> {
            let x0 = g.flatten(e)?;
            let width = g.shape(x0).dims()[1];
            let mut xl = x0;
            for l in 0..cfg.cross_layers {
                let u = g.linear(xl, cfg.cross_rank)?;
                let v = g.linear_stored(u, width)?;
                // in bf16 where the next layer alone reads it (Graph::set_bf16_cross)
                xl = g.mul_add_stored(x0, v, xl, l + 1 < cfg.cross_layers)?;
            }
            Ok(xl)
        })?;
        let c = blocks.mark(g, "cross", c)?;
        top(g, c, &cfg.top, x.batch)
    }
}

/// DeepFM (Guo et al. 2017): FM's first- and second-order terms beside a deep MLP, summed.
pub struct DeepFm;

impl Model for DeepFm {
    fn name(&self) -> &str {
        "deepfm"
    }
    fn build(
        &self,
        g: &mut Graph,
        x: &ModelInputs,
        cfg: &CtrConfig,
        blocks: &mut Blocks,
    ) -> Result<Tensor> {
        let e = match x.dense {
            // the dense features as one more field, through one linear layer
            Some(d) => g.scoped("embedding", |g| -> Result<Tensor> {
                let b = g.linear(d, x.dim)?;
                let b = g.reshape(b, &[x.batch, 1, x.dim])?;
                Ok(g.concat(&[x.fields, b], 1)?)
            })?,
            None => x.fields,
        };
        let fields = g.shape(e).dims()[1];
        let flat = g.flatten(e)?;
        let fm = g.scoped("fm", |g| -> Result<Tensor> {
            // Σ_{i<j} <e_i, e_j>: the pairwise dots summed by a constant ones vector
            let pd = g.pairwise_dot(e)?;
            let pairs = fields * (fields - 1) / 2;
            let ones = g.constant("ones", &[pairs, 1], vec![1.0; pairs])?;
            let second = g.matmul(pd, ones)?;
            let first = g.linear(flat, 1)?;
            Ok(g.add(first, second)?)
        })?;
        let deep = g.scoped("deep", |g| mlp(g, flat, &cfg.deep, true))?;
        let deep = blocks.mark(g, "deep", deep)?;
        g.scoped("top", |g| -> Result<Tensor> {
            let d = g.linear(deep, 1)?;
            let y = g.add(fm, d)?;
            Ok(g.reshape(y, &[x.batch])?)
        })
    }
}
