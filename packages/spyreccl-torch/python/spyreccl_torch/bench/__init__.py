"""spyreccl benchmark suite (``spyreccl-bench``, ``python -m spyreccl_torch.bench``).

Levels measured side by side, nccl-tests style:

- ``core``: spyreccl_core (the C library through its pybind11 module) on numpy buffers, in
  rank processes that never import torch (see ``core_worker.py``);
- ``spyreccl``: ``torch.distributed`` on ``spyre`` tensors through the spyreccl backend;
- ``gloo``: ``torch.distributed`` on CPU tensors through gloo, the baseline.

Other modes: ``threshold`` (one-shot vs two-phase all_reduce), ``ibm`` (IBM's
pytorch-communication-benchmarks loop methodology) and ``ddp`` (DDP step time). See
docs/performance.md for the methodology and the results on the reference machine.

The modules of this subpackage import torch only where a torch level needs it, but importing
``spyreccl_torch`` itself loads torch; the torch-free modules (``timing``, ``ops``) are
therefore loaded by file path in the core-level ranks.
"""

__all__: list[str] = []
