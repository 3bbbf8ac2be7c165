"""The offload settings travel as one value (issue 66): the engine takes the :class:`OffloadSettings` every face built
(its former keyword arguments still work, by their names), and the value has one home, at the engine's floor, under
every import path it had."""

from __future__ import annotations

import pytest
import torch

import lightning_offload
from lightning_offload.engine.optimizer import OffloadOptimizer
from lightning_offload.engine.settings import OffloadSettings
from lightning_offload.setup import settings as setup_settings
from tiny_modules import tiny_hf_model


def _engine(**kwargs):
    model = tiny_hf_model("llama")
    return OffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), [], torch.device("cpu"), model=model,
                            **kwargs)


def test_one_value_under_every_import_path() -> None:
    assert lightning_offload.OffloadSettings is setup_settings.OffloadSettings is OffloadSettings


def test_the_engine_takes_one_settings_value() -> None:
    settings = OffloadSettings(pipelined=False, link_dtype="bf16", seed=3, on_nonfinite="raise")
    engine = _engine(settings=settings)
    assert engine.settings is settings and (engine.pipelined, engine.on_nonfinite) == (False, "raise")
    assert engine.lanes.link_dtype == torch.bfloat16
    engine.close()


def test_the_engine_s_former_keywords_keep_working() -> None:
    # rounding_seed is the settings' seed; a keyword given replaces the value's field; the default is synchronous.
    engine = _engine(pipelined=True, link_dtype="bf16", rounding_seed=5, free_sent_gradients=True)
    assert engine.settings == OffloadSettings(pipelined=True, link_dtype="bf16", seed=5, free_sent_gradients=True)
    engine.close()
    engine = _engine(settings=OffloadSettings(link_dtype="bf16"), pipelined=False)
    assert (engine.settings.pipelined, engine.settings.link_dtype) == (False, "bf16")
    engine.close()
    assert _engine().settings == OffloadSettings(pipelined=False)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'pipelnied'.*settings=OffloadSettings"):
        _engine(pipelnied=True)
    with pytest.raises(TypeError, match=r"settings must be an OffloadSettings, got True"):
        _engine(settings=True)
    with pytest.raises(ValueError, match=r"link_dtype must be one of"):
        _engine(link_dtype="fp8")


def test_each_face_hands_the_engine_its_own_value() -> None:
    # The loop face's default for free_sent_gradients=None is torch's (off); the value is otherwise the face's.
    model = tiny_hf_model("llama")
    optimizer = lightning_offload.offload(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "zero_offload",
                                          link_dtype="bf16")
    assert optimizer.settings == OffloadSettings(projection=False, link_dtype="bf16", free_sent_gradients=False)
    optimizer.close()
