"""The recommendation in a trainer's words: the exported keyword arguments build the real
``TrainingArguments`` and Lightning ``Trainer``, with the batch, micro-batch and precision the
configuration names; what a trainer cannot say gets a line."""

from __future__ import annotations

import json

import pytest

from search.reporting.trainer_words import (
    HF_TRAINER_FILE,
    LIGHTNING_FILE,
    hf_trainer_arguments,
    hf_trainer_line,
    lightning_trainer_arguments,
    write_trainer_files,
)

PLAIN = {"batch_size": 32, "micro_batch_size": 8, "precision": "fp32", "streams": 1}
TUNED = {
    "batch_size": 16,
    "micro_batch_size": 4,
    "precision": "bf16",
    "streams": 2,
    "recompute": "selective",
    "compile": "max-autotune",
    "optimizer": "fused",
    "attention": "math",
    "kernels": "torch",
}


@pytest.mark.parametrize("config", [PLAIN, TUNED, {**PLAIN, "recompute": True}])
def test_the_hf_arguments_build_training_arguments_of_the_same_batches(config, tmp_path):
    pytest.importorskip("accelerate")  # TrainingArguments needs it
    from transformers import TrainingArguments

    arguments, _ = hf_trainer_arguments(config)
    built = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, **arguments)
    assert built.per_device_train_batch_size == config["micro_batch_size"]
    assert (
        built.per_device_train_batch_size * built.gradient_accumulation_steps
        == (config["batch_size"])
    )
    assert built.bf16 == (config["precision"] == "bf16") and not built.fp16
    assert built.gradient_checkpointing == (config.get("recompute", "none") not in ("none", False))
    assert built.torch_compile == (config.get("compile", "off") != "off")
    assert built.optim == (
        "adamw_torch_fused" if config.get("optimizer") == "fused" else "adamw_torch"
    )
    assert not built.tf32


def test_what_the_trainer_cannot_say_is_said_in_a_line_each():
    arguments, notes = hf_trainer_arguments(TUNED)
    assert arguments["optim"] == "adamw_torch_fused"
    assert arguments["torch_compile_mode"] == "max-autotune"
    assert set(notes) == {"recompute", "streams", "attention"}
    assert all("\n" not in line and line for line in notes.values())
    assert "2 concurrent lanes" in notes["streams"] and "sdpa_kernel" in notes["attention"]
    assert hf_trainer_arguments(PLAIN)[1] == {}
    line = hf_trainer_line(TUNED)
    assert line.startswith("TrainingArguments(per_device_train_batch_size=4, ")
    assert hf_trainer_arguments(PLAIN)[0]["optim"] == "adamw_torch"  # not the Trainer's default
    assert f"see {HF_TRAINER_FILE}" in line


@pytest.mark.parametrize("config", [PLAIN, TUNED])
def test_the_lightning_arguments_build_a_trainer_that_accumulates_to_the_batch(config, tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    arguments, notes = lightning_trainer_arguments(config)
    trainer = pl.Trainer(
        default_root_dir=str(tmp_path), accelerator="cpu", logger=False, **arguments
    )
    steps = config["batch_size"] // config["micro_batch_size"]
    assert trainer.accumulate_grad_batches == steps
    assert f"batch_size={config['micro_batch_size']}" in notes["micro_batch_size"]
    precision = {"fp32": "32-true", "bf16": "bf16-mixed"}[config["precision"]]
    assert trainer.precision == precision
    if config is TUNED:
        assert 'torch.compile(model, mode="max-autotune")' in notes["compile"]


def test_the_files_follow_the_recommendation_and_go_without_one(tmp_path):
    paths = write_trainer_files(tmp_path, TUNED)
    assert [p.name for p in paths] == [HF_TRAINER_FILE, LIGHTNING_FILE]
    hf = json.loads((tmp_path / HF_TRAINER_FILE).read_text())
    assert hf["config"] == TUNED and hf["arguments"]["per_device_train_batch_size"] == 4
    assert write_trainer_files(tmp_path, None) == []
    assert not (tmp_path / HF_TRAINER_FILE).exists() and not (tmp_path / LIGHTNING_FILE).exists()
