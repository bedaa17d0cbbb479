"""Building a hand-written C kernel on first use and loading it through ctypes (attention/cpu_decode.c,
model/cpu_gemm.c).

    lib, why = load(source, path, function, argtypes)    # (the library, None), or (None, why not)

The library is compiled with the C compiler Inductor uses too (`cc`; FLAGS: -O3 -march=native -fopenmp, no
torch headers: under a second) into `path`, which library_name() keys by the source, the header it includes,
the flags and this CPU's instruction sets (a library built on another CPU could use instructions this one
lacks). Where it cannot be built the caller keeps a PyTorch path and reports why.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

HEADER = Path(__file__).with_name("vec16.h")            # the vector type and bf16 conversions the kernels share
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11", f"-I{HEADER.parent}")


def cpu_flags() -> str:
    """This CPU's instruction sets: -march=native compiles for them."""
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return os.uname().machine


def library_name(source: Path) -> str:
    """The file name of `source`'s library: its stem and a key that changes with what it is built from."""
    key = hashlib.sha256(source.read_bytes() + HEADER.read_bytes() + " ".join(FLAGS).encode()
                         + cpu_flags().encode()).hexdigest()[:16]
    return f"{source.stem}-{key}.so"


def cache_path(source: Path) -> Path:
    """Where `source`'s library is kept: the model cache's kernels folder (loader.cache_dir())."""
    from minillm.loading.loader import cache_dir

    return cache_dir() / "kernels" / library_name(source)


def load(source: Path, path: Path, function: str, argtypes: list) -> tuple[ctypes.CDLL | None, str | None]:
    """-> (the library built from `source` at `path`, its entry point `function` declared with `argtypes`
    returning a C int, None), or (None, why it could not be built or loaded)."""
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                built = Path(tmp) / path.name
                done = subprocess.run([os.environ.get("CC", "cc"), *FLAGS, str(source), "-o", str(built)],
                                      capture_output=True, text=True, timeout=120)
                if done.returncode != 0:
                    return None, f"cc failed: {(done.stderr.strip().splitlines() or ['no message'])[-1]}"
                os.replace(built, path)                                   # whole or not at all, if two build at once
        except (OSError, subprocess.TimeoutExpired) as e:                 # no compiler, or the cache not writable
            return None, f"could not build {path.name}: {e}"
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return None, f"could not load {path.name}: {e}"
    entry = getattr(lib, function)
    entry.argtypes, entry.restype = argtypes, ctypes.c_int
    return lib, None
