"""Imported once by the server that forks test ranks (:func:`snnfw.testing.run_on_ranks`): what nearly every rank
would otherwise import for itself, seconds each time. That is torch's compiler front end, which an optimizer or
FSDP imports on first use; torch.distributed's pipelining, checkpoint and optimizer packages; and the built-in
plugins."""

import torch._dynamo  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.optim  # noqa: F401
import torch.distributed.pipelining  # noqa: F401

import snnfw.testing  # noqa: F401
from snnfw import entry_points

for _plugin in entry_points.installed(entry_points.GROUP):
    if entry_points.is_builtin(_plugin):
        _plugin.load()
