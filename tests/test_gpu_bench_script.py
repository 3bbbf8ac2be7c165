"""The prepared GPU scripts run end to end (tiny shape; on the CPU here, on the GPU when there is one), and in a
Python like the device machine's, which lacks the command line's packages: a device run is short and rare, and an
import error there costs its minutes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from scripts_loader import load_script

REPO = Path(__file__).resolve().parent.parent
#: Installed here but not on the device machine: the GPU scripts, and the tests they run there, must not need them.
NOT_ON_THE_DEVICE = ("hydra", "omegaconf", "wandb", "optuna", "galore_torch", "torchao", "deepspeed")


@pytest.fixture()
def device_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The environment of interpreters started from here on (the scripts' own subprocesses too): a ``sitecustomize``
    puts ``None`` in ``sys.modules`` for each of :data:`NOT_ON_THE_DEVICE`, so importing one raises
    ``ModuleNotFoundError`` and ``importlib.util.find_spec`` returns ``None``, as for a package not installed."""
    site = tmp_path / "device_site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in NOT_ON_THE_DEVICE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    absent = subprocess.run([sys.executable, "-c", "import hydra"], capture_output=True, text=True)
    assert "ModuleNotFoundError" in absent.stderr, "the device's Python must lack hydra for this test to mean anything"
    return dict(os.environ)


def test_gpu_benchmark_script_runs_every_available_method(tmp_path, device_python, monkeypatch):
    gpu_bench = load_script("gpu_bench")
    # Behind the simulated link, as a GPU runs it: the worker a thread, the ring, speculation (the GPU test list it
    # would run first on the CPU under it is left out here: those modules run in this suite).
    monkeypatch.setenv("LIGHTNING_OFFLOAD_SIMULATED_LINK", "gbps=2,jitter_ms=1")  # the script sets it: undone after
    report = gpu_bench.main(["--smoke", "--simulated-link", "gbps=2,jitter_ms=1", "--no-gpu-tests",
                             "--out", str(tmp_path / "report.json")])
    by_method = {entry["method"]: entry for entry in report["methods"]}
    for method in ("native", "lora_device", "zero_offload", "lsp_offload"):
        assert "error" not in by_method[method], by_method[method]
        assert by_method[method]["median_step_seconds"] > 0
        assert by_method[method]["profile"]  # one profiled step, by kernel class
    # The offload methods explain their step: timeline lanes, host time, page faults, bytes each way.
    for method in ("zero_offload", "lsp_offload"):
        entry = by_method[method]
        assert {"device_seconds", "host_seconds", "device_wait_seconds"} <= set(entry["step_split_seconds"])
        assert entry["host_optimizer_seconds_per_step"] > 0 and entry["host_page_faults_per_step"] >= 0
        assert entry["link_bytes_to_host_per_step"] > 0 and entry["link_bytes_to_device_per_step"] > 0
        assert 0 <= entry["host_share_before_backward_end"] <= 1
    # Per projected-layer shape: every kernel that runs here against the GEMMs they replace, and the kernels chosen.
    kernels = report["projection_kernels"]
    assert "error" not in kernels, kernels
    assert [layer["layer"] for layer in kernels["layers"]] == ["q/o", "k/v", "gate/up", "down"]
    for layer in kernels["layers"]:
        assert layer["weight-gradient GEMM"] > 0 and layer["csr: backward"] > 0 and layer["dense: update"] > 0
        assert set(layer["chosen"]) == {"forward", "backward", "update"}
    table = (tmp_path / "report.md").read_text()
    assert "| lsp_offload | 2 |" in table and "| native | 2 |" in table
    assert by_method["lsp_offload"]["link_bytes_measured"]
    # Device memory of the offload machinery by category: persistent, per step, and the initial fit's.
    lsp = by_method["lsp_offload"]
    assert lsp["device_persistent_bytes"]["projectors"] > 0
    assert lsp["device_transient_bytes"]["saved_projections"] > 0 and lsp["fit_device_state_bytes"] > 0
    assert 0 < by_method["lsp_offload"]["link_bytes_per_step"] < by_method["zero_offload"]["link_bytes_per_step"]
    # The default placements move fewer bytes than embedding and head stepped densely on the host.
    assert by_method["lsp_offload"]["sparse_embedding_rows_per_step"] > 0
    dense_ends = by_method["lsp_offload_dense_ends"]
    assert "error" not in dense_ends, dense_ends
    assert by_method["lsp_offload"]["link_bytes_per_step"] < dense_ends["link_bytes_per_step"]
    # update="scaled", a lane of its own: the projection's bytes cross (fewer than zero's), its P and the full
    # gradients it holds until the scales return are counted.
    scaled = by_method["lsp_offload_scaled"]
    assert "error" not in scaled, scaled
    assert 0 < scaled["link_bytes_per_step"] < by_method["zero_offload"]["link_bytes_per_step"]
    assert scaled["device_persistent_bytes"]["scaled_projections"] > 0
    assert scaled["device_transient_bytes"]["held_gradients"] > 0
    for method in ("meft_host_routing", "meft_device_routing"):
        entry = by_method[method]
        assert "error" not in entry, entry
        assert 0 < entry["meft_rows_share_per_step"] <= 1 and entry["meft_link_bytes_per_step"] > 0
        assert entry["meft_rows_share_per_step"] <= entry["meft_row_bound_share"] < 1  # per-sequence routing
        assert entry["meft_rows_share_per_step"] <= entry["meft_rows_stepped_share_per_step"] <= 1
    # Host routing keeps no key copy on the device.
    assert by_method["meft_host_routing"]["meft_adapter_device_bytes"] < \
        by_method["meft_device_routing"]["meft_adapter_device_bytes"]
    # The offload methods' steps phase by phase (a run each with the engine's phase clock on).
    for method in ("zero_offload", "lsp_offload"):
        phases = report["phases"][method]
        assert isinstance(phases, dict) and phases["host_adam"] > 0 and phases["step_launch"] > 0, phases
    assert report["phases"]["lsp_offload"]["forward_projection"] > 0
    assert report["phases"]["lsp_offload"]["apply_update"] > 0
    assert (tmp_path / "report.json").exists()


def test_multi_gpu_benchmark_script_runs_on_two_cpu_processes(tmp_path):
    gpu_bench_ddp = load_script("gpu_bench_ddp")
    report = gpu_bench_ddp.main(["--smoke", "--out", str(tmp_path / "report.json")])
    by_method = {entry["method"]: entry for entry in report["methods"]}
    assert set(by_method) == {"ddp", "zero_offload_ddp", "lsp_offload_ddp"}
    for entry in by_method.values():
        assert "error" not in entry, entry
        assert entry["ranks"] == 2 and entry["median_step_seconds"] > 0
    # Compressed gradients and updates: fewer bytes between ranks than the dense offload and than plain DDP.
    lsp, zero = by_method["lsp_offload_ddp"], by_method["zero_offload_ddp"]
    assert lsp["bytes_between_ranks_per_step"] < zero["bytes_between_ranks_per_step"]
    assert lsp["host_state_bytes_rank0"] < zero["host_state_bytes_rank0"]
    assert lsp["step_split_seconds"]["host"] > 0
    assert (tmp_path / "report.json").exists()


def test_the_tests_run_on_the_device_and_the_plan_check_need_no_command_line_package(tmp_path, device_python):
    gpu_bench = load_script("gpu_bench")
    # The CUDA tests gpu_bench.py runs there: every module imports (pytest itself is on the device).
    modules = [Path(path).stem for path in gpu_bench.GPU_TESTS]
    imported = subprocess.run(
        [sys.executable, "-c", "import importlib, sys; sys.path.insert(0, 'tests'); "
         f"[importlib.import_module(name) for name in {modules!r}]"],
        cwd=REPO, env=device_python, capture_output=True, text=True, timeout=300)
    assert imported.returncode == 0, imported.stderr[-3000:]
    # The planner's GPU check, on its tiny shape.
    checked = subprocess.run([sys.executable, "scripts/gpu_plan_check.py", "--shape", "tiny", "--device", "cpu",
                              "--steps", "2", "--batch", "2", "--seq", "64"],
                             cwd=REPO, env=device_python, capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert "| lsp_offload |" in checked.stdout
