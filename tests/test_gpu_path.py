"""The GPU path's numerics and memory, where the CPU can show them: DeepSpeed's bf16 gradient accumulation across
micro-batches (DeepSpeed's CPU accelerator runs bf16), and the learner's memory given back when `train` returns (a
vLLM engine started next in the same process needs it: gpu_check.py's restart)."""

import gc, os, sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from dapo_ref.cli import load_config  # noqa: E402
from dapo_ref.policy import load_policy  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from accum_bf16 import accumulation_ratio  # noqa: E402  (no pytest there: gpu_check.py runs it on a GPU)

RECIPE = "recipes/tiny-cpu.yaml"


pytestmark = pytest.mark.usefixtures("one_thread")  # torch on one thread (conftest.py)


@pytest.mark.parametrize("offload", [False, True], ids=["gpu-states", "offload"])
@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_micro_batches_accumulate_in_fp32(stage, offload, tmp_path):
    """k = 16 micro-batches, the first at scale 1 and 15 at 2^-9 (benchmarks/accum_bf16.py, which gpu_check.py's `accum`
    phase runs on a GPU, overlap_comm on and off). Scaling a loss by a power of two scales its bf16 backward exactly,
    so micro-batch i's gradient is c_i g, with g the gradient of one micro-batch at scale 1, and the float64 sum is
    g * (1 + 15 * 2^-9) exactly. Summed in fp32 the error is at most (k - 1) u32 sum_i |c_i g| (Wilkinson); summed in
    bf16 every 2^-9 g rounds away (half a bf16 ulp of g is at least 2^-9 |g|), leaving g: a relative error of
    15 * 2^-9 / (1 + 15 * 2^-9) = 2.8%, ~10^5 times the fp32 bound. With the optimizer offloaded ZeRO sums the
    partitions in CPU memory (another code path): the same bound."""
    assert accumulation_ratio(stage, str(tmp_path), offload=offload) <= 1


@pytest.mark.parametrize("stage", [2, 3])
def test_learner_refuses_gradients_summed_in_bf16(stage, tmp_path):
    """The learner reads the dtype its ZeRO optimizer sums micro-batches in (`scale.accumulation_dtype`) and stops on
    anything but fp32. A bf16 engine whose DeepSpeed config lacks `data_types.grad_accum_dtype` sums in the parameters'
    bf16 (as ZeRO-2 of DeepSpeed < 0.19.8 does whatever the config says): refused in one line naming the fix. The same
    engine under `deepspeed_config`'s own config reads fp32 (the test above shows those sums are fp32 sums)."""
    from dapo_ref.core import InputError
    from dapo_ref.scale import DeepSpeedLearner, accumulation_dtype, deepspeed_config

    cfg = load_config(RECIPE, dict(zero_stage=stage, dtype="bfloat16", warmup_steps=0, output_dir=str(tmp_path)))
    model, tok = load_policy("tiny")
    ds = deepspeed_config(cfg, n_trained=sum(p.numel() for p in model.parameters()))  # buckets of the model's size
    del ds["data_types"]
    fix = r"pip install 'deepspeed>=0\.19\.8,<0\.20'"
    with pytest.raises(InputError, match=rf"sums ZeRO-{stage} micro-batch gradients in bfloat16, not fp32 .*{fix}"):
        DeepSpeedLearner(model.to(torch.bfloat16), cfg, tok.pad_token_id, ds_config=ds)
    model, tok = load_policy("tiny")
    learner = DeepSpeedLearner(model.to(torch.bfloat16), cfg, tok.pad_token_id)
    assert accumulation_dtype(learner.opt) == torch.float32
    learner.close()


def live_tensor_bytes() -> int:
    "Bytes of every storage a live tensor of this process holds (each storage once)."
    gc.collect()
    seen, n = set(), 0
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            s = o.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                n += s.nbytes()
    return n


@pytest.mark.parametrize("stage", [2, 3])
def test_train_gives_the_deepspeed_learners_memory_back(stage, tmp_path):
    """After `train` returns, no tensor of its DeepSpeed learner is alive: the tensor bytes of the process are what
    they were before it (within the tiny model's own size, 4 bytes a parameter: any leaked copy of the weights, its
    gradients or Adam's states is at least that). Without `DeepSpeedLearner.close`, ZeRO-2 kept the model, and ZeRO-3
    the model, its partitions and its optimizer states (DeepSpeed's module stack holds the model after `destroy`), and
    transformers' ZeRO-3 flag stayed set for every later load."""
    from dapo_ref.trainer import train

    cfg = load_config(
        RECIPE,
        dict(
            zero_stage=stage,
            total_steps=1,
            eval_every=0,
            save_every=0,
            prompts_per_step=2,
            gen_batch_size=4,
            mini_batch_size=16,
            val_before_train=False,
            output_dir=str(tmp_path / "run"),
        ),
    )
    n_params = sum(p.numel() for p in load_policy("tiny")[0].parameters())
    before = live_tensor_bytes()
    train(cfg, log=None)
    left = live_tensor_bytes() - before
    assert left < 4 * n_params, (left, 4 * n_params)
    # and a model loaded next is whole: ZeRO-3's load had told transformers that ZeRO-3 is on (HfDeepSpeedConfig),
    # so every later from_pretrained in the process built its parameters partitioned (embedding shape (0,))
    after = load_policy("tiny")[0]
    assert sum(p.numel() for p in after.parameters()) == n_params and after.model.embed_tokens.weight.dim() == 2
