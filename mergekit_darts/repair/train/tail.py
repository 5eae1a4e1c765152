"""What training runs for a domain with ``depth: k``: the frozen last blocks with the domain's adapters
on their linears, then the final-state correction (docs/quality.md, "Depth: adapters inside the last decoder blocks").

The emitted model applies the same adapters inside its own blocks (remote_code/), so what is trained
here is what loads.
"""

from contextlib import contextmanager

import torch
from torch import nn

from mergekit_darts.repair.capture.block_inputs import FrozenTail


def adapted_output(out: torch.Tensor, adapter, inputs: torch.Tensor, autocast: bool) -> torch.Tensor:
    """A frozen linear's output plus its adapter's. Under the tail's autocast (a GPU, bfloat16 blocks)
    the adapter runs with autocast off on the float32 input and the sum is float32: the trained
    parameters and their gradients never pass through bfloat16 (docs/scale.md)."""
    if not autocast:
        return out + adapter(inputs).to(out.dtype)
    with torch.autocast(inputs.device.type, enabled=False):
        return out.float() + adapter(inputs.float())


@contextmanager
def adapters_on(tail: FrozenTail, surgery):
    """The domain's block adapters added to the tail's linears while the context is open (only those of
    the blocks ``tail`` holds: a view of part of the tail, ``FrozenTail.view``, leaves the others out)."""
    handles = []
    autocast = tail.compute_dtype is not None
    try:
        for index, path, adapter in surgery.block_adapters():
            if not 0 <= index - tail.first < len(tail.layers):
                continue
            linear = tail.layers[index - tail.first].get_submodule(path)
            handles.append(linear.register_forward_hook(
                lambda module, args, out, adapter=adapter: adapted_output(out, adapter, args[0], autocast)))
        yield
    finally:
        for handle in handles:
            handle.remove()


class TailSurgery(nn.Module):
    """What training sees for a domain with depth: block input -> last blocks with the domain's
    adapters -> final norm -> ``DomainSurgery``. Only ``surgery`` is a submodule (its parameters are
    trained, saved and copied); the frozen tail is shared by every domain and candidate."""

    def __init__(self, tail: FrozenTail, surgery):
        super().__init__()
        self.surgery = surgery
        object.__setattr__(self, "tail", tail)  # not registered: not trained, not in state_dict

    @property
    def hidden_size(self) -> int:
        return self.surgery.hidden_size

    @property
    def head_rank(self) -> int:
        return self.surgery.head_rank

    @property
    def position_bias(self):
        return self.surgery.position_bias

    def head_correction(self, corrected_hidden):
        return self.surgery.head_correction(corrected_hidden)

    def content(self, hidden):
        return self.surgery.content(hidden)

    def final_states(self, block_input: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The final norm's output with the adapters on: what the surgery module then corrects."""
        with adapters_on(self.tail, self.surgery):
            return self.tail(block_input.to(next(self.surgery.parameters()).device), position_ids)

    def forward(self, block_input: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.surgery(self.final_states(block_input, position_ids), position_ids)


def final_states(module, inputs: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """The final state the module's own correction starts from (its input when it has no depth)."""
    return module.final_states(inputs, position_ids) if isinstance(module, TailSurgery) else inputs
