"""GPU kernels written in Triton, runnable on CPU under Triton's interpreter (docs/kernels.md §1).

Imported only when a Triton path is chosen: nothing else in m2serve imports this package (a test
checks it), so the CPU engine never needs ``triton``. Importing it sets up the interpreter before
any kernel module defines a ``@triton.jit`` function, because Triton reads ``TRITON_INTERPRET``
when the decorator runs (set later, a CPU launch fails with "0 active drivers"):

- ``TRITON_INTERPRET`` already set (``0`` / ``1``): kept as is (the sm_90 compile test sets ``0``
  to get compilable kernels on a machine without a GPU);
- otherwise ``1`` when torch sees no CUDA device, ``0`` when it does.

Layout: ``runtime.py`` the launcher conventions (compute dtype, interpreter flag), ``aot.py`` the
registry of kernel variants and their ahead-of-time compile for sm_90, one module per kernel
(``attention.py``: paged attention). Pinned to the Triton that torch 2.11 requires (3.6.0, with
numpy < 2.4 for its interpreter; the ``test`` extra of pyproject.toml).
"""

from __future__ import annotations

import os
import sys
import warnings

if "TRITON_INTERPRET" not in os.environ:
    import torch

    os.environ["TRITON_INTERPRET"] = "0" if torch.cuda.is_available() else "1"
    if os.environ["TRITON_INTERPRET"] == "1" and "triton" in sys.modules:
        # triton built its own @jit helpers (tl.cdiv, reductions, ...) for a GPU when it was imported;
        # interpreted kernels that call them fail with "Cannot call @triton.jit'd outside of the scope
        # of a kernel", so say what to do instead
        warnings.warn("triton was imported before m2serve.kernels.triton could select its CPU "
                      "interpreter; kernels calling Triton's own helpers will fail: set "
                      "TRITON_INTERPRET=1 in the environment before starting (docs/kernels.md §1)",
                      RuntimeWarning, stacklevel=2)
