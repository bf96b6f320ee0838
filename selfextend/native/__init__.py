"""The native kernels: C sources, their build, and the ctypes bindings that call them.

Two libraries, each compiled once per source, compiler and target on first use (:mod:`.build`):
``quant`` (:mod:`.quant`), the products with a GGUF tensor's blocks as stored, whose block types are
described once in :mod:`.blocktypes`; and ``decode`` (:mod:`.decode`), the decode step's attention,
rotate-and-write, norms, activations and layer loop. Below the model loading in the import order, so that
:mod:`selfextend.models` and :mod:`selfextend.generation` both use them.
"""
