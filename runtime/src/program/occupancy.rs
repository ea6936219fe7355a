//! The occupancy model: how much of the device one launch occupies, and for how long.
//!
//! A launch's footprint is its grid against one wave (SMs x CTAs per SM, the latter from
//! the kernel's registers, shared memory and threads, as the CUDA occupancy calculator
//! computes it). Its duration comes from a roofline: FLOPs against the tensor-core or
//! CUDA-core peak, bytes against memory bandwidth, plus a launch latency. The rule the
//! scheduler applies: a launch that fills at least one full wave AND runs longer than a
//! threshold is not overlapped with other streams, since sharing a full device only
//! adds contention; short full-wave kernels are left alone or the rule would serialize
//! the whole step.

use erase_ops::LaunchSpec;

/// The H200's contention costs, measured there (BENCHMARKS.md, "The occupancy model",
/// 2026-12-02): two device-filling GEMMs of the CTR step side by side take 3.6 % less
/// than one after the other, a GEMM beside a memory-bound add 4.7 % less, two adds
/// 1.5 % less (at 4096 rows; at 16384 about a third of that). Sharing the device fills
/// the tails of each other's waves: on this device ordering never pays.
pub const H200_CONTENTION: [f64; 3] = [-0.036, -0.047, -0.015];

/// The pipelined GEMM tiles on the H200 (`DeviceModel::gemm_k_step_s`): a CTA's k step
/// of 64 takes 0.11 µs in a tile 64 wide and 0.208 µs in one 128 wide, and the epilogue
/// moves the op's bytes at 2.04 TB/s, beside the 6 µs a launch of the measured rates.
/// Fitted by least squares to the launches of these kernels in the traced serial steps of
/// the spec model and DCNv2 at batch 4096 (build 3fbcdc5, 2026-12-04; the 77 of
/// `runtime/tests/data/h200-gemm-launches.tsv`, less the 4 with a rounding pass of their
/// own; BENCHMARKS.md, "The simulator against today's steps"): 10.6 % off a launch on
/// average, where the rates by kind (250 TFLOP/s, 350 on bf16 copies) were 43 % off
/// (0.6x to 2x). The traced times include the events' few µs a launch.
pub const H200_GEMM_K_STEP_S: [f64; 2] = [0.110e-6, 0.208e-6];
/// See [`H200_GEMM_K_STEP_S`].
pub const H200_GEMM_EPILOGUE_BW: f64 = 2.04e12;

/// What the model needs to know about a device.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceModel {
    pub name: &'static str,
    pub sms: u32,
    pub regs_per_sm: u32,
    /// Register allocation granularity per warp.
    pub reg_alloc_unit: u32,
    pub smem_per_sm: u32,
    /// Shared memory the driver reserves per CTA.
    pub smem_reserved_per_cta: u32,
    pub max_ctas_per_sm: u32,
    pub max_threads_per_sm: u32,
    /// Dense bf16 tensor-core FLOP/s that a good GEMM reaches.
    pub tensor_flops: f64,
    /// The same for a GEMM that reads bf16 copies of its operands in place
    /// (`LaunchSpec::copies`: no rounding pass).
    pub tensor_flops_copies: f64,
    /// The fused attention kernels' FLOP/s.
    pub attention_flops: f64,
    /// FP32 CUDA-core FLOP/s.
    pub simt_flops: f64,
    /// Reachable memory bandwidth, bytes/s.
    pub mem_bw: f64,
    /// Fixed cost of one kernel (launch and tail), seconds.
    pub launch_s: f64,
    /// Launches longer than this that fill a wave are not overlapped (the rule).
    pub exclusive_threshold_s: f64,
    /// What two launches that together oversubscribe the device pay for sharing it, as a
    /// share of their time one after the other, by what bounds them (see
    /// [`DeviceModel::memory_bound`]): `[compute with compute, compute with memory, memory
    /// with memory]`. 0 conserves the device's work (each runs at its share); above 0 they
    /// contend (caches, the tails of their waves); below 0 they overlap usefully.
    /// Measured pair by pair (`cargo bench --bench kernels -- --contention`).
    pub contention: [f64; 3],
    /// The pipelined GEMM tiles' model (`gemm_bf16t_*`, `gemm_bf16p_*`, `gemm_bf16w_*`,
    /// their tile in the kernel's name): seconds of one CTA's k step of 64 for tiles 64
    /// and 128 wide (256: twice 128's), each SM taking its share of the grid's CTAs one
    /// after the other (two at a time, as these kernels run, sharing its L2 bandwidth).
    /// `None`: those GEMMs are priced at `tensor_flops` as the others.
    pub gemm_k_step_s: Option<[f64; 2]>,
    /// With `gemm_k_step_s`: the rate at which such a GEMM's epilogue moves its bytes
    /// (the output, a residual or mask, a bf16 copy), bytes/s, not overlapped with its
    /// k steps.
    pub gemm_epilogue_bw: f64,
}

/// A pipelined GEMM kernel's tile (rows, columns) from its name (`gemm_bf16t_km_128x64_k2`),
/// or `None` for every other kernel.
pub fn pipelined_gemm_tile(kernel: &str) -> Option<(u32, u32)> {
    let rest = ["gemm_bf16t_", "gemm_bf16p_", "gemm_bf16w_"]
        .iter()
        .find_map(|p| kernel.strip_prefix(p))?;
    rest.split('_').find_map(|part| {
        let (m, n) = part.split_once('x')?;
        Some((m.parse().ok()?, n.parse().ok()?))
    })
}

impl DeviceModel {
    /// One NVIDIA H200 (SXM): 132 SMs; peaks as measured by the anchor's runs
    /// (cuBLAS bf16 736 TFLOP/s at 4096³, copy 4.22 TB/s).
    pub fn h200() -> Self {
        DeviceModel {
            name: "NVIDIA H200 (peak rates: cuBLAS's 736 TFLOP/s, a copy's 4.22 TB/s)",
            sms: 132,
            regs_per_sm: 65536,
            reg_alloc_unit: 256,
            smem_per_sm: 233_472,
            smem_reserved_per_cta: 1024,
            max_ctas_per_sm: 32,
            max_threads_per_sm: 2048,
            tensor_flops: 736e12,
            tensor_flops_copies: 736e12,
            attention_flops: 736e12,
            simt_flops: 60e12,
            mem_bw: 4.22e12,
            launch_s: 2.5e-6,
            exclusive_threshold_s: 20e-6,
            contention: H200_CONTENTION,
            gemm_k_step_s: None,
            gemm_epilogue_bw: 4.22e12,
        }
    }

    /// An H200 with the rates Erase's own kernels reach on it (BENCHMARKS.md, 2026-12-02):
    /// a GEMM that rounds its f32 operands itself at 250 TFLOP/s (the CTR model's
    /// 4096 x 1024 x 1728 forward measured 290 alone, nanochat's GEMMs 179-266), a GEMM
    /// reading bf16 copies in place at 350 TFLOP/s, the fused attention at 150 (nanochat's
    /// measured 119-124 alone, more beside other work), memory-bound kernels at 3.6 TB/s
    /// and 6 µs a launch (its latency and its last wave's tail). Fitted to the CTR step's
    /// three variants at batch 4096 and 16384 and to nanochat's ERASE and serial steps:
    /// every one within 5 %, and mlp30's step within 8 %. What the simulator predicts with
    /// until the kernels reach the peaks.
    pub fn h200_measured() -> Self {
        DeviceModel {
            name: "NVIDIA H200 (Erase's measured kernel rates)",
            tensor_flops: 250e12,
            tensor_flops_copies: 350e12,
            attention_flops: 150e12,
            mem_bw: 3.6e12,
            launch_s: 6e-6,
            gemm_k_step_s: Some(H200_GEMM_K_STEP_S),
            gemm_epilogue_bw: H200_GEMM_EPILOGUE_BW,
            ..Self::h200()
        }
    }

    /// The CPU backend: one "SM" that nothing fills; streams are not concurrent.
    pub fn cpu() -> Self {
        DeviceModel {
            name: "CPU",
            sms: 1,
            regs_per_sm: u32::MAX,
            reg_alloc_unit: 1,
            smem_per_sm: u32::MAX,
            smem_reserved_per_cta: 0,
            max_ctas_per_sm: u32::MAX,
            max_threads_per_sm: u32::MAX,
            tensor_flops: 50e9,
            tensor_flops_copies: 50e9,
            attention_flops: 50e9,
            simt_flops: 50e9,
            mem_bw: 10e9,
            launch_s: 1e-6,
            exclusive_threshold_s: f64::INFINITY,
            contention: [0.0; 3],
            gemm_k_step_s: None,
            gemm_epilogue_bw: 10e9,
        }
    }

    /// CTAs of `spec`'s kernel that fit on one SM at once.
    pub fn ctas_per_sm(&self, spec: &LaunchSpec) -> u32 {
        let threads = spec.block.max(1);
        let warps = threads.div_ceil(32);
        let by_threads = self.max_threads_per_sm / (warps * 32);
        // registers are allocated per warp, in units, from the four quarters of the SM's
        // register file: a warp lives in one quarter
        let regs_per_warp =
            (spec.regs_per_thread.max(1) * 32).div_ceil(self.reg_alloc_unit) * self.reg_alloc_unit;
        let warps_by_regs = 4 * ((self.regs_per_sm / 4) / regs_per_warp.max(1));
        let by_regs = warps_by_regs / warps.max(1);
        let by_smem = if spec.smem_bytes == 0 {
            u32::MAX
        } else {
            self.smem_per_sm / (spec.smem_bytes + self.smem_reserved_per_cta)
        };
        self.max_ctas_per_sm
            .min(by_threads)
            .min(by_regs)
            .min(by_smem)
    }

    /// CTAs that run at once on the whole device: one wave.
    pub fn wave(&self, spec: &LaunchSpec) -> u64 {
        u64::from(self.sms) * u64::from(self.ctas_per_sm(spec).max(1))
    }

    /// The fraction of the device the launch occupies while it runs (1 = at least a wave).
    pub fn footprint(&self, spec: &LaunchSpec) -> f64 {
        (spec.grid as f64 / self.wave(spec) as f64).min(1.0)
    }

    /// The FLOP rate the launch's kernel reaches, by its kind.
    pub fn flop_rate(&self, spec: &LaunchSpec) -> f64 {
        if spec.attention {
            self.attention_flops
        } else if spec.copies {
            self.tensor_flops_copies
        } else if spec.tensor_core {
            self.tensor_flops
        } else {
            self.simt_flops
        }
    }

    /// Predicted time of the launch running alone.
    pub fn duration_s(&self, spec: &LaunchSpec) -> f64 {
        if let (Some(k_step), Some((bm, bn))) =
            (self.gemm_k_step_s, pipelined_gemm_tile(spec.kernel))
        {
            // each CTA's k steps (the FLOPs over its tile's k step of 64), the SMs' CTAs
            // one after the other, then the epilogue's bytes
            let grid = spec.grid.max(1) as f64;
            let k_steps = spec.flops / (2.0 * f64::from(bm) * f64::from(bn) * 64.0 * grid);
            let per_sm = spec.grid.max(1).div_ceil(u64::from(self.sms.max(1))) as f64;
            let step = match bn {
                0..=64 => k_step[0],
                65..=128 => k_step[1],
                _ => k_step[1] * f64::from(bn) / 128.0,
            };
            let launches = 1.0 + f64::from(spec.extra_launches);
            return launches * self.launch_s
                + per_sm * k_steps * step
                + spec.bytes / self.gemm_epilogue_bw;
        }
        let peak = self.flop_rate(spec).max(1.0);
        let work = (spec.flops / peak).max(spec.bytes / self.mem_bw);
        let wave = self.wave(spec) as f64;
        let full = spec.grid.max(1) as f64 / wave;
        let time = if full >= 1.0 {
            // a partial last wave leaves SMs idle: the time stretches by waves / full
            work * full.ceil() / full
        } else {
            // a grid smaller than a wave gets only its share of the device
            work / full
        };
        self.launch_s + time
    }

    /// Whether the launch alone is bound by memory bandwidth rather than arithmetic.
    pub fn memory_bound(&self, spec: &LaunchSpec) -> bool {
        let peak = self.flop_rate(spec).max(1.0);
        spec.bytes / self.mem_bw > spec.flops / peak
    }

    /// The contention cost of two launches sharing the device, by whether each is
    /// memory-bound.
    pub fn pair_cost(&self, a_memory: bool, b_memory: bool) -> f64 {
        self.contention[usize::from(a_memory) + usize::from(b_memory)]
    }

    /// The rule: fills a full wave and runs long enough that overlap would only contend.
    pub fn is_exclusive(&self, spec: &LaunchSpec) -> bool {
        spec.grid >= self.wave(spec) && self.duration_s(spec) > self.exclusive_threshold_s
    }
}

#[cfg(test)]
mod tests {
    use super::DeviceModel;
    use erase_graph::{DType, Op, Shape};
    use erase_ops::launch_spec;

    #[test]
    fn gemms_on_bf16_copies_are_priced_at_their_own_rate() {
        let (x, w, y) = (
            Shape::new(&[4096, 1728]),
            Shape::new(&[1024, 1728]),
            Shape::new(&[4096, 1024]),
        );
        let op = Op::Linear {
            bias: false,
            relu: false,
        };
        let f32_spec = launch_spec(&op, &[&x, &w], &[&y], DType::F32).expect("a launch");
        let copies = launch_spec(&op, &[&x, &w], &[&y], DType::Bf16).expect("a launch");
        assert!(!f32_spec.copies && copies.copies);
        assert_eq!(f32_spec.flops, copies.flops);
        // FLOP-bound at both rates: the time in the inverse ratio of the rates (plus the
        // launch)
        let m = DeviceModel::h200_measured();
        assert!(m.tensor_flops_copies > m.tensor_flops);
        let (a, b) = (m.duration_s(&f32_spec), m.duration_s(&copies));
        let ratio = (a - m.launch_s) / (b - m.launch_s);
        let want = m.tensor_flops_copies / m.tensor_flops;
        assert!((ratio - want).abs() < 1e-9, "{a} s against {b} s");
        // an elementwise op of bf16 operands is not a GEMM on copies
        let cast = launch_spec(
            &Op::RoundBf16 { col_sums: false },
            &[&x],
            &[&x],
            DType::Bf16,
        )
        .expect("a launch");
        assert!(!cast.copies);
    }

    /// A launch's bytes count each operand at its own element size: the cross update
    /// that writes its output's bf16 copy beside it moves 18 bytes an element, not 20.
    #[test]
    fn bytes_count_each_operands_element_size() {
        use erase_ops::launch_spec_typed;
        let s = Shape::new(&[4096, 3456]);
        let n = s.numel() as f64;
        let f = DType::F32;
        let plain = launch_spec(&Op::MulAdd, &[&s, &s, &s], &[&s, &s], f).expect("a launch");
        let typed = launch_spec_typed(
            &Op::MulAdd,
            &[&s, &s, &s],
            &[f, f, f],
            &[&s, &s],
            &[f, DType::Bf16],
            f,
        )
        .expect("a launch");
        assert_eq!(plain.bytes, 20.0 * n);
        assert_eq!(typed.bytes, 18.0 * n);
        // types past the lists' end are the op's
        let short = launch_spec_typed(&Op::MulAdd, &[&s, &s, &s], &[], &[&s, &s], &[], f)
            .expect("a launch");
        assert_eq!(short.bytes, plain.bytes);
    }

    #[test]
    fn pipelined_gemm_tiles_are_read_from_the_kernels_names() {
        use super::pipelined_gemm_tile as tile;
        assert_eq!(tile("gemm_bf16t_km_128x64_k2"), Some((128, 64)));
        assert_eq!(tile("gemm_bf16t_128x128"), Some((128, 128)));
        assert_eq!(tile("gemm_bf16p_128x256_k4"), Some((128, 256)));
        assert_eq!(tile("gemm_bf16w_c_128x64"), Some((128, 64)));
        for other in [
            "gemm_bf16_nt_64x64",
            "gemm_tall_n64_c",
            "gemm_thin_m1",
            "gemm_linear",
        ] {
            assert_eq!(tile(other), None, "{other}");
        }
    }

    /// The per-CTA model of the pipelined GEMMs against their launches in traced serial
    /// steps on an H200 (the spec model's and DCNv2's, `tests/data/h200-gemm-launches.tsv`):
    /// within 12 % a launch on average, and under half the error of pricing them at one
    /// device-wide rate.
    #[test]
    fn the_pipelined_gemms_model_fits_their_measured_launches() {
        let data = include_str!("../../tests/data/h200-gemm-launches.tsv");
        let m = DeviceModel::h200_measured();
        let rate = DeviceModel {
            gemm_k_step_s: None,
            ..m.clone()
        };
        let (mut err, mut err_rate, mut n) = (0.0, 0.0, 0);
        for line in data.lines().filter(|l| !l.starts_with('#')) {
            let f: Vec<&str> = line.split('\t').collect();
            assert_eq!(f.len(), 8, "{line}");
            let kernel: &'static str = Box::leak(f[2].to_string().into_boxed_str());
            let spec = erase_ops::LaunchSpec {
                kernel,
                grid: f[4].parse().expect("grid"),
                block: 256,
                regs_per_thread: 102,
                smem_bytes: 3 * (128 + 128) * 72 * 2 + 1024,
                flops: f[5].parse::<f64>().expect("GFLOP") * 1e9,
                bytes: f[6].parse::<f64>().expect("MB") * 1e6,
                tensor_core: true,
                copies: false,
                attention: false,
                extra_launches: f[3].parse().expect("extra launches"),
            };
            let measured = f[7].parse::<f64>().expect("µs") * 1e-6;
            err += (m.duration_s(&spec) / measured - 1.0).abs();
            err_rate += (rate.duration_s(&spec) / measured - 1.0).abs();
            n += 1;
        }
        assert!(n >= 70, "{n} launches");
        let (err, err_rate) = (err / n as f64, err_rate / n as f64);
        eprintln!("{n} launches: mean error {err:.3} a launch, {err_rate:.3} at one rate");
        assert!(err <= 0.12, "mean error {err:.3} a launch");
        assert!(
            err < 0.5 * err_rate,
            "{err:.3} against {err_rate:.3} at one rate"
        );
    }
}
