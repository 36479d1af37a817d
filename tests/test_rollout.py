"""Tests of dapo_ref.rollout beyond the notebook's lesson: randomized shapes and chunking against a naive
reference, two-step sampling distributions through the KV cache, tied weights, streaming weight loads."""

import copy, math, random

import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers import Qwen2Config, Qwen2ForCausalLM

from dapo_ref.cli import config_from_dict
from dapo_ref.interfaces import Completion, RolloutEngine, SamplingParams, sampling_params_from_config
from dapo_ref.rollout import HFRolloutEngine, sample_next, top_k_filter, top_p_filter

PAD, EOS = 0, 1


def tiny_qwen2(seed=0, vocab=48, tie=False, dtype=torch.float32):
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,
        initializer_range=0.2,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).to(dtype).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_qwen2(0)


@torch.no_grad()
def naive_greedy(model, prompt, max_tokens, eos_ids=()):
    seq, out = list(prompt), []
    for _ in range(max_tokens):
        nxt = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
        out.append(nxt)
        seq.append(nxt)
        if nxt in eos_ids:
            break
    return out


def ids(cs):
    return [c.token_ids for c in cs]


# ---------------------------------------------------------------- greedy vs naive, random shapes and chunking
@pytest.mark.parametrize("trial", range(4))
def test_greedy_matches_naive_random_shapes(model, trial):
    rng = random.Random(trial)
    P = rng.randint(1, 6)
    prompts = [[rng.randrange(2, 48) for _ in range(rng.randint(1, 12))] for _ in range(P)]
    n, mbs, T = rng.randint(1, 3), rng.randint(1, 7), rng.randint(1, 10)
    # EOS: a token some greedy path emits, so some rows stop and others run on
    refs0 = [naive_greedy(model, p, T) for p in prompts]
    eos = refs0[0][min(T - 1, 2)]
    refs = [naive_greedy(model, p, T, [eos]) for p in prompts]
    eng = HFRolloutEngine(model, eos_token_id=eos, pad_token_id=PAD, max_batch_size=mbs)
    got = eng.generate(prompts, SamplingParams(n=n, temperature=0, max_tokens=T))
    assert len(got) == P * n
    assert [c.prompt_index for c in got] == [i for i in range(P) for _ in range(n)]
    assert ids(got) == [r for r in refs for _ in range(n)]
    for c in got:
        stopped = c.token_ids[-1] == eos
        assert c.finish_reason == ("stop" if stopped else "length")
        assert c.truncated == (not stopped)
        assert stopped or len(c.token_ids) == T
        assert eos not in c.token_ids[:-1]


def test_pad_equal_to_eos(model):
    # base models often use the EOS id as the pad id; finished rows then emit EOS, which must not leak into outputs
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14]]
    ref = [naive_greedy(model, p, 10) for p in prompts]
    eos = ref[0][1]
    eng = HFRolloutEngine(model, eos_token_id=eos, pad_token_id=eos)
    got = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=10))
    want = [naive_greedy(model, p, 10, [eos]) for p in prompts]
    assert ids(got) == want
    assert got[0].token_ids == ref[0][:2] and got[0].finish_reason == "stop"


def test_errors(model):
    eng = HFRolloutEngine(model, EOS, PAD)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        eng.generate([[3], []], SamplingParams())
    with pytest.raises(ValueError, match="eos_token_id: got an empty list"):
        HFRolloutEngine(model, [], PAD)
    with pytest.raises(ValueError, match="SamplingParams.max_tokens = 0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="SamplingParams.n = 0"):
        SamplingParams(n=0)
    assert eng.generate([], SamplingParams()) == []


def test_use_tqdm_same_result(model):
    prompts = [[5, 6], [7, 8, 9]]
    eng = HFRolloutEngine(model, EOS, PAD, max_batch_size=2)
    sp = SamplingParams(n=2, max_tokens=5, seed=11)
    assert ids(eng.generate(prompts, sp, use_tqdm=True)) == ids(eng.generate(prompts, sp))


# ---------------------------------------------------------------- sampling distributions
def _python_filtered_probs(z, tau, top_k, top_p):
    "float64 python reference: temperature, keep top_k, renormalise, keep smallest prefix with mass >= top_p."
    z = [float(v) / tau for v in z]
    order = sorted(range(len(z)), key=lambda v: -z[v])
    if top_k != -1:
        order = order[:top_k]
    m = max(z[v] for v in order)
    w = {v: pow(2.718281828459045, z[v] - m) for v in order}
    s = sum(w.values())
    pr = {v: w[v] / s for v in order}
    keep, mass = [], 0.0
    for v in order:
        if mass >= top_p:
            break
        keep.append(v)
        mass += pr[v]
    s = sum(pr[v] for v in keep)
    out = [0.0] * len(z)
    for v in keep:
        out[v] = pr[v] / s
    return torch.tensor(out, dtype=torch.float64)


def tv_bound(q, N: int, delta: float = 1e-6) -> float:
    """A bound the empirical total-variation distance of N i.i.d. draws from q exceeds with probability <= delta:
    E[TV] <= 1/2 sum_i sqrt(q_i (1 - q_i) / N) <= 1/2 sum_i sqrt(q_i / N) (Jensen, per outcome), and TV moves by
    <= 1/N when one draw changes, so McDiarmid gives P(TV >= E[TV] + t) <= exp(-2 N t^2): t = sqrt(ln(1/delta) / (2 N)).
    The draws are seeded, so on one machine the outcome is fixed; another CPU can change logits by a few ulps and so
    the draws, which this bound covers. The float64 reference q and the engine's float32 softmax differ by ~V u ~1e-6,
    far below 1/N."""
    return 0.5 * sum((float(x) / N) ** 0.5 for x in q) + math.sqrt(math.log(1 / delta) / (2 * N))


def test_one_step_frequencies_topk_topp(model):
    N, tau, k, p = 20000, 1.3, 8, 0.85
    prompt = [3, 4, 5, 6]
    with torch.no_grad():
        z = model(input_ids=torch.tensor([prompt])).logits[0, -1].double()
    want = _python_filtered_probs(z.tolist(), tau, k, p)
    eng = HFRolloutEngine(model, EOS, PAD, max_batch_size=N)
    cs = eng.generate([prompt], SamplingParams(n=N, temperature=tau, top_k=k, top_p=p, max_tokens=1, seed=5))
    emp = torch.bincount(torch.tensor([c.token_ids[0] for c in cs]), minlength=z.numel()).double() / N
    assert (emp[want == 0] == 0).all()
    tv = 0.5 * (emp - want).abs().sum()
    assert tv < tv_bound(want.tolist(), N), (tv, tv_bound(want.tolist(), N))  # N = 20000: +0.019 over E[TV]'s bound


def test_two_step_joint_through_cache_and_padding(model):
    """Joint law of the first two sampled tokens of a left-padded prompt equals the product of the
    conditionals computed without padding or cache (top_k = 3 keeps 9 outcomes)."""
    N, k, tau = 8000, 3, 1.0
    short, long_ = [7, 8], [9, 10, 11, 12, 13]
    eng = HFRolloutEngine(model, eos_token_id=47, pad_token_id=PAD, max_batch_size=2 * N)
    cs = eng.generate([short, long_], SamplingParams(n=N, temperature=tau, top_k=k, max_tokens=2, seed=0))
    cs = [c for c in cs if c.prompt_index == 0]  # the padded prompt
    want = {}
    with torch.no_grad():
        z1 = model(input_ids=torch.tensor([short])).logits[0, -1].double()
        p1 = _python_filtered_probs(z1.tolist(), tau, k, 1.0)
        for a in torch.nonzero(p1).flatten().tolist():
            z2 = model(input_ids=torch.tensor([short + [a]])).logits[0, -1].double()
            p2 = _python_filtered_probs(z2.tolist(), tau, k, 1.0)
            for b in torch.nonzero(p2).flatten().tolist():
                want[(a, b)] = float(p1[a] * p2[b])
    counts = {}
    for c in cs:
        counts[tuple(c.token_ids)] = counts.get(tuple(c.token_ids), 0) + 1
    assert set(counts) <= set(want), set(counts) - set(want)
    tv = 0.5 * sum(abs(counts.get(o, 0) / N - q) for o, q in want.items())
    bound = tv_bound(want.values(), N)
    assert tv < bound, (tv, bound)


def test_seeded_reproducible_across_engines(model):
    prompts = [[5, 6, 7], [9]]
    sp = SamplingParams(n=3, temperature=0.9, top_p=0.9, max_tokens=6, seed=123)
    a = HFRolloutEngine(model, EOS, PAD).generate(prompts, sp)
    b = HFRolloutEngine(copy.deepcopy(model), EOS, PAD).generate(prompts, sp)
    assert ids(a) == ids(b)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=2, max_size=10), st.floats(0.01, 1.0))
def test_top_p_minimal_set(zs, p):
    z = torch.tensor([zs], dtype=torch.float64)
    kept = top_p_filter(z, p)[0] > float("-inf")
    pr = z.softmax(-1)[0]
    mass = float(pr[kept].sum())
    # float64: the filter's softmax and cumulative sum and this softmax and sum each err by <= (n + 3) u64 on a mass
    # <= 1 (n = len(zs) terms: Wilkinson for the sums, exp and the division), so they differ by <= 2 (n + 3) u64;
    # doubled for the subtraction below
    tol = 4 * (len(zs) + 3) * 2.0**-53
    assert mass >= p - tol
    # minimal: dropping the least likely kept token leaves less than p
    if kept.sum() > 1:
        assert mass - float(pr[kept].min()) < p + tol
    # it is a prefix of the sorted order: every kept token is at least as likely as every dropped one
    if (~kept).any():
        assert float(pr[kept].min()) >= float(pr[~kept].max())


def test_sample_next_greedy_dtype():
    z = torch.tensor([[0.0, 2.0, 1.0]], dtype=torch.bfloat16)
    assert sample_next(z, SamplingParams(temperature=0), None).tolist() == [1]
    assert top_k_filter(torch.tensor([[1.0, 3.0, 2.0]]), 5).tolist() == [[1.0, 3.0, 2.0]]


# ---------------------------------------------------------------- weights
def test_load_weights_tied_from_state_dict_and_stream():
    learner, sampler_model = tiny_qwen2(1, tie=True), tiny_qwen2(0, tie=True)
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    eng = HFRolloutEngine(sampler_model, EOS, PAD)
    eng.load_weights((n, t) for n, t in learner.state_dict().items())  # a generator, as a sharded learner streams
    want = [naive_greedy(learner, p, 8, [EOS]) for p in prompts]
    assert ids(eng.generate(prompts, SamplingParams(temperature=0, max_tokens=8))) == want
    for (n, a), b in zip(learner.state_dict().items(), eng.model.state_dict().values()):
        assert torch.equal(a, b), n


def test_load_weights_casts_dtype():
    learner = tiny_qwen2(1, dtype=torch.float64)
    eng = HFRolloutEngine(tiny_qwen2(0), EOS, PAD)
    eng.load_weights(learner.named_parameters())
    p = dict(eng.model.named_parameters())["model.layers.0.mlp.up_proj.weight"]
    assert p.dtype == torch.float32
    assert torch.equal(p, learner.model.layers[0].mlp.up_proj.weight.float())


def test_load_weights_errors(model):
    eng = HFRolloutEngine(copy.deepcopy(model), EOS, PAD)
    with pytest.raises(KeyError, match="unknown parameter name 'lm_head.bias'"):
        eng.load_weights([("lm_head.bias", torch.zeros(48))])
    with pytest.raises(
        ValueError, match=r"shape mismatch for 'lm_head.weight': got \(64, 48\), the engine's model has \(48, 64\)"
    ):
        eng.load_weights([("lm_head.weight", torch.zeros(64, 48))])


# ---------------------------------------------------------------- interface
def test_abstract_interface():
    with pytest.raises(TypeError):
        RolloutEngine()

    class Echo(RolloutEngine):
        "A toy backend: repeats the prompt's last token, to show the interface needs no transformers type."

        def generate(self, prompts, params, use_tqdm=False):
            return [
                Completion(i, [p[-1]] * params.max_tokens, "length")
                for i, p in enumerate(prompts)
                for _ in range(params.n)
            ]

        def load_weights(self, named_tensors):
            pass

    e = Echo()
    e.sleep()
    e.wake()
    out = e.generate([[1, 2], [3]], SamplingParams(n=2, max_tokens=2))
    assert [(c.prompt_index, c.token_ids, c.truncated) for c in out] == [
        (0, [2, 2], True),
        (0, [2, 2], True),
        (1, [3, 3], True),
        (1, [3, 3], True),
    ]


def test_sampling_params_from_validated_config():
    cfg = config_from_dict({"group_size": 8, "l_max": 128, "l_cache": 32, "top_k": 50, "eval_top_p": 0.6, "eval_k": 4})
    assert sampling_params_from_config(cfg) == SamplingParams(n=8, temperature=1.0, top_p=1.0, top_k=50, max_tokens=128)
    assert sampling_params_from_config(cfg, eval=True, seed=9) == SamplingParams(
        n=4, temperature=1.0, top_p=0.6, top_k=-1, max_tokens=128, seed=9
    )
