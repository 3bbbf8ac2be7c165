"""``import lightning_offload`` loads no Lightning, and the strategy names still reach Lightning's registries.

A plain loop or Hugging Face's ``Trainer`` never uses Lightning's Trainer or Fabric, so the package's names load on
first use and the names ``lsp_offload`` and the others are registered when Lightning is imported, before or after
this package. Each check runs in a fresh interpreter: the test process has imported everything already.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

import lightning_offload

#: What a plain loop must not pay for at import.
HEAVY = ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric", "transformers",
         "torchmetrics", "hydra", "wandb")
NAMES = ("lsp_offload", "zero_offload", "meft_offload", "lsp_offload_ddp", "zero_offload_ddp")


def _run(code: str) -> str:
    """Run ``code`` in a fresh interpreter; its stdout, or the failure with its stderr."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parent)
    assert done.returncode == 0, f"exit status {done.returncode}:\n{done.stderr[-4000:]}"
    return done.stdout


def _loaded_heavy() -> str:
    return f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"


def test_import_loads_no_lightning_nor_transformers() -> None:
    assert _run(f"import sys\nimport lightning_offload\n{_loaded_heavy()}").strip() == "[]"


def test_the_hf_trainer_face_loads_no_lightning() -> None:
    out = _run(f"import sys\nfrom lightning_offload.faces.hf import OffloadCallback\n{_loaded_heavy()}")
    assert out.strip() == "['transformers']"  # the callback is a transformers.TrainerCallback


def test_a_plain_loop_trains_without_lightning() -> None:
    out = _run(f"""
        import sys
        import torch
        from lightning_offload import offload

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = offload(model, torch.optim.AdamW(model.parameters(), lr=1e-2), min_dim=16)
        model(torch.randn(8, 32)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        optimizer.close()
        assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        {_loaded_heavy()}
    """)
    assert out.strip() == "[]"


# Lightning first or this package first; the registries' own modules as the first Lightning import too.
ORDERS = {
    "lightning_offload_then_lightning": "import lightning_offload\nimport lightning.pytorch as pl\n"
                                        "import lightning as L",
    "lightning_then_lightning_offload": "import lightning as L\nimport lightning.pytorch as pl\n"
                                        "import lightning_offload",
    "registry_module_first": "import lightning_offload\nfrom lightning.fabric.strategies import STRATEGY_REGISTRY\n"
                             "import lightning.pytorch as pl\nimport lightning as L",
    # Our Fabric module imports Lightning itself, and filling the registries needs that module whole.
    "a_strategy_name_first": "import lightning_offload\nlightning_offload.FabricMEFTOffload\n"
                             "import lightning.pytorch as pl\nimport lightning as L",
    "a_strategy_module_first": "import lightning_offload.faces.trainer.offload\nimport lightning_offload\n"
                               "import lightning.pytorch as pl\nimport lightning as L",
}


ORDER_CHECK = f"""
import sys
from lightning.pytorch.strategies import StrategyRegistry
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning_offload.registries import _FINDER
assert all(name in StrategyRegistry and name in STRATEGY_REGISTRY for name in {NAMES!r})
assert _FINDER not in sys.meta_path  # both registries filled: nothing left to watch for
trainer = pl.Trainer(strategy="lsp_offload", accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_checkpointing=False, enable_model_summary=False)
fabric = L.Fabric(strategy="zero_offload", accelerator="cpu", devices=1)
print(type(trainer.strategy).__name__, type(fabric.strategy).__name__)
print(isinstance(trainer.strategy, lightning_offload.LSPOffloadStrategy),
      isinstance(fabric.strategy, lightning_offload.FabricZeroOffload))
print(lightning_offload.LSPOffloadStrategy.preset_of is StrategyRegistry["lsp_offload"]["strategy"])
"""


@pytest.fixture(scope="module")
def order_runs() -> dict[str, Future]:
    """Each import order's fresh interpreter, two at a time (each spends its seconds importing, on one core); a
    future of its stdout, or of the failure with its stderr."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {name: pool.submit(_run, imports + ORDER_CHECK) for name, imports in ORDERS.items()}


@pytest.mark.parametrize("order", list(ORDERS))
def test_trainer_and_fabric_resolve_the_names_in_either_import_order(order_runs: dict[str, Future], order: str) -> None:
    out = order_runs[order].result()
    # Each name builds its face's one class with its preset, which the name's preset class takes as one of its own.
    assert out.split() == ["SingleDeviceOffload", "FabricSingleDevice", "True", "True", "True"]


def test_registration_runs_once_and_leaves_lightning_s_loader_alone() -> None:
    out = _run("""
        import importlib
        import sys
        from unittest import mock
        import lightning_offload
        from lightning_offload import registries
        with mock.patch.object(registries, "register_trainer_strategies",
                               wraps=registries.register_trainer_strategies) as trainer_calls:
            registries.REGISTRIES["Trainer"] = ("lightning.pytorch", trainer_calls)
            import lightning
            import lightning.pytorch, lightning.fabric
            importlib.reload(lightning_offload)  # a second import of the package registers nothing again
            assert registries._FINDER not in sys.meta_path
        print(trainer_calls.call_count, type(lightning.__loader__).__name__, type(lightning.__spec__.loader).__name__)
    """)
    assert out.split() == ["1", "SourceFileLoader", "SourceFileLoader"]


def test_a_failed_registration_is_a_clear_error_from_lightning_s_import() -> None:
    out = _run("""
        import sys
        import lightning_offload
        sys.modules["lightning_offload.faces.trainer.offload"] = None  # its import now fails
        try:
            import lightning.pytorch
        except ImportError as error:
            print(type(error).__name__, "|", error)
    """)
    assert out.startswith("StrategyRegistrationError | lightning_offload could not register its strategy names with "
                          "the Trainer's registry"), out


def test_every_public_name_resolves_and_is_listed() -> None:
    out = _run("""
        import lightning_offload
        missing = [name for name in lightning_offload.__all__ if getattr(lightning_offload, name, None) is None]
        unlisted = sorted(set(lightning_offload.__all__) - set(dir(lightning_offload)))
        print(missing)
        print(unlisted)
        print(len(lightning_offload.__all__))
        from lightning.pytorch.strategies import StrategyRegistry  # resolving the strategies imported Lightning
        print("lsp_offload" in StrategyRegistry)
    """)
    missing, unlisted, count, registered = out.splitlines()
    assert (missing, unlisted, registered) == ("[]", "[]", "True")
    assert int(count) == len(lightning_offload.__all__) > 40
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        lightning_offload.no_such_name  # noqa: B018


def test_type_checkers_see_exactly_the_public_names() -> None:
    # The names in the TYPE_CHECKING block are what static analysis knows; they must be the lazy ones, one to one.
    tree = ast.parse(Path(lightning_offload.__file__).read_text())
    checked = [node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"]
    assert len(checked) == 1, "no `if TYPE_CHECKING:` block of the public names in lightning_offload/__init__.py"
    imported = {alias.name: node.module for node in ast.walk(checked[0]) if isinstance(node, ast.ImportFrom)
                for alias in node.names}
    assert imported == lightning_offload._SOURCES
    assert sorted(imported) == sorted(lightning_offload.__all__)
