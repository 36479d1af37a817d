"""One learner step on the CPU for tests/test_plan.py's memory check (run as a script: a fresh process per case).

    python tests/plan_worker.py OUT.json TOKENS [gc]

A small Qwen2 (built in code, saved with `save_pretrained`, loaded with `from_pretrained`), bf16, the plain learner
(`TorchLearner`, AdamW), one micro-batch of one packed sequence of TOKENS tokens (64 prompt + the rest response).
Writes the peak resident bytes of `Learner.update` above its start (`zero.PeakRSS`: the gradients, AdamW's two states
created at the first step, the activations and the fused log-probs; the weights were resident before) and the model's
shape for the planner."""

import json, sys, tempfile
from pathlib import Path

import torch

# 2**24 // VOCAB = 512 rows per fused log-prob chunk: 4 chunks of test_plan's 2048 tokens, the chunked path at scale
VOCAB = 32768

if __name__ == "__main__":
    out, T, gc = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:4] == ["gc"]
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
    from dapo_ref.core import DAPOConfig
    from dapo_ref.learner import TorchLearner
    from dapo_ref.interfaces import RolloutBatch
    from dapo_ref.zero import PeakRSS

    folder = Path(tempfile.mkdtemp()) / "qwen2"
    torch.manual_seed(0)
    c = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=T,
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(c).save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    # the config float32, the model bf16: a bf16 config without a master copy is refused (#59), but the learner takes
    # the model it is given, and the planner's bf16 accounting (activations, bf16 AdamW states) is what this measures
    cfg = DAPOConfig(
        model=str(folder),
        dtype="float32",
        micro_token_budget=T,
        l_max=T,
        l_cache=T // 4,
        warmup_steps=0,
        gradient_checkpointing=gc,
    )
    learner = TorchLearner.build(cfg, 0, model=model)
    g = torch.Generator().manual_seed(1)
    prompt, resp = (
        torch.randint(5, VOCAB, (64,), generator=g).tolist(),
        torch.randint(5, VOCAB, (T - 64,), generator=g).tolist(),
    )
    batch = RolloutBatch([prompt], [resp], torch.ones(1), torch.zeros(1, dtype=torch.bool), torch.zeros(1))
    with PeakRSS() as m:
        learner.update(batch, [torch.full((T - 64,), -10.0)])
    out.write_text(json.dumps(dict(peak=m.extra, config=model.config.to_dict())))
