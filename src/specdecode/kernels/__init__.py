"""The C kernels (csrc/) and their ctypes bindings: the tree attention kernel, the w8a8 products and
the int8 decoder layer, each built for the instruction set the CPU runs (native.py builds and
loads them; cpu.py chooses)."""
