"""The causal-LM loss without its logits (lightning_offload/lm_loss.py): equal to Hugging Face's own loss and its
gradients on every architecture of the zoo, never a ``tokens × vocabulary`` tensor, a plain head's gradient hooks
called once, a projected head's ``S`` the one the unchunked loss gives and complete once, and the same training under
the offload as Hugging Face's loss under plain AdamW on a separate model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_offload import causal_lm_loss, offload, signed_permutation_projector
from lightning_offload.lm_loss import IGNORE_INDEX, default_chunk_tokens
from lightning_offload.lsp.linear import ProjectedWeight
from lightning_offload.lsp.projector import SparseProjector
from tiny_modules import params_of, tiny_hf_model, token_data

transformers = pytest.importorskip("transformers")

VOCAB = 96


def _model(kind: str, seed: int = 0) -> torch.nn.Module:
    """A tiny model of each family whose head the loss must reproduce (dropout off: two runs must see one network)."""
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    torch.manual_seed(seed)
    if kind == "llama_untied":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=False)).eval()
    if kind == "llama_tied":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=True)).eval()
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=False)).eval()
    if kind == "gemma2":  # soft-capped logits (a low cap, so the cap matters)
        config = transformers.Gemma2Config(**common, head_dim=8, final_logit_softcapping=1.5)
        return transformers.Gemma2ForCausalLM(config).eval()
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                                                bos_token_id=0, eos_token_id=0)).eval()


def _batch(seed: int = 0, rows: int = 3, length: int = 17) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, length), generator=generator)
    labels = ids.clone()
    labels[0, :5] = IGNORE_INDEX  # a prompt
    labels[2, 10:] = IGNORE_INDEX  # padding
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _loss_and_grads(model: torch.nn.Module, loss_of: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = loss_of(model)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["llama_untied", "llama_tied", "qwen2", "gemma2", "gpt2"])
@pytest.mark.parametrize("chunk_tokens", [1, 7, None])
def test_the_loss_and_every_gradient_equal_hugging_face_s(kind: str, chunk_tokens: int | None) -> None:
    model = _model(kind)
    batch = _batch()
    want_loss, want = _loss_and_grads(model, lambda m: m(**batch).loss)
    got_loss, got = _loss_and_grads(model, lambda m: causal_lm_loss(m, batch, chunk_tokens=chunk_tokens))
    torch.testing.assert_close(got_loss, want_loss)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m, n=name: f"{n}: {m}")


def test_a_scaled_loss_scales_the_gradients_made_in_forward() -> None:
    # Lightning divides the loss by accumulate_grad_batches; the plain head's gradients were made for a gradient of 1.
    model = _model("llama_untied")
    batch = _batch()
    _, want = _loss_and_grads(model, lambda m: m(**batch).loss * 0.25)
    _, got = _loss_and_grads(model, lambda m: causal_lm_loss(m, batch, chunk_tokens=5) * 0.25)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m, n=name: f"{n}: {m}")
    loss = causal_lm_loss(model, batch)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        loss.backward()


def test_num_items_in_batch_divides_the_sum_as_hugging_face_does() -> None:
    model = _model("llama_untied")
    batch = _batch()
    want = model(**batch, num_items_in_batch=100).loss
    torch.testing.assert_close(causal_lm_loss(model, batch, num_items_in_batch=100, chunk_tokens=5), want)


def test_under_autocast_the_recomputed_chunks_compute_in_the_forward_s_dtype() -> None:
    # bf16 autocast on the CPU, as Lightning's bf16-mixed runs the step; backward runs outside autocast, so the
    # recomputation must re-enter it (computed in fp32 instead, the gradients would differ by bf16's rounding).
    model = _model("llama_untied")
    batch = _batch()

    def under_autocast(loss_of: Any) -> Any:
        def run(m: torch.nn.Module) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return loss_of(m)
        return run

    want_loss, want = _loss_and_grads(model, under_autocast(lambda m: m(**batch).loss))
    got_loss, got = _loss_and_grads(model, under_autocast(lambda m: causal_lm_loss(m, batch, chunk_tokens=8)))
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-3, atol=1e-3)
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        # One bf16 product per chunk against one over all tokens: summation order at bf16's precision.
        torch.testing.assert_close(got[name], want[name], rtol=2e-2, atol=2e-3)
    # Every product of the backward ran in bf16: the recomputation re-entered autocast (in fp32 it would not have).
    with _ProductDtypes() as products:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = causal_lm_loss(model, batch, chunk_tokens=8)
        loss.backward()
    assert products.dtypes == {torch.bfloat16}


class _ProductDtypes(TorchDispatchMode):
    """The dtypes of the matrix products run while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.dtypes.add(out.dtype)
        return out


class _LargestTensor(TorchDispatchMode):
    """The most elements any operation's output had while it was on."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


def test_no_tensor_of_all_tokens_logits_exists_in_forward_or_backward() -> None:
    model = _model("llama_untied")
    batch = _batch(rows=4, length=32)
    tokens = 4 * 32
    with _LargestTensor() as hf:
        model(**batch).loss.backward()
    assert hf.largest >= tokens * VOCAB  # the measurement sees the logits when they exist
    model.zero_grad(set_to_none=True)
    with _LargestTensor() as chunked:
        causal_lm_loss(model, batch, chunk_tokens=16).backward()
    assert chunked.largest <= max(16 * VOCAB, VOCAB * 32, 32 * 64 * 4)  # a chunk's logits, the head, a block's


def test_a_plain_head_s_gradient_hooks_run_once_with_the_whole_gradient() -> None:
    model = _model("llama_untied")
    batch = _batch()
    seen: list[torch.Tensor] = []
    accumulated: list[int] = []
    model.lm_head.weight.register_hook(lambda grad: seen.append(grad.clone()))
    model.lm_head.weight.register_post_accumulate_grad_hook(lambda p: accumulated.append(1))
    causal_lm_loss(model, batch, chunk_tokens=4).backward()
    assert len(seen) == 1 and len(accumulated) == 1
    _, want = _loss_and_grads(_model("llama_untied"), lambda m: m(**batch).loss)
    torch.testing.assert_close(seen[0], want["lm_head.weight"])


def _identity_projected_head(model: torch.nn.Module) -> ProjectedWeight:
    out_features, in_features = model.lm_head.weight.shape
    generator = torch.Generator().manual_seed(3)
    proj_out = SparseProjector.random(out_features, out_features // 2, 2, generator=generator,
                                      device=torch.device("cpu"))
    proj_in = SparseProjector.random(in_features, in_features // 2, 2, generator=generator, device=torch.device("cpu"))
    return ProjectedWeight("lm_head", model.lm_head, proj_out, proj_in)


def test_a_projected_head_s_compressed_gradient_is_the_unchunked_one_and_completes_once() -> None:
    batch = _batch()
    results = []
    for loss_of in (lambda m: m(**batch).loss, lambda m: causal_lm_loss(m, batch, chunk_tokens=6)):
        model = _model("llama_untied")
        layer = _identity_projected_head(model)
        ready: list[int] = []
        layer.on_grad_ready = lambda state: ready.append(state.grad_version)
        loss_of(model).backward()
        assert model.lm_head.weight.grad is None  # no dense head gradient either way
        results.append((layer.grad_buffer.clone(), ready))
    (want, want_ready), (got, got_ready) = results
    torch.testing.assert_close(got, want)
    assert len(want_ready) == 1
    assert len(got_ready) == 1 and got_ready[0] == len(range(0, 3 * 17, 6))  # after the last chunk's S only


def _train_loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_of: Any, steps: int = 4) -> None:
    for (ids,) in list(token_data(n=4 * steps, batch_size=4))[:steps]:
        batch = {"input_ids": ids, "labels": ids}
        loss_of(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("head", ["projected", "host"])
def test_lossless_offload_with_the_chunked_loss_equals_adamw_with_hugging_face_s_loss(head: str) -> None:
    reference = tiny_hf_model("llama")
    _train_loop(reference, torch.optim.AdamW(reference.parameters(), lr=3e-3),
                lambda m, b: m(**b).loss)
    model = tiny_hf_model("llama")
    optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=3e-3), strategy="lsp_offload", rank=1.0,
                        density=1, min_dim=16, projectors="random", projector_factory=signed_permutation_projector,
                        embeddings="host", head=head)
    _train_loop(model, optimizer, lambda m, b: causal_lm_loss(m, b, chunk_tokens=9))
    optimizer.close()
    got, want = params_of(model), params_of(reference)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m, n=name: f"{n}: {m}")


def test_the_hugging_face_trainer_takes_it_as_compute_loss(tmp_path: Path) -> None:
    from tiny_modules import TokenDicts

    class ChunkedLossTrainer(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001
            return causal_lm_loss(model, inputs, num_items_in_batch=num_items_in_batch, chunk_tokens=8)

    def fit(cls: type, model: torch.nn.Module, out: Path) -> None:
        args = transformers.TrainingArguments(
            output_dir=str(out), max_steps=3, per_device_train_batch_size=4, gradient_accumulation_steps=2,
            use_cpu=True, report_to=[], save_strategy="no", seed=0, data_seed=0, disable_tqdm=True,
            dataloader_num_workers=0, learning_rate=3e-3)
        cls(model=model, args=args, train_dataset=TokenDicts()).train()

    reference, model = tiny_hf_model("llama"), tiny_hf_model("llama")
    fit(transformers.Trainer, reference, tmp_path / "plain")
    fit(ChunkedLossTrainer, model, tmp_path / "chunked")
    got, want = params_of(model), params_of(reference)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m, n=name: f"{n}: {m}")


def test_bad_calls_say_what_to_do() -> None:
    model = _model("llama_untied")
    with pytest.raises(ValueError, match="labels"):
        causal_lm_loss(model, {"input_ids": _batch()["input_ids"]})
    with pytest.raises(TypeError, match="base model"):
        causal_lm_loss(model.model, _batch())
    with pytest.raises(TypeError, match="pass the model it wraps"):
        causal_lm_loss(torch.nn.DataParallel(model), _batch())
    with pytest.raises(ValueError, match="chunk_tokens=-1"):
        causal_lm_loss(model, _batch(), chunk_tokens=-1)


def test_the_default_chunk_holds_64_mib_of_fp32_logits() -> None:
    assert default_chunk_tokens(128256) == 130
    assert default_chunk_tokens(2**40) == 1


def test_a_peft_wrapped_model_s_loss_and_adapter_gradients_equal_its_own() -> None:
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_model("llama_untied"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                        init_lora_weights=False))
    batch = _batch()
    want_loss, want = _loss_and_grads(model, lambda m: m(**batch).loss)
    got_loss, got = _loss_and_grads(model, lambda m: causal_lm_loss(m, batch, chunk_tokens=5))
    torch.testing.assert_close(got_loss, want_loss)
    assert got.keys() == want.keys() and any("lora_A" in name for name in got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m, n=name: f"{n}: {m}")


def test_a_compiled_whole_model_is_said_to_be_bypassed_and_a_compiled_base_is_used() -> None:
    model = _model("llama_untied")
    batch = _batch()
    want = model(**batch).loss
    with pytest.warns(UserWarning, match=r"torch.compile around the whole model is bypassed.*model.model.compile\(\)"):
        got = causal_lm_loss(torch.compile(model, backend="eager"), batch)
    torch.testing.assert_close(got, want)
    compiled_calls = []

    def backend(graph: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
        compiled_calls.append(1)
        return graph.forward

    model.model.compile(backend=backend)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(causal_lm_loss(model, batch), want)
    assert compiled_calls  # the compiled base ran
