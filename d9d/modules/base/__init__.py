"""Structural protocols shared by every d9d block."""

from d9d.modules.base.late_init import ModuleLateInit

__all__ = ["ModuleLateInit"]
