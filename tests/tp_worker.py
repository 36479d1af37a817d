"""One rank of the rollout-group checks in tests/test_tp.py (run it with torchrun, or alone for the one-process reference).

    torchrun --nproc_per_node 2 tests/tp_worker.py OUT_DIR TP     # TP = vllm_tensor_parallel (1 or 2)
    KILL_RANK=3 DIST_TIMEOUT=60 (4 ranks) ... OUT_DIR 2             # rank 3 kills itself (SIGKILL) before the first step
    python tests/tp_worker.py OUT_DIR 1                            # one process
    torchrun --nproc_per_node 4 tests/tp_worker.py OUT_DIR vllm ZERO EVAL [TP]  # real vLLM: 4 / TP engines (.venv-vllm; TP 2)

Two DAPO steps of the real `Trainer` (tiny policy, plain learner, dynamic sampling) with a recording stand-in for
the vLLM engine: `RecordingEngine` is a `VLLMRolloutEngine` whose `vllm.LLM` is replaced by a recorder, so
`around_update` runs its real memory order (the GPU one, `FULL_ORDER`) and the weight stream its real buckets, while
`generate` answers every (prompt, per-prompt seed, sample) deterministically: "Answer: <truth>" for about a third of
the samples (chosen by a hash of the three), a wrong answer otherwise. Two ranks of one engine given the same prompts
and seed therefore return the same completions, as vLLM's external_launcher engines do.

Each rank writes OUT_DIR/rank{r}.json: its generate calls (prompts, seed, completions), the recorder's memory calls,
the responses its learner trained in each step, and the step rows.

`vllm ZERO EVAL [TP]`: `dapo-train` itself (recipes/tiny-cpu.yaml, smaller steps) with rollout_backend vllm and
vllm_tensor_parallel TP (2): world / TP independent vLLM engines, each over TP consecutive ranks (external_launcher), the
learner at zero_stage ZERO on the same ranks, the held-out set EVAL (a file). Recorders around the engine's generate,
the learner's update, the trainer's step and evaluation; before the first step and after each step every rank compares
the engine's greedy completions of four training prompts with the learner's own weights decoded greedily by
transformers. Each rank writes OUT_DIR/vllm{r}.json."""

import hashlib, json, os, sys
from pathlib import Path

import torch

G, P, GEN, MINI, STEPS = 4, 4, 6, 8, 2  # group size, prompts per step, prompts per round, mini-batch, steps


class _LLMRecorder:
    "Stands in for `vllm.LLM` inside `around_update`: records the memory calls and the names each reload carries."

    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(f"sleep({level})")

    def wake_up(self, tags=None):
        self.calls.append(f"wake({tags[0]})" if tags else "wake")

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def collective_rpc(self, method, kwargs):
        self.calls.append([method, [n for n, _ in kwargs["weights_iterator"]]])


def recording_engine(tokenizer, truths: dict):
    "A `VLLMRolloutEngine` on a recorder; `truths` maps a prompt's token ids (tuple) to its ground truth."
    from dapo_ref.interfaces import Completion
    from dapo_ref.vllm_rollout import VLLMRolloutEngine, prompt_seeds, update_order

    class RecordingEngine(VLLMRolloutEngine):
        def generate(self, prompts, params, use_tqdm=False):
            if self._asleep:
                raise RuntimeError("generate() on a sleeping engine")
            seeds, comps = prompt_seeds(params.seed, len(prompts)), []
            for i, (p, s) in enumerate(zip(prompts, seeds)):
                for k in range(params.n):
                    h = hashlib.sha256(f"{tuple(p)}/{s}/{k}".encode()).digest()[0]
                    truth = truths[tuple(p)]
                    text = f"Answer: {truth}" if h % 3 == 0 else f"Answer: {int(truth) + 1 + h % 5}"
                    comps.append(
                        Completion(
                            i, tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id], "stop"
                        )
                    )
            self.generated.append(
                dict(
                    prompts=[list(p) for p in prompts],
                    seed=params.seed,
                    n=params.n,
                    completions=[c.token_ids for c in comps],
                )
            )
            return comps

        def around_update(self, update, weights):
            def recorded():
                self.llm.calls.append("update")
                return update()

            return super().around_update(recorded, weights)

    eng = RecordingEngine.__new__(RecordingEngine)
    eng.llm, eng.sleep_mode, eng.weight_bucket_bytes, eng._shapes, eng._tied = _LLMRecorder(), True, 0, None, False
    eng._asleep = eng._weights_awake = False
    eng.loaded = True  # the recorder answers from the start (a real engine with load_format="dummy" waits for a load)
    eng.update_order, eng.missing_steps = update_order(sleep_mode=True)  # the GPU order
    eng._release = lambda: eng.llm.calls.append("release")
    eng.generated, eng.eos_ids, eng.seeded_requests = [], None, True
    return eng


def main(out: Path, tp: int):
    import dataclasses
    from dapo_ref import dist
    from dapo_ref import trainer as T
    from dapo_ref.cli import config_from_dict
    from dapo_ref.tiny import tiny_splits
    from dapo_ref.policy import load_policy

    rank, world = dist.init_distributed()
    model, tok = load_policy("tiny")
    train = tiny_splits(64, 1, seed=0)[0]
    cfg = config_from_dict(
        dict(
            model="tiny",
            group_size=G,
            prompts_per_step=P,
            gen_batch_size=GEN,
            mini_batch_size=MINI,
            max_num_gen_batches=10,
            lr=1e-4,
            warmup_steps=0,
            l_max=32,
            l_cache=8,
            dtype="float32",
            gpus_per_node=world,
            rollout_backend="vllm",
            vllm_tensor_parallel=tp,
            vllm_enable_chunked_prefill=False,
            output_dir=str(out / f"run{world}-{tp}"),
            dist_timeout=float(os.environ.get("DIST_TIMEOUT", 1800)),
        )
    )
    check = T.check_run
    if T.importlib.util.find_spec("vllm") is None:  # the recorder stands in for vLLM, which this environment lacks:
        T.check_run = lambda c, w: (
            check(
                dataclasses.replace(
                    c,
                    rollout_backend="hf",
                    vllm_tensor_parallel=1,  # every other check
                    vllm_enable_chunked_prefill=True,
                ),
                w,
            ),
            c,
        )[1]
    prompt_ids = T.prompt_ids_for(train, tok, cfg)  # as the trainer encodes them (chat template, system prompt)
    eng = recording_engine(tok, {tuple(p): e.ground_truth for p, e in zip(prompt_ids, train)})
    tr = T.Trainer(
        cfg, train_examples=train, eval_examples=[], model=model, tokenizer=tok, engine=eng, progress=False, log=None
    )
    trained, update = [], tr.learner.update

    def recording_update(mini, old):  # the responses this rank's learner trains on
        trained[-1] += [[list(p), list(r)] for p, r in zip(mini.prompt_ids, mini.response_ids)]
        return update(mini, old)

    tr.learner.update = recording_update
    if os.environ.get("KILL_RANK") == str(rank):  # kill -9 of this rank as the job starts its first step
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    rows, weights = [], []
    for _ in range(STEPS):
        trained.append([])
        rows.append(tr.step())
        weights.append([n for n, _ in tr.learner.named_weights()])
    json.dump(
        dict(
            rank=rank,
            world=world,
            tp=tp,
            generated=eng.generated,
            memory=eng.llm.calls,
            trained=trained,
            weight_names=weights,
            prompt_ids=prompt_ids,
            full_order=list(eng.update_order),
            rows=[{k: v for k, v in r.items() if isinstance(v, (int, float, str))} for r in rows],
        ),
        open(out / f"rank{rank}.json", "w"),
    )
    dist.barrier()


def main_vllm(out: Path, zero: int, eval_data: str, tp: int = 2):
    """`dapo-train` itself (`dapo_ref.train.main`) on this rank of a torchrun job: real vLLM engines at TP `tp` (world / tp
    of them, independent), the learner at zero_stage ZERO on the same ranks, 2 steps; with recorders wrapped around the
    engine's generate, the learner's update, the trainer's step and evaluation, and an engine-vs-learner greedy check
    before the first step and after each (the weights the engine serves are the learner's, on every rank)."""
    import time
    from dapo_ref import dist, train
    from dapo_ref import trainer as T
    from dapo_ref.rollout import HFRolloutEngine
    from dapo_ref.interfaces import SamplingParams
    from dapo_ref.vllm_rollout import VLLMRolloutEngine, vllm_engine_kwargs

    t0, world = time.perf_counter(), int(os.environ["WORLD_SIZE"])
    rec = dict(generated=[], trained=[], pairs=[], rows=[], eval=[])
    greedy = SamplingParams(n=1, temperature=0, max_tokens=24)

    gen = VLLMRolloutEngine.generate

    def generate(self, prompts, params, use_tqdm=False):
        comps = gen(self, prompts, params, use_tqdm)
        rec["generated"].append(
            dict(
                prompts=[list(p) for p in prompts],
                seed=params.seed,
                n=params.n,
                completions=[c.token_ids for c in comps],
            )
        )
        return comps

    VLLMRolloutEngine.generate = generate

    from dapo_ref.learner import MicroBatchLearner

    upd = MicroBatchLearner.update

    def update(self, mini, old):  # the responses this rank's learner trains on
        rec["trained"][-1] += [[list(p), list(r)] for p, r in zip(mini.prompt_ids, mini.response_ids)]
        return upd(self, mini, old)

    MicroBatchLearner.update = update

    def compare(
        tr,
    ):  # every rank: the engine's greedy vs the learner's weights in transformers (a collective under ZeRO-3)
        probe = tr.prompt_ids[:4]
        got = [c.token_ids for c in gen(tr.engine, probe, greedy)]  # unrecorded
        hf = HFRolloutEngine(tr.learner.policy_copy(), eos_token_id=tr.engine.eos_ids, pad_token_id=tr.pad_id)
        rec["pairs"].append(dict(engine=got, learner=[c.token_ids for c in hf.generate(probe, greedy)]))

    fit, step, evaluate = T.Trainer.fit, T.Trainer.step, T.Trainer.evaluate

    def fit_(self, *a, **k):
        w = self.engine.llm.llm_engine.model_executor.driver_worker.worker  # vLLM's worker on this rank
        rec.update(
            executor=type(self.engine.llm.llm_engine.model_executor).__name__,
            vllm_rank=w.rank,
            vllm_local_rank=w.local_rank,
            vllm_device=str(w.device),
            rank_device=f"cuda:{dist.local_rank()}" if torch.cuda.is_available() else "cpu",
            local_rank=dist.local_rank(),
            learner=type(self.learner).__name__,
            update_order=list(self.engine.update_order),
            missing_steps=self.engine.missing_steps,
            vllm=self.engine.vllm_version,
            n_eval=len(self.eval_examples),
            engine_kwargs=vllm_engine_kwargs(self.cfg, self.world),
            vllm_dp=self.engine.llm.llm_engine.vllm_config.parallel_config.data_parallel_size,
        )
        compare(self)
        return fit(self, *a, **k)

    def step_(self):
        rec["trained"].append([])
        row = step(self)
        rec["rows"].append(
            {k: v for k, v in row.items() if isinstance(v, (int, float, str)) and not k.startswith("time")}
        )
        compare(self)
        return row

    def evaluate_(self):
        ev = evaluate(self)
        rec["eval"].append({k: v for k, v in ev.items() if not k.startswith("time")})
        return ev

    T.Trainer.fit, T.Trainer.step, T.Trainer.evaluate = fit_, step_, evaluate_

    rc = train.main(
        [
            "--config",
            str(Path(__file__).resolve().parents[1] / "recipes" / "tiny-cpu.yaml"),
            "--threads",
            "1",
            "--quiet",
            "rollout_backend=vllm",
            f"vllm_tensor_parallel={tp}",
            "vllm_enable_chunked_prefill=false",
            "vllm_gpu_memory_utilization=0.3",
            "vllm_enforce_eager=true",  # no torch.compile of the model on the CPU: the engine starts in seconds
            f"zero_stage={zero}",
            f"gpus_per_node={world}",
            f"group_size={VLLM_G}",
            "prompts_per_step=8",
            f"gen_batch_size={VLLM_GEN}",
            "max_num_gen_batches=10",
            "mini_batch_size=8",
            f"total_steps={os.environ.get('VLLM_STEPS', 2)}",
            "eval_every=0",
            "eval_k=1",
            f"eval_data={eval_data}",
            "save_every=0",
            f"dist_timeout={VLLM_DIST_TIMEOUT}",
            f"output_dir={out / 'run'}",
        ]
    )
    rec.update(rank=dist.rank(), world=world, rc=rc, total_s=time.perf_counter() - t0)
    json.dump(rec, open(out / f"vllm{dist.rank()}.json", "w"))
    return rc


VLLM_G = 2  # responses per prompt: about half the groups are all-equal (dropped) at the warm start's ~45% accuracy
VLLM_GEN = (
    9  # prompts per generation round: 5 on engine 0, 4 on engine 1 (uneven); 8 of 9 must be kept to finish a step
)
# in one round (P ~ 10/512 at a drop rate of 1/2): steps take several rounds
VLLM_DIST_TIMEOUT = (
    120  # seconds a rank may wait in a collective in the test: a hung engine fails the job, not the suite
)


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    if sys.argv[2] == "vllm":
        sys.exit(
            main_vllm(out, int(sys.argv[3]), sys.argv[4], *map(int, sys.argv[5:6]))
        )  # vLLM tears down its groups at exit
    else:
        main(out, int(sys.argv[2]))
        import torch.distributed

        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
