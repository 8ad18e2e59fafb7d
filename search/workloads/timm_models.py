"""Any timm image model by name: random weights, synthetic images at the model's own input size,
cross-entropy on random labels. Nothing is fetched (``pretrained=False``).

The knobs map onto what timm's models already have: ``recompute`` onto the blocks timm's own
``set_grad_checkpointing`` recomputes (a ResNet's bottlenecks, a ViT's blocks, a ConvNeXt's or an
EfficientNet's blocks stage by stage), so ``every-K`` and ``selective`` apply too; the workload's
``memory_format`` onto the weights and the images (``channels-last``: NHWC, the layout the CPU's
and the GPU's convolution kernels prefer under autocast). timm is an optional dependency (the
``timm`` extra), imported only here.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from search.core.errors import first_line
from search.workloads.base import Workload

__all__ = ["MEMORY_FORMATS", "Timm"]

MEMORY_FORMATS = {"contiguous": torch.contiguous_format, "channels-last": torch.channels_last}
"""The ``memory_format`` values: NCHW (torch's default) or NHWC, for the weights and the images."""

_CONTAINERS = (nn.Sequential, nn.ModuleList)


@dataclass(eq=False)
class Timm(Workload):
    """A timm image classifier trained on random images and labels; throughput in images.
    ``model``: a timm model name (``resnet50``, ``vit_base_patch16_224``); ``image_size``: the
    side of the square images (None: the model's own input size); ``settings``: any other keyword
    of ``timm.create_model`` (``depths``, ``drop_path_rate``, ...)."""

    unit = "images"
    requires: ClassVar[dict[str, str]] = {"timm": "pip install 'search[timm]'"}
    # timm and torchvision: 0.75 s of every trial's process on a 2-core CPU otherwise (a tiny
    # resnet18 built in a forked worker in 0.14 s with it against 0.89 s without)
    preload: ClassVar[tuple[str, ...]] = ("timm",)

    model: str | None = None
    image_size: int | None = None
    num_classes: int | None = None
    memory_format: str = "contiguous"
    settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.memory_format not in MEMORY_FORMATS:
            raise ValueError(
                f"memory_format must be one of {', '.join(MEMORY_FORMATS)}, "
                f"but got {self.memory_format!r}"
            )
        if not self.model:
            raise ValueError(
                "no model named: pass model= a timm model name "
                "(python -m search +space=timm model=resnet50)"
            )
        _check_name(self.model)
        self._meta: nn.Module | None = None
        self._patches: bool | None = None  # whether it cuts images into a fixed grid (_img_size)
        self._input: tuple[int, int, int] | None = None

    def build_model(self) -> nn.Module:
        model = self._create(self._img_size())
        layout = MEMORY_FORMATS[self.memory_format]
        # torch's stubs lack Module.to's memory_format, which it takes (4-D weights follow it)
        return cast(nn.Module, model.to(memory_format=layout))  # type: ignore[call-overload]

    def _create(self, img_size: int | None) -> nn.Module:
        kwargs = dict(self.settings)
        if self.num_classes is not None:
            kwargs["num_classes"] = self.num_classes
        if img_size is not None:
            kwargs["img_size"] = img_size
        return _timm().create_model(self.model, pretrained=False, **kwargs)

    def input_shape(self) -> tuple[int, int, int]:
        """(channels, height, width) of one image: the model's own, at ``image_size`` if given."""
        if self._input is None:
            own: dict[str, Any] = getattr(self._on_meta(), "pretrained_cfg", {})
            channels, height, width = own.get("input_size", (3, 224, 224))
            if self.image_size is not None:
                height = width = self.image_size
            self._input = (int(channels), int(height), int(width))
        return self._input

    def classes(self) -> int:
        return int(getattr(self._on_meta(), "num_classes", 1000))

    def make_batch(
        self, size: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.randn(size, *self.input_shape(), generator=generator)
        labels = torch.randint(self.classes(), (size,), generator=generator)
        return images.contiguous(memory_format=MEMORY_FORMATS[self.memory_format]), labels

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(model(images), labels)

    def recompute_modules(self, model: nn.Module) -> list[nn.Module]:
        """Every block of every stage, in forward order: the children of the innermost
        containers (``nn.Sequential``, ``nn.ModuleList``) whose children are all one class of
        block with weights of its own. These are what timm's ``set_grad_checkpointing``
        checkpoints (``checkpoint_seq`` over a stage's blocks)."""
        stages = [m for m in model.modules() if _is_stage(m)]
        inner = [
            s for s in stages if not any(_is_stage(m) for c in s.children() for m in c.modules())
        ]
        return [block for stage in inner for block in stage.children()]

    def _img_size(self) -> int | None:
        """``image_size`` as timm's ``img_size`` keyword: for a model whose position embeddings
        follow the image size (a vision transformer's); None for one that takes any size (a CNN),
        or at its own size. Asked of the model at its own size on the meta device, once."""
        if self.image_size is None:
            return None
        if self._patches is None:
            with torch.device("meta"):
                self._patches = _has_patches(self._create(None))
        return self.image_size if self._patches else None

    def _on_meta(self) -> nn.Module:
        """The model on the meta device: its structure and defaults, no memory (built once)."""
        if self._meta is None:
            with torch.device("meta"):
                self._meta = self.build_model()
        return self._meta


def _is_stage(module: nn.Module) -> bool:
    """A container of like blocks: one class, each a module of modules holding weights."""
    if not isinstance(module, _CONTAINERS) or len(module) == 0:
        return False
    children = list(module.children())
    return (
        len({type(c) for c in children}) == 1
        and not isinstance(children[0], _CONTAINERS)
        and all(any(True for _ in c.children()) for c in children)
        and all(any(True for _ in c.parameters()) for c in children)
    )


def _has_patches(model: nn.Module) -> bool:
    """Whether ``model`` cuts its images into patches of a fixed grid (a ViT's ``patch_embed``
    with an ``img_size``), so its constructor must be told the image size."""
    return getattr(getattr(model, "patch_embed", None), "img_size", None) is not None


def _timm() -> Any:
    """timm, imported; a ValueError of one line where it is installed but cannot be imported
    (a torchvision built for another torch: the CPU build of torch beside torchvision's default,
    a CUDA build, fails with "operator torchvision::nms does not exist")."""
    try:
        import timm
    except (ImportError, RuntimeError) as e:
        first = first_line(e)
        raise ValueError(
            f"timm is installed but cannot be imported ({first}); torchvision must be built for "
            "the installed torch (docs/guide/timm.md)"
        ) from None
    return timm


def _check_name(name: str) -> None:
    """ValueError naming close matches where ``name`` is not a timm model."""
    timm = _timm()
    if timm.is_model(name):
        return
    close = difflib.get_close_matches(name, timm.list_models(), n=3)
    hint = f" (close: {', '.join(close)})" if close else ""
    raise ValueError(
        f"model {name!r} is not a timm model name{hint}; timm.list_models() lists them"
    )
