"""LSP-Offload on Hugging Face architectures: LLaMA (nn.Linear) and GPT-2 (transposed Conv1D)."""

import pytest
import torch

from lightning_offload import LSPOffloadStrategy
from tiny_modules import TinyCausalLM, check_checkpoint_loads_into_plain, params_of, tiny_hf_model, token_data, trainer

EXPECTED_PROJECTED = {
    "llama": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "gpt2": {"c_attn", "c_proj", "c_fc"},
}


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_projects_the_blocks_trains_the_rest_and_keeps_state_dict_keys(kind, tmp_path):
    module = TinyCausalLM(tiny_hf_model(kind))
    keys = list(module.state_dict())
    before = params_of(module)
    strategy = LSPOffloadStrategy(rank=0.5, density=2, min_dim=16)
    fit = trainer(strategy, max_steps=30)
    fit.fit(module, token_data())

    projected = strategy.projected_layers
    assert {name.rsplit(".", 1)[-1] for name in projected} == EXPECTED_PROJECTED[kind]
    assert not any("lm_head" in name or "wte" in name or "embed" in name for name in projected)
    after = params_of(module)
    assert all(not torch.equal(before[n], after[n]) for n in before), "a trainable parameter was left frozen"
    assert sum(module.losses[-5:]) < sum(module.losses[:5])

    # The saved weights load into the plain architecture, key for key.
    check_checkpoint_loads_into_plain(fit, tmp_path / "model.ckpt", keys, TinyCausalLM(tiny_hf_model(kind, seed=1)),
                                      module.model, next(iter(token_data()))[0])


def test_after_fit_modules_are_plain_again():
    module = TinyCausalLM(tiny_hf_model("llama"))
    trainer(LSPOffloadStrategy(rank=0.5, density=2, min_dim=16), max_steps=2).fit(module, token_data())
    ids = next(iter(token_data()))[0]
    module.model(input_ids=ids, labels=ids).loss.backward()
    assert module.model.model.layers[0].self_attn.q_proj.weight.grad is not None
