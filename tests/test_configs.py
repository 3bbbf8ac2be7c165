"""The Hydra configs: every group option composes and instantiates, every experiment runs, errors are clear."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from lightning.pytorch.utilities.model_summary import ModelSummary
from omegaconf import DictConfig, open_dict

from lightning_offload.cli.policies import OffloadPolicy
from lightning_offload.cli.train import CONFIG_DIR, compose_config, train
from lightning_offload.reporting.summary import format_summary
from lightning_offload.faces.trainer.meft import MEFTOffloadStrategy
from lightning_offload.models.builders import LanguageModel
from lightning_offload.models.tiny import ByteTokenizer
from lightning_offload.faces.trainer.offload import LSPOffloadStrategy, ZeroOffloadStrategy
from lightning_offload.tasks.causal_lm import CausalLMModule
from lightning_offload.tasks.classifier import SequenceClassifierModule

GROUPS = ("model", "data", "offload", "trainer", "logger", "callbacks", "experiment", "hparams_search", "debug",
          "paths")


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


@pytest.fixture(autouse=True)
def _isolated(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tokenised-data caches of the tiny byte-level runs go to a temp dir, not the user's cache.
    monkeypatch.setenv("LIGHTNING_OFFLOAD_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    GlobalHydra.instance().clear()


def compose_cfg(overrides: list[str], out: Path | None = None) -> DictConfig:
    """The real config with overrides, as the CLI composes it, writing into ``out``."""
    cfg = compose_config(overrides, out)
    if out is not None:
        with open_dict(cfg):
            cfg.paths.log_dir = str(out)
    return cfg


def test_every_group_exists_with_options() -> None:
    for group in GROUPS:
        assert options(group), f"conf/{group}/ has no options"
    assert {"smollm2_135m", "tiny_llama", "tiny_gpt2", "hf", "llama_1b3", "llama_7b"} <= set(options("model"))
    assert {"bible_lm", "bible_genre", "bible_qa"} <= set(options("data"))
    assert {"lsp", "zero", "none", "galore", "lora", "meft"} <= set(options("offload"))
    assert {"wandb", "csv"} <= set(options("logger"))


def test_default_is_the_main_job() -> None:
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train")
    assert cfg.model._target_.endswith("smollm2_135m")
    assert cfg.data._target_.endswith("BibleLMDataModule")
    assert cfg.offload.name == "lsp"
    assert cfg.logger.wandb.offline is True


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_gpt2"])
def test_tiny_models_instantiate(name: str, tmp_path: Path) -> None:
    lm = instantiate(compose_cfg([f"model={name}"], tmp_path).model)
    assert isinstance(lm, LanguageModel) and isinstance(lm.tokenizer, ByteTokenizer)
    assert all(p.requires_grad for p in lm.network.parameters())


@pytest.mark.parametrize("name, billions", [("llama_1b3", 1.3), ("llama_7b", 6.7)])
def test_shape_only_models_have_their_size(name: str, billions: float, tmp_path: Path) -> None:
    cfg = compose_cfg([f"model={name}"], tmp_path)
    with torch.device("meta"):  # the real shape without allocating gigabytes
        lm = instantiate(cfg.model)
    assert lm.num_parameters / 1e9 == pytest.approx(billions, rel=0.06)
    assert getattr(lm.network, "is_activation_checkpointing", None) or lm.network.is_gradient_checkpointing
    assert next(lm.network.parameters()).dtype == torch.bfloat16


def test_hf_model_from_a_local_directory(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    model_dir = tmp_path / "tiny-hf"
    LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(model_dir)
    vocab = {f"t{i}": i for i in range(32)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                  eos_token="t1")
    tok.save_pretrained(model_dir)
    lm = instantiate(compose_cfg(["model=hf", f"model.name_or_path={model_dir}"], tmp_path).model)
    assert lm.name == str(model_dir) and lm.tokenizer.pad_token is not None


def test_a_local_model_directory_without_a_tokenizer_says_so(tmp_path: Path) -> None:
    """transformers itself would blame a missing sentencepiece package, which installing does not fix."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = tmp_path / "weights-only"
    LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(model_dir)
    with pytest.raises(Exception) as caught:
        instantiate(compose_cfg(["model=hf", f"model.name_or_path={model_dir}"], tmp_path).model)
    message = str(caught.value) + str(caught.value.__cause__)
    assert f"model.name_or_path='{model_dir}' is a directory without a tokenizer" in message
    assert f"tokenizer.save_pretrained('{model_dir}')" in message and "sentencepiece" not in message


def test_hf_model_without_a_name_says_what_to_set(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="name_or_path"):
        instantiate(compose_cfg(["model=hf"], tmp_path).model)


@pytest.mark.parametrize("name", ["bible_lm", "bible_genre", "bible_qa"])
def test_data_instantiates_and_yields_batches(name: str, tmp_path: Path) -> None:
    dm = instantiate(compose_cfg([f"data={name}"], tmp_path).data, tokenizer=ByteTokenizer())
    dm.prepare_data()
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == batch["attention_mask"].shape
    assert batch["input_ids"].shape[0] == dm.batch_size


def test_offload_policies_instantiate(tmp_path: Path) -> None:
    expected = {"lsp": (LSPOffloadStrategy, "full"), "lsp_learned": (LSPOffloadStrategy, "full"),
                "lsp_scaled": (LSPOffloadStrategy, "full"),
                "zero": (ZeroOffloadStrategy, "full"), "none": (str, "full"),
                "galore": (str, "galore"), "lora": (str, "lora"), "meft": (MEFTOffloadStrategy, "meft"),
                "dense_adapter": (str, "adapter")}
    for name in options("offload"):
        policy = instantiate(compose_cfg([f"offload={name}"], tmp_path).offload)
        assert isinstance(policy, OffloadPolicy) and policy.name == name
        strategy_type, method = expected[name]
        assert isinstance(policy.strategy, strategy_type) and policy.method == method
    # offload=lsp draws random projectors (the default) and adds no callback; lsp_learned is lsp with learned ones.
    lsp = instantiate(compose_cfg(["offload=lsp"], tmp_path).offload)
    assert lsp.strategy.settings.projectors == "random" and not lsp.learns_projectors and lsp.callbacks() == []
    learned = instantiate(compose_cfg(["offload=lsp_learned"], tmp_path).offload)
    assert learned.strategy.settings.projectors == "learned" and learned.learns_projectors
    assert len(learned.callbacks()) == 1
    assert learned.strategy.settings.rank == lsp.strategy.settings.rank \
        and learned.strategy.settings.density == lsp.strategy.settings.density
    # lsp_scaled is lsp's host bytes with the full-rank scaled update.
    scaled = instantiate(compose_cfg(["offload=lsp_scaled"], tmp_path).offload)
    assert scaled.strategy.settings.update == "scaled" and scaled.strategy.settings.rank == lsp.strategy.settings.rank
    assert lsp.strategy.settings.update == "projected"


@pytest.mark.parametrize("name", ["default", "cpu"])
def test_trainers_instantiate(name: str, tmp_path: Path) -> None:
    trainer = instantiate(compose_cfg([f"trainer={name}"], tmp_path).trainer, logger=False)
    assert isinstance(trainer, pl.Trainer) and trainer.max_steps == 40


def test_gpu_trainer_composes(tmp_path: Path) -> None:
    # Instantiating needs a GPU; the composed values are what can be checked here.
    assert compose_cfg(["trainer=gpu"], tmp_path).trainer.accelerator == "gpu"


@pytest.mark.parametrize("name", ["wandb", "csv", "many"])
def test_loggers_instantiate(name: str, tmp_path: Path) -> None:
    cfg = compose_cfg([f"logger={name}"], tmp_path)
    loggers = [instantiate(entry, _convert_="all") for entry in cfg.logger.values()]
    assert loggers and all(isinstance(lg, pl.loggers.Logger) for lg in loggers)


@pytest.mark.parametrize("name", ["default", "checkpoint", "none"])
def test_callbacks_instantiate(name: str, tmp_path: Path) -> None:
    node = compose_cfg([f"callbacks={name}"], tmp_path).callbacks or {}
    callbacks = [instantiate(entry) for entry in node.values()]
    assert all(isinstance(c, pl.Callback) for c in callbacks)
    assert (name == "checkpoint") == any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in callbacks)


@pytest.mark.parametrize("name", ["fdr", "limit", "profiler"])
def test_debug_presets_compose(name: str, tmp_path: Path) -> None:
    cfg = compose_cfg([f"debug={name}"], tmp_path)
    assert cfg.task_name == "debug"


def test_optuna_search_composes(tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["hparams_search=lsp_optuna"], return_hydra_config=True)
    assert cfg.optimized_metric == "val/loss"
    assert "OptunaSweeper" in cfg.hydra.sweeper._target_
    assert set(cfg.hydra.sweeper.params) == {"optim.lr", "offload.projected_lr", "offload.strategy.rank"}


@pytest.mark.parametrize("experiment", options("experiment"))
def test_every_experiment_runs_one_step_on_a_tiny_model(experiment: str, tmp_path: Path) -> None:
    cfg = compose_cfg([f"experiment={experiment}", "model=tiny_llama", "trainer=cpu", "debug=fdr"], tmp_path)
    metrics, objects = train(cfg)
    assert objects["trainer"].global_step == 1
    assert (tmp_path / "summary.json").is_file() and (tmp_path / "history.jsonl").is_file()
    module = objects["module"]
    expected = SequenceClassifierModule if experiment == "genre" else CausalLMModule
    assert isinstance(module, expected)
    assert all(torch.isfinite(torch.tensor(v)) for k, v in metrics.items() if k.startswith("val/"))


def test_genre_run_reports_accuracy_and_qa_run_exact_match(tmp_path: Path) -> None:
    common = ["model=tiny_gpt2", "trainer=cpu", "debug=fdr", "offload=zero"]
    metrics, _ = train(compose_cfg(["data=bible_genre", *common], tmp_path / "genre"))
    assert 0.0 <= metrics["val/acc"] <= 1.0 and metrics["summary/metric_after"] == metrics["val/acc"]
    metrics, _ = train(compose_cfg(["data=bible_qa", *common], tmp_path / "qa"))
    assert 0.0 <= metrics["val/exact_match"] <= 1.0


@pytest.mark.parametrize("offload", ["galore", "lora", "meft", "dense_adapter"])
def test_baseline_policies_train(offload: str, tmp_path: Path) -> None:
    metrics, objects = train(compose_cfg([f"offload={offload}", "model=tiny_llama", "trainer=cpu", "debug=fdr"],
                                         tmp_path))
    trainable = [n for n, p in objects["module"].named_parameters() if p.requires_grad]
    if offload == "lora":
        assert any("lora_" in n for n in trainable)
        assert not any(n.endswith("q_proj.base_layer.weight") for n in trainable)
    if offload == "meft":
        assert trainable and all(n.endswith("adapter.router.weight") for n in trainable)
        assert metrics["meft/rows_updated"] > 0
        # The summary's count is Lightning's (module parameters) plus the adapter rows it cannot see, said so.
        summary = objects["summary"]
        lightning_count = ModelSummary(objects["module"]).trainable_parameters
        host_rows = summary["host_trainable_parameters"]
        assert host_rows > 0 and summary["trainable_parameters"] == lightning_count + host_rows
        assert (f"trainable params    {lightning_count + host_rows:,} ({lightning_count:,} module parameters, which "
                f"Lightning's model summary counts, + {host_rows:,} adapter rows held on the host)"
                in format_summary(summary))
    if offload == "dense_adapter":
        assert trainable and all(n.endswith(("adapter_keys", "keys", "values")) for n in trainable)
    assert metrics["summary/steps"] == 1


def test_lightnings_banner_is_said_once_per_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The run evaluates before and after training with Trainers of its own; they print no second banner."""
    with caplog.at_level(logging.INFO):
        train(compose_cfg(["offload=zero", "model=tiny_llama", "trainer=cpu", "debug=fdr", "logger=none"], tmp_path))
    banners = [r for r in caplog.records if r.getMessage().startswith("GPU available:")]
    assert len(banners) == 1


def test_unknown_option_names_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ConfigCompositionException) as err:
        compose_cfg(["offload=lsb"], tmp_path)
    message = str(err.value) + str(err.value.__cause__)
    assert "offload/lsb" in message and "lsp" in message and "zero" in message


def test_unknown_key_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigCompositionException, match="rnak"):
        compose_cfg(["offload.strategy.rnak=0.5"], tmp_path)


@pytest.mark.parametrize("overrides, words", [
    (["offload.strategy.rank=1.5"], "rank=1.5"),
    (["offload.method=sgd"], "offload.method='sgd'"),
    (["offload=lora", "offload.lora_rank=0"], "offload.lora_rank=0"),
    (["data=bible_genre", "data.max_length=1"], "data.max_length=1"),
    (["data=bible_qa", "data.books=[Hezekiah]"], "Hezekiah"),
])
def test_bad_values_name_the_value(overrides: list[str], words: str, tmp_path: Path) -> None:
    cfg = compose_cfg([*overrides, "model=tiny_llama", "trainer=cpu", "debug=fdr"], tmp_path)
    with pytest.raises(Exception) as err:
        train(cfg)
    assert words in str(err.value) + str(err.value.__cause__)


def test_lora_with_a_projecting_strategy_is_refused(tmp_path: Path) -> None:
    cfg = compose_cfg(["offload=lsp", "offload.method=lora", "model=tiny_llama"], tmp_path)
    with pytest.raises(Exception, match="not a projecting lsp_offload"):
        instantiate(cfg.offload)
