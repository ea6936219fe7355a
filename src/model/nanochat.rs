//! A small byte-level GPT cut into three subgraphs by two `detach` points
//! (`examples/nanochat.rs`).
//!
//! ```text
//! x    = tok_emb[ids] + pos_emb                           [B, S, D]   (embedding_bag, one id a bag)
//! x    = block_i(x), i in segment 0                       pre-LN: x += proj(attn(ln(x)·Wqkv)),
//! aux0 = CE(head0(x), next)      x = detach(x)                    x += W2·gelu(W1·ln(x))
//! x    = block_i(x), i in segment 1
//! aux1 = CE(head1(x), next)      x = detach(x)
//! x    = block_i(x), i in segment 2
//! main = CE(lm_head(x), next)                             head = ln, then linear D -> 256
//! ```
//!
//! Segment `k` holds blocks `[k·L/3, (k+1)·L/3)` (rounded), its nodes are scoped
//! `seg{k}/...`, so the backward programs the partition finds are `seg0`, `seg1` (early:
//! ready after their local loss) and the remainder. The model is trained with the ERASE
//! schedule: `seg0` and `seg1` start on side streams while the later segments' forward
//! runs on the main stream.
//!
//! The token table gets a sparse gradient, so the optimizer updates it with row-wise
//! Adagrad (`OptimizerConfig::rowwise_adagrad`); everything else with the dense optimizer.

use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use erase_graph::{DType, Graph, Init, OptimizerConfig, Tensor};
use erase_ops::Buffer;
use erase_runtime::cuda::CudaDevice;
use erase_runtime::init::splitmix64;
use erase_runtime::program::schedule::ScheduleKind;

use super::stepper::{plan_graph, GraphPlan, StepSchedule, StepTimes, Stepper};

/// Byte-level tokens.
pub const VOCAB: usize = 256;

/// The model's sizes.
#[derive(Clone, Debug, PartialEq)]
pub struct NanoConfig {
    /// Tokens per sequence (context length).
    pub seq: usize,
    /// Model width `D`.
    pub width: usize,
    /// Attention heads; `width / heads` must be 32 or 64 (the CUDA attention kernels).
    pub heads: usize,
    /// Transformer blocks, at least 3 (one segment each at least).
    pub layers: usize,
    /// Sequences per step.
    pub batch: usize,
    /// Weight of each local loss.
    pub aux_weight: f64,
}

impl Default for NanoConfig {
    /// CPU-sized: 64 tokens, width 64 (2 heads of 32), 3 blocks, 16 sequences a step.
    fn default() -> Self {
        NanoConfig {
            seq: 64,
            width: 64,
            heads: 2,
            layers: 3,
            batch: 16,
            aux_weight: 1.0,
        }
    }
}

impl NanoConfig {
    pub fn validate(&self) -> Result<()> {
        ensure!(
            self.seq >= 2 && self.batch >= 1,
            "nanochat: --seq must be at least 2 and --batch at least 1"
        );
        ensure!(
            self.layers >= 3,
            "nanochat: {} layer(s); the two detach points need at least 3 blocks",
            self.layers
        );
        ensure!(
            self.heads >= 1 && self.width.is_multiple_of(self.heads),
            "nanochat: {} heads do not divide width {}",
            self.heads,
            self.width
        );
        let dh = self.width / self.heads;
        ensure!(
            dh == 32 || dh == 64,
            "nanochat: head dim width/heads = {}/{} = {dh}; the CUDA attention kernels take 32 or 64",
            self.width,
            self.heads
        );
        ensure!(
            self.aux_weight.is_finite() && self.aux_weight >= 0.0,
            "nanochat: the local-loss weight must be finite and non-negative"
        );
        Ok(())
    }

    /// The blocks of segment `k` (0..3).
    pub fn segment(&self, k: usize) -> std::ops::Range<usize> {
        let at = |k: usize| (k * self.layers + 1) / 3;
        at(k)..at(k + 1)
    }
}

/// The forward graph with its losses registered.
pub struct NanoChat {
    pub cfg: NanoConfig,
    pub graph: Graph,
    /// i32 `[B·S]`: the input bytes.
    pub ids: Tensor,
    /// i32 `[B·S + 1]`: `0, 1, .., B·S` (one id per bag).
    pub offsets: Tensor,
    /// i32 `[B·S]`: the next bytes.
    pub targets: Tensor,
    /// The main head's logits `[B·S, 256]`.
    pub logits: Tensor,
    pub main_loss: Tensor,
    /// The local losses of segments 0 and 1.
    pub aux_losses: Vec<Tensor>,
}

/// Pre-LN attention and MLP block on `[B, S, D]`.
fn block(g: &mut Graph, x: Tensor, cfg: &NanoConfig) -> Result<Tensor> {
    let d = cfg.width;
    let h = g.layer_norm(x)?;
    let qkv = g.linear(h, 3 * d)?;
    let a = g.attention_packed(qkv, cfg.heads, true)?;
    let o = g.linear(a, d)?;
    let x = g.add(x, o)?;
    let h = g.layer_norm(x)?;
    let m = g.linear(h, 4 * d)?;
    let m = g.gelu(m)?;
    let m = g.linear(m, d)?;
    Ok(g.add(x, m)?)
}

/// LayerNorm, linear to the vocabulary, cross-entropy with the next bytes: (logits, loss).
fn lm_head(
    g: &mut Graph,
    x: Tensor,
    targets: Tensor,
    cfg: &NanoConfig,
) -> Result<(Tensor, Tensor)> {
    let h = g.layer_norm(x)?;
    let l = g.linear(h, VOCAB)?;
    let l = g.reshape(l, &[cfg.batch * cfg.seq, VOCAB])?;
    let l = g.set_name(l, "logits");
    let ce = g.softmax_cross_entropy(l, targets)?;
    Ok((l, g.set_name(ce, "loss")))
}

/// Builds the forward graph of `cfg` (f32).
pub fn build(cfg: &NanoConfig) -> Result<NanoChat> {
    cfg.validate()?;
    let (b, s, d) = (cfg.batch, cfg.seq, cfg.width);
    let mut g = Graph::new(DType::F32);
    let ids = g.input("ids", &[b * s], DType::I32)?;
    let offsets = g.input("offsets", &[b * s + 1], DType::I32)?;
    let targets = g.input("targets", &[b * s], DType::I32)?;
    let mut x = g.scoped("seg0", |g| -> Result<Tensor> {
        g.scoped("embed", |g| {
            let table = g.embedding_tables("tok_emb", &[VOCAB], d)?;
            let pos = g.param("pos_emb", &[s, d], Init::Normal { std: 0.02 })?;
            let e = g.embedding_bag(table, ids, offsets, &[VOCAB])?;
            let e = g.reshape(e, &[b, s, d])?;
            Ok(g.add(e, pos)?)
        })
    })?;
    let mut aux_losses = Vec::new();
    let mut out = None;
    for k in 0..3 {
        let seg = format!("seg{k}");
        x = g.scoped(&seg, |g| -> Result<Tensor> {
            let mut x = if k > 0 { g.detach(x)? } else { x };
            for i in cfg.segment(k) {
                x = g.scoped(&format!("block{i}"), |g| block(g, x, cfg))?;
            }
            let (l, ce) = g.scoped("head", |g| lm_head(g, x, targets, cfg))?;
            if k < 2 {
                g.loss(ce, cfg.aux_weight)?;
                aux_losses.push(ce);
            } else {
                g.loss(ce, 1.0)?;
                out = Some((l, ce));
            }
            Ok(x)
        })?;
    }
    let Some((logits, main_loss)) = out else {
        bail!("internal error: no main head");
    };
    Ok(NanoChat {
        cfg: cfg.clone(),
        graph: g,
        ids,
        offsets,
        targets,
        logits,
        main_loss,
        aux_losses,
    })
}

/// The model, planned.
pub struct NanoPlan {
    pub plan: GraphPlan,
    pub cfg: NanoConfig,
    pub ids: Tensor,
    pub offsets: Tensor,
    pub targets: Tensor,
    pub logits: Tensor,
    pub main_loss: Tensor,
    pub aux_losses: Vec<Tensor>,
}

/// Builds and plans the model: `kind` [`ScheduleKind::Early`] with 2 side streams is the
/// ERASE schedule on three streams.
pub fn plan(
    cfg: &NanoConfig,
    opt: &OptimizerConfig,
    kind: ScheduleKind,
    side_streams: usize,
) -> Result<NanoPlan> {
    plan_with(
        cfg,
        opt,
        &StepSchedule {
            kind,
            side_streams,
            occupancy: crate::train::Occupancy::Auto,
        },
    )
}

/// [`plan`] with every scheduling choice, the occupancy rule included.
pub fn plan_with(
    cfg: &NanoConfig,
    opt: &OptimizerConfig,
    sched: &StepSchedule,
) -> Result<NanoPlan> {
    let m = build(cfg).context("building nanochat")?;
    let mut keep = vec![m.logits, m.main_loss];
    keep.extend(&m.aux_losses);
    let plan = plan_graph(m.graph, opt, sched, &keep)?;
    Ok(NanoPlan {
        plan,
        cfg: m.cfg,
        ids: m.ids,
        offsets: m.offsets,
        targets: m.targets,
        logits: m.logits,
        main_loss: m.main_loss,
        aux_losses: m.aux_losses,
    })
}

/// The bytes of a text file; an error names the file if it cannot be read or is empty.
pub fn load_text(path: &Path) -> Result<Vec<u8>> {
    let b = std::fs::read(path).with_context(|| format!("cannot read text {}", path.display()))?;
    ensure!(!b.is_empty(), "text {} is empty", path.display());
    Ok(b)
}

/// One training step's results.
#[derive(Clone, Debug)]
pub struct NanoStep {
    /// The main (last segment's) loss, nats per byte.
    pub loss: f64,
    /// The local losses of segments 0 and 1.
    pub aux: Vec<f64>,
    pub times: StepTimes,
}

/// Training on a byte string: each step `B` windows at pseudo-random offsets.
pub struct NanoTrainer<'a> {
    pub m: &'a NanoPlan,
    stepper: Stepper<'a>,
    text: &'a [u8],
    seed: u64,
    ids: Vec<i32>,
    targets: Vec<i32>,
    /// Steps done.
    pub step: usize,
}

impl<'a> NanoTrainer<'a> {
    /// Parameters from `seed`, windows from `data_seed`. The text needs `seq + 1` bytes.
    pub fn new(
        m: &'a NanoPlan,
        text: &'a [u8],
        dev: Option<&'a CudaDevice>,
        seed: u64,
        data_seed: u64,
        threads: usize,
    ) -> Result<Self> {
        let (b, s) = (m.cfg.batch, m.cfg.seq);
        ensure!(
            text.len() > s,
            "the text has {} bytes; sequences of {s} tokens need at least {}",
            text.len(),
            s + 1
        );
        let mut stepper = Stepper::new(&m.plan, dev, seed, threads)?;
        let offsets: Vec<i32> = (0..=(b * s) as i32).collect();
        stepper.feed(m.offsets, Buffer::I32(offsets))?;
        Ok(NanoTrainer {
            m,
            stepper,
            text,
            seed: data_seed,
            ids: vec![0; b * s],
            targets: vec![0; b * s],
            step: 0,
        })
    }

    /// The `i`-th window start of step `step`.
    fn window(&self, step: usize, i: usize) -> usize {
        let starts = (self.text.len() - self.m.cfg.seq) as u64;
        let r = splitmix64(splitmix64(self.seed) ^ ((step * self.m.cfg.batch + i) as u64));
        (r % starts) as usize
    }

    /// One step on the next batch. A non-finite loss is an error.
    /// Marks every launch of the steps from now on (CUDA), for [`NanoTrainer::last_trace`].
    pub fn trace_all(&mut self) -> Result<()> {
        self.stepper.trace_all()
    }

    /// The measured trace of the last step, after [`NanoTrainer::trace_all`].
    pub fn last_trace(&self, step: usize) -> Result<erase_runtime::trace::Trace> {
        self.stepper.last_trace(&self.m.plan, step)
    }

    pub fn train_step(&mut self) -> Result<NanoStep> {
        let (b, s) = (self.m.cfg.batch, self.m.cfg.seq);
        for i in 0..b {
            let o = self.window(self.step, i);
            for t in 0..s {
                self.ids[i * s + t] = i32::from(self.text[o + t]);
                self.targets[i * s + t] = i32::from(self.text[o + t + 1]);
            }
        }
        self.stepper
            .feed(self.m.ids, Buffer::I32(self.ids.clone()))?;
        self.stepper
            .feed(self.m.targets, Buffer::I32(self.targets.clone()))?;
        let step = self.step;
        let times = self
            .stepper
            .step()
            .with_context(|| format!("step {step}"))?;
        let loss = self.stepper.scalar(self.m.main_loss)?;
        let mut aux = Vec::new();
        for &t in &self.m.aux_losses {
            aux.push(self.stepper.scalar(t)?);
        }
        if let Some(bad) = std::iter::once(loss)
            .chain(aux.iter().copied())
            .find(|l| !l.is_finite())
        {
            bail!("step {step}: a loss is {bad}; training stopped");
        }
        self.step += 1;
        Ok(NanoStep { loss, aux, times })
    }

    /// Greedy continuation of `prompt` by `n` bytes (forward only; the context is the last
    /// `seq` bytes).
    pub fn generate(&mut self, prompt: &[u8], n: usize) -> Result<Vec<u8>> {
        ensure!(!prompt.is_empty(), "generation needs a non-empty prompt");
        let s = self.m.cfg.seq;
        let mut ctx = prompt.to_vec();
        let mut out = Vec::with_capacity(n);
        let mut ids = vec![0i32; self.ids.len()];
        for _ in 0..n {
            let w = &ctx[ctx.len().saturating_sub(s)..];
            for (t, &c) in w.iter().enumerate() {
                ids[t] = i32::from(c);
            }
            self.stepper.feed(self.m.ids, Buffer::I32(ids.clone()))?;
            self.stepper.forward()?;
            let logits = self.stepper.get(self.m.logits)?.to_f64();
            let row = &logits[(w.len() - 1) * VOCAB..w.len() * VOCAB];
            let next = (0..VOCAB)
                .max_by(|&a, &c| row[a].total_cmp(&row[c]).then(c.cmp(&a)))
                .unwrap_or(0) as u8;
            out.push(next);
            ctx.push(next);
        }
        Ok(out)
    }
}
