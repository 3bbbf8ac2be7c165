"""The package's strategy names, one table per Lightning registry (``lightning_offload/registries.py``): each name is in
Lightning's registry as the one class of its face's base with its preset from the preset table, as Lightning's own
presets are; the Trainer and Fabric build that class from the name, its preset class (``ZeroOffloadStrategy``) takes it
as one of its own, and a preset's keyword arguments reach the constructor."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry

import lightning_offload
from lightning_offload.faces.fabric import FabricDataParallel, FabricSingleDevice
from lightning_offload.faces.trainer.ddp import DDPOffload
from lightning_offload.faces.trainer.offload import SingleDeviceOffload
from lightning_offload.registries import StrategyName, fabric_names, register, trainer_names
from lightning_offload.setup.settings import PRESETS, OffloadSettings

NAMES = ["lsp_offload", "zero_offload", "meft_offload", "lsp_offload_ddp", "zero_offload_ddp"]
TABLES = {"Trainer": (trainer_names, StrategyRegistry), "Fabric": (fabric_names, STRATEGY_REGISTRY)}
#: The one class each face's base gives its names (MEFT's adapters have a class of their own).
BASES = {"Trainer": {"lsp_offload": SingleDeviceOffload, "zero_offload": SingleDeviceOffload,
                     "lsp_offload_ddp": DDPOffload, "zero_offload_ddp": DDPOffload,
                     "meft_offload": lightning_offload.MEFTOffloadStrategy},
         "Fabric": {"lsp_offload": FabricSingleDevice, "zero_offload": FabricSingleDevice,
                    "lsp_offload_ddp": FabricDataParallel, "zero_offload_ddp": FabricDataParallel,
                    "meft_offload": lightning_offload.FabricMEFTOffload}}
PACKAGE = Path(lightning_offload.__file__).parent


@pytest.mark.parametrize("face", list(TABLES))
def test_every_name_is_in_lightning_s_registry_as_its_base_class_with_its_preset(face: str) -> None:
    names, registry = TABLES[face]
    assert [entry.name for entry in names()] == NAMES == list(PRESETS)
    for entry in names():
        assert registry[entry.name]["strategy"] is entry.cls is BASES[face][entry.name]
        assert registry[entry.name]["init_params"] == entry.preset == PRESETS[entry.name]
        assert registry[entry.name]["description"] == entry.public.__doc__.splitlines()[0] != ""
        assert entry.public.strategy_name == entry.name and issubclass(entry.public, entry.cls)


@pytest.mark.parametrize("name", NAMES)
def test_the_trainer_builds_each_name_s_class(name: str) -> None:
    entry = next(entry for entry in trainer_names() if entry.name == name)
    trainer = Trainer(strategy=name, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False)
    _is_the_preset(trainer.strategy, entry, trainer_names())


@pytest.mark.parametrize("name", NAMES)
def test_fabric_builds_each_name_s_class(name: str) -> None:
    entry = next(entry for entry in fabric_names() if entry.name == name)
    _is_the_preset(Fabric(strategy=name, accelerator="cpu", devices=1).strategy, entry, fabric_names())


def _is_the_preset(strategy: object, entry: StrategyName, table: tuple[StrategyName, ...]) -> None:
    """``strategy``, built from ``entry``'s name, is its base class under the name's settings, an instance of the
    name's public class and of no other name's."""
    assert type(strategy) is entry.cls and strategy.strategy_name == entry.name
    assert strategy.settings == OffloadSettings(**PRESETS[entry.name])
    assert [other.name for other in table if isinstance(strategy, other.public)] == [entry.name]


def test_a_preset_class_is_its_base_under_the_name_and_isinstance_follows_the_name() -> None:
    zero = lightning_offload.ZeroOffloadStrategy(link_dtype="bf16")
    assert type(zero) is lightning_offload.ZeroOffloadStrategy and zero.strategy_name == "zero_offload"
    assert zero.settings == OffloadSettings(projection=False, link_dtype="bf16")
    # The base built by hand under zero's preset is one, and goes by its name; under lsp's it is not.
    by_hand = SingleDeviceOffload(projection=False)
    assert isinstance(by_hand, lightning_offload.ZeroOffloadStrategy) and by_hand.strategy_name == "zero_offload"
    assert not isinstance(by_hand, lightning_offload.LSPOffloadStrategy)
    assert not isinstance(SingleDeviceOffload(), lightning_offload.ZeroOffloadStrategy)
    assert not isinstance(zero, lightning_offload.LSPOffloadStrategy)  # siblings, not kinds of each other
    # The name's preset given again is accepted; another value is refused, naming the fix.
    assert lightning_offload.ZeroOffloadStrategy(projection=False).settings.projection is False
    with pytest.raises(ValueError, match=r"projection=True: nothing is projected .* which sets it itself"):
        lightning_offload.FabricZeroOffloadDDP(projection=True)


def _hand_written_presets(path: Path) -> list[str]:
    """``projection=False`` as a call's keyword argument or ``{"projection": False}`` in a dict, in ``path``'s code."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.keyword) and node.arg == "projection" and ast.unparse(node.value) == "False":
            found.append(f"{path.relative_to(PACKAGE)}:{node.value.lineno}")
        elif isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "projection"
                                                and ast.unparse(v) == "False" for k, v in zip(node.keys, node.values)):
            found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    return found


def test_the_zero_preset_is_written_once() -> None:
    # zero_offload is lsp_offload without projection: the preset table says so, and everyone reads it there.
    found = [place for path in sorted(PACKAGE.rglob("*.py")) for place in _hand_written_presets(path)]
    assert len(found) == 1 and found[0].startswith("setup/settings.py:"), found


def test_no_face_declares_the_settings_by_hand() -> None:
    # Their signatures and help() are generated from OffloadSettings: a new setting is its field, not a parameter of
    # each strategy, Fabric's classes, offload() and the registries. (A lone ``seed`` is a projector fit's own.)
    fields = set(OffloadSettings.__dataclass_fields__) - {"seed"}
    paths = [*(PACKAGE / "faces").rglob("*.py"), PACKAGE / "registries.py"]
    declared = {f"{path.relative_to(PACKAGE)}:{node.name}": sorted(fields & {a.arg for a in ast.walk(node.args)
                                                                              if isinstance(a, ast.arg)})
                for path in paths for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert not {name: args for name, args in declared.items() if args}


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
