"""The package's layers, as docs/design.md's Package layout states them: each module imports only its own layer and
those below, and the faces are peers.

cache (where built kernels and converted models are kept), lm_loss (a causal LM's loss without its logits) and lsp
(projectors, projected layers, their kernels) < engine (the offload optimizer; no Lightning) < setup (what every face
shares; no Lightning) < meft (the adapters; no Lightning strategy) and planning (a run's plan; no Lightning) < faces
(one per training loop: trainer, fabric, loop, hf; none imports another) < the product (registries, cli, tasks,
reporting, models, data). Imports inside functions count too: a cycle hidden in a local import is still a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_offload

PACKAGE = Path(lightning_offload.__file__).parent
LAYERS = {"cache": 0, "inner_optimizers": 0, "lm_loss": 0, "lsp": 0,
          "engine": 1, "setup": 2, "meft": 3, "planning": 3, "faces": 4,
          "registries": 5, "cli": 5, "tasks": 5, "reporting": 5, "models": 5, "data": 5}
#: The faces, peers in their layer: each is one kind of training loop.
FACES = {"trainer", "fabric", "loop", "hf"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The lightning_offload modules ``path`` imports (anywhere in it, local imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_offload"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("lightning_offload")}
    return found


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in _imports(path) if m in modules} for name, path in modules.items()}


def test_every_module_belongs_to_a_layer() -> None:
    loose = sorted(m for m in _graph() if m != "lightning_offload" and _layer(m) is None)
    assert not loose, f"modules outside the layers of the README's Layout: {loose}"


def test_no_module_imports_a_later_layer() -> None:
    upward = [(module, imported) for module, imports in _graph().items() for imported in imports
              if module != "lightning_offload" and _layer(imported) is not None
              and _layer(imported) > _layer(module)]
    assert not upward, f"imports of a later layer: {upward}"


def _lightning_imports(path: Path) -> list[str]:
    """The Lightning modules ``path`` imports (anywhere in it, local imports included)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        found += [n for n in names if n.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric")]
    return found


def test_lsp_the_engine_and_the_set_up_do_not_use_lightning() -> None:
    # lsp/ is torch math, engine/ the offload optimizer and setup/ what every face shares: each must run in any
    # training loop, so Lightning (its Trainer's strategies and callbacks, Fabric's strategies) lives in faces/.
    offending = {str(path.relative_to(PACKAGE)): _lightning_imports(path)
                 for layer in ("lsp", "engine", "setup", "planning") for path in (PACKAGE / layer).rglob("*.py")}
    offending = {path: names for path, names in offending.items() if names}
    assert not offending, f"Lightning imported below the faces: {offending}"


def _face(module: str) -> str | None:
    """The face ``module`` belongs to (``trainer`` for ``lightning_offload.faces.trainer.ddp``), or ``None``."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "faces" else None


def test_every_face_module_belongs_to_a_known_face() -> None:
    unknown = sorted(m for m in _graph() if _face(m) is not None and _face(m) not in FACES)
    assert not unknown, f"modules under faces/ outside the faces {sorted(FACES)}: {unknown}"


def test_no_face_imports_another() -> None:
    # A face reaches what it shares with the others through setup/, so each can change (or go) alone.
    crossing = [(module, imported) for module, imports in _graph().items() for imported in imports
                if _face(module) is not None and _face(imported) is not None and _face(imported) != _face(module)]
    assert not crossing, f"a face importing another: {crossing}"


def test_reporting_imports_no_face() -> None:
    # The run's reporting reads the strategies through the report port (setup/report.py) only.
    found = [(module, imported) for module, imports in _graph().items()
             if module.startswith("lightning_offload.reporting") for imported in imports if _face(imported) is not None]
    assert not found, f"reporting importing a face: {found}"


def test_the_lightning_check_sees_every_form_of_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import torch\nimport lightning.pytorch as pl\ndef f():\n"
                      "    from lightning_fabric import Fabric\n")
    assert _lightning_imports(module) == ["lightning.pytorch", "lightning_fabric"]


#: The engine's floors, lowest first: each of its parts imports only its own part and the floors below. The figures
#: (phases, telemetry, the timeline), the host rules and the checkpoint kinds; the lanes the slots share (the worker,
#: the link, the update ring, the ranks); the row Adam; the slots; the step; what the optimizer is built from (its late
#: parameters, the user's optimizer, the engine's state, the offload settings it takes whole); the optimizer; the
#: projector fitting that drives it.
ENGINE_FLOORS = {"figures": 0, "rules": 0, "checkpoint_kinds": 0, "lanes": 1, "rows": 2, "slots": 3, "step": 4,
                 "late_params": 5, "user_optimizer": 5, "engine_state": 5, "settings": 5, "optimizer": 6, "fitting": 7}


def _engine_part(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "engine" else None


def test_every_engine_module_is_on_a_floor() -> None:
    loose = sorted(m for m in _graph() if _engine_part(m) is not None and _engine_part(m) not in ENGINE_FLOORS)
    assert not loose, f"engine modules on no floor of ENGINE_FLOORS: {loose}"


def test_no_arrow_runs_back_up_the_engine_s_floors() -> None:
    upward = [(module, imported) for module, imports in _graph().items() if _engine_part(module) in ENGINE_FLOORS
              for imported in imports if _engine_part(imported) in ENGINE_FLOORS
              and ENGINE_FLOORS[_engine_part(imported)] > ENGINE_FLOORS[_engine_part(module)]]
    assert not upward, f"imports of a higher floor inside engine/: {upward}"


def test_no_import_cycles() -> None:
    graph = _graph()
    state: dict[str, int] = {}

    def visit(module: str, stack: list[str]) -> None:
        state[module] = 1
        for imported in sorted(graph[module]):
            if imported == "lightning_offload":
                continue
            if state.get(imported) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(stack[stack.index(imported):] + [imported])}")
            if imported not in state:
                visit(imported, stack + [imported])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


#: What the strategies keep to themselves: the product reads them through lightning_offload/setup/report.py.
STRATEGY_INTERNALS = {"offload_optimizer", "adapters", "attached", "row_optimizers", "last_metrics", "host_rows_bytes",
                      "host_trainable_parameters", "projected_layers", "telemetry"}


def _reads_of_strategy_internals(path: Path) -> list[str]:
    """``getattr`` calls on anything named like a strategy or an optimizer, and reads of their internals."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" and node.args:
            target = ast.unparse(node.args[0])
            if "strategy" in target or "optimizer" in target:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute) and node.attr in STRATEGY_INTERNALS and (
                "strategy" in ast.unparse(node.value) or "optimizer" in ast.unparse(node.value)):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_cli_and_reporting_read_no_strategy_internals() -> None:
    # The run summary and the per-step records are built from the strategy's report (facts and filed figures), so
    # the engine can be reorganised without the product noticing.
    offending = {str(path.relative_to(PACKAGE)): _reads_of_strategy_internals(path)
                 for layer in ("cli", "reporting") for path in (PACKAGE / layer).rglob("*.py")}
    offending = {path: reads for path, reads in offending.items() if reads}
    assert not offending, f"strategy internals read outside the strategies: {offending}"


def test_the_internals_check_sees_getattr_and_attribute_reads(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f(trainer, datamodule):\n    a = getattr(trainer.strategy, 'x', None)\n"
                      "    b = trainer.strategy.offload_optimizer.slots\n    c = recorder.telemetry\n"
                      "    return getattr(datamodule, 'task', '')\n")
    assert _reads_of_strategy_internals(module) == ["line 2: getattr(trainer.strategy, 'x', None)",
                                                    "line 3: trainer.strategy.offload_optimizer"]


# Sizes a maintainer can hold in their head (issue 29): a module past them has grown a second job.
MODULE_MAX_LINES = 400
ORCHESTRATOR_MAX_LINES = 350
MEFT_STRATEGY_MAX_LINES = 150  # set-up only: the rows are a slot kind of the engine (meft/attached.py)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_module_is_over_its_size() -> None:
    long = {str(p.relative_to(PACKAGE)): _lines(p) for p in PACKAGE.rglob("*.py") if _lines(p) > MODULE_MAX_LINES}
    assert not long, f"modules over {MODULE_MAX_LINES} lines (split them by job): {long}"
    assert _lines(PACKAGE / "engine" / "step" / "orchestrator.py") <= ORCHESTRATOR_MAX_LINES
    assert _lines(PACKAGE / "faces" / "trainer" / "meft.py") <= MEFT_STRATEGY_MAX_LINES


FUNCTION_MAX_LINES = 80  # a function past it (docstring included) holds steps that want names of their own


def _long_functions(path: Path) -> list[str]:
    """The functions and methods of ``path`` longer than :data:`FUNCTION_MAX_LINES`, with their lengths."""
    return [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > FUNCTION_MAX_LINES]


def test_no_function_is_over_its_size() -> None:
    long = {str(p.relative_to(PACKAGE)): _long_functions(p) for p in PACKAGE.rglob("*.py")}
    long = {path: names for path, names in long.items() if names}
    assert not long, f"functions over {FUNCTION_MAX_LINES} lines (give their steps names): {long}"


def test_the_function_size_check_counts_docstrings_and_methods(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_MAX_LINES - 2))
    module.write_text(f'def short():\n    """Doc."""\n{body}\n\n'
                      f'class C:\n    def long(self):\n        """Doc."""\n        y = 0\n'
                      + "\n".join(f"        x{i} = {i}" for i in range(FUNCTION_MAX_LINES - 2)) + "\n")
    assert _long_functions(module) == [f"long ({FUNCTION_MAX_LINES + 1} lines)"]


def _constructs(path: Path, names: set[str]) -> list[str]:
    """Calls in ``path`` that construct one of ``names`` (by its bare or dotted name)."""
    return [f"line {node.lineno}: {ast.unparse(node.func)}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and ast.unparse(node.func).rsplit(".", 1)[-1] in names]


def test_meft_runs_on_the_engine_s_worker_and_norm() -> None:
    # One host worker and one global norm for the whole step: MEFT's rows are a slot kind of the engine, so nothing
    # under meft/ starts a host worker or a thread of its own, or computes a gradient norm of its own.
    found = {str(p.relative_to(PACKAGE)): _constructs(p, {"HostWorker", "Thread", "GradientNorms"})
             for p in (PACKAGE / "meft").rglob("*.py")}
    found = {path: calls for path, calls in found.items() if calls}
    assert not found, f"a second worker or norm under meft/: {found}"


def test_the_construction_check_sees_bare_and_dotted_calls(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import threading\nw = HostWorker()\nt = threading.Thread(target=print)\nx = Worker()\n")
    assert _constructs(module, {"HostWorker", "Thread"}) == ["line 2: HostWorker", "line 3: threading.Thread"]


#: The engine's inside: the step and the slot kinds. What the rest of the package needs of them lives at a lower floor
#: (the rules' refusals, the rows an owner hands the engine) or in setup/ (the settings' types).
ENGINE_INSIDE = ("lightning_offload.engine.slots", "lightning_offload.engine.step")
#: Modules outside engine/ that import its inside anyway, each with its reason.
ENGINE_INSIDE_READERS = {
    # The public face: users catch lightning_offload.NonFiniteGradientError and filter NonFiniteStepWarning, which the
    # step raises and issues; the package only re-exports the two names (on first use), it reads nothing of the step.
    "lightning_offload": {"lightning_offload.engine.step.clipping"},
}


def _inside_engine(module: str) -> bool:
    return any(module == part or module.startswith(f"{part}.") for part in ENGINE_INSIDE)


def test_only_the_engine_imports_its_step_and_slots() -> None:
    # The step and the slots can be reorganised (issue 57) without a face, the set-up, the planner or MEFT noticing.
    found = {module: sorted(m for m in imports if _inside_engine(m)) for module, imports in _graph().items()
             if not module.startswith("lightning_offload.engine")}
    found = {module: names for module, names in found.items() if names}
    assert {module: set(names) for module, names in found.items()} == ENGINE_INSIDE_READERS, \
        f"imports of the engine's step or slots from outside engine/ (not among ENGINE_INSIDE_READERS): {found}"


def _names(path: Path) -> set[str]:
    """Every name ``path`` uses: bare names, attributes, and the names it imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= {alias.name.rsplit(".", 1)[-1] for alias in node.names}
    return found


def test_meft_names_no_slot_kind() -> None:
    # MEFT's adapters hand the engine their rows (HostRowBlocks) and use its stepping of them through the owner's side
    # (RowBlocksStepping): which slot kind steps them is the engine's own business.
    kinds = {node.name for path in (PACKAGE / "engine" / "slots").glob("*.py")
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)}
    assert {"Slot", "RowBlocksSlot"} <= kinds
    named = {str(p.relative_to(PACKAGE)): sorted(_names(p) & kinds) for p in (PACKAGE / "meft").rglob("*.py")}
    assert not {path: names for path, names in named.items() if names}, f"slot kinds named under meft/: {named}"


def _fused_kernel_calls(path: Path) -> list[str]:
    """Calls of torch's fused Adam kernels (``torch._fused_adam_``/``torch._fused_adamw_``) in ``path``."""
    return [f"line {node.lineno}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and node.attr in ("_fused_adam_", "_fused_adamw_")]


def test_one_row_adam_drives_the_fused_kernel() -> None:
    # One row Adam for every row-stepped tensor (a row-sparse embedding, MEFT's adapter rows): only its module calls
    # torch's fused kernel on rows; everything else steps through torch.optim.Adam or through it. The native row
    # kernel's load-time check calls it too, to compare the kernel with it, and the Adam host rule's one-tensor Adam
    # (a torch.optim.Adam) makes the call torch's own step makes, without its per-step Python.
    found = {str(p.relative_to(PACKAGE)): _fused_kernel_calls(p) for p in PACKAGE.rglob("*.py")}
    found = {path: calls for path, calls in found.items() if calls}
    assert sorted(found) == ["engine/rows/block_row_adam.py", "engine/rows/native_row_adam.py",
                             "engine/rules/adam.py"], \
        f"fused Adam kernels called outside the row Adam: {found}"


def _calls(path: Path) -> set[str]:
    """The bare names of every function called in ``path``."""
    return {ast.unparse(node.func).rsplit(".", 1)[-1] for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call)}


def test_every_face_sets_up_through_one_function_and_builds_no_engine_part() -> None:
    # The Trainer strategies, Fabric's strategies and a plain loop share the engine (issue 30): each is set-up and
    # hooks only, so each builds the engine through build_engine, and nothing in a face builds a part of it.
    faces = [PACKAGE / "faces" / "trainer" / "offload_base.py", PACKAGE / "faces" / "fabric.py",
             PACKAGE / "faces" / "loop.py"]
    assert all("build_engine" in _calls(path) for path in faces)
    parts = {"OffloadOptimizer", "StepOrchestrator", "HostWorker", "GradientNorms", "GradientRouting",
             "CommitAfterNorm", "SpeculativeCommit", "commit_policy", "LayerFit", "build_slots", "attach_projections",
             "plan_placement"}
    built = {str(p.relative_to(PACKAGE)): sorted(_calls(p) & parts)
             for p in (PACKAGE / "faces").rglob("*.py")}
    assert not {path: names for path, names in built.items() if names}


def test_each_face_s_strategies_are_configurations_of_one_class_not_kinds_of_lsp() -> None:
    # zero_offload and meft_offload are not LSP-Offload: in each face they are siblings of lsp_offload over the face's
    # one offload class (its machinery), each setting only its name and what it forces.
    from lightning_offload.faces.fabric import FabricDataParallel, FabricSingleDevice
    from lightning_offload.faces.trainer.ddp import DDPOffload
    from lightning_offload.faces.trainer.offload import SingleDeviceOffload

    families = {
        SingleDeviceOffload: (lightning_offload.LSPOffloadStrategy, lightning_offload.ZeroOffloadStrategy,
                              lightning_offload.MEFTOffloadStrategy),
        DDPOffload: (lightning_offload.LSPOffloadDDPStrategy, lightning_offload.ZeroOffloadDDPStrategy),
        FabricSingleDevice: (lightning_offload.FabricOffload, lightning_offload.FabricZeroOffload,
                             lightning_offload.FabricMEFTOffload),
        FabricDataParallel: (lightning_offload.FabricOffloadDDP, lightning_offload.FabricZeroOffloadDDP),
    }
    for base, strategies in families.items():
        lsp, *others = strategies
        assert all(strategy.__bases__ == (base,) for strategy in strategies), base.__name__
        assert not any(issubclass(other, lsp) for other in others), f"a kind of {lsp.__name__}: {others}"
        # How ranks agree on a fit is a value the strategy hands the fit, not three methods in every one's help().
        assert not any(hasattr(strategy, name) for strategy in strategies
                       for name in ("agree", "agree_projectors", "reduce_sampled_gradient"))


def _attribute_reads(path: Path, names: set[str]) -> set[str]:
    return {node.attr for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and node.attr in names}


def test_the_step_and_the_checkpoint_know_slots_only_through_their_interface() -> None:
    # What is one kind's (a projected weight's layer, its forward counts and buffers, its prefetch, its projectors in a
    # checkpoint; a row Adam's or the scaled rule's state) lives in that kind's hooks: the orchestrator, the checkpoint
    # and the state sizes import no kind of slot and read no kind's internals.
    engine = PACKAGE / "engine"
    readers = [engine / "step" / "orchestrator.py", engine / "engine_state.py", engine / "step" / "sizes.py",
               engine / "step" / "commit.py", engine / "step" / "speculation.py", engine / "step" / "slot_step.py",
               engine / "step" / "update_prefetch.py", engine / "step" / "commit_policies.py"]
    kinds = {f"lightning_offload.engine.slots.{kind}" for kind in (
        "projected_slot", "scaled_slot", "dense_slot", "row_slot", "row_blocks_slot", "remote_slot")}
    internals = {"layer", "projected_layers", "prefetch", "proj_out", "proj_in", "grad_buffer", "generator", "adam",
                 "_opt_called"}
    found = {str(p.relative_to(PACKAGE)): sorted((_imports(p) & kinds) | _attribute_reads(p, internals))
             for p in readers}
    assert not {path: names for path, names in found.items() if names}


LINE_MAX_CHARS = 120  # the project's style: a line past it is rewrapped (docstrings and comments re-flowed)
ROOT = Path(__file__).resolve().parents[1]


def _long_lines(path: Path) -> list[str]:
    """``file:line (length)`` for each line of ``path`` longer than :data:`LINE_MAX_CHARS` characters."""
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return [f"{name}:{number} ({len(line)} chars)"
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if len(line) > LINE_MAX_CHARS]


def test_no_line_is_over_its_length() -> None:
    # The package, the scripts and the tests: a docstring that grew when its module moved deeper is rewrapped.
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "scripts").glob("*.py"), *(ROOT / "tests").glob("*.py")]
    assert any(path.parent.name == "scripts" for path in files) and Path(__file__).resolve() in files
    long = [line for path in sorted(files) for line in _long_lines(path)]
    assert not long, f"lines over {LINE_MAX_CHARS} characters (rewrap them): {long}"


def test_the_line_length_check_names_file_and_line(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    # Characters, not bytes: the last line is at the limit in characters but over it in UTF-8 bytes.
    module.write_text(f"x = 1\n{'#' * LINE_MAX_CHARS}\n{'#' * (LINE_MAX_CHARS + 1)}\n"
                      f"# ×{'−' * (LINE_MAX_CHARS - 3)}\n", encoding="utf-8")
    assert _long_lines(module) == [f"{module}:3 ({LINE_MAX_CHARS + 1} chars)"]
