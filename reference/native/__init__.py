"""Native kernels: C compiled on first use with the machine's own compiler and loaded with
ctypes, each with a torch fallback that gives the same bytes.

- :mod:`.build`: :class:`~weight_transfer.native.build.NativeKernel`, how every kernel of the
  package is built, cached per machine and turned off (``WT_*_NATIVE=0``); the other kernels'
  sources live with their users (``convert/_fp8_cpu.c``, ``plan/_greedy.c``);
- :mod:`.delta`: ``_delta.c``, the byte comparisons of delta updates and the segment writers
  the CPU transports copy runs with (:data:`~weight_transfer.native.delta.KERNEL`).

Imports: nothing of the package.
"""
