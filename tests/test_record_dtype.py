"""The model's type on the CPU (``twin record --dtype``): on an x86 CPU with AVX2 but no AVX-512 torch runs bf16
matrix products without vector support, 41-48x float32's time, and the recorder says so and can record float32
instead (docs/calibration.md, "Hosts without AVX-512"). No vLLM here: the recorder's checks on given /proc/cpuinfo
text, the CLI with a stand-in recorder, and a float32 recording's profile."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from twin.calibration import _vllm_common as common
from twin.calibration.recorded import load_recorded_run
from twin.cli import main
from twin.engine_profiles import derive_num_gpu_blocks, load_profile
from twin.paths import REPO_ROOT

# /proc/cpuinfo as three kinds of VM print it (trimmed to the lines read)
ZEN3 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx f16c fma avx2 bmi2 vaes\n"
XEON = "processor\t: 0\nmodel name\t: Intel Xeon Processor\nflags\t\t: fpu avx avx2 avx512f avx512bw avx512_bf16\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd bf16\nCPU implementer\t: 0x41\n"


def test_the_cpus_flags_and_instruction_set_are_read_from_cpuinfo() -> None:
    assert {"avx2", "fma"} <= common.cpu_flags(ZEN3) and "avx512f" not in common.cpu_flags(ZEN3)
    assert "avx512f" in common.cpu_flags(XEON)
    assert common.cpu_flags(ARM) == set()
    assert common.hardware_string(ZEN3).endswith("avx2 (AMD EPYC)")
    assert common.hardware_string(XEON).endswith("avx512 (Intel Xeon Processor)")  # as every recording so far said
    assert common.hardware_string(ARM).endswith("(cpu)")


@pytest.mark.parametrize(("dtype", "info", "slow"), [
    ("bfloat16", ZEN3, True), ("auto", ZEN3, True), ("float32", ZEN3, False),
    ("bfloat16", XEON, False), ("bfloat16", ARM, False),
])
def test_bf16_is_flagged_only_on_an_x86_cpu_without_avx512(dtype: str, info: str, slow: bool) -> None:
    assert common.bf16_without_avx512(dtype, common.cpu_flags(info)) is slow


def _stand_in_recorder(monkeypatch: pytest.MonkeyPatch, seen: list) -> None:
    """``record_workload`` that keeps the spec it was given and writes a committed run as its recording."""
    def record(spec, out, **kwargs):
        seen.append(spec)
        shutil.copytree(REPO_ROOT / "tests" / "fixtures" / "recorded" / "server-poisson-low", out)
        return out

    monkeypatch.setattr("twin.calibration.record.record_workload", record)


@pytest.mark.parametrize("flags", [ZEN3, XEON])
def test_record_warns_of_bf16_without_avx512_and_takes_a_dtype(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture, flags: str) -> None:
    monkeypatch.setattr(common, "_cpuinfo", lambda: flags)
    seen: list = []
    _stand_in_recorder(monkeypatch, seen)
    assert main(["record", "--workload", "heldout-server-bursty", "--out", str(tmp_path / "a")]) == 0
    warned = "AVX2 but no AVX-512" in capsys.readouterr().err
    assert warned is (flags is ZEN3)
    assert main(["record", "--workload", "heldout-server-bursty", "--dtype", "float32",
                 "--out", str(tmp_path / "b")]) == 0
    assert "AVX-512" not in capsys.readouterr().err
    assert [s.engine.dtype for s in seen] == ["bfloat16", "float32"]
    assert seen[1].engine.model_copy(update={"dtype": "bfloat16"}) == seen[0].engine  # nothing else changed


def test_record_refuses_a_type_without_a_profile_equivalent(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    assert main(["record", "--workload", "heldout-server-bursty", "--dtype", "float16", "--out", str(tmp_path)]) == 2
    assert "argument --dtype: invalid choice: 'float16'" in capsys.readouterr().err
    assert not tmp_path.joinpath("run.json").exists()


def test_a_float32_recording_fits_an_fp32_profile_that_gives_its_block_count_back(tmp_path: Path) -> None:
    """Recorded runs in float32 (run.json ``dtype``): 4 bytes a weight and a KV element, so the same KV memory holds
    half the bf16 blocks; the profile's memory section must give the recorded count back."""
    src = REPO_ROOT / "tests" / "fixtures" / "calibration" / "cpu-tiny-llama" / "calibration"
    runs = []
    for name in ("sweep-decode-batch", "sweep-prefill-chunk-512", "sweep-kv-pressure"):
        dst = tmp_path / name
        shutil.copytree(src / name, dst)
        run = json.loads((dst / "run.json").read_text())
        run["dtype"] = "float32"
        if "--num-gpu-blocks-override" not in run["engine_args"]:
            run["num_gpu_blocks"] //= 2
        (dst / "run.json").write_text(json.dumps(run))
        runs.append(dst)
    out = tmp_path / "fp32.yaml"
    assert main(["calibrate", *map(str, runs), "--name", "cpu-tiny-llama-float32", "--out", str(out)]) == 0
    prof = load_profile(str(out))
    assert (prof.weight_dtype, prof.kv_dtype) == ("fp32", "fp32")
    r0 = load_recorded_run(runs[0]).run
    assert derive_num_gpu_blocks(prof, block_size=r0.block_size, max_num_batched_tokens=r0.max_num_batched_tokens) \
        == r0.num_gpu_blocks
    assert prof.weight_bytes == 2 * load_profile("cpu-tiny-llama").weight_bytes
