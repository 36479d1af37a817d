"""One rank of the two-process learner checks in tests/test_scale.py (run it with torchrun, not pytest).

    torchrun --nproc_per_node 2 tests/scale_worker.py OUT_DIR [3,2,3gc,0,3sp]   (3sp: ZeRO-3, sequence_parallel_size 2)
    torchrun --nproc_per_node 2 tests/scale_worker.py OUT_DIR build MODEL   (or python tests/scale_worker.py ...: one rank)


Each rank builds the same fixed DAPO mini-batch (`fixed_batch`), keeps its share of the groups (`dist.shard`), and for
ZeRO-3, ZeRO-2, ZeRO-3 with gradient checkpointing (`DeepSpeedLearner`) and the plain learner (`ShardedTorchLearner`, stage
"0", gradients summed with one all-reduce): computes old log-probs, does one `update`, and syncs the new weights into a
rollout engine (`HFRolloutEngine`), all through `algorithm.train_on` and
`Trainer.sync_weights`. Rank 0 writes to OUT_DIR/stage{name}.pt: the full weights the learner streamed, the
learner's own consolidated weights, the engine's weights on every rank, the old log-probs, the update's metrics and
the full gradient of every parameter as the optimizer step received it (`capture_grads`: summed over ranks, not yet
clipped). Adam's eps is `ADAM_EPS` on every learner here (`set_adam_eps`; why: tests/test_scale.py).
The one-device comparison is done by the test, in its own process, with `learner.TorchLearner`.

`build MODEL` (a model the learner loads by name, here a ~57M-parameter Qwen2 from a local HF cache): the ZeRO-3
learner as `dapo-train` builds it. Each rank measures its peak resident memory above its baseline (torch,
transformers, DeepSpeed and dapo_ref imported, process group up) while `DeepSpeedLearner.build_model` constructs the
policy, and checks every parameter is partitioned and the gathered weights equal the checkpoint's; then `Trainer` (through `DeepSpeedLearner.build` and the
transformers engine's copy) trains one mini-batch of the fixed batch with every group on rank 0, recording the
response tokens each rank's `Learner.update` received and the full gradients; syncs the engine; measures
`save_model`'s peak into OUT_DIR/export; and writes the model again with `zero.save_pretrained_streamed` in shards of
model/8 bytes into OUT_DIR/export8. Rank 0 writes OUT_DIR/build.pt.

`build MODEL MODE` (for the record, not the tests; `python tests/scale_worker.py OUT build MODEL MODE` or torchrun):
`no-heap-fix` constructs without `zero.returned_large_blocks`, `transformers` with transformers' own `from_pretrained`
under a live `HfDeepSpeedConfig`; compare their `construct_extra` in build.pt with the default's."""

import copy, os, sys
from pathlib import Path

import torch

G, N_GROUPS = 4, 5  # 5 groups of 4, shared over the ranks by tokens (`sharded_learner.balanced_share`)


def test_cfg():
    "The tiny recipe with a learning rate that moves the weights visibly, and a small token budget (several micro-batches)."
    from dapo_ref.cli import config_from_dict

    return config_from_dict(
        dict(
            model="tiny",
            group_size=G,
            prompts_per_step=N_GROUPS,
            gen_batch_size=N_GROUPS,
            mini_batch_size=G * N_GROUPS,
            lr=1e-3,
            warmup_steps=0,
            weight_decay=0.1,
            grad_clip=1.0,
            micro_token_budget=96,
            zero_stage=0,
            dtype="float32",
            l_max=32,
            l_cache=8,
        )
    )


def fixed_batch(vocab: int = 392, seed: int = 21):
    """N_GROUPS * G responses with random token ids, lengths and advantages (deterministic; no generation). Seed 21:
    the two token-balanced shares pack into 4 and 3 micro-batches (7 on one device), so the padding passes run."""
    from dapo_ref.interfaces import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(N_GROUPS):
        p = torch.randint(1, vocab, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(G):
            prompts.append(p)
            responses.append(
                torch.randint(1, vocab, (int(torch.randint(2, 33, (1,), generator=g)),), generator=g).tolist()
            )
    adv = torch.randn(N_GROUPS * G, generator=g)  # (B,)
    return RolloutBatch(prompts, responses, adv, torch.zeros(N_GROUPS * G, dtype=torch.bool), adv.clone())


ADAM_EPS = 1e-5  # Adam's eps in the update checks (product default 1e-8): g -> g/(|g|+eps) is then (1/eps)-Lipschitz


def set_adam_eps(learner, eps: float = ADAM_EPS):
    "Set eps in the torch optimizer both learners step (TorchLearner's AdamW, the torch AdamW inside DeepSpeed's ZeRO)."
    for g in learner.sched.optimizer.param_groups:
        g["eps"] = eps


def capture_grads(learner) -> dict:
    """Wrap `learner.optimizer_step` (called after the last backward, before the step): fills the returned dict with
    every parameter's full, un-partitioned float32 gradient, summed over ranks and not yet clipped. DeepSpeed:
    `deepspeed.utils.safe_get_full_grad` (a collective: every rank calls it, parameters in the same order); the plain
    learner: `p.grad` when `clip_grad_norm_` is called, i.e. after its all-reduce and before the clip."""
    grads, inner = {}, learner.optimizer_step
    if type(learner).__name__ == "DeepSpeedLearner":
        from deepspeed.utils import safe_get_full_grad

        def step(loss):
            for n, p in learner.model.named_parameters():
                g = safe_get_full_grad(p)
                grads[n] = None if g is None else g.detach().float().cpu().clone()
            return inner(loss)
    else:
        from unittest import mock

        names, clip = {id(p): n for n, p in learner.model.named_parameters()}, torch.nn.utils.clip_grad_norm_

        def clip_and_capture(params, *a, **k):
            params = list(params)
            for p in params:
                grads[names[id(p)]] = None if p.grad is None else p.grad.detach().float().cpu().clone()
            return clip(params, *a, **k)

        def step(loss):
            with mock.patch("torch.nn.utils.clip_grad_norm_", clip_and_capture):
                return inner(loss)

    learner.optimizer_step = step
    return grads


def trainer_update(cfg, model, tok, engine=None):
    """`algorithm.train_on` (Algorithm 1 lines 10-11, one mini-batch) of the fixed batch, through the learner of the same
    `Trainer` as `dapo-train`, with Adam's eps `ADAM_EPS`: returns (trainer, old log-probs of this rank's share, the
    update's metrics, micro-batch count, the full pre-clip gradients)."""
    from dapo_ref.algorithm import train_on
    from dapo_ref.tiny import tiny_splits
    from dapo_ref.trainer import Trainer

    trainer = Trainer(
        cfg,
        train_examples=tiny_splits(8, 1, seed=0)[0],
        eval_examples=[],
        model=model,
        tokenizer=tok,
        engine=engine,
        progress=False,
        log=None,
    )
    full = fixed_batch()  # every rank holds the step's whole batch (the sharded rollout gathers each round)
    from dapo_ref.sharded_learner import balanced_share

    trainer.logprob_indices = balanced_share(
        [len(p) + len(r) for p, r in zip(full.prompt_ids, full.response_ids)],
        cfg.mini_batch_size,
        *trainer.learner.data_rank(),
    )[0]  # as `train_on` shares it
    lp_batch = full.select(trainer.logprob_indices)
    n_micro = len(trainer.learner.micro_batches(lp_batch))
    old, _ = trainer.learner.compute_logprobs(lp_batch)
    set_adam_eps(trainer.learner)
    grads = capture_grads(trainer.learner)
    updates, _ = train_on(trainer.learner, full, cfg.mini_batch_size)
    return trainer, old, updates[0], n_micro, grads


def run_stage(name: str, out: Path):
    "name: ZeRO stage, with a `gc` suffix for gradient checkpointing (e.g. `3gc`); `0` is the plain learner."
    from dapo_ref import dist
    from dapo_ref.policy import load_policy
    from dapo_ref.rollout import HFRolloutEngine

    rank, world = dist.rank(), dist.world_size()
    cfg = test_cfg()
    cfg.zero_stage = stage = int(name[0])
    cfg.gradient_checkpointing = name.endswith("gc")
    cfg.gpus_per_node = world
    cfg.sequence_parallel_size = 2 if name.endswith("sp") else 1
    model, tok = load_policy("tiny")
    engine = HFRolloutEngine(copy.deepcopy(model), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    trainer, old, metrics, n_micro, grads = trainer_update(cfg, model, tok, engine)
    learner = trainer.learner
    from transformers.modeling_layers import GradientCheckpointingLayer

    ckpt = [
        m.gradient_checkpointing and m.training for m in model.modules() if isinstance(m, GradientCheckpointingLayer)
    ]
    learner.end_step()
    streamed = {n: t.clone() for n, t in learner.named_weights()}  # every rank iterates: a collective
    trainer.sync_weights()  # Algorithm 1 line 3
    eng_sd = {n: t.clone() for n, t in engine.model.state_dict().items()}
    consolidated = (
        learner.engine._zero3_consolidated_16bit_state_dict()
        if stage == 3
        else {n: t.clone() for n, t in learner.model.state_dict().items()}
    )  # the learner's own weights
    engines = dist.all_gather(eng_sd)
    olds, n_micros = dist.all_gather(old), dist.all_gather(n_micro)
    sp = learner.sp and dict(
        size=learner.sp.size,
        rank=learner.sp.rank,
        data_rank=learner.data_rank(),
        idx=trainer.logprob_indices,
        local=learner.sp.attn.local_seq_length,
        whole=learner.sp.attn.global_seq_length,
    )  # last row's
    sps, idxs = dist.all_gather(sp), dist.all_gather(trainer.logprob_indices)  # collectives: every rank
    if rank == 0:
        torch.save(
            dict(
                streamed=streamed,
                consolidated=consolidated,
                engines=engines,
                old=olds,
                n_micro=n_micros,
                idx=idxs,
                metrics=metrics,
                world=world,
                checkpointed_layers=ckpt,
                learner=type(learner).__name__,
                grads=grads,
                sp=sps,
            ),
            out / f"stage{name}.pt",
        )
    dist.barrier()


def matches_checkpoint(model, name) -> bool:
    "Every gathered weight equals the checkpoint's tensor (a collective; rank 0 compares)."
    from safetensors import safe_open
    from dapo_ref import dist
    from dapo_ref.zero import checkpoint_folder, gathered, module_tensors

    folder, wm = checkpoint_folder(name)
    ok = True
    for _, items in module_tensors(model):
        with gathered([t for _, t in items]):
            if dist.is_main():
                for k, t in items:
                    with safe_open(folder / wm[k], "pt") as f:
                        ok &= torch.equal(f.get_tensor(k), t.data)
    return ok


def run_build(model_name: str, out: Path, mode: str = "ours"):
    "ZeRO-3 construction, a balanced update with every group on rank 0, the engine sync and the streamed export."
    import deepspeed, transformers.models.qwen2.modeling_qwen2  # noqa: F401  (part of the baseline)
    from transformers.integrations import HfDeepSpeedConfig  # (part of the baseline)
    from dapo_ref import dist
    from dapo_ref.scale import DeepSpeedLearner
    from dapo_ref.tiny import tiny_splits
    from dapo_ref.trainer import Trainer
    from dapo_ref.policy import load_tokenizer
    import dapo_ref.zero
    from dapo_ref.zero import PeakRSS, save_pretrained_streamed

    rank, world = dist.rank(), dist.world_size()
    cfg = test_cfg()
    cfg.model, cfg.zero_stage, cfg.gpus_per_node, cfg.lr = model_name, 3, world, LR_BUILD
    tok = load_tokenizer("tiny")
    if mode == "no-heap-fix":
        import contextlib

        dapo_ref.zero.returned_large_blocks = contextlib.nullcontext
    if mode == "transformers":  # DeepSpeed's comm over the process group, which build_model sets up itself
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), verbose=False)
    with PeakRSS() as m:
        if mode == "transformers":
            from transformers import AutoModelForCausalLM
            from dapo_ref.scale import deepspeed_config

            keep = HfDeepSpeedConfig(deepspeed_config(cfg, world))
            model = AutoModelForCausalLM.from_pretrained(model_name, dtype=torch.float32)
            model.hf_ds_config = keep
        else:
            model = DeepSpeedLearner.build_model(cfg)
    params = list(model.parameters())
    res = dict(
        rank=rank,
        construct_extra=m.extra,
        construct_base=m.base,
        linear_after_build=torch.nn.functional.linear is torch._C._nn.linear,  # zero.Init left F.linear as it was
        all_partitioned=all(p.numel() == 0 and hasattr(p, "ds_id") for p in params),
        full_numel=sum(p.ds_numel for p in params),
        local_numel=sum(p.ds_tensor.numel() for p in params),
        model_bytes=sum(p.ds_numel * p.element_size() for p in params),
        hf_ds_config_alive=getattr(model, "hf_ds_config", None) is not None,
    )
    res["matches_checkpoint"] = matches_checkpoint(model, model_name)  # a collective; rank 0's answer counts
    with PeakRSS() as m:  # deepspeed.initialize (optimizer partitions) and the transformers engine's whole copy
        trainer = Trainer(
            cfg,
            train_examples=tiny_splits(8, 1, seed=0)[0],
            eval_examples=[],
            model=model,
            tokenizer=tok,
            progress=False,
            log=None,
        )
    res["trainer_extra"] = m.extra
    res["linear_after_initialize"] = torch.nn.functional.linear is torch._C._nn.linear  # and deepspeed.initialize too
    learner = trainer.learner
    set_adam_eps(learner)
    grads = capture_grads(learner)
    res["engine_partitioned"] = any(hasattr(p, "ds_id") for p in trainer.engine.model.parameters())
    trained, update = [], learner.update

    def recording_update(mini, old):  # what this rank's learner trains: the balanced share
        trained.append([len(r) for r in mini.response_ids])
        return update(mini, old)

    learner.update = recording_update
    from dapo_ref.algorithm import train_on

    updates, _ = train_on(learner, fixed_batch(), cfg.mini_batch_size)  # every rank holds the whole batch
    res.update(trained=trained, metrics=updates)
    learner.end_step()
    trainer.sync_weights()
    engine_sd = {n: t.clone() for n, t in trainer.engine.model.state_dict().items()}
    weights = {n: t.clone() for n, t in learner.named_weights()}
    res["engine_equal"] = all(torch.equal(engine_sd[k], v) for k, v in weights.items())
    with PeakRSS() as m:
        learner.save_model(out / "export")
    res["export_extra"], res["export_file"], res["export_shm"] = m.extra, m.file, m.shm  # file, shm: not counted
    save_pretrained_streamed(learner.model, out / "export8", shard_bytes=res["model_bytes"] // 8)  # several shards
    every = dist.all_gather(res)
    if rank == 0:
        torch.save(dict(ranks=every, weights=weights, grads=grads), out / "build.pt")
    dist.barrier()


LR_BUILD = 1e-4  # the learning rate of the `build` check's update (see tests/test_scale.py)


if __name__ == "__main__":
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from dapo_ref import dist

    dist.init_distributed()
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    if sys.argv[2:3] == ["build"]:
        run_build(sys.argv[3], out, *sys.argv[4:5])
    else:
        for s in sys.argv[2].split(",") if len(sys.argv) > 2 else ["3", "2", "3gc", "0", "3sp"]:
            run_stage(s, out)
    import torch.distributed

    torch.distributed.destroy_process_group()
    # several DeepSpeed engines were built in this process: leave without the interpreter's teardown, where a native
    # thread of one can abort the process after the results are saved (seen once in test_trainer's guard worker)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
