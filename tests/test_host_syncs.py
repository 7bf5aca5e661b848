"""No host sync in a step that records nothing: on a GPU, a value read back from the device, a tensor made there
from Python numbers (a copy from pageable memory) or a blocking copy of a host tensor to it makes the host wait
for the GPU's queue to drain, every step. On CPU there is no queue to see, so the tests follow the tensors instead:
a TorchFunctionMode, pasted into the scripts with the user's code, marks the model's parameters, their gradients,
the batch once on the device, and every tensor made on the device or computed from those, and counts each such
event between one training forward and the next. Recording steps read their numbers (they must, and they are
counted: the check sees what it looks for); the steps between them count zero."""

from __future__ import annotations

import json

import pytest

from processes import TINY, run_parallel
from projects import copy_with_your_functions, launch

# the built-in data and model, the model's forward pre-hook telling SYNCS (a counter the code before defines) that a
# training step begins (tools/gpu_check.py counts the GPU's syncs with it too)
PLUGGED = """

def build_datasets(args):
    return builtin.datasets(args)


def build_model(args, num_classes):
    model = builtin.model(args.arch, num_classes, args.image_size)
    model.register_forward_pre_hook(SYNCS.step_begins)
    return model
"""

COUNTED = (
    '''
import json
import os

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from extras import builtin

READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.__float__,
         torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.__index__}
MADE = {torch.tensor, torch.as_tensor, torch.Tensor.new_tensor}  # from Python numbers


class HostSyncs(TorchFunctionMode):
    """Per training step: what would make the host wait for the device."""

    def __init__(self):
        super().__init__()
        self.on_device = {}  # id -> tensor, kept (a weak reference would stop FSDP swapping its parameters)
        self.found, self.forwards = [], 0
        self.path = os.path.join(os.environ["SYNCS"], os.environ.get("RANK", "0"))

    def mark(self, tensors):
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.on_device[id(t)] = t

    def there(self, t) -> bool:
        return isinstance(t, torch.Tensor) and self.on_device.get(id(t)) is t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        inputs = tree_leaves((args, kwargs))
        # made on the model's device (the CPU here) by name: a device tensor
        device = kwargs.get("device")
        made_there = device is not None and torch.device(device).type == "cpu"
        if func is torch.Tensor.to:
            device, _, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            made_there = device is not None
            if made_there and not self.there(args[0]) and not non_blocking:
                self.found.append("a blocking copy to the device")
        if any(self.there(t) for t in inputs):
            if func in READS:
                self.found.append(f"{func.__name__} of a device tensor")
            made_there = True
        if func in MADE and made_there and not isinstance(args[0], torch.Tensor):
            self.found.append(f"{func.__name__} of Python numbers on the device")
        if made_there:
            self.mark(tree_leaves(result))
        return result

    def step_begins(self, module, inputs):
        """A training forward: the interval since the last one is written, the model's tensors marked."""
        if not module.training:
            return
        if not self.forwards:  # here, not in build_model: FSDP builds rank 1's model under a device mode
            self.__enter__()
        self.forwards += 1
        with open(self.path, "a") as f:
            f.write(json.dumps(self.found) + "\\n")
        self.found = []
        self.mark([*module.parameters(), *module.buffers()])
        self.mark([p.grad for p in module.parameters()])


SYNCS = HostSyncs()
'''
    + PLUGGED
    + """

def compute_loss(outputs, targets):  # a (sum, count) pair: its count a Python number
    return F.cross_entropy(outputs, targets, reduction="sum"), len(targets)
"""
)

SCRIPTS = {
    "distributed.py": [],
    "distributed_amp.py": ["--amp-dtype", "bfloat16"],
    "distributed_fsdp.py": [],
}
# 32 steps: records at steps 10, 20, 30 and 32 (the last); the phases timed too (--phases), read at a record only
FLAGS = [*TINY, "--epochs", "1", "--workers", "1", "--phases"]


@pytest.fixture(scope="module")
def counted(tmp_path_factory) -> dict[str, list[list[list[str]]]]:
    """Each script on 2 processes with the counting pasted in: per rank, what each interval found, from the
    start-up check's forward on."""
    base = tmp_path_factory.mktemp("syncs")
    commands = []
    for script, flags in SCRIPTS.items():
        folder = base / script
        (folder / "syncs").mkdir(parents=True)
        copy = copy_with_your_functions(script, folder / "copy", COUNTED)
        commands.append(
            (
                launch(copy, 2, *FLAGS, *flags, "--output-dir", folder / "out"),
                {"SYNCS": str(folder / "syncs")},
            )
        )
    run_parallel(commands, timeout=300)
    return {
        script: [
            [
                json.loads(line)
                for line in (base / script / "syncs" / str(rank)).read_text().splitlines()
            ]
            for rank in (0, 1)
        ]
        for script in SCRIPTS
    }


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_step_that_records_nothing_never_waits_for_the_device(script, counted):
    for rank, intervals in enumerate(counted[script]):
        # intervals[0]: before the start-up check's forward; [1]: from it to step 1's forward; [s + 1]: from step
        # s's forward to step s + 1's, which holds step s's end and step s + 1's batch moved to the device
        steps = {s: intervals[s + 1] for s in range(1, len(intervals) - 1)}
        assert len(steps) == 31, (rank, len(intervals))
        recording = {10, 20, 30}
        quiet = {s: found for s, found in steps.items() if s not in recording and found}
        assert not quiet, (rank, quiet)
        # what a record reads is seen: the all-reduced sums and the gradients' norm
        assert all(steps[s] for s in recording), (rank, {s: steps[s] for s in recording})
