"""The package's strategy names, one table per Lightning registry (``lightning_offload/registries.py``): each name is in
Lightning's registry as its class with its preset, the Trainer and Fabric build that class from the name, and a
preset's keyword arguments reach the constructor, as Lightning's own presets do."""

from __future__ import annotations

import pytest
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry

import lightning_offload
from lightning_offload.registries import StrategyName, fabric_names, register, trainer_names

NAMES = ["lsp_offload", "zero_offload", "meft_offload", "lsp_offload_ddp", "zero_offload_ddp"]
TABLES = {"Trainer": (trainer_names, StrategyRegistry), "Fabric": (fabric_names, STRATEGY_REGISTRY)}


@pytest.mark.parametrize("face", list(TABLES))
def test_every_name_of_the_table_is_in_lightning_s_registry_as_its_class_with_its_preset(face: str) -> None:
    names, registry = TABLES[face]
    assert [entry.name for entry in names()] == NAMES
    for entry in names():
        assert registry[entry.name]["strategy"] is entry.cls
        assert registry[entry.name]["init_params"] == entry.preset
        assert registry[entry.name]["description"] == entry.cls.__doc__.splitlines()[0] != ""
        # A name without a preset is its class's own: the class says it in its messages.
        assert entry.preset or entry.cls.strategy_name == entry.name


@pytest.mark.parametrize("name", NAMES)
def test_the_trainer_builds_each_name_s_class(name: str) -> None:
    entry = next(entry for entry in trainer_names() if entry.name == name)
    trainer = Trainer(strategy=name, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False)
    assert type(trainer.strategy) is entry.cls


@pytest.mark.parametrize("name", NAMES)
def test_fabric_builds_each_name_s_class(name: str) -> None:
    entry = next(entry for entry in fabric_names() if entry.name == name)
    assert type(Fabric(strategy=name, accelerator="cpu", devices=1).strategy) is entry.cls


def test_a_preset_reaches_the_constructor_and_a_name_is_registered_once() -> None:
    registry = _StrategyRegistry()
    preset = StrategyName("lsp_offload_eighth", lightning_offload.LSPOffloadStrategy,
                          {"rank": 0.125, "link_dtype": "bf16"})
    register(registry, preset.name, preset.cls, **preset.preset)
    register(registry, preset.name, lightning_offload.ZeroOffloadStrategy)  # already there: left as it is
    strategy = registry.get(preset.name)
    assert type(strategy) is lightning_offload.LSPOffloadStrategy
    assert (strategy.settings.rank, strategy.settings.link_dtype, strategy.settings.density) == (0.125, "bf16", 8)


def test_the_trainer_builds_a_preset_name_with_its_settings() -> None:
    register(StrategyRegistry, "test_zero_offload_bf16_link", lightning_offload.ZeroOffloadStrategy,
             link_dtype="bf16", pipelined=False)
    try:
        strategy = Trainer(strategy="test_zero_offload_bf16_link", accelerator="cpu", devices=1, logger=False).strategy
    finally:
        StrategyRegistry.pop("test_zero_offload_bf16_link")
    assert type(strategy) is lightning_offload.ZeroOffloadStrategy
    assert (strategy.settings.link_dtype, strategy.settings.pipelined, strategy.settings.projection) == \
        ("bf16", False, False)


def test_register_strategies_stays_a_public_name_that_fills_both_registries() -> None:
    lightning_offload.register_strategies()  # idempotent: every name stays its class's
    assert all(StrategyRegistry[entry.name]["strategy"] is entry.cls for entry in trainer_names())
    assert all(STRATEGY_REGISTRY[entry.name]["strategy"] is entry.cls for entry in fabric_names())
