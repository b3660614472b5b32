"""A stand-in for the torchvision parts that Qwen2-VL's processor and vLLM's Qwen2-VL model import, for the CPU
set-up only.

Why: the CPU install (Makefile `setup`) removes PyPI's torchvision because it does not load beside the CPU
torch (`operator torchvision::nms does not exist`). Without it transformers cannot build or load a Qwen2-VL
processor (`AutoProcessor` wants the video processor, which needs torchvision), and vLLM cannot inspect the
Qwen2-VL model class (its qwen2_vl.py imports `smart_resize` from a transformers module that imports
torchvision). Images need none of it: the PIL image processor resizes and normalises them. Videos stay
unsupported here.

How: the VLM tests (tests/conftest.py `vl_env`) and `make demo-vl` (bench/bench_vl.py) put this directory on
PYTHONPATH (a VLM run of train_ppo.py on a CPU install needs it there too), so Python imports this file as `sitecustomize` in every process they start, vLLM's subprocesses included. It
steps aside when torchvision is installed (GPU installs have it); otherwise it patches the two transformers
modules only when something imports them, so other processes start as fast as before. Nothing in the
toolkit imports it.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import sys

_SMART_RESIZE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_VIDEO_AUTO = "transformers.models.auto.video_processing_auto"


def _stand_ins() -> tuple[type, type]:
    """transformers' VideoProcessorMixin name, and a video processor of that class that refuses videos."""
    from transformers.utils import PushToHubMixin

    class VideoProcessorMixin(PushToHubMixin):
        """ProcessorMixin checks a video processor's class against transformers' class of this name."""

    class NoVideoProcessor(VideoProcessorMixin):
        """Takes the video processor's place in a Qwen2-VL processor and refuses videos."""

        valid_kwargs = type("NoVideoKwargs", (dict,), {"__annotations__": {}})
        model_input_names: list = []
        merge_size = 2

        def __call__(self, *args, **kwargs):
            raise NotImplementedError("videos need torchvision, which this CPU set-up does not have")

        def to_dict(self) -> dict:
            return {}

    return VideoProcessorMixin, NoVideoProcessor


def _patch_video_auto(module) -> None:
    mixin, no_video = _stand_ins()
    module.AutoVideoProcessor.from_pretrained = staticmethod(lambda *a, **k: no_video())
    sys.modules["transformers"].VideoProcessorMixin = mixin


class _Patcher(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    torchvision_stand_in = True  # marks it on sys.meta_path, however often this file is imported
    def find_spec(self, name, path=None, target=None):
        if name not in (_SMART_RESIZE, _VIDEO_AUTO):
            return None
        if name == _SMART_RESIZE:  # the PIL module defines the same smart_resize
            return importlib.machinery.ModuleSpec(name, self)
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            _patch_video_auto(module)

        spec.loader.exec_module = exec_module
        return spec

    def create_module(self, spec):
        return importlib.import_module("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")

    def exec_module(self, module):
        pass


ACTIVE = importlib.util.find_spec("torchvision") is None
if ACTIVE and not any(getattr(f, "torchvision_stand_in", False) for f in sys.meta_path):
    sys.meta_path.insert(0, _Patcher())
    if _VIDEO_AUTO in sys.modules:  # imported as a module after transformers was (a test process)
        _patch_video_auto(sys.modules[_VIDEO_AUTO])
