"""One rank of the two-process ZeRO-3 checks in tests/test_zero.py (run it with torchrun, not pytest).

    torchrun --nproc_per_node 2 tests/zero_worker.py MODEL OUT_DIR [MODE]

MODEL is a hub name (resolved from the HF cache, HF_HUB_OFFLINE=1) or a local folder. Each rank: imports torch,
transformers and DeepSpeed, then measures its peak resident memory above that baseline while
`zero.from_pretrained_zero3` builds the model under ZeRO-3; checks that every parameter is partitioned and that the
gathered weights equal the checkpoint's; runs `deepspeed.initialize` and one AdamW step (so the weights differ from
the checkpoint); measures the peak of `zero.save_pretrained_streamed` into OUT_DIR/export. Rank 0 writes
OUT_DIR/rank{r}.json for every rank (numbers) and OUT_DIR/learner.pt (the learner's full weights, gathered after
the measurements). MODE (for the record, not the tests): `no-heap-fix` builds without `zero.returned_large_blocks`,
`transformers` builds with transformers' own `from_pretrained` under a live `HfDeepSpeedConfig`."""
import contextlib, json, os, sys, time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers, deepspeed  # noqa: F401  (part of the baseline: imported before any measurement)
import transformers.models.qwen2.modeling_qwen2  # noqa: F401
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dapo_ref.zero
from dapo_ref.zero import PeakRSS, checkpoint_folder, from_pretrained_zero3, gathered, module_tensors, save_pretrained_streamed

DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 2,
             "zero_optimization": {"stage": 3}, "steps_per_print": 10**9,
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}


def matches_checkpoint(model, name) -> bool:
    "Every gathered weight equals the checkpoint's tensor (a collective; rank 0 compares)."
    folder, wm = checkpoint_folder(name)
    ok = True
    for _, items in module_tensors(model):
        with gathered([t for _, t in items]):
            if dist.get_rank() == 0:
                for k, t in items:
                    with safe_open(folder / wm[k], "pt") as f: ok &= torch.equal(f.get_tensor(k), t.data)
    return ok


def full_weights(model) -> dict:
    "The full weights, gathered module by module (a collective; complete on rank 0)."
    out = {}
    for _, items in module_tensors(model):
        with gathered([t for _, t in items]):
            for k, t in items: out[k] = t.data.clone()
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    name, out = sys.argv[1], Path(sys.argv[2])
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    rank = dist.get_rank()
    res = {"rank": rank}
    t0 = time.perf_counter()
    mode = sys.argv[3] if len(sys.argv) > 3 else "ours"
    if mode == "no-heap-fix": dapo_ref.zero.returned_large_blocks = contextlib.nullcontext
    with PeakRSS() as m:
        if mode == "transformers":
            from transformers import AutoModelForCausalLM
            from transformers.integrations import HfDeepSpeedConfig
            keep = HfDeepSpeedConfig(DS_CONFIG)
            model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)
            model.hf_ds_config = keep
        else:
            model = from_pretrained_zero3(name, DS_CONFIG)
    res["construct_s"] = time.perf_counter() - t0
    params = list(model.parameters())
    res.update(construct_extra=m.extra, construct_base=m.base,
               all_partitioned=all(p.numel() == 0 and hasattr(p, "ds_id") for p in params),
               full_numel=sum(p.ds_numel for p in params), local_numel=sum(p.ds_tensor.numel() for p in params),
               model_bytes=sum(p.ds_numel * p.element_size() for p in params),
               hf_ds_config_alive=model.hf_ds_config is not None)
    res["matches_checkpoint"] = matches_checkpoint(model, name)

    engine, *_ = deepspeed.initialize(model=model, config=DS_CONFIG, model_parameters=model.parameters())
    ids = torch.arange(1, 33).remainder(model.config.vocab_size).unsqueeze(0) + rank  # a different batch per rank
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss); engine.step()
    res["loss"] = loss.item()

    t0 = time.perf_counter()
    with PeakRSS() as m:
        save_pretrained_streamed(engine.module, out / "export", shard_bytes=res["model_bytes"] // 8)
    res.update(export_extra=m.extra, export_s=time.perf_counter() - t0)
    weights = full_weights(engine.module)
    res_all = [None, None]
    dist.all_gather_object(res_all, res)
    if rank == 0:
        torch.save(weights, out / "learner.pt")
        for r in res_all: (out / f"rank{r['rank']}.json").write_text(json.dumps(r))
    dist.barrier()
    dist.destroy_process_group()
