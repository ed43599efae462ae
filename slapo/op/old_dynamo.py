"""Run some of Slapo's autograd.Functions outside dynamo's graph on torch before 2.13.

torch 2.11's dynamo (the GPU image's; 2.12 unchecked, 2.13 right) gets the gradient wrong
through an autograd.Function whose forward mutates its own output in place (`out.mul_(3)`,
`loss += ...`, `.masked_fill_(...)` on the result), with every backend ("eager", "aot_eager",
"inductor"): the loss is right, the gradients are not. Measured on 2.11 under
`torch.compile`: Slapo's fused and chunked linear+cross-entropy gave gradients off by up to 0.38,
the vocabulary-parallel cross-entropy by 0.08, and a tiny `x * 2` then `.mul_(3)` Function's
were wrong too. In-place ops on other intermediates are fine (the LSTM/GRU
sequence Functions activate their gates in place and compile right). Slapo's compiled blocks never
contain these Functions (the loss head runs outside them), but a user may compile a whole
scheduled model, or call the ops in compiled code.

`outside_old_dynamo(fn)` is `fn` on torch 2.13 and later, and `torch.compiler.disable(fn)` before
it: dynamo then runs the call eagerly (one graph break, right gradients).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

OLD_DYNAMO = torch.torch_version.TorchVersion(torch.__version__) < (2, 13)


def outside_old_dynamo(fn: Callable) -> Callable:
    """`fn`, run eagerly under dynamo on a torch whose dynamo loses such Functions' gradients."""
    return torch.compiler.disable(fn) if OLD_DYNAMO else fn
