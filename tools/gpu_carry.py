"""Prepare what a GPU lease must carry (`make gpu-carry`, here, before the lease): .gpu/ (ignored by git)

    .gpu/wheels/   the packages of tools/gpu_wheels.txt, cp312 manylinux x86-64 (the image has no index)
    .gpu/model.1   the first half of the SmolLM2 GGUF   } one call carries at most 64 MiB: the 98 MB
    .gpu/model.2   the second half                      } model travels in two calls (tools/gpu_check.py)

Call 1 carries .gpu/wheels and .gpu/model.1, call 2 (while the machine is still warm) .gpu/model.2.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPU = ROOT / ".gpu"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64"]


def pinned_wheels(listing: Path = ROOT / "tools" / "gpu_wheels.txt") -> list[str]:
    return [line.strip() for line in listing.read_text().splitlines() if line.strip() and not line.startswith("#")]


def download_wheels(dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-d", str(dest)]
    cmd += [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(cmd + pinned_wheels(), check=True)
    return sorted(dest.glob("*.whl"))


def split_file(path: Path, first: Path, second: Path) -> None:
    """Two halves whose concatenation is the file (tools/gpu_check.py joins them and checks the sha256)."""
    data = path.read_bytes()
    half = len(data) // 2
    first.write_bytes(data[:half])
    second.write_bytes(data[half:])


def main() -> None:
    from minillm.loader import fetch_smollm2

    wheels = download_wheels(GPU / "wheels")
    split_file(fetch_smollm2(), GPU / "model.1", GPU / "model.2")
    mib = lambda paths: sum(p.stat().st_size for p in paths) / 2**20
    print(f"{len(wheels)} wheels, {mib(wheels):.1f} MiB; model halves {mib([GPU / 'model.1']):.1f} + "
          f"{mib([GPU / 'model.2']):.1f} MiB in {GPU}")


if __name__ == "__main__":
    main()
