"""The stand-in ops are checked against SGLang's own Triton kernels, run by Triton's interpreter on CPU: it must be
switched on before triton is first imported."""

import os

os.environ["TRITON_INTERPRET"] = "1"
