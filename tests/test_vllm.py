"""vLLM rollout backend (dapo_ref.vllm_rollout) run for real: on CPU through vllm-cpu in .venv-vllm
(`make test-vllm`), on GPUs through regular vLLM. Skipped as a whole where vllm is not importable
(the main .venv), so `pytest tests/` there only reports it skipped.

One engine for the whole module: starting vLLM takes 20-30 s here (plus ~50 s once per machine while
torch.compile fills ~/.cache/vllm); test_close_then_a_second_engine starts one more beside it (on the CPU), closes
it, and leaves a new engine as the module's. The model is a random 2-layer Qwen2 (hidden 128, 4 heads of 32:
vLLM's CPU attention needs head_dim >= 32) with a word-level tokenizer, built and saved here."""

import copy, dataclasses, gc, logging, os, warnings

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU (24 GiB machine)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process

import pytest

vllm = pytest.importorskip("vllm", reason="vllm is not installed (make test-vllm runs these tests in .venv-vllm)")

import torch

from dapo_ref.core import DAPOConfig
from dapo_ref.rollout import HFRolloutEngine
from dapo_ref.interfaces import SamplingParams
from dapo_ref.vllm_rollout import VLLMRolloutEngine, vllm_engine_kwargs

PAD = 0
VOCAB = 64
PROMPTS = [[5, 6, 7], [10, 11], [20, 21, 22, 23], [40]]
GREEDY = SamplingParams(n=1, temperature=0, max_tokens=10)
CUDA = torch.cuda.is_available()


def save_tiny_qwen2(out_dir, seed, eos_id):
    "Random Qwen2 (hidden 128, 4 heads of 32) + a word-level tokenizer with EOS = word `eos_id`, saved to out_dir."
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    words = ["<pad>"] + [f"w{i}" for i in range(1, VOCAB)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=words[eos_id], pad_token="<pad>").save_pretrained(out_dir)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        pad_token_id=PAD,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).float().eval()
    model.save_pretrained(out_dir)
    return model


@torch.no_grad()
def naive_greedy(model, prompt, max_tokens):
    "Greedy continuation by full forward passes, no EOS."
    seq, out = list(prompt), []
    for _ in range(max_tokens):
        nxt = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
        out.append(nxt)
        seq.append(nxt)
    return out


def ids(cs):
    return [c.token_ids for c in cs]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The policy, its EOS and a float32 engine on it. EOS = a token the policy's greedy path emits
    early for prompt 0, first seen there at a position >= 2 (chosen before the tokenizer is saved)."""
    d = tmp_path_factory.mktemp("policy")
    policy = save_tiny_qwen2(d, seed=0, eos_id=1)
    path0 = naive_greedy(policy, PROMPTS[0], GREEDY.max_tokens)
    pos = next(i for i in range(2, len(path0)) if path0[i] not in path0[:i] and path0[i] != PAD)
    eos = path0[pos]
    policy = save_tiny_qwen2(d, seed=0, eos_id=eos)  # same weights (same seed), tokenizer/config EOS = eos
    engine = VLLMRolloutEngine(
        d, dtype="float32", seed=0, max_model_len=256, gpu_memory_utilization=0.3, enforce_eager=not CUDA
    )  # CPU: no torch.compile of the model, starts in seconds
    out = dict(dir=d, policy=policy, eos=eos, eos_pos=pos, engine=engine)
    yield out
    out.clear()
    del engine
    gc.collect()


def check_endings(comps, eos, max_tokens):
    for c in comps:
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == eos and eos not in c.token_ids[:-1] and len(c.token_ids) <= max_tokens
            assert not c.truncated
        else:
            assert c.finish_reason == "length" and c.truncated
            assert len(c.token_ids) == max_tokens and eos not in c.token_ids


# ---------------------------------------------------------------- greedy, EOS and truncation
def test_greedy_matches_transformers(setup):
    eng, eos = setup["engine"], setup["eos"]
    got = eng.generate(PROMPTS, GREEDY)
    hf = HFRolloutEngine(copy.deepcopy(setup["policy"]), eos_token_id=eos, pad_token_id=PAD)
    want = hf.generate(PROMPTS, GREEDY)
    assert ids(got) == ids(want)
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
    assert [c.prompt_index for c in got] == [0, 1, 2, 3]


def test_eos_is_kept_and_counted(setup):
    "Prompt 0's greedy path emits EOS at position eos_pos: 'stop', EOS last, length eos_pos + 1 (both EOS rules)."
    eng, eos, pos = setup["engine"], setup["eos"], setup["eos_pos"]
    full = naive_greedy(setup["policy"], PROMPTS[0], GREEDY.max_tokens)
    for eos_ids in (None, [eos]):  # the model's own EOS (tokenizer + generation_config), then explicit stop ids
        eng.eos_ids = eos_ids
        try:
            c = eng.generate(PROMPTS[:1], GREEDY)[0]
        finally:
            eng.eos_ids = None
        assert c.finish_reason == "stop" and not c.truncated
        assert c.token_ids == full[: pos + 1] and c.token_ids[-1] == eos and len(c.token_ids) == pos + 1


def test_max_tokens_truncates(setup):
    "max_tokens below the EOS position: 'length', exactly max_tokens tokens, the greedy prefix; at the EOS position: 'stop'."
    eng, pos = setup["engine"], setup["eos_pos"]
    full = naive_greedy(setup["policy"], PROMPTS[0], GREEDY.max_tokens)
    c = eng.generate(PROMPTS[:1], SamplingParams(n=1, temperature=0, max_tokens=pos))[0]
    assert (c.finish_reason, c.truncated, c.token_ids) == ("length", True, full[:pos])
    c = eng.generate(PROMPTS[:1], SamplingParams(n=1, temperature=0, max_tokens=pos + 1))[0]
    assert (c.finish_reason, c.truncated, c.token_ids) == (
        "stop",
        False,
        full[: pos + 1],
    )  # EOS on the last allowed token


def test_explicit_eos_other_token(setup):
    "eos_ids replaces the model's EOS: stop on another token of the path, no longer on the tokenizer's EOS."
    eng = setup["engine"]
    full = naive_greedy(setup["policy"], PROMPTS[0], GREEDY.max_tokens)
    other = full[1] if full[1] != full[0] else full[0]
    first = full.index(other)
    eng.eos_ids = [other]
    try:
        c = eng.generate(PROMPTS[:1], GREEDY)[0]
    finally:
        eng.eos_ids = None
    assert (c.finish_reason, c.token_ids) == ("stop", full[: first + 1])


# ---------------------------------------------------------------- groups of G with the configured sampling
def test_groups_count_order_seed(setup):
    eng, eos = setup["engine"], setup["eos"]
    G, T = 4, 8
    sp = SamplingParams(n=G, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=T, seed=11)
    a = eng.generate(PROMPTS, sp)
    assert len(a) == len(PROMPTS) * G
    assert [c.prompt_index for c in a] == [i for i in range(len(PROMPTS)) for _ in range(G)]
    check_endings(a, eos, T)
    assert ids(eng.generate(PROMPTS, sp)) == ids(a)  # same seed, same samples
    b = eng.generate(PROMPTS, SamplingParams(n=G, temperature=1.0, max_tokens=T, seed=12))
    assert ids(b) != ids(a)  # another seed, other samples
    for i in range(len(PROMPTS)):  # samples of a group differ
        group = ids(a[i * G : (i + 1) * G])
        assert len({tuple(t) for t in group}) > 1
    # a prompt's samples do not depend on the other prompts of the call (per-prompt seeds)
    assert ids(eng.generate(PROMPTS[:2], sp)) == ids(a[: 2 * G])
    # the same prompt twice in one call: two different groups (vLLM seeds sample j with seed + j, so one
    # seed for the whole call would repeat the group)
    twice = ids(eng.generate([PROMPTS[0], PROMPTS[0]], sp))
    assert twice[:G] != twice[G:]


def test_unseeded_calls_are_random(setup):
    eng = setup["engine"]
    sp = SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=None)
    assert ids(eng.generate(PROMPTS, sp)) != ids(eng.generate(PROMPTS, sp))


def test_unseeded_requests_follow_the_process_stream(setup):
    """Why training requests stay seeded (nbs/07a_vllm.ipynb, "Seeds"): an unseeded request samples from process-wide
    state that the learner of the same process draws from too. On the CPU build (vLLM's V1 model runner:
    v1/sample/ops/topk_topp_sampler.py, forward_cpu) that is torch's global generator: reset it and the samples repeat,
    one draw from it elsewhere and they change; a seeded request ignores it. On GPUs vLLM 0.32's V2 runner draws an
    unseeded request's seed from NumPy's global stream instead (v1/worker/gpu/sample/states.py, add_request), which
    a checkpoint does not save either. Four prompts of 4 samples of 8 tokens: one extra draw shifts every row's noise,
    so equal samples after it would mean the stream is not the one used."""
    eng = setup["engine"]

    def after(params, seed, draws=0):
        torch.manual_seed(seed)
        if draws:
            torch.rand(draws)
        return ids(eng.generate(PROMPTS, params))

    unseeded = SamplingParams(n=4, temperature=1.0, max_tokens=8)
    assert after(unseeded, 3) == after(unseeded, 3)
    assert after(unseeded, 3, draws=1) != after(unseeded, 3)
    seeded = dataclasses.replace(unseeded, seed=5)
    assert after(seeded, 3) == after(seeded, 4, draws=1)


def test_sampling_knobs_reach_vllm(setup):
    "temperature 0, top_k 1 and a tiny top_p all reduce to greedy; each sample of the group is then the greedy path."
    eng = setup["engine"]
    greedy = ids(eng.generate(PROMPTS, GREEDY))
    for sp in (
        SamplingParams(n=3, temperature=0, max_tokens=10, seed=1),
        SamplingParams(n=3, temperature=1.0, top_k=1, max_tokens=10, seed=1),
        SamplingParams(n=3, temperature=1.0, top_p=1e-6, max_tokens=10, seed=1),
    ):
        assert ids(eng.generate(PROMPTS, sp)) == [g for g in greedy for _ in range(3)], sp


@torch.no_grad()
def test_first_token_distribution(setup):
    """400 one-token samples at temperature 0.7, top_k 5: every token is in the top 5 of the transformers logits
    and the frequencies match softmax(top-5 logits / 0.7) within 0.1: 4 sigma of a frequency of 400 draws
    (sd <= sqrt(0.25 / 400) = 0.025); distribution-free, Hoeffding gives P(|f - p| >= 0.1) <= 2 exp(-2 * 400 * 0.1^2)
    = 6.7e-4 per token, 3.4e-3 for the 5. The draws are seeded (seed=5)."""
    eng, policy = setup["engine"], setup["policy"]
    eng_eos, eng.eos_ids = eng.eos_ids, [PAD]  # PAD is never sampled here; only max_tokens ends a sample
    try:
        cs = eng.generate([PROMPTS[2]], SamplingParams(n=400, temperature=0.7, top_k=5, max_tokens=1, seed=5))
    finally:
        eng.eos_ids = eng_eos
    logits = policy(input_ids=torch.tensor([PROMPTS[2]])).logits[0, -1].double()  # (V,)
    top = logits.topk(5)
    probs = (top.values / 0.7).softmax(-1)
    counts = {int(t): 0 for t in top.indices}
    for c in cs:
        assert c.token_ids[0] in counts, f"token {c.token_ids[0]} outside the top 5"
        counts[c.token_ids[0]] += 1
    for t, p in zip(top.indices.tolist(), probs.tolist()):
        assert abs(counts[t] / 400 - p) < 0.1, (t, counts[t] / 400, p)  # see the docstring


# ---------------------------------------------------------------- weights from the learner
# 150 tokens: longer than one KV block (128 on CPU), so vLLM's prefix cache holds a block of it computed with
# the old weights unless load_weights drops the cache
LONG = [(7 * i) % 62 + 2 for i in range(150)]


@pytest.mark.parametrize("bucket_bytes", [1 << 30, 0])  # the whole model in one reload call; one layer per call
def test_load_weights_matches_transformers(setup, tmp_path, bucket_bytes):
    eng, eos, policy = setup["engine"], setup["eos"], setup["policy"]
    prompts = PROMPTS + [LONG]
    before = ids(eng.generate(prompts, GREEDY))  # also fills the prefix cache
    new = save_tiny_qwen2(tmp_path, seed=1, eos_id=eos)
    hf = HFRolloutEngine(copy.deepcopy(new), eos_token_id=eos, pad_token_id=PAD)
    want = hf.generate(prompts, GREEDY)
    eng.weight_bucket_bytes = bucket_bytes
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            eng.load_weights(new.state_dict().items())
        assert not [w for w in caught if "got no new tensor" in str(w.message)]  # every vLLM parameter updated
        got = eng.generate(prompts, GREEDY)
        assert ids(got) == ids(want) and ids(got) != before
        assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
        # a sampled group also comes from the new weights: with top_k 1 every sample is the new greedy path
        assert ids(eng.generate(prompts, SamplingParams(n=2, top_k=1, max_tokens=10, seed=3))) == [
            t for t in ids(want) for _ in range(2)
        ]
    finally:
        eng.weight_bucket_bytes = 1 << 30
        eng.load_weights(policy.state_dict().items())  # back to the module's policy
    assert ids(eng.generate(prompts, GREEDY)) == before


def test_load_weights_every_tensor_changes_output(setup):
    """Perturb one tensor at a time (every tensor of layer 1, the norm, the head): vLLM's greedy path must follow
    transformers each time, so no tensor is silently left behind (the CPU backend repacks linear weights)."""
    eng, eos, policy = setup["engine"], setup["eos"], setup["policy"]
    base = {k: v.clone() for k, v in policy.state_dict().items()}
    layer = [k for k in base if k.startswith("model.layers.1.")]
    g = torch.Generator().manual_seed(0)
    before = ids(eng.generate(PROMPTS, GREEDY))
    try:
        for name in layer + ["model.norm.weight", "lm_head.weight", "model.embed_tokens.weight"]:
            sd = dict(base)
            sd[name] = base[name] + torch.randn(base[name].shape, generator=g) * 0.5
            model = copy.deepcopy(policy)
            model.load_state_dict(sd)
            want = HFRolloutEngine(model, eos_token_id=eos, pad_token_id=PAD).generate(PROMPTS, GREEDY)
            assert ids(want) != before, f"perturbing {name} does not change greedy decoding: the check would be blind"
            # send whole layers only: the perturbed one and everything else unchanged
            eng.load_weights(sd.items())
            assert ids(eng.generate(PROMPTS, GREEDY)) == ids(want), name
    finally:
        eng.load_weights(base.items())


@pytest.mark.parametrize("bucket_bytes", [1 << 30, 0])
def test_load_weights_partial_warns(setup, tmp_path, bucket_bytes):
    "A load that leaves out layer 1: a warning names its parameters, and the engine runs old layer 1 with the new rest."
    eng, eos, policy = setup["engine"], setup["eos"], setup["policy"]
    new = save_tiny_qwen2(tmp_path, seed=1, eos_id=eos)
    part = {k: v for k, v in new.state_dict().items() if not k.startswith("model.layers.1.")}
    eng.weight_bucket_bytes = bucket_bytes
    try:
        with pytest.warns(UserWarning, match=r"got no new tensor and keep their old values: \['model\.layers\.1\."):
            eng.load_weights(part.items())
        mixed = copy.deepcopy(policy)
        mixed.load_state_dict(part, strict=False)
        want = HFRolloutEngine(mixed, eos_token_id=eos, pad_token_id=PAD).generate(PROMPTS, GREEDY)
        assert ids(eng.generate(PROMPTS, GREEDY)) == ids(want)
    finally:
        eng.weight_bucket_bytes = 1 << 30
        eng.load_weights(policy.state_dict().items())


def test_load_weights_errors(setup):
    eng, policy = setup["engine"], setup["policy"]
    sd = policy.state_dict()
    with pytest.raises(KeyError, match="did you mean"):
        eng.load_weights([("model.layers.0.self_attn.q_prj.weight", sd["model.layers.0.self_attn.q_proj.weight"])])
    with pytest.raises(ValueError, match="shape mismatch"):
        eng.load_weights([("model.norm.weight", torch.ones(3))])
    with pytest.raises(ValueError, match="is missing"):
        eng.load_weights([("model.layers.0.self_attn.q_proj.weight", sd["model.layers.0.self_attn.q_proj.weight"])])
    assert ids(eng.generate(PROMPTS, GREEDY)) == ids(
        HFRolloutEngine(copy.deepcopy(policy), eos_token_id=setup["eos"], pad_token_id=PAD).generate(PROMPTS, GREEDY)
    )


def test_dummy_weights_wait_for_a_whole_load(setup):
    "An engine started with load_format='dummy' refuses to generate before a load, and its first load must cover every parameter."
    eng, policy = setup["engine"], setup["policy"]
    eng.loaded = False  # as load_format="dummy" leaves it
    try:
        with pytest.raises(RuntimeError, match="before any load_weights"):
            eng.generate(PROMPTS, GREEDY)
        part = {k: v for k, v in policy.state_dict().items() if not k.startswith("model.layers.1.")}
        with pytest.raises(RuntimeError, match="random from load_format='dummy'"):
            eng.load_weights(part.items())
        assert eng.loaded is False
    finally:
        eng.load_weights(policy.state_dict().items())
    assert eng.loaded is True


def test_close_then_a_second_engine(setup, monkeypatch, caplog):
    """close() gives a next engine of the process what it needs (nbs/07a_vllm.ipynb, "Closing"). On the CPU, closing an
    engine while another is open leaves the shared vLLM state alone (the other still generates), and its close() says
    nothing (no device count). Closing the process's last engine tears down vLLM's process groups (its world and
    tensor-parallel groups, which the code before this change kept: a next engine of another tensor-parallel size
    would have failed vLLM's size check), and a new engine then starts and generates the policy's greedy tokens.
    close() is idempotent. Its one line is checked with a stand-in for torch.cuda.mem_get_info: 60 GiB free at the
    start, 57.5 GiB after close, 80 GiB in all -> "2.5 GiB less", logged as a warning (at least 1 GiB short)."""
    from vllm.distributed import parallel_state as ps

    kw = dict(dtype="float32", seed=0, max_model_len=256, gpu_memory_utilization=0.3, enforce_eager=not CUDA)
    hf = HFRolloutEngine(copy.deepcopy(setup["policy"]), eos_token_id=setup["eos"], pad_token_id=PAD)
    ref = ids(hf.generate(PROMPTS, GREEDY))
    first = setup["engine"]
    if not CUDA:  # on GPUs one engine at a time: a vLLM worker's shutdown releases the process's sleep-mode pools
        second = VLLMRolloutEngine(setup["dir"], **kw)  # beside the module's engine
        assert ids(second.generate(PROMPTS, GREEDY)) == ref
        assert second.close() is None and second.close() is None  # the CPU: no line; idempotent
        assert ps.model_parallel_is_initialized()  # the module's engine is open: vLLM's groups stay
        assert ids(first.generate(PROMPTS, GREEDY)) == ref
    GiB = 2**30
    first._free_at_start = (0, 60 * GiB)  # what a start on cuda:0 notes (the CPU notes nothing)
    with monkeypatch.context() as m, caplog.at_level(logging.INFO, logger="dapo_ref.vllm_rollout"):
        m.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(57.5 * GiB), 80 * GiB))
        line = first.close()
    assert "cuda:0 has 57.5 GiB of 80.0 GiB free, 2.5 GiB less than before the engine started" in line, line
    assert caplog.records[-1].getMessage() == line and caplog.records[-1].levelno == logging.WARNING
    assert first.close() is None  # idempotent
    assert not ps.model_parallel_is_initialized() and ps._WORLD is None  # the process's last engine: torn down
    third = VLLMRolloutEngine(setup["dir"], **kw)
    setup["engine"] = third  # the module's engine from here on
    assert ids(third.generate(PROMPTS, GREEDY)) == ref


def test_sleep_wake_noop_on_cpu(setup):
    eng = setup["engine"]
    if CUDA:
        pytest.skip("CPU behaviour")
    assert eng.sleep_mode is False
    before = ids(eng.generate(PROMPTS, GREEDY))
    eng.sleep()
    eng.load_weights(setup["policy"].state_dict().items())
    eng.wake()
    assert ids(eng.generate(PROMPTS, GREEDY)) == before


def test_from_config_maps_fields(setup):
    cfg = DAPOConfig(
        rollout_backend="vllm",
        vllm_tensor_parallel=1,
        vllm_gpu_memory_utilization=0.5,
        vllm_enable_chunked_prefill=False,
        dtype="float32",
        seed=3,
        max_prompt_length=16,
        l_max=32,
        l_cache=8,
    )
    kw = vllm_engine_kwargs(cfg)
    assert kw == dict(
        tensor_parallel_size=1,
        gpu_memory_utilization=0.5,
        enable_chunked_prefill=False,
        enforce_eager=False,
        dtype="float32",
        seed=3,
        load_format="dummy",
        logprobs_mode="processed_logprobs",
        max_model_len=48,
        disable_custom_all_reduce=True,
    )
    from vllm.engine.arg_utils import EngineArgs  # every key is one this vLLM takes

    assert set(kw) - {f.name for f in dataclasses.fields(EngineArgs)} == set(), kw
    assert vllm_engine_kwargs(DAPOConfig(rollout_backend="vllm", vllm_enforce_eager=True))["enforce_eager"] is True
    mc = setup["engine"].llm.llm_engine.model_config
    assert str(mc.dtype) == "torch.float32" and mc.max_model_len == 256 and mc.seed == 0


# ---------------------------------------------------------------- GPU only: sleep / wake, tensor parallelism
@pytest.mark.skipif(not CUDA, reason="needs CUDA (regular vLLM on GPUs)")
@pytest.mark.parametrize("level", [1, 2])
def test_gpu_sleep_wake(setup, level):
    """Sleep frees GPU memory; generate refuses while asleep; load_weights wakes only the weights and refills them;
    wake brings the KV cache back; greedy output is what transformers gives."""
    eng, eos, policy = setup["engine"], setup["eos"], setup["policy"]
    assert eng.sleep_mode is True
    want = ids(HFRolloutEngine(copy.deepcopy(policy), eos_token_id=eos, pad_token_id=PAD).generate(PROMPTS, GREEDY))
    assert ids(eng.generate(PROMPTS, GREEDY)) == want
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    eng.sleep(level=level)
    # 256 MiB: sleep releases the KV cache, >= 0.3 x 16 GiB less a tiny model (~4.8 GiB) on any GPU of >= 16 GiB, so
    # the margin separates a release from allocator noise (tens of MiB) and is < 1/18 of the smallest expected release
    assert torch.cuda.mem_get_info()[0] > free0 + (1 << 28)
    with pytest.raises(RuntimeError, match="sleeping"):
        eng.generate(PROMPTS, GREEDY)
    eng.load_weights(policy.state_dict().items())
    eng.wake()
    assert ids(eng.generate(PROMPTS, GREEDY)) == want


@pytest.mark.skipif(not CUDA, reason="needs CUDA (regular vLLM on GPUs)")
def test_gpu_around_update(setup, tmp_path):
    """The full memory order on a GPU: the update runs with the engine's weights and KV cache discarded (sleep level 2:
    more free memory than the KV cache alone would give back), generate refuses meanwhile, and afterwards the engine
    serves exactly the new weights (greedy = transformers)."""
    from dapo_ref.vllm_rollout import FULL_ORDER

    eng, eos, policy = setup["engine"], setup["eos"], setup["policy"]
    assert eng.update_order == list(FULL_ORDER) and eng.missing_steps == []
    new = save_tiny_qwen2(tmp_path, seed=1, eos_id=eos)
    want = ids(HFRolloutEngine(copy.deepcopy(new), eos_token_id=eos, pad_token_id=PAD).generate(PROMPTS, GREEDY))
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    seen = []

    def update():
        torch.cuda.synchronize()
        seen.append(torch.cuda.mem_get_info()[0])
        with pytest.raises(RuntimeError, match="sleeping"):
            eng.generate(PROMPTS, GREEDY)
        return "done"

    try:
        assert eng.around_update(update, lambda: new.state_dict().items()) == "done"
        assert seen[0] > free0 + (1 << 28)  # 256 MiB: see test_gpu_sleep_wake (the KV cache alone is GiBs)
        assert ids(eng.generate(PROMPTS, GREEDY)) == want
    finally:
        eng.load_weights(policy.state_dict().items())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (tensor parallel 2)")
def test_gpu_tensor_parallel(setup, tmp_path):
    "Tensor parallel 2: greedy as transformers, new weights (one layer per call) sharded correctly, sleep/wake. Runs last."
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    d, eos, policy = setup["dir"], setup["eos"], setup["policy"]
    setup.pop("engine").llm = None
    gc.collect()  # free the module engine and its process group
    destroy_model_parallel()
    destroy_distributed_environment()
    torch.cuda.empty_cache()
    eng = VLLMRolloutEngine(
        d,
        dtype="float32",
        seed=0,
        max_model_len=256,
        tensor_parallel_size=2,
        gpu_memory_utilization=0.3,
        weight_bucket_bytes=0,
    )
    hf = HFRolloutEngine(copy.deepcopy(policy), eos_token_id=eos, pad_token_id=PAD)
    assert ids(eng.generate(PROMPTS, GREEDY)) == ids(hf.generate(PROMPTS, GREEDY))
    new = save_tiny_qwen2(tmp_path, seed=1, eos_id=eos)
    eng.sleep(level=2)
    eng.load_weights(new.state_dict().items())
    eng.wake()
    hf.load_weights(new.state_dict().items())
    assert ids(eng.generate(PROMPTS, GREEDY)) == ids(hf.generate(PROMPTS, GREEDY))


# ---------------------------------------------------------------- dapo-train with rollout_backend: vllm
@pytest.mark.skipif(CUDA, reason="the CPU backend's limit")
def test_chunked_prefill_on_cpu_is_refused_by_name():
    from dapo_ref.trainer import check_run

    with pytest.raises(ValueError, match="vllm_enable_chunked_prefill"):
        check_run(DAPOConfig(rollout_backend="vllm"))
    assert check_run(DAPOConfig(rollout_backend="vllm", vllm_enable_chunked_prefill=False)).rollout_backend == "vllm"


def launch_vllm_job(tmp_path, tp: int, steps: int = 2):
    """torchrun --nproc_per_node 4 of tests/tp_worker.py's `dapo-train` with real vLLM engines at tensor parallel `tp`,
    the held-out set one problem (so all engines but the first have nothing to evaluate); each rank's record."""
    import json, socket, subprocess, sys
    from pathlib import Path
    from dapo_ref.data import save_math_dataset
    from dapo_ref.tiny import tiny_splits

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tests"))
    held = tiny_splits(64, 1, seed=0)[1][:1]  # one held-out problem, several engines
    eval_data = save_math_dataset(held, tmp_path / "one_problem.jsonl")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "VLLM_STEPS": str(steps),
    }
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "4",
            "--master_port",
            port,
            str(root / "tests" / "tp_worker.py"),
            str(tmp_path),
            "vllm",
            "3",
            str(eval_data),
            str(tp),
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )  # hang guard
    assert p.returncode == 0, p.stderr[-4000:]
    return [json.loads((tmp_path / f"vllm{k}.json").read_text()) for k in range(4)]


# ---------------------------------------------------------------- the real run's shape in miniature: 4 ranks, 2 engines
@pytest.mark.skipif(CUDA, reason="the CPU miniature of the colocated layout (four CPU processes)")
@pytest.mark.ranks
def test_four_ranks_two_independent_tp2_engines(tmp_path):
    """torchrun --nproc_per_node 4 running `dapo-train` (tests/tp_worker.py): two independent vLLM engines at
    tensor_parallel_size 2 (ranks 0-1 and 2-3, external_launcher, no vLLM data-parallel group), the learner at
    zero_stage 3 on the same ranks, 2 DAPO steps. The 32B recipe's layout shrunk: rounds of 9 prompts split 5 + 4
    between the engines (uneven shares), several dynamic-sampling rounds a step (engines finish at different times),
    and a held-out set of one problem for two engines: engine 1 has nothing to evaluate and goes straight to
    the gather. With the engines joined in one vLLM data-parallel group (the old `data_parallel_size = world // tp`)
    this job hung at its first evaluation: engine 0 waits inside vLLM for engine 1, which never calls generate; here
    `dist_timeout` (120 s) turns such a wait into an error, and the subprocess timeout bounds the test.
    Checked: the job finishes; the two ranks of an engine pass the same prompts and seeds and get the same completions;
    the engines' shares of a round are disjoint, 5 and 4; each group is counted once (groups_seen = 9 x rounds); the
    responses the four learners train in a step are the step's batch, each once (8 groups x 2); before the first step
    and after each sync every engine's greedy completions equal the learner's weights decoded greedily by transformers
    (the engine started from dummy weights: the first sync replaced all of them); the evaluation agrees on every rank."""
    r = launch_vllm_job(tmp_path, tp=2)
    import tp_worker  # on the path now

    assert all(x["rc"] == 0 and x["world"] == 4 for x in r)
    assert r[0]["engine_kwargs"]["distributed_executor_backend"] == "external_launcher"
    assert all(x["vllm_dp"] == 1 for x in r)  # independent engines: vLLM itself runs no data-parallel group
    assert r[0]["engine_kwargs"]["load_format"] == "dummy"
    assert r[0]["generated"] == r[1]["generated"] and r[2]["generated"] == r[3]["generated"]  # one engine, one stream
    G = tp_worker.VLLM_G
    train0 = [g for g in r[0]["generated"] if g["seed"] is not None and g["n"] == G]  # the training rounds
    train1 = [g for g in r[2]["generated"] if g["seed"] is not None and g["n"] == G]
    rows = r[0]["rows"]
    assert len(train0) == len(train1) == sum(x["gen_rounds"] for x in rows)  # every round on both engines
    assert sum(x["gen_rounds"] for x in rows) > len(rows)  # dynamic sampling dropped groups: rounds were resampled
    for a, b in zip(train0, train1):
        pa, pb = {tuple(q) for q in a["prompts"]}, {tuple(q) for q in b["prompts"]}
        assert (len(pa), len(pb)) == (5, 4) and not pa & pb  # uneven, disjoint shares of the round's 9 prompts
    assert [x["groups_seen"] for x in rows] == [tp_worker.VLLM_GEN * x["gen_rounds"] for x in rows]  # each group once
    from dapo_ref.trainer import strip_timing

    untimed = lambda rows: [
        {k: v for k, v in strip_timing(x).items() if not k.endswith("per_s")} for x in rows
    ]  # rates and the ETA (perf/eta_s): each rank's clock
    assert all(untimed(x["rows"]) == untimed(rows) for x in r)  # every rank's step rows agree
    for s in range(len(rows)):
        union = [tuple(map(tuple, pr)) for x in r for pr in x["trained"][s]]
        per_prompt = {}
        for q, resp in union:
            per_prompt.setdefault(q, []).append(resp)
        assert len(union) == 8 * G and len(per_prompt) == 8 and all(len(v) == G for v in per_prompt.values())
    assert rows[-1]["grad_updates"] == 4  # 8 groups x 2 / 8 per update, 2 steps
    # the rollout-learner gap: the engines sampled from the learner's old policy. Both sides are float32 with the same
    # weights: d is kernel rounding, a few hundred ulps of log-probs of size ~1-10 at most (u = 6e-8: ~1e-5). An engine one
    # update behind would sit at the update's own size, which these rows show: ratio_min/max 0.92-1.13 (|log r| up to
    # 0.12) and approx_kl ~1e-4, i.e. an rms |log r| ~ sqrt(2e-4) = 1.4e-2. The bounds sit 100x below that and ~10x above
    # rounding (measured here: mean 4e-7, max 1e-5).
    for x in rows:
        assert (
            x["rollout_logp_diff_mean"] < 1e-4 and x["rollout_logp_diff_max"] < 1e-3 and 0 <= x["rollout_kl_k3"] < 1e-6
        ), x
    for x in r:
        assert len(x["pairs"]) == 3 and all(
            pair["engine"] == pair["learner"] for pair in x["pairs"]
        )  # the learner's weights
    assert (
        r[0]["pairs"][0]["engine"] != r[0]["pairs"][-1]["engine"]
    )  # the updates moved the greedy path: not a blind check
    assert r[0]["n_eval"] == 1 and len(r[0]["eval"]) == 2  # held-out at the start and the end, on every rank alike
    assert all(x["eval"] == r[0]["eval"] for x in r) and 0 <= r[0]["eval"][-1]["eval_acc"] <= 1
    evals = lambda x: [g for g in x["generated"] if g["n"] == 1 and g["seed"] is not None]
    assert len(evals(r[0])) == 2 and evals(r[2]) == []  # engine 1 had nothing to evaluate: it never called generate
    assert r[0]["update_order"] == ["update", "release", "load", "release", "reset_prefix_cache"]
    assert "no sleep mode" in r[0]["missing_steps"][0]


@pytest.mark.skipif(CUDA, reason="the CPU miniature of the colocated layout (four CPU processes)")
@pytest.mark.ranks
def test_four_ranks_four_tp1_engines(tmp_path):
    """The 7B recipe's layout shrunk (tensor parallel 1: one engine per rank), 4 ranks, ZeRO-3, one DAPO step and the
    held-out evaluation. Every engine must be an external-launcher engine on its own rank: with vLLM's default
    single-process executor (what `vllm_engine_kwargs` chose at tensor parallel 1 before) every engine starts as
    vLLM's rank 0 on local rank 0, i.e. on device 0 of its node, whatever the job's rank. Checked: the job finishes;
    each rank's vLLM worker has the job's rank and local rank and its rank's device string; no vLLM data-parallel
    group; a round's 9 prompts go to the four engines in disjoint shares of 3, 2, 2, 2; after the sync every engine
    serves the learner's weights (greedy completions equal transformers' on the learner's weights); with one held-out
    problem only engine 0 evaluates, and every rank reports the same evaluation."""
    r = launch_vllm_job(tmp_path, tp=1, steps=1)
    import tp_worker

    assert all(x["rc"] == 0 and x["world"] == 4 for x in r)
    for k, x in enumerate(r):
        assert x["engine_kwargs"]["distributed_executor_backend"] == "external_launcher", x["engine_kwargs"]
        assert x["engine_kwargs"]["tensor_parallel_size"] == 1 and x["vllm_dp"] == 1
        assert x["executor"] == "ExecutorWithExternalLauncher", x["executor"]
        assert (x["vllm_rank"], x["vllm_local_rank"], x["vllm_device"]) == (k, x["local_rank"], x["rank_device"]), x
    G = tp_worker.VLLM_G
    rounds = [[g for g in x["generated"] if g["seed"] is not None and g["n"] == G] for x in r]  # training rounds
    assert len({len(x) for x in rounds}) == 1 and len(rounds[0]) == r[0]["rows"][0]["gen_rounds"] >= 1
    for shares in zip(*rounds):
        sets = [{tuple(q) for q in g["prompts"]} for g in shares]
        assert sorted(map(len, sets), reverse=True) == [3, 2, 2, 2]
        assert len(set().union(*sets)) == tp_worker.VLLM_GEN  # disjoint
    assert r[0]["rows"][-1]["grad_updates"] >= 1
    for x in r:
        assert len(x["pairs"]) == 2 and all(pair["engine"] == pair["learner"] for pair in x["pairs"])
    assert r[0]["n_eval"] == 1 and len(r[0]["eval"]) == 2 and all(x["eval"] == r[0]["eval"] for x in r)
    evals = lambda x: [g for g in x["generated"] if g["n"] == 1 and g["seed"] is not None]
    assert len(evals(r[0])) == 2 and all(evals(x) == [] for x in r[1:])  # engines 1-3 had nothing to evaluate


# ---------------------------------------------------------------- dapo-eval --backend vllm --tensor-parallel 2
@pytest.mark.ranks
def test_dapo_eval_vllm_tp2_matches_transformers_greedy(tmp_path):
    """`dapo-eval --backend vllm --tensor-parallel 2` (one process; vLLM starts its two workers) on the tiny model and 8
    held-out problems, greedy: every problem's predictions, and so avg@k / pass@k / maj@k, equal `--backend hf`'s."""
    import json, subprocess, sys
    from pathlib import Path
    from dapo_ref.data import save_math_dataset
    from dapo_ref.tiny import tiny_splits

    root = Path(__file__).resolve().parents[1]
    data = save_math_dataset(tiny_splits(64, 16, seed=0)[1][:8], tmp_path / "held.jsonl")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        **({} if CUDA else {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}),
    }  # vLLM's CPU workers: one core each
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # two workers: vLLM's multiprocessing executor
    res = {}
    for backend in ("vllm", "hf"):
        out = tmp_path / f"{backend}.json"
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "dapo_ref.eval_cli",
                "--backend",
                backend,
                "--model",
                "tiny",
                "--data",
                str(data),
                "--k",
                "2",
                "--temperature",
                "0",
                "--max-tokens",
                "48",
                "--out",
                str(out),
                *(["--tensor-parallel", "2"] if backend == "vllm" else []),
            ],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        res[backend] = json.loads(out.read_text())
    v, h = res["vllm"], res["hf"]
    assert v["backend"] == "vllm" and v["tensor_parallel"] == 2 and v["n_prompts"] == 8
    assert [q["preds"] for q in v["per_prompt"]] == [q["preds"] for q in h["per_prompt"]]
    assert (v["avg@k"], v["pass@k"], v["maj@k"]) == (h["avg@k"], h["pass@k"], h["maj@k"])


# ---------------------------------------------------------------- benchmarks/gpu_check.py --cpu: its phases on the CPU
def test_gpu_check_cpu(tmp_path):
    """The one-GPU check's phases at tiny shapes (so the script cannot rot), in a process where pytest cannot be imported:
    a ZeRO-3 learner (float32) and a vLLM engine
    (bfloat16) in one process, one DAPO step (rollout-corrected), the engine's log-probs against the learner's after it, the bf16 fused-gradient check, the
    engine closed and a new one started and synced, then the 7B recipe's LoRA adapters served by a LoRA engine through 3 syncs (10 on a GPU). On the
    CPU it says what it skipped (compiled engine, sleep mode)."""
    import json, subprocess, sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "gc"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    (tmp_path / "site").mkdir()  # pytest not importable, as after `pip install -e ".[scale]"`: the check needs none
    (tmp_path / "site" / "sitecustomize.py").write_text("import sys\nsys.modules['pytest'] = None\n")
    env["PYTHONPATH"] = str(tmp_path / "site")
    p = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--cpu", "--out", str(out)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )  # hang guard
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    s = json.loads((out / "gpu_check.json").read_text())
    phases = [x["phase"] for x in s["phases"]]
    assert phases == ["build", "step", "sync", "fused", "seeds", "free", "restart", "lora"], phases
    seeds = s["phases"][
        4
    ]  # decode with and without per-request seeds: both ran (their speed is the GPU run's question)
    assert seeds["seeded_tok_s"] > 0 and seeds["unseeded_tok_s"] > 0, seeds
    assert len(s["checks"]) == 7 and all(s["checks"].values()), s["checks"]
    # LoRA (nbs/07c_lora): the bfloat16 engine, after loading the merged adapters, is within the bf16 sync bound of the
    # adapted float32 learner on tokens it sampled, while the adapters moved those log-probs by more than twice that gap
    lora = s["phases"][-1]  # the 7B recipe's adapters served by a LoRA engine (bf16) through 10 syncs
    assert lora["trained"] > 0 and lora["gap_tokens"] > 0 and lora["adapter_syncs"] == 4, lora  # --cpu: 3 syncs
    assert s["phases"][0]["engine"] == "VLLMRolloutEngine" and s["phases"][0]["learner"] == "DeepSpeedLearner"
    assert any("sleep" in x for x in s["skipped"]) and any("compiled" in x for x in s["skipped"])
    assert set(s["plan"]["phases_gb"]) >= {"load", "update"}  # dapo-plan's prediction for the shape was read
    assert "[skipped] sleep/wake" in p.stdout and "[ok] fused" in p.stdout
    # the CPU run's engine is bfloat16 beside the float32 learner (vllm_dtype), and its update is corrected with the
    # engine's own log-probs (rollout_correction: token_truncate, nbs/04b). Float32 on both sides differs by kernel
    # rounding, mean |d| < 1e-4 (test_four_ranks_two_independent_tp2_engines' bound); a bfloat16 engine (weights
    # rounded to 8 significant bits) must sit above that bound and below the bf16 sync tolerance, or it is not the
    # engine that sampled. E_rollout[w] = sum of pi_old = 1, so the mean weight sits near 1; a token's w = e^d, and
    # engine log-probs shifted by one token would give |d| ~ 1 (other tokens' log-probs), the sync check's failure.
    build, step = s["phases"][0], s["phases"][1]
    assert build["engine_dtype"] == "bfloat16", build
    assert 1e-4 < step["rollout_logp_diff_mean"] < 0.1 and abs(step["rollout_w_mean"] - 1) < 0.1, step
    assert step["rollout_w_max"] > 1 and 0 <= step["rollout_w_truncated_frac"] < 1, step
    assert step["rollout_w_masked_frac"] == 0, step  # token_truncate masks nothing
    assert step["rollout_seq_log_w_std"] > 0 and step["grad_updates"] >= 1 and step["skipped"] == 0, step


# ---------------------------------------------------------------- nbs/09b_one_gpu.ipynb: its CPU-sized twin
def test_one_gpu_notebook_cpu_twin(tmp_path):
    """09b's cells, `gpu` ones included, in one process at tiny sizes (tests/twin_09b.py lists the only changes): the
    recipe and plan, `train(run)` with ZeRO-2 and vLLM, whose engine evaluates the held-out set at step 0 and after
    the last step, then those evaluations read back from metrics.jsonl: no second engine in the process (vLLM's CPU
    build has no sleep mode: what only the GPU run shows is in benchmarks/README.md)."""
    import json, subprocess, sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
    }
    p = subprocess.run(
        [sys.executable, "tests/twin_09b.py", str(tmp_path)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )  # hang guard
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    line = next(l for l in p.stdout.splitlines() if l.startswith("twin: "))
    r = json.loads(line[len("twin: ") :])
    assert r["backend"] == "vllm" and r["zero_stage"] == 2 and r["steps"] == 1 and r["grad_updates"] >= 1, r
    assert all(0 <= a <= 1 for a in r["evals"]) and "eval/avg@1" in r["eval_keys"] and r["final"], r


def lora_engine(path, lora_config) -> VLLMRolloutEngine:
    "A float32 engine serving adapters (`lora_config`) on the checkpoint at `path`, as small as this module's engine."
    return VLLMRolloutEngine(
        path,
        dtype="float32",
        seed=0,
        max_model_len=256,
        gpu_memory_utilization=0.3,
        enforce_eager=not CUDA,
        lora_config=lora_config,
    )


# ---------------------------------------------------------------- gpu_check's LoRA phase on this module's policy
def test_gpu_check_lora_phase_serves_the_recipes_adapters(setup):
    """gpu_check's `lora` phase (the 7B recipe's r 64, alpha 128, lr 1e-5) on this module's policy, float32: a LoRA
    engine started on the policy's folder serves the learner's adapters through 10 `around_update` syncs (11 adapter
    ids: the first at the start), and its log-probs of tokens it samples equal the learner's within float32 kernel
    rounding (test_four_ranks_two_independent_tp2_engines' bounds: mean < 1e-4, max < 1e-3), while the 10 updates
    moved the learner's log-probs of the batch by more than 10x that mean bound (an engine serving a stale adapter, or
    none, would miss a share of the move). The phase also reports how much of the update a bf16 merge into W0 would
    lose: at lr 1e-5 most of it (test_lora_engine_serves_the_adapters_the_learner_applies measures the served policy
    against the merged one)."""
    import sys
    from pathlib import Path
    from dapo_ref.lora import adapter_config

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from gpu_check import lora_phase

    def make(lcfg, learner):
        eng = lora_engine(setup["dir"], adapter_config(lcfg))
        eng.load_weights(learner.sync_weights())
        return eng

    lo = lora_phase(DAPOConfig(dtype="float32"), setup["dir"], make, PROMPTS, 12, PAD)
    assert lo["trained"] > 0 and lo["gap_tokens"] > 0 and lo["adapter_syncs"] == 11, lo
    assert lo["gap_mean"] < 1e-4 and lo["gap_max"] < 1e-3 and lo["moved_mean"] > 1e-3, lo
    assert lo["bf16_merge_lost_frac"] > 0.5, lo  # what the merged design would have lost at this learning rate


# ---------------------------------------------------------------- LoRA: the engine serves the learner's adapters
@torch.no_grad()
def token_logps(model, prompts, comps) -> torch.Tensor:
    "`model`'s log-probs (float32 log-softmax, temperature 1) of each completion's tokens after its prompt, concatenated."
    out = []
    for c in comps:
        ids = torch.tensor([prompts[c.prompt_index] + c.token_ids])
        lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)  # (L, V)
        k = len(prompts[c.prompt_index])
        out.append(lp[k - 1 : -1].gather(-1, ids[0, k:, None])[:, 0])
    return torch.cat(out)


def test_lora_engine_serves_the_adapters_the_learner_applies(setup, tmp_path):
    """LoRA at the 7B recipe's settings (r 64, alpha 128, AdamW lr 1e-5; nbs/07c_lora.ipynb): a bf16 learner over the
    module's policy rounded to bf16, 10 updates, then the engine in LoRA mode (vLLM's LoRA layers on the base read
    from its folder, `load_weights(learner.sync_weights())`: the adapters alone). The engine computes in float32 over
    the same bf16-valued base: so the only rounding on the way from the learner's tensors to the engine's policy is the
    merge's, where the merged path takes it, and a float32 reference (the learner's PEFT model in float32: its W0, its
    adapters) is the policy both should serve. (A bf16 engine would add bf16 kernel noise as large as a 10-step update:
    the property would not show.) The adapters served: the engine's log-probs of the tokens it samples are the
    reference's within float32 kernel rounding (test_four_ranks_two_independent_tp2_engines' bounds: mean < 1e-4, max
    < 1e-3). The merged weights (`named_weights`, W0 + (alpha / r) B A rounded to bf16: what the engine loaded before),
    served by the module's float32 engine: most of the update's entries vanish in the merge, and its log-probs miss
    the reference by more than 10x that bound. A second sync, `around_update` around 5 more updates: a new adapter id,
    the old one removed and its folder deleted, and the engine serves the new policy (the old one is off by more than
    the bound)."""
    from pathlib import Path
    from dapo_ref.algorithm import train_on
    from dapo_ref.interfaces import RolloutBatch
    from dapo_ref.learner import TorchLearner
    from dapo_ref.lora import adapter_config, base_named_weights
    from dapo_ref.policy import load_model

    base = tmp_path / "base"  # the module's policy with its weights rounded to bf16: W0 as a bf16 run holds it
    copy.deepcopy(setup["policy"]).to(torch.bfloat16).save_pretrained(base)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (base / f).write_bytes((setup["dir"] / f).read_bytes())
    import typing
    from vllm.config.lora import MaxLoRARanks
    from vllm.engine.arg_utils import EngineArgs
    from dapo_ref.vllm_rollout import VLLM_LORA_RANKS, vllm_lora_kwargs

    assert typing.get_args(MaxLoRARanks) == VLLM_LORA_RANKS  # the rank slots this vLLM allows
    assert set(vllm_lora_kwargs(64)) <= {f.name for f in dataclasses.fields(EngineArgs)}
    cfg = DAPOConfig(lora_r=64, lora_alpha=128, lr=1e-5, warmup_steps=0, dtype="bfloat16")
    kw = vllm_engine_kwargs(cfg)  # the base from the checkpoint (only the adapters are ever sent)
    assert kw["load_format"] == "auto" and "lora_config" not in kw
    with pytest.raises(ValueError, match="needs lora_config"):  # a LoRA run's engine must be told the adapters' config
        VLLMRolloutEngine.from_config(cfg, model_path=base)
    learner = TorchLearner(load_model(str(base), "bfloat16"), cfg, PAD)
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(1, VOCAB, (6,), generator=g).tolist() for _ in range(8)]
    batch = RolloutBatch(
        [PROMPTS[i % 4] for i in range(8)],
        responses,
        torch.tensor([1.0, -1.0] * 4),  # half pushed up, half down: the policy moves
        torch.zeros(8, dtype=torch.bool),
        torch.zeros(8),
    )
    params = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=5)
    reference = lambda: copy.deepcopy(learner.model).float().eval()  # the learner's policy, computed in float32

    def gap(engine, ref):
        "mean and max |engine - ref| over the tokens `engine` samples, and those tokens' completions."
        comps = engine.generate(PROMPTS, params)
        d = (torch.cat([torch.tensor(c.logprobs) for c in comps]) - token_logps(ref, PROMPTS, comps)).abs()
        return float(d.mean()), float(d.max()), comps

    for _ in range(10):
        train_on(learner, batch, len(batch))
    eng = lora_engine(base, adapter_config(cfg))
    lora_dir = Path(eng._lora_dir.name)
    try:
        eng.load_weights(learner.sync_weights())
        ref1 = reference()
        mean1, max1, comps = gap(eng, ref1)
        assert mean1 < 1e-4 and max1 < 1e-3, (mean1, max1)
        with ref1.disable_adapter():  # how far the 10 updates moved these tokens' log-probs: what an engine must follow
            moved = float(
                (token_logps(ref1, PROMPTS, comps) - torch.cat([torch.tensor(c.logprobs) for c in comps])).abs().mean()
            )
        # the merged path: most entries of (alpha / r) B A are below half of bf16's step at W0 and round away
        w0 = dict(base_named_weights(learner.model))
        merged = dict(learner.named_weights())
        adapted = [k for k in merged if k.endswith("proj.weight")]
        vanished = sum(int((merged[k] == w0[k]).sum()) for k in adapted) / sum(w0[k].numel() for k in adapted)
        assert vanished > 0.5, vanished
        module = setup["engine"]
        try:
            module.load_weights(learner.named_weights())
            merged_mean, merged_max, _ = gap(module, ref1)
        finally:
            module.load_weights(setup["policy"].state_dict().items())  # back to the module's policy
        assert merged_mean > 10 * 1e-4 and merged_mean > 10 * mean1, (merged_mean, mean1, moved)
        # a second sync, as a step makes it (5 more updates): a new adapter id and name, the first removed and its folder
        # gone, the new policy served
        eng.around_update(lambda: [train_on(learner, batch, len(batch)) for _ in range(5)], learner.sync_weights)
        assert eng.llm.llm_engine.list_loras() == {2} and eng._lora_request.lora_name == "policy-2"
        assert sorted(p.name for p in lora_dir.iterdir()) == ["policy-2"]
        mean2, max2, comps2 = gap(eng, reference())
        assert mean2 < 1e-4 and max2 < 1e-3, (mean2, max2)
        stale = float(
            (torch.cat([torch.tensor(c.logprobs) for c in comps2]) - token_logps(ref1, PROMPTS, comps2)).abs().mean()
        )
        assert stale > 10 * 1e-4, stale  # the first sync's policy is not the one served now
    finally:
        eng.close()
    assert not lora_dir.exists()  # close() deletes every sync's folder
