"""One rank of the two-process learner checks in tests/test_scale.py (run it with torchrun, not pytest).

    torchrun --nproc_per_node 2 tests/scale_worker.py OUT_DIR [3,2,3gc,0]
    torchrun --nproc_per_node 2 tests/scale_worker.py OUT_DIR build MODEL   (or python tests/scale_worker.py ...: one rank)


Each rank builds the same fixed DAPO mini-batch (`fixed_batch`), keeps its share of the groups (`dist.shard`), and for
ZeRO-3, ZeRO-2, ZeRO-3 with gradient checkpointing (`DeepSpeedLearner`) and the plain learner (`TorchLearner`, stage
"0", gradients summed with one all-reduce): computes old log-probs, does one `update`, and syncs the new weights into a
rollout engine (`HFRolloutEngine`), all through `Trainer.train_on` and
`Trainer.sync_weights`. Rank 0 writes to OUT_DIR/stage{name}.pt: the full weights the learner streamed, the
learner's own consolidated weights, the engine's weights on every rank, the old log-probs and the update's metrics.
The one-device comparison is done by the test, in its own process, with `trainer.TorchLearner`.

`build MODEL` (a model the learner loads by name, here a ~57M-parameter Qwen2 from a local HF cache): the ZeRO-3
learner as `dapo-train` builds it. Each rank measures its peak resident memory above its baseline (torch,
transformers, DeepSpeed and dapo_ref imported, process group up) while `DeepSpeedLearner.build_model` constructs the
policy, and checks every parameter is partitioned; then `Trainer` (through `DeepSpeedLearner.build` and the
transformers engine's copy) trains one mini-batch of the fixed batch with every group on rank 0, recording the
response tokens each rank's `Learner.update` received; syncs the engine; and measures `save_model`'s peak into
OUT_DIR/export. Rank 0 writes OUT_DIR/build.pt."""
import copy, os, sys
from pathlib import Path

import torch

G, N_GROUPS = 4, 5  # 5 groups of 4: rank 0 gets groups 0, 2, 4 and rank 1 groups 1, 3 (unequal shares)


def test_cfg():
    "The tiny recipe with a learning rate that moves the weights visibly, and a small token budget (several micro-batches)."
    from dapo_ref.core import config_from_dict
    return config_from_dict(dict(model="tiny", group_size=G, prompts_per_step=N_GROUPS, gen_batch_size=N_GROUPS,
                                 mini_batch_size=G * N_GROUPS, lr=1e-3, warmup_steps=0, weight_decay=0.1, grad_clip=1.0,
                                 micro_token_budget=96, zero_stage=0, dtype="float32", l_max=32, l_cache=8))


def fixed_batch(vocab: int = 392, seed: int = 0):
    "N_GROUPS * G responses with random token ids, lengths and advantages (deterministic; no generation)."
    from dapo_ref.trainer import RolloutBatch
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(N_GROUPS):
        p = torch.randint(1, vocab, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(G):
            prompts.append(p)
            responses.append(torch.randint(1, vocab, (int(torch.randint(2, 24, (1,), generator=g)),), generator=g).tolist())
    adv = torch.randn(N_GROUPS * G, generator=g)  # (B,)
    return RolloutBatch(prompts, responses, adv, torch.zeros(N_GROUPS * G, dtype=torch.bool), adv.clone())


def trainer_update(cfg, model, tok, engine=None):
    """`Trainer.train_on` (Algorithm 1 lines 10-11, one mini-batch) on this rank's groups of the fixed batch, through the
    same `Trainer` as `dapo-train`: returns (trainer, old log-probs, the update's metrics, micro-batch count)."""
    from dapo_ref import dist
    from dapo_ref.tiny import tiny_splits
    from dapo_ref.trainer import Trainer
    trainer = Trainer(cfg, train_examples=tiny_splits(8, 1, seed=0)[0], eval_examples=[], model=model, tokenizer=tok,
                      engine=engine, progress=False, log=None)
    mine = set(dist.shard(list(range(N_GROUPS)), dist.rank(), dist.world_size()))  # groups stay whole on one rank
    owned = [k in mine for k in range(N_GROUPS) for _ in range(G)]  # (B,) responses this rank trains on
    batch = fixed_batch().select([i for i, o in enumerate(owned) if o])
    n_micro = len(trainer.learner.micro_batches(batch))
    old, _ = trainer.learner.compute_logprobs(batch)
    updates, _ = trainer.train_on(batch, owned, {})
    return trainer, old, updates[0], n_micro


def run_stage(name: str, out: Path):
    "name: ZeRO stage, with a `gc` suffix for gradient checkpointing (e.g. `3gc`); `0` is the plain learner."
    from dapo_ref import dist
    from dapo_ref.trainer import load_policy
    from dapo_ref.rollout import HFRolloutEngine
    rank, world = dist.rank(), dist.world_size()
    cfg = test_cfg(); cfg.zero_stage = stage = int(name[0]); cfg.gradient_checkpointing = name.endswith("gc")
    cfg.gpus_per_node = world
    model, tok = load_policy("tiny")
    engine = HFRolloutEngine(copy.deepcopy(model), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    trainer, old, metrics, n_micro = trainer_update(cfg, model, tok, engine)
    learner = trainer.learner
    from transformers.modeling_layers import GradientCheckpointingLayer
    ckpt = [m.gradient_checkpointing and m.training for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    learner.end_step()
    streamed = {n: t.clone() for n, t in learner.named_weights()}  # every rank iterates: a collective
    trainer.sync_weights()  # Algorithm 1 line 3
    eng_sd = {n: t.clone() for n, t in engine.model.state_dict().items()}
    consolidated = (learner.engine._zero3_consolidated_16bit_state_dict() if stage == 3
                    else {n: t.clone() for n, t in learner.model.state_dict().items()})  # the learner's own weights
    engines = dist.all_gather(eng_sd)
    olds, n_micros = dist.all_gather(old), dist.all_gather(n_micro)
    if rank == 0:
        torch.save(dict(streamed=streamed, consolidated=consolidated, engines=engines, old=olds, n_micro=n_micros,
                        metrics=metrics, world=world, checkpointed_layers=ckpt, learner=type(learner).__name__),
                   out / f"stage{name}.pt")
    dist.barrier()


def run_build(model_name: str, out: Path):
    "ZeRO-3 construction, a balanced update with every group on rank 0, the engine sync and the streamed export."
    import deepspeed, transformers.models.qwen2.modeling_qwen2  # noqa: F401  (part of the baseline)
    from transformers.integrations import HfDeepSpeedConfig  # noqa: F401
    from dapo_ref import dist
    from dapo_ref.scale import DeepSpeedLearner
    from dapo_ref.tiny import tiny_splits
    from dapo_ref.trainer import Trainer, load_tokenizer
    from dapo_ref.zero import PeakRSS
    rank, world = dist.rank(), dist.world_size()
    cfg = test_cfg(); cfg.model, cfg.zero_stage, cfg.gpus_per_node, cfg.lr = model_name, 3, world, LR_BUILD
    tok = load_tokenizer("tiny")
    with PeakRSS() as m:
        model = DeepSpeedLearner.build_model(cfg)
    params = list(model.parameters())
    res = dict(rank=rank, construct_extra=m.extra, construct_base=m.base,
               all_partitioned=all(p.numel() == 0 and hasattr(p, "ds_id") for p in params),
               full_numel=sum(p.ds_numel for p in params), local_numel=sum(p.ds_tensor.numel() for p in params),
               model_bytes=sum(p.ds_numel * p.element_size() for p in params))
    with PeakRSS() as m:  # deepspeed.initialize (optimizer partitions) and the transformers engine's whole copy
        trainer = Trainer(cfg, train_examples=tiny_splits(8, 1, seed=0)[0], eval_examples=[], model=model,
                          tokenizer=tok, progress=False, log=None)
    res["trainer_extra"] = m.extra
    learner = trainer.learner
    res["engine_partitioned"] = any(hasattr(p, "ds_id") for p in trainer.engine.model.parameters())
    trained, update = [], learner.update
    def recording_update(mini, old):  # what this rank's learner trains: the balanced share
        trained.append([len(r) for r in mini.response_ids])
        return update(mini, old)
    learner.update = recording_update
    batch = fixed_batch()
    owned = [rank == 0] * len(batch)  # every kept group generated on rank 0
    updates, _ = trainer.train_on(batch if rank == 0 else batch.select([]), owned, {})
    res.update(trained=trained, metrics=updates)
    learner.end_step()
    trainer.sync_weights()
    engine_sd = {n: t.clone() for n, t in trainer.engine.model.state_dict().items()}
    weights = {n: t.clone() for n, t in learner.named_weights()}
    res["engine_equal"] = all(torch.equal(engine_sd[k], v) for k, v in weights.items())
    with PeakRSS() as m:
        learner.save_model(out / "export")
    res["export_extra"] = m.extra
    every = dist.all_gather(res)
    if rank == 0: torch.save(dict(ranks=every, weights=weights), out / "build.pt")
    dist.barrier()


LR_BUILD = 1e-4  # the learning rate of the `build` check's update (see tests/test_scale.py)


if __name__ == "__main__":
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from dapo_ref import dist
    dist.init_distributed()
    out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
    if sys.argv[2:3] == ["build"]: run_build(sys.argv[3], out)
    else:
        for s in (sys.argv[2].split(",") if len(sys.argv) > 2 else ["3", "2", "3gc", "0"]): run_stage(s, out)
    import torch.distributed
    torch.distributed.destroy_process_group()
