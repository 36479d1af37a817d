"""The fused log-prob's lm-head weight gradient in bf16 over many chunks: one bf16 rounding of a float32 sum.

`FusedTokenLogprobs.backward` sums the weight gradient over all M response rows, one chunk of c rows at a time.
Summed in bf16 that is one bf16 rounding of the whole (V, H) sum per chunk (187 at M = 20480, V = 152064); summed in
float32 it is one, at the end. The reference is float64 from the kernel's own bf16 logits, so the test sees the
backward's arithmetic alone. The measurement, `fused_grad_ratio`, is benchmarks/fused_bf16.py's.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from fused_bf16 import fused_grad_ratio  # noqa: E402  (no pytest there: gpu_check.py runs it on a GPU)


@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_fused_weight_grad_bf16_is_one_rounding_of_an_fp32_sum(tau):
    """bf16 h (M, H) and W (V, H), M = 16384 rows in c = 128-row chunks (128 chunks). Per entry (v, h), to first
    order in the float32 u = 2^-24 (closed by gamma below), with Y = max |z / tau| and
    gz = g_r / tau (1[v = o_r] - p_rv) exact from the bf16 logits z:

    dL/dz in float32. Forward logsumexp of y = fl(z / tau) (<= u Y off), shifted by its max (<= 2 u Y), exp (the CPU's
    vectorised exp and log: <= 1 ulp, 2 u), a sum of V positive terms ((V - 1) u), log (<= 2 u log V), + max
    (u |lse| <= u (Y + log V)): |d lse| <= u (V + 1 + 4 Y + 3 log V). The backward's y - lse adds u Y (its y) and
    u |y - lse| <= u (2 Y + log V), exp 2 u: p's relative error <= n_p u, n_p = V + 3 + 7 Y + 4 log V. Then 1 - p,
    g / tau and the product: 3 u |gz|. So |gz32 - gz| <= n_p u (|gz| + p |g| / tau)  (n_p >= 3).

    The sum over rows. Each product gz32 * h (h exact in float32) is rounded once; a chunk's c products are summed in
    any order (depth <= c - 1), then added to the float32 accumulator once per chunk (n_ch adds). This assumes gemm
    adds C once to the chunk's sum, as cuBLAS's epilogue does and MKL's / oneDNN's sgemm do for K = c = 128 within
    their K block; summed in any order the depth would be M, a bound the bf16-summed code fails too (by > 3x here).
    With n_acc = c + n_ch factors the float32 sum S has |S - g64| <= gamma(n_acc + n_p) A,
    A = sum_r (|gz| + p |g| / tau) |h|.

    One bf16 rounding at the end: |bf16(S) - S| <= u_b |S| <= u_b (|g64| + |S - g64|), so
      |gw - g64| <= u_b |g64| + (1 + u_b) gamma(n_acc + n_p) A.
    The float64 reference's own error (~ M 2^-53 A) is below 1e-6 of the bound's second term."""
    assert fused_grad_ratio(tau) <= 1
