"""The prepared GPU benchmark runs end to end (tiny shape; on the CPU here, on the GPU when there is one)."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_bench.py"


def test_gpu_benchmark_script_runs_every_available_method(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    gpu_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_bench)
    report = gpu_bench.main(["--smoke", "--out", str(tmp_path / "report.json")])
    by_method = {entry["method"]: entry for entry in report["methods"]}
    for method in ("native", "zero_offload", "lsp_offload"):
        assert "error" not in by_method[method], by_method[method]
        assert by_method[method]["median_step_seconds"] > 0
    assert by_method["lsp_offload"]["link_bytes_measured"]
    assert 0 < by_method["lsp_offload"]["link_bytes_per_step"] < by_method["zero_offload"]["link_bytes_per_step"]
    for method in ("meft_host_routing", "meft_device_routing"):
        entry = by_method[method]
        assert "error" not in entry, entry
        assert 0 < entry["meft_rows_share_per_step"] <= 1 and entry["meft_link_bytes_per_step"] > 0
    # Host routing keeps no key copy on the device.
    assert by_method["meft_host_routing"]["meft_adapter_device_bytes"] < \
        by_method["meft_device_routing"]["meft_adapter_device_bytes"]
    assert (tmp_path / "report.json").exists()
