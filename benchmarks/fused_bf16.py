"""The fused log-prob's lm-head weight gradient in bf16, measured against its derived bound (tests/test_fused_bf16.py
holds the derivation and runs it on the CPU; gpu_check.py's `fused` phase runs it on a GPU). No pytest here: the GPU
check runs where only the library is installed."""

import math

import torch

from dapo_ref.logprobs import fused_token_logprobs

U32, UB = 2.0**-24, 2.0**-8  # unit roundoff of float32 / bfloat16 (8 significant bits), round to nearest


def gamma(n: float, u: float = U32) -> float:
    "Higham's gamma_n = n u / (1 - n u): bounds |prod (1 + d_i) - 1| over n factors |d_i| <= u, and e^(n u) - 1."
    return n * u / (1 - n * u)


def fused_grad_ratio(tau: float, M: int = 16384, V: int = 128, H: int = 64, c: int = 128, device: str = "cpu") -> float:
    "max over (v, h) of |gw - g64| / bound for bf16 inputs on `device` (tests/test_fused_bf16.py's derivation)."
    g = torch.Generator().manual_seed(0)
    h = torch.randn(M, H, generator=g).bfloat16().to(device)  # (M, H)
    w = (torch.randn(V, H, generator=g) / math.sqrt(H)).bfloat16().to(device)  # (V, H) logits ~ N(0, 1)
    labels = torch.randint(0, V, (M,), generator=g).to(device)  # (M,)
    g_logp = ((torch.rand(M, generator=g) + 0.5) / M).to(device)  # (M,) a token-mean's weights, one sign
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp, _ = fused_token_logprobs(hh, ww, labels, tau, chunk_rows=c)
    logp.backward(g_logp)
    assert ww.grad.dtype == torch.bfloat16 and hh.grad.dtype == torch.bfloat16

    z = torch.cat([h[s : s + c] @ w.T for s in range(0, M, c)]).double() / tau  # (M, V) the kernel's bf16 logits, / tau
    p = torch.softmax(z, -1)  # (M, V)
    gr = g_logp.double() / tau  # (M,)
    gz = (torch.nn.functional.one_hot(labels, V).double() - p) * gr[:, None]  # (M, V) dL/dz
    g64 = gz.T @ h.double()  # (V, H)
    A = (gz.abs() + p * gr.abs()[:, None]).T @ h.double().abs()  # (V, H)
    Y = z.abs().max().item()
    n_p, n_acc = V + 3 + 7 * Y + 4 * math.log(V), c + M // c
    bound = UB * g64.abs() + (1 + UB) * gamma(n_acc + n_p) * A
    return ((ww.grad.double() - g64).abs() / bound).max().item()
