"""Model code shared by the demo (``examples/tp_llama.py``), ``spyreccl-bench --mode
decode`` and the tests: one implementation of a small Llama-style decoder and its
tensor-parallel greedy generation."""
