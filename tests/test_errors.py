"""Bad input gets a clear error naming the bad value and the fix."""

import pytest

from lightning_offload.setup.settings import OffloadSettings
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_offload import LSPOffloadStrategy
from tiny_modules import TinyClassifier, classification_data, trainer


def _fit(strategy, module=None, **kwargs):
    trainer(strategy, max_steps=1, **kwargs).fit(module or TinyClassifier(), classification_data())


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(rank=64, min_dim=16), r"rank=64 is larger than the output dim 32 of body.0"),
        (dict(rank=4, density=8, min_dim=16), r"density=8 is larger than the compressed output size 4 of body.0"),
        (dict(target_modules=["attention"]), r"'attention' matches no trainable Linear/Conv1D"),
        (dict(exclude_modules=["nope"], min_dim=16), r"'nope' matches no trainable"),
        # An int is an absolute size: rank=1 keeps one row (rank=1.0 is the full size), which density=8 cannot fill.
        (dict(rank=1, min_dim=16), r"density=8 is larger than the compressed output size 1 of body.0 allows.*"
                                   r"rank=1 is an int: an absolute size, 1 features of each side.*rank=1.0 the full "
                                   r"size.*Use density ≤ 1 or a larger rank \(rank=1.0 for the full size\)"),
        (dict(rank=64, min_dim=16), r"rank=64 is an int: an absolute size"),
    ],
)
def test_projection_settings_that_do_not_fit_the_model(settings, message):
    with pytest.raises(ValueError, match=message):
        _fit(LSPOffloadStrategy(**settings))


@pytest.mark.parametrize(
    "settings, error, message",
    [
        (dict(rank=1.5), ValueError, r"rank=1.5 as a fraction"),
        (dict(rank=0), ValueError, r"rank=0 must be at least 1"),
        (dict(rank="big"), TypeError, r"rank must be an int"),
        (dict(density=0), ValueError, r"density must be a positive int"),
        (dict(on_nonfinite="ignore"), ValueError, r"on_nonfinite must be 'skip' or 'raise', got 'ignore'"),
        (dict(update_buffers=-1), ValueError, r"update_buffers must be None or an int ≥ 0 .* got -1"),
        (dict(update_buffers=2.5), ValueError, r"update_buffers must be None or an int ≥ 0 .* got 2.5"),
        (dict(speculative="yes"), TypeError, r"speculative must be True, False or None .* got 'yes'"),
    ],
)
def test_invalid_strategy_arguments(settings, error, message):
    with pytest.raises(error, match=message):
        LSPOffloadStrategy(**settings)


def test_several_optimizers_are_refused():
    class TwoOptimizers(TinyClassifier):
        # Lightning itself refuses several optimizers under automatic optimization; manual optimization reaches us.
        automatic_optimization = False

        def configure_optimizers(self):
            return [torch.optim.AdamW(self.body.parameters()), torch.optim.AdamW(self.head.parameters())]

    with pytest.raises(ValueError, match="returned 2. Return a single optimizer"):
        _fit(LSPOffloadStrategy(projectors="random"), TwoOptimizers())


@pytest.mark.parametrize("strategy", ["lsp_offload", "zero_offload"])
def test_unsupported_optimizer_class_is_refused(strategy):
    module = TinyClassifier(optimizer_factory=lambda groups: torch.optim.SGD(groups, lr=0.1))
    with pytest.raises(TypeError,
                       match=r"torch.optim.sgd.SGD \(returned by configure_optimizers.*Use torch.optim.AdamW"):
        _fit(strategy, module)


@pytest.mark.parametrize("precision, message", [("16-true", "bf16-true"),
                                                ("64-true", "32-true, bf16-mixed, bf16-true")])
def test_unsupported_precision_is_refused_when_the_trainer_is_built(precision, message):
    with pytest.raises(ValueError, match=rf"does not support precision='{precision}'.*{message}"):
        trainer("lsp_offload", precision=precision)


def test_fp16_mixed_precision_is_refused_with_the_reason():
    # On a CPU the Trainer itself turns '16-mixed' into 'bf16-mixed', so hand the plugin over directly, as the
    # accelerator connector does on a GPU.
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match=r"precision='16-mixed'.*param.grad.*Use precision='bf16-mixed'"):
        LSPOffloadStrategy().precision_plugin = plugin


def test_projected_weight_outside_the_optimizer_is_refused():
    from torch import nn

    from lightning_offload import OffloadOptimizer, ProjectedWeight, SparseProjector

    layer = nn.Linear(8, 8)
    projected = ProjectedWeight("layer", layer, SparseProjector.random(8, 4, 2), SparseProjector.random(8, 4, 2))
    with pytest.raises(ValueError, match="Projected layers layer have weights that the optimizer does not train"):
        OffloadOptimizer(torch.optim.AdamW([layer.bias]), [projected], torch.device("cpu"))


@pytest.mark.parametrize("strategy", ["ZeroOffloadStrategy", "ZeroOffloadDDPStrategy"])
@pytest.mark.parametrize("setting", [dict(rank=0.1), dict(density=4), dict(projectors="random"),
                                     dict(update_buffers=2), dict(target_modules=["q_proj"])])
def test_a_projection_setting_is_refused_where_nothing_is_projected(strategy, setting):
    # zero_offload used to accept rank=0.1 and do nothing with it: the constructor refuses it by name now.
    import lightning_offload

    name = next(iter(setting))
    with pytest.raises(ValueError, match=rf"{name}=.*: nothing is projected without projection .* "
                                         rf"strategy='lsp_offload'"):
        getattr(lightning_offload, strategy)(**setting)


@pytest.mark.parametrize("setting", [dict(rank=0.1), dict(rank=0.25), dict(density=4)])
def test_meft_refuses_projection_settings_by_name_whatever_their_value(setting):
    from lightning_offload import MEFTOffloadStrategy

    name = next(iter(setting))  # the default value too: given at all, it says the user expects it to do something
    with pytest.raises(ValueError, match=rf"{name}={setting[name]!r}: nothing is projected .* "
                                         rf"strategy='lsp_offload'"):
        MEFTOffloadStrategy(**setting)


def test_meft_refuses_unknown_keywords_and_projection_and_keeps_its_settings_as_one_value():
    from lightning_offload import MEFTOffloadStrategy

    with pytest.raises(TypeError, match=r"unknown setting pipelnied=\. Did you mean pipelined=\?"):
        MEFTOffloadStrategy(pipelnied=False)
    with pytest.raises(ValueError, match=r"projection=True: nothing is projected"):
        MEFTOffloadStrategy(projection=True)
    strategy = MEFTOffloadStrategy(seed=3, link_dtype="bf16", pipelined=False)
    assert strategy.settings == OffloadSettings(projection=False, seed=3, link_dtype="bf16", pipelined=False)
    with pytest.raises(ValueError, match=r"link_dtype must be one of"):
        MEFTOffloadStrategy(link_dtype="fp8")


def test_settings_are_one_frozen_value_that_the_strategy_keeps():
    import dataclasses
    import inspect

    from lightning_offload import OffloadSettings, ZeroOffloadStrategy

    strategy = LSPOffloadStrategy(rank=0.125, exclude_modules=["head"], seed=3)
    assert strategy.settings == OffloadSettings(rank=0.125, exclude_modules=("head",), seed=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        strategy.settings.rank = 0.5
    assert ZeroOffloadStrategy().settings.projection is False
    # help() and editors see every setting with its default.
    signature = inspect.signature(LSPOffloadStrategy)
    assert signature.parameters["rank"].default == 0.25 and signature.parameters["head"].default is None
    with pytest.raises(TypeError, match=r"exclude_modules must be a list of regular expressions .* got 'head'"):
        OffloadSettings(exclude_modules="head")
    with pytest.raises(ValueError, match=r"min_dim must be a positive int .* got 0"):
        LSPOffloadStrategy(min_dim=0)


@pytest.mark.parametrize("setting", ["target_modules", "exclude_modules"])
def test_a_pattern_that_is_not_a_regular_expression_is_refused_where_the_settings_are_given(setting):
    import lightning_offload

    message = (rf"{setting}: '\[' is not a regular expression \(unterminated character set at position 0\)\. .*"
               rf"re\.search against module names .* escape a literal '\['.* with a backslash")
    with pytest.raises(ValueError, match=message):
        OffloadSettings(**{setting: ["["]})
    with pytest.raises(ValueError, match=message):
        LSPOffloadStrategy(**{setting: [r"mlp\.", "["]})
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(ValueError, match=message):
        lightning_offload.offload(model, torch.optim.AdamW(model.parameters()), **{setting: ["["]})
    assert "_lsp_state" not in model[0].__dict__  # refused before anything was set up


@pytest.mark.parametrize("batch, named", [
    (torch.zeros(2, 8, dtype=torch.long), r"a Tensor of shape \(2, 8\) \(torch.int64\)"),
    ((torch.zeros(2, 8, dtype=torch.long),), r"a tuple of 1 \(Tensor\)"),
])
def test_causal_lm_loss_of_something_else_than_a_batch_dict_says_what_a_batch_is(batch, named):
    import lightning_offload
    from tiny_modules import tiny_hf_model

    with pytest.raises(TypeError, match=rf"batch must be a mapping of the model's inputs.*'input_ids'.*'labels'.*"
                                        rf"got {named}\. For a tensor of token ids: causal_lm_loss\(model, "
                                        rf"\{{'input_ids': ids, 'labels': ids\}}\)"):
        lightning_offload.causal_lm_loss(tiny_hf_model("llama"), batch)
