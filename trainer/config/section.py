"""The base of every config section: unknown keys, NaN and infinity are errors."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

Auto = Literal["auto"]  # an OpenAI hyperparameter left to the documented default


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, and so are NaN and infinity
    (`.inf` passes `gt=0`, and a NaN threshold passes every comparison)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
