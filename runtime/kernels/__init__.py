"""The runtime's kernels, one module per kind; importing the package loads none of them.

- Triton, for CUDA GPUs (or the Triton interpreter: TRITON_INTERPRET=1 set before these modules are
  imported, which the CPU tests do): `flash_attention` (tiled flash attention over the static KV
  cache, the attention backend "triton" of `runtime.attention.attend`) and `flash_decoding`
  (split-key merges).
- C++, for the CPU, in one extension: `extension` (its build and load), `cpu_blockq`
  (block-quantized linears), `cpu_attention` (the compiled step's cache attention, the row-invariant
  attention), `cpu_argmax` (the greedy token choice); `build` builds a library so that no build can
  wedge or crash a process.
"""
