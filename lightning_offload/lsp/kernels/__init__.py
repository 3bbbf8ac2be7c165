"""The kernels of a projected layer's three products (``B Xᵀ`` in forward, ``A Δᵀ`` in backward, the update
``W·decay + c·Aᵀ U B``), and the choice among them.

* :mod:`.reference`: the products as dense torch, the definition every kernel is held to;
* :mod:`.candidates`: the kernels (torch's CSR, dense per product, the CPU's native C, CUDA's Triton);
* :mod:`.native` and ``native/projection.c``: the C kernels, built for this CPU and checked at load (:mod:`.checks`);
* :mod:`.triton_projection`: the Triton kernels;
* :mod:`.selection`: each distinct product's kernel, timed on the user's device and kept per machine;
* :mod:`.build`: building a C kernel of the package into the cache.
"""
