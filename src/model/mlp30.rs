//! The ERASE paper's sanity check: a deep MLP on MNIST (`examples/mlp30.rs`), the same
//! model as `shared/anchors/torch_mlp30.py` so GPU timings can be compared with it.
//!
//! ```text
//! h_0 = x                                             [B, 784]
//! h_i = relu(hidden_i(h_{i-1}'))      i = 1..L        [B, W]     h' = detach(h) when cut
//! logits = final(h_L')                                [B, 10]    main loss: CE(logits, y)
//! local_i = CE(head_i(h_i), y)        i = 1..L        (detached / erase only, weight 1)
//! ```
//!
//! Three modes: `conventional` (no cuts, no heads: one backward at the end), `detached`
//! (every layer's input detached, a local linear head and cross-entropy per hidden layer;
//! the output layer reads the detached last hidden layer, so it is one more local head,
//! as in `torch_mlp30.py`) and `erase` (the same graph as `detached`, scheduled with each
//! layer's backward started right after its local loss, on a pool of side streams).
//! `detached` and `erase` compute the same function, so they give the same bits; only
//! the schedule differs.
//!
//! Parameters are created in PyTorch's `model.parameters()` order (hidden layers, final,
//! heads), so every mode starts from the same hidden and final weights. Heads and the
//! output layer get PyTorch's default `Linear` init (weight and bias uniform in
//! `±1/sqrt(fan_in)`); hidden layers get He's (weight uniform in `±sqrt(6/fan_in)`, bias
//! 0) by default: under PyTorch's, the input's signal shrinks by about 2.4x a layer and
//! the conventional 30-layer model stays at chance for an epoch ([`HiddenInit::Torch`]
//! keeps the anchor's init).
//!
//! It is planned and run by the pieces it shares with `nanochat`: [`super::stepper`].

use std::fmt;
use std::str::FromStr;

use anyhow::{bail, ensure, Context, Result};
use erase_graph::{DType, Graph, Init, OptimizerConfig, Tensor};
use erase_ops::Buffer;
use erase_runtime::cuda::CudaDevice;
use erase_runtime::program::schedule::ScheduleKind;

use crate::data::mnist::{self, Mnist, CLASSES, PIXELS};

use super::stepper::{plan_graph, GraphPlan, StepSchedule, StepTimes, Stepper};

/// How the MLP is trained.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Mode {
    /// Full backprop of the final loss, one backward at the end.
    Conventional,
    /// FF-style: every layer cut off by `detach`, a local head and loss per layer; the
    /// backward still runs at the end, on one stream.
    Detached,
    /// The `detached` graph with each layer's backward started early on a side stream.
    #[default]
    Erase,
}

impl Mode {
    pub const ALL: [Mode; 3] = [Mode::Conventional, Mode::Detached, Mode::Erase];

    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Conventional => "conventional",
            Mode::Detached => "detached",
            Mode::Erase => "erase",
        }
    }

    /// True when the graph has the cuts and the local heads.
    pub fn is_detached(self) -> bool {
        self != Mode::Conventional
    }

    /// `erase` schedules early; the others run everything on the main stream.
    pub fn schedule_kind(self) -> ScheduleKind {
        match self {
            Mode::Erase => ScheduleKind::Early,
            Mode::Conventional | Mode::Detached => ScheduleKind::Serial,
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Mode {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "conventional" => Ok(Mode::Conventional),
            "detached" => Ok(Mode::Detached),
            "erase" => Ok(Mode::Erase),
            other => bail!("unknown mode '{other}': expected conventional, detached or erase"),
        }
    }
}

/// The initialisation of the hidden layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum HiddenInit {
    /// He (Kaiming) uniform for ReLU: weight in `±sqrt(6/fan_in)`, bias 0.
    #[default]
    He,
    /// PyTorch's `nn.Linear` default, as `torch_mlp30.py`: weight and bias in
    /// `±1/sqrt(fan_in)`.
    Torch,
}

impl FromStr for HiddenInit {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "he" => Ok(HiddenInit::He),
            "torch" => Ok(HiddenInit::Torch),
            other => bail!("unknown init '{other}': expected he or torch"),
        }
    }
}

/// The model's sizes.
#[derive(Clone, Debug, PartialEq)]
pub struct Mlp30Config {
    pub mode: Mode,
    pub init: HiddenInit,
    /// Hidden width (the paper: 1024).
    pub width: usize,
    /// Hidden layers (the paper: 30).
    pub layers: usize,
    pub batch: usize,
}

impl Default for Mlp30Config {
    /// The paper's model at a CPU-friendly width (256 instead of 1024).
    fn default() -> Self {
        Mlp30Config {
            mode: Mode::Erase,
            init: HiddenInit::He,
            width: 256,
            layers: 30,
            batch: 256,
        }
    }
}

impl Mlp30Config {
    pub fn validate(&self) -> Result<()> {
        ensure!(
            self.width > 0 && self.layers > 0 && self.batch > 0,
            "mlp30: width ({}), layers ({}) and batch ({}) must all be at least 1",
            self.width,
            self.layers,
            self.batch
        );
        Ok(())
    }
}

/// The forward graph with its losses registered.
pub struct Mlp30 {
    pub cfg: Mlp30Config,
    pub graph: Graph,
    /// f32 `[B, 784]`.
    pub image: Tensor,
    /// i32 `[B]`.
    pub label: Tensor,
    /// The output layer's logits `[B, 10]`.
    pub logits: Tensor,
    pub main_loss: Tensor,
    /// One per hidden layer (`detached` / `erase`), in layer order.
    pub local_losses: Vec<Tensor>,
}

/// The weight and bias of an `inp -> out` linear layer, created now.
fn linear_params(
    g: &mut Graph,
    name: &str,
    inp: usize,
    out: usize,
    init: HiddenInit,
) -> Result<(Tensor, Tensor)> {
    let (wi, bi) = match init {
        HiddenInit::He => (
            Init::Uniform {
                bound: (6.0 / inp as f64).sqrt(),
            },
            Init::Zeros,
        ),
        HiddenInit::Torch => {
            let bound = 1.0 / (inp as f64).sqrt();
            (Init::Uniform { bound }, Init::Uniform { bound })
        }
    };
    let w = g.param(&format!("{name}.weight"), &[out, inp], wi)?;
    let b = g.param(&format!("{name}.bias"), &[out], bi)?;
    Ok((w, b))
}

/// Builds the forward graph of `cfg` in `float`.
pub fn build(cfg: &Mlp30Config, float: DType) -> Result<Mlp30> {
    cfg.validate()?;
    let (b, w, l) = (cfg.batch, cfg.width, cfg.layers);
    let mut g = Graph::new(float);
    let image = g.input("image", &[b, PIXELS], float)?;
    let label = g.input("label", &[b], DType::I32)?;
    // parameters first, in PyTorch's order: hidden.i, final, heads.i
    let mut hidden = Vec::with_capacity(l);
    for i in 0..l {
        let inp = if i == 0 { PIXELS } else { w };
        hidden.push(g.scoped(&layer_scope(i), |g| {
            linear_params(g, &format!("hidden.{i}"), inp, w, cfg.init)
        })?);
    }
    let fin = g.scoped("final", |g| {
        linear_params(g, "final", w, CLASSES, HiddenInit::Torch)
    })?;
    let mut heads = Vec::new();
    if cfg.mode.is_detached() {
        for i in 0..l {
            heads.push(g.scoped(&layer_scope(i), |g| {
                linear_params(g, &format!("heads.{i}"), w, CLASSES, HiddenInit::Torch)
            })?);
        }
    }
    let mut h = image;
    let mut local_losses = Vec::new();
    for (i, &(wi, bi)) in hidden.iter().enumerate() {
        h = g.scoped(&layer_scope(i), |g| -> Result<Tensor> {
            let x = if cfg.mode.is_detached() && i > 0 {
                g.detach(h)?
            } else {
                h
            };
            let z = g.linear_with(x, wi, Some(bi))?;
            let a = g.relu(z)?;
            if let Some(&(hw, hb)) = heads.get(i) {
                let logits = g.linear_with(a, hw, Some(hb))?;
                let ce = g.softmax_cross_entropy(logits, label)?;
                g.loss(ce, 1.0)?;
                local_losses.push(g.set_name(ce, "local_loss"));
            }
            Ok(a)
        })?;
    }
    let (logits, main_loss) = g.scoped("final", |g| -> Result<(Tensor, Tensor)> {
        let x = if cfg.mode.is_detached() {
            g.detach(h)?
        } else {
            h
        };
        let logits = g.linear_with(x, fin.0, Some(fin.1))?;
        let logits = g.set_name(logits, "logits");
        let ce = g.softmax_cross_entropy(logits, label)?;
        g.loss(ce, 1.0)?;
        Ok((logits, g.set_name(ce, "loss")))
    })?;
    Ok(Mlp30 {
        cfg: cfg.clone(),
        graph: g,
        image,
        label,
        logits,
        main_loss,
        local_losses,
    })
}

/// The scope of hidden layer `i` (and its head): `layer07`.
pub fn layer_scope(i: usize) -> String {
    format!("layer{i:02}")
}

// ---- training the MLP --------------------------------------------------------------

/// The MLP of `cfg`, planned: `erase` gets the early schedule on `side_streams`.
pub struct Mlp30Plan {
    pub plan: GraphPlan,
    pub cfg: Mlp30Config,
    pub image: Tensor,
    pub label: Tensor,
    pub logits: Tensor,
    pub main_loss: Tensor,
    pub local_losses: Vec<Tensor>,
}

/// Builds and plans the MLP (the occupancy model deciding, as by default).
pub fn plan(cfg: &Mlp30Config, opt: &OptimizerConfig, side_streams: usize) -> Result<Mlp30Plan> {
    plan_with(cfg, opt, side_streams, crate::train::Occupancy::Auto)
}

/// [`plan`] with the occupancy rule `occupancy`.
pub fn plan_with(
    cfg: &Mlp30Config,
    opt: &OptimizerConfig,
    side_streams: usize,
    occupancy: crate::train::Occupancy,
) -> Result<Mlp30Plan> {
    let m = build(cfg, DType::F32).context("building the MLP")?;
    let mut keep = vec![m.logits, m.main_loss];
    keep.extend(&m.local_losses);
    let sched = StepSchedule {
        kind: cfg.mode.schedule_kind(),
        side_streams,
        occupancy,
    };
    let plan = plan_graph(m.graph, opt, &sched, &keep)?;
    Ok(Mlp30Plan {
        plan,
        cfg: m.cfg,
        image: m.image,
        label: m.label,
        logits: m.logits,
        main_loss: m.main_loss,
        local_losses: m.local_losses,
    })
}

/// One training step's results.
#[derive(Clone, Copy, Debug)]
pub struct Mlp30Step {
    /// The output layer's loss.
    pub loss: f64,
    /// Mean of the local losses (NaN for `conventional`).
    pub local_mean: f64,
    pub times: StepTimes,
}

/// Training of one MLP on MNIST: batches in a fresh shuffled order each epoch.
pub struct Mlp30Trainer<'a> {
    pub m: &'a Mlp30Plan,
    stepper: Stepper<'a>,
    seed: u64,
    order: Vec<usize>,
    epoch: usize,
    images: Vec<f32>,
    labels: Vec<i32>,
    /// Steps done.
    pub step: usize,
}

impl<'a> Mlp30Trainer<'a> {
    /// Parameters from `seed`, data order from `data_seed`.
    pub fn new(
        m: &'a Mlp30Plan,
        dev: Option<&'a CudaDevice>,
        seed: u64,
        data_seed: u64,
        threads: usize,
    ) -> Result<Self> {
        let b = m.cfg.batch;
        Ok(Mlp30Trainer {
            m,
            stepper: Stepper::new(&m.plan, dev, seed, threads)?,
            seed: data_seed,
            order: Vec::new(),
            epoch: usize::MAX,
            images: vec![0.0; b * PIXELS],
            labels: vec![0; b],
            step: 0,
        })
    }

    /// Whole batches per epoch of `train`.
    pub fn steps_per_epoch(&self, train: &Mnist) -> usize {
        train.len() / self.m.cfg.batch
    }

    fn feed(&mut self) -> Result<()> {
        let m = self.m;
        self.stepper
            .feed(m.image, Buffer::F32(self.images.clone()))?;
        self.stepper.feed(m.label, Buffer::I32(self.labels.clone()))
    }

    /// One step on the next batch of `train`. A non-finite loss is an error.
    pub fn train_step(&mut self, train: &Mnist) -> Result<Mlp30Step> {
        let b = self.m.cfg.batch;
        let per_epoch = self.steps_per_epoch(train);
        ensure!(
            per_epoch > 0,
            "{} training examples are fewer than one batch of {b}",
            train.len()
        );
        let (e, k) = (self.step / per_epoch, self.step % per_epoch);
        if e != self.epoch {
            self.order = mnist::shuffled(train.len(), self.seed, e as u64);
            self.epoch = e;
        }
        train.fill_batch(
            &self.order[k * b..(k + 1) * b],
            &mut self.images,
            &mut self.labels,
        );
        self.feed()?;
        let step = self.step;
        let times = self
            .stepper
            .step()
            .with_context(|| format!("step {step}"))?;
        let loss = self.stepper.scalar(self.m.main_loss)?;
        ensure!(
            loss.is_finite(),
            "step {step}: the loss is {loss}; training stopped"
        );
        let mut local = Vec::with_capacity(self.m.local_losses.len());
        for &t in &self.m.local_losses {
            local.push(self.stepper.scalar(t)?);
        }
        self.step += 1;
        Ok(Mlp30Step {
            loss,
            local_mean: if local.is_empty() {
                f64::NAN
            } else {
                local.iter().sum::<f64>() / local.len() as f64
            },
            times,
        })
    }

    /// Accuracy of the output layer on every example of `data` (forward only).
    pub fn accuracy(&mut self, data: &Mnist) -> Result<f64> {
        let b = self.m.cfg.batch;
        let mut correct = 0usize;
        let mut first = 0;
        while first < data.len() {
            let real = data.fill_range(first, &mut self.images, &mut self.labels);
            self.feed()?;
            self.stepper.forward()?;
            let logits = self.stepper.get(self.m.logits)?.to_f64();
            for k in 0..real {
                let row = &logits[k * CLASSES..(k + 1) * CLASSES];
                let pred = (0..CLASSES)
                    .max_by(|&a, &c| row[a].total_cmp(&row[c]).then(c.cmp(&a)))
                    .unwrap_or(0);
                correct += usize::from(pred as i32 == self.labels[k]);
            }
            first += b;
        }
        Ok(correct as f64 / data.len().max(1) as f64)
    }

    /// Every parameter's bytes, in creation order (to compare runs bit for bit).
    pub fn param_bytes(&self) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        for p in self.m.plan.graph.params() {
            out.extend_from_slice(self.stepper.get(p)?.bytes());
        }
        Ok(out)
    }
}
