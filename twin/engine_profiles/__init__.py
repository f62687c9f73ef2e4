"""Engine profiles: how long a replica's engine step takes and how much KV cache it holds.

``load_profile("llama3-70b-fp8-tp4-h100")`` returns an ``EngineProfile``; its ``step_time_model()``
implements ``twin.engine_profiles.step.StepTimeModel``. Light imports only (numpy, pydantic, yaml).
"""

from __future__ import annotations

import difflib
from functools import lru_cache
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


# libyaml's parser where PyYAML was built with it (its wheels are): the same SafeConstructor and resolver, so the
# same values, ~6x faster on a profile's provenance notes
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _read(path: Path) -> EngineProfile:
    st = path.stat()
    return _read_file(str(path.resolve()), st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=64)
def _read_file(path: str, mtime_ns: int, size: int) -> EngineProfile:
    """One parse per file version: a fidelity table loads its profile a few times per replay (hundreds of times
    for nine noise draws of twelve runs). The spec is a frozen model, so every caller can share it."""
    with open(path, encoding="utf-8") as f:
        raw = yaml.load(f, Loader=_LOADER)  # noqa: S506 (a safe loader)
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
