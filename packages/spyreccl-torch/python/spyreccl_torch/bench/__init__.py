"""spyreccl benchmark suite (``spyreccl-bench``, ``python -m spyreccl_torch.bench``).

Levels measured side by side:

- ``core``: spyreccl_core (the C library through its pybind11 module) on numpy buffers, in
  rank processes that never import torch;
- ``spyreccl``: ``torch.distributed`` on ``spyre`` tensors through the spyreccl backend;
- ``gloo``: ``torch.distributed`` on CPU tensors through gloo, the baseline.

Importing this package is cheap: nothing here imports torch at module level (the torch levels
import it inside their rank processes), so the command line starts quickly.
"""

__all__: list[str] = []
