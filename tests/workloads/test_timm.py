"""Any timm image model by name: random weights at its own input size, its blocks recomputed as
timm's own switch does, channels-last measured as a knob, and a bad name refused in one line.

timm needs torchvision built for the installed torch; where it cannot be imported (the CPU build
of torch beside torchvision's default build) these tests skip."""

from __future__ import annotations

import pytest
import torch
from invoke import completed_study
from invoke import search as invoke_search  # tests/ is on sys.path
from tiny_overrides import LENIENT, TINY_ANY_SPACE

try:
    import timm  # noqa: F401
except (ImportError, RuntimeError) as e:  # absent, or beside a torchvision of another build
    pytest.skip(f"timm cannot be imported here: {e}", allow_module_level=True)

from search.workloads.timm_models import Timm  # noqa: E402 - after the skip

CNN, VIT = "resnet18", "vit_tiny_patch16_224"
TINY = {CNN: {"layers": [1, 1, 1, 1]}, VIT: {"depth": 2}}
"""Each model's own architecture at a depth a test can afford (timm's own keywords)."""


@pytest.mark.parametrize("name", [CNN, VIT])
def test_each_model_trains_at_its_size_and_names_the_blocks_timm_checkpoints(name):
    workload = Timm(model=name, image_size=32, num_classes=10, settings=TINY[name])
    model = workload.build_model().train()
    images, labels = workload.make_batch(2, torch.Generator().manual_seed(0))
    assert images.shape == (2, 3, 32, 32) and labels.max() < 10
    loss = workload.loss(model, (images, labels))
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    blocks = workload.recompute_modules(model)
    # timm's own switch checkpoints these: a ResNet's basic blocks, a ViT's blocks
    assert [type(b).__name__ for b in blocks] == (
        ["BasicBlock"] * 4 if name == CNN else ["Block"] * 2
    )


def test_the_model_s_own_input_size_unless_told_and_channels_last_on_weights_and_images():
    own = Timm(model=CNN, settings=TINY[CNN])
    assert own.input_shape() == (3, 224, 224)
    nhwc = Timm(model=CNN, image_size=32, memory_format="channels-last", settings=TINY[CNN])
    images, _ = nhwc.make_batch(2, torch.Generator().manual_seed(0))
    assert images.is_contiguous(memory_format=torch.channels_last)
    assert nhwc.build_model().conv1.weight.is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="memory_format must be one of"):
        Timm(model=CNN, memory_format="nhwc")


@pytest.mark.parametrize("name", [CNN, VIT])
def test_a_four_trial_study_measures_recompute_and_on_the_cnn_channels_last(name, tmp_path):
    settings = [f"+space.workload.settings.{k}={v}".replace(" ", "") for k, v in TINY[name].items()]
    result = invoke_search(
        "+space=timm",
        f"model={name}",
        "space.workload.image_size=32",
        "space.workload.num_classes=10",
        *settings,
        *TINY_ANY_SPACE,
        *LENIENT,
        "space.params.batch_size.low=4",
        "space.params.batch_size.high=8",
        "space.params.micro_batch_size.low=4",
        "space.params.micro_batch_size.high=8",
        "space.params.recompute.choices=[selective,all]",
        "space.params.memory_format.choices=[channels-last]",
        "study.n_trials=4",
        "measure.max_time_s=0.5",
        runs_dir=tmp_path / "runs",
    )
    done = completed_study(tmp_path / "runs", f"timm-{name}-cpu", result, trials=4)
    assert {t.user_attrs["config"]["recompute"] for t in done} <= {"selective", "all"}
    assert {t.user_attrs["config"]["memory_format"] for t in done} == {"channels-last"}


def test_a_name_timm_does_not_know_is_one_line_with_close_matches_and_exit_2(tmp_path):
    runs_dir = tmp_path / "runs"
    typo = invoke_search("+space=timm", "model=resnet5O", "device=cpu", runs_dir=runs_dir, code=2)
    assert typo.stderr.count("\n") == 1 and "close: resnet50" in typo.stderr, typo.stderr
    assert not runs_dir.exists()
