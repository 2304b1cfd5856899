"""A user's model family, outside d9d: registered on import and used as a plug-in provider
(`tests.model_family_fixtures:ByoQwenProvider`), as docs/models.md describes.

Its config is a subclass of Qwen3's with one extra field, so it is a family of its own (`family_of` picks the
closest config class); everything else is composed from d9d's pieces.
"""

from __future__ import annotations

from dataclasses import replace

from pydantic import Field

from d9d.engine.builtin.models import family_provider
from d9d.models.family import register_family
from d9d.models.qwen3 import QWEN3, Qwen3Config, Qwen3ForCausalLM


class ByoQwenConfig(Qwen3Config):
    note: str = Field("a user family", min_length=1)


BYO_QWEN = register_family(
    replace(
        QWEN3,
        name="byo_qwen",
        config_class=ByoQwenConfig,
        build_causal_lm=lambda config, stage: Qwen3ForCausalLM(config, stage),
        hf=None,
        description="a test family registered from outside d9d",
    )
)

ByoQwenProvider = family_provider(BYO_QWEN)
