//! The CPU reference of the attention ops: fused attention and its gradient.

use super::*;

/// Fused attention and its gradient.
pub(super) fn exec_attention<T: Elem>(
    call: &NodeCall,
    ins: &[&Buffer],
    outs: &mut [Buffer],
    _upd: &mut [Buffer],
) -> Result<(), String> {
    let ish = |i: usize| call.in_shapes[i];
    match call.op {
        Op::Attention {
            heads,
            causal,
            packed: true,
        } => {
            let d = ish(0).dims();
            let a = AttnDims {
                s: d[1],
                heads: *heads,
                dh: d[2] / 3 / heads,
                causal: *causal,
                bf16: call.bf16_gemm,
            };
            let [q, k, v] = unpack3(get::<T>(ins[0], "qkv")?, d[2] / 3);
            let [o, lse] = outs else {
                return Err("expected two outputs".into());
            };
            kernels::attention(&q, &k, &v, out(o)?, out(lse)?, a);
        }
        Op::AttentionGrad {
            heads,
            causal,
            packed: true,
        } => {
            let d = ish(1).dims();
            let w = d[2] / 3;
            let a = AttnDims {
                s: d[1],
                heads: *heads,
                dh: w / heads,
                causal: *causal,
                bf16: call.bf16_gemm,
            };
            let [q, k, v] = unpack3(get::<T>(ins[1], "qkv")?, w);
            let x = AttnGradIn {
                d_o: get::<T>(ins[0], "do")?,
                q: &q,
                k: &k,
                v: &v,
                o: get::<T>(ins[2], "o")?,
                lse: get::<T>(ins[3], "lse")?,
            };
            let n = q.len();
            let (mut dq, mut dk, mut dv) = (vec![T::ZERO; n], vec![T::ZERO; n], vec![T::ZERO; n]);
            kernels::attention_grad(x, &mut dq, &mut dk, &mut dv, a);
            pack3([&dq, &dk, &dv], w, out(&mut outs[0])?);
        }
        Op::Attention { heads, causal, .. } => {
            let d = ish(0).dims();
            let a = AttnDims {
                s: d[1],
                heads: *heads,
                dh: d[2] / heads,
                causal: *causal,
                bf16: call.bf16_gemm,
            };
            let (q, k, v) = (
                get::<T>(ins[0], "q")?,
                get::<T>(ins[1], "k")?,
                get::<T>(ins[2], "v")?,
            );
            let [o, lse] = outs else {
                return Err("expected two outputs".into());
            };
            kernels::attention(q, k, v, out(o)?, out(lse)?, a);
        }
        Op::AttentionGrad { heads, causal, .. } => {
            let d = ish(1).dims();
            let a = AttnDims {
                s: d[1],
                heads: *heads,
                dh: d[2] / heads,
                causal: *causal,
                bf16: call.bf16_gemm,
            };
            let x = AttnGradIn {
                d_o: get::<T>(ins[0], "do")?,
                q: get::<T>(ins[1], "q")?,
                k: get::<T>(ins[2], "k")?,
                v: get::<T>(ins[3], "v")?,
                o: get::<T>(ins[4], "o")?,
                lse: get::<T>(ins[5], "lse")?,
            };
            let (dq, dk, dv) = three::<T>(outs)?;
            kernels::attention_grad(x, dq, dk, dv, a);
        }
        other => {
            return Err(format!(
                "attention: no CPU implementation of {}",
                other.name()
            ))
        }
    }
    Ok(())
}
