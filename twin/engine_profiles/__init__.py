"""Engine profiles: how long a replica's engine step takes and how much KV cache it holds.

``load_profile("llama3-70b-fp8-tp4-h100")`` returns an ``EngineProfile``; its ``step_time_model()``
implements ``twin.engine_profiles.step.StepTimeModel``. Light imports only (numpy, pydantic, yaml).
"""

from __future__ import annotations

import difflib
from importlib import resources
from pathlib import Path

import yaml

from twin.engine_profiles.memory import derive_num_gpu_blocks
from twin.engine_profiles.profile import EngineProfile, EngineProfileSpec
from twin.engine_profiles.step import StepShape, StepTimeModel, prefill_attention_work
from twin.engine_profiles.step_time import LinearStepTimeModel

__all__ = [
    "EngineProfile",
    "EngineProfileSpec",
    "LinearStepTimeModel",
    "StepShape",
    "StepTimeModel",
    "UnknownProfileError",
    "derive_num_gpu_blocks",
    "list_profiles",
    "load_profile",
    "prefill_attention_work",
]


class UnknownProfileError(KeyError):
    """A profile name that is neither shipped nor an existing YAML file."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _data_dir() -> Path:
    return Path(str(resources.files("twin.engine_profiles") / "data"))


def list_profiles() -> list[str]:
    """Names of the shipped profiles."""
    return sorted(p.stem for p in _data_dir().glob("*.yaml"))


def _read(path: Path) -> EngineProfile:
    with path.open() as f:
        raw = yaml.safe_load(f)
    return EngineProfile(EngineProfileSpec.model_validate(raw))


def load_profile(name_or_path: str) -> EngineProfile:
    """A shipped profile by name, or a profile YAML file by path."""
    shipped = _data_dir() / f"{name_or_path}.yaml"
    if shipped.is_file():
        return _read(shipped)
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return _read(path)
    known = list_profiles()
    close = difflib.get_close_matches(name_or_path, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise UnknownProfileError(
        f"unknown engine profile {name_or_path!r}{hint} (known: {', '.join(known) or '(none)'}; "
        "or pass a path to a .yaml file)"
    )
