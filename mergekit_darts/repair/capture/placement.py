"""Where a captured model's weights live: one device, or accelerate's device map with offload.

With ``surgery.device_map`` set, every model of the capture is loaded through accelerate (transformers'
``device_map`` / ``max_memory`` / ``offload_folder``): layers may be spread over several GPUs, the CPU
and the disk. The capture still holds one model at a time; each load gets its own temporary offload
folder, deleted when the model is freed. Offloaded modules keep their weights on the ``meta`` device
between calls, so the LM head weight is read through accelerate's ``align_module_device``, which loads
offloaded weights for the duration of the block.
"""

import logging
import shutil
import tempfile
from typing import Dict, Optional, Union

import torch

from mergekit_darts.errors import SurgeryConfigError

LOG = logging.getLogger(__name__)

DeviceMap = Union[str, Dict[str, Union[int, str]]]


def check_device_map(model_dir: str, device_map: Dict[str, Union[int, str]], trust_remote_code: bool) -> None:
    """An explicit map must name modules of the model and place every parameter and buffer.

    transformers accepts a map with a misspelt module name and silently leaves the missing weights
    uninitialised, so this check runs on an empty (meta) skeleton of the model before any load.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    modules = {name for name, _ in skeleton.named_modules()}
    unknown = sorted(key for key in device_map if key not in modules)
    if unknown:
        top = sorted(name for name in modules if name and name.count(".") <= 2)[:12]
        raise SurgeryConfigError(
            f"surgery.device_map: {unknown} are not module names of {model_dir} "
            f"({type(skeleton).__name__}); module names look like {top}"
        )
    tensors = [name for name, _ in skeleton.named_parameters()] + [name for name, _ in skeleton.named_buffers()]
    unplaced = [name for name in tensors
                if not any(key == "" or name == key or name.startswith(key + ".") for key in device_map)]
    if unplaced:
        raise SurgeryConfigError(
            f"surgery.device_map: {len(unplaced)} weights of {model_dir} are on no device, e.g. "
            f"{unplaced[:5]}; add their modules to the map (or a parent such as 'model' or '' for the rest)"
        )


class Placement:
    """The ``from_pretrained`` arguments of one model load, and the offload folder to clean up."""

    def __init__(self, device: torch.device, device_map: Optional[DeviceMap] = None,
                 max_memory: Optional[dict] = None):
        self.device, self.device_map, self.max_memory = device, device_map, max_memory
        self.offload_dir: Optional[str] = None

    @property
    def sharded(self) -> bool:
        return self.device_map is not None

    def load_kwargs(self, model_dir: str, trust_remote_code: bool) -> dict:
        if not self.sharded:
            return {"device_map": {"": self.device} if self.device.type != "cpu" else None}
        device_map = self.device_map
        if isinstance(device_map, dict):
            check_device_map(model_dir, device_map, trust_remote_code)
            device_map = {key: _device_name(value) for key, value in device_map.items()}
        self.offload_dir = tempfile.mkdtemp(prefix="darts-offload-")
        kwargs = {"device_map": device_map, "offload_folder": self.offload_dir}
        if self.max_memory is not None:
            kwargs["max_memory"] = {_memory_key(key): size for key, size in self.max_memory.items()}
        return kwargs

    def release(self) -> None:
        """Delete this load's offload folder (after the model is freed)."""
        if self.offload_dir is not None:
            shutil.rmtree(self.offload_dir, ignore_errors=True)
            self.offload_dir = None


def _device_name(value: Union[int, str]) -> Union[int, str]:
    if isinstance(value, int):
        return value
    return int(value.split(":", 1)[1]) if value.startswith("cuda:") else value


def _memory_key(key: Union[int, str]) -> Union[int, str]:
    """accelerate names GPUs by index: 0, "0" and "cuda:0" all mean GPU 0."""
    if isinstance(key, str) and key.startswith("cuda:"):
        return int(key.split(":", 1)[1])
    return int(key) if isinstance(key, str) and key.isdigit() else key


def execution_device(module: torch.nn.Module, fallback: torch.device) -> torch.device:
    """The device ``module`` computes on: its accelerate hook's, else its first real parameter's."""
    hook = getattr(module, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is not None:
        return torch.device(device if not isinstance(device, int) else f"cuda:{device}")
    for parameter in module.parameters():
        if parameter.device.type != "meta":
            return parameter.device
    return fallback


def input_device(model: torch.nn.Module, fallback: torch.device) -> torch.device:
    """Where the token ids must go: the input embedding's device (the first module a forward runs)."""
    if getattr(model, "hf_device_map", None) is None or not hasattr(model, "get_input_embeddings"):
        return fallback
    return execution_device(model.get_input_embeddings(), fallback)


def read_weight(module: torch.nn.Module, name: str = "weight") -> Optional[torch.Tensor]:
    """``module.<name>`` as a real tensor (a detached copy when it was offloaded to cpu or disk)."""
    tensor = getattr(module, name, None)
    if tensor is None or tensor.device.type != "meta":
        return None if tensor is None else tensor.detach()
    from accelerate.utils import align_module_device

    device = execution_device(module, torch.device("cpu"))
    with align_module_device(module, device):
        return getattr(module, name).detach().clone()
