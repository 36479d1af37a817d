"""DeepSpeed's bf16 gradient accumulation over micro-batches, measured against the float64 sum and its fp32 bound
(tests/test_gpu_path.py holds the derivation and runs it on the CPU, where DeepSpeed has no overlap_comm and no
offload to speak of; gpu_check.py's `accum` phase runs it on a GPU: ZeRO-2 and ZeRO-3, overlap_comm on and off, the
optimizer in GPU or CPU memory). No pytest here: the GPU check runs where only the library is installed."""

from pathlib import Path

import torch

RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "tiny-cpu.yaml")
U32 = 2.0**-24  # float32 unit roundoff
K = 16  # micro-batches: the first at scale 1, the other 15 at 2^-9 (each of those rounds away in a bf16 sum)
SCALES = [1.0] + [2.0**-9] * (K - 1)


def accumulated_grads(
    stage: int,  # ZeRO stage 2 or 3
    scales: list[float],  # one micro-batch per scale c: the loss c * f(theta)
    out: str,  # the learner's output_dir
    overlap: bool | None = None,  # zero_optimization.overlap_comm; None: deepspeed_config's choice
    offload: bool = False,  # the optimizer's states (and ZeRO's fp32 gradient partition) in CPU memory
) -> dict[str, torch.Tensor]:
    """A bf16 `DeepSpeedLearner` (one rank, the tiny policy) runs one backward per scale on the same sequence, the loss
    c * f(theta) (f: the logits' logsumexp summed), through the learner's own `backward(loss, last)`; returns the
    gradient DeepSpeed accumulated by the last micro-batch, in float64."""
    from deepspeed.utils import safe_get_full_grad
    from dapo_ref.cli import load_config
    from dapo_ref.policy import load_policy
    from dapo_ref.scale import DeepSpeedLearner, deepspeed_config

    model, tok = load_policy("tiny")
    cfg = load_config(
        RECIPE, dict(zero_stage=stage, dtype="bfloat16", warmup_steps=0, offload_optimizer=offload, output_dir=out)
    )
    ds = deepspeed_config(cfg, n_trained=sum(p.numel() for p in model.parameters()))
    if overlap is not None:
        ds["zero_optimization"]["overlap_comm"] = overlap
    ds["optimizer"]["params"]["torch_adam"] = True  # no step is taken: no DeepSpeedCPUAdam build for an offload run
    learner = DeepSpeedLearner(model.to(torch.bfloat16), cfg, tok.pad_token_id, ds_config=ds)
    ids = torch.tensor([tok.encode("12+7=19", add_special_tokens=False)], device=learner.engine.device)
    for i, c in enumerate(scales):
        logits = learner.engine(input_ids=ids).logits.float()  # (1, T, V)
        learner.backward(c * logits.logsumexp(-1).sum(), last=i == len(scales) - 1)
    grads = {n: safe_get_full_grad(p).double().cpu().clone() for n, p in learner.engine.module.named_parameters()}
    learner.close()
    return grads


def accumulation_ratio(stage: int, out: str, overlap: bool | None = None, offload: bool = False) -> float:
    """max over the elements of |sum - float64 sum| / the fp32 bound (k - 1) u32 sum_i |c_i g| (Wilkinson): <= 1 when
    DeepSpeed sums the 16 micro-batches in fp32; ~10^5 when it sums them in bf16 (the 2^-9 ones round away)."""
    g = accumulated_grads(stage, [1.0], f"{out}/one", overlap, offload)
    acc = accumulated_grads(stage, SCALES, f"{out}/k", overlap, offload)
    s, ratio = sum(SCALES), 0.0  # s exact in float64
    for name, g1 in g.items():
        bound = (K - 1) * U32 * s * g1.abs()
        err = (acc[name] - s * g1).abs()
        over = torch.where(bound > 0, err / bound.clamp(min=1e-300), torch.where(err > 0, float("inf"), 0.0))
        ratio = max(ratio, float(over.max()))  # an element with g = 0 must sum to exactly 0
    assert any(bool(g1.abs().max() > 0) for g1 in g.values()), "no gradient reached the check"
    return ratio
