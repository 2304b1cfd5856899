"""Feed-forward blocks."""

from d9d.modules.mlp.swiglu import SwiGLU

__all__ = ["SwiGLU"]
