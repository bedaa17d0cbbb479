"""Prepare what a GPU lease must carry (`make gpu-carry`, here, before the lease): .gpu/ (ignored by git)

    .gpu/wheels/   the packages of tools/gpu_wheels.txt, cp312 manylinux x86-64 (the image has no index)
    .gpu/wheels.2/ those of tools/gpu_wheels_2.txt (notebook 09's server stack), for call 2
    .gpu/model.1   the first half of the SmolLM2 GGUF   } one call carries at most 64 MiB: the 98 MB
    .gpu/model.2   the second half                      } model travels in two calls (tools/gpu_check.py)

Call 1 carries .gpu/wheels and .gpu/model.1, call 2 (while the machine is still warm) .gpu/wheels.2 and
.gpu/model.2. main() prints what each call carries beside the tree, against the 64 MiB limit.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPU = ROOT / ".gpu"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64"]


LISTINGS = {"wheels": ROOT / "tools" / "gpu_wheels.txt", "wheels.2": ROOT / "tools" / "gpu_wheels_2.txt"}
CALL_LIMIT_MIB = 64                                   # the device tool's limit on what one call carries


def pinned_wheels(listing: Path = LISTINGS["wheels"]) -> list[str]:
    return [line.strip() for line in listing.read_text().splitlines() if line.strip() and not line.startswith("#")]


def download_wheels(dest: Path, listing: Path = LISTINGS["wheels"]) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-d", str(dest)]
    cmd += [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(cmd + pinned_wheels(listing), check=True)
    return sorted(dest.glob("*.whl"))


def split_file(path: Path, first: Path, second: Path) -> None:
    """Two halves whose concatenation is the file (tools/gpu_check.py joins them and checks the sha256)."""
    data = path.read_bytes()
    half = len(data) // 2
    first.write_bytes(data[:half])
    second.write_bytes(data[half:])


def tracked_mib() -> float:
    """The tree that travels with every call: git's tracked files."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return sum((ROOT / n).stat().st_size for n in names.decode().split("\0") if n and (ROOT / n).is_file()) / 2**20


def main() -> None:
    from minillm.loading.loader import fetch_smollm2

    wheels = {name: download_wheels(GPU / name, listing) for name, listing in LISTINGS.items()}
    split_file(fetch_smollm2(), GPU / "model.1", GPU / "model.2")
    mib = lambda paths: sum(p.stat().st_size for p in paths) / 2**20
    tree = tracked_mib()
    for call, (wheel_dir, half) in enumerate((("wheels", "model.1"), ("wheels.2", "model.2")), start=1):
        total = tree + mib(wheels[wheel_dir]) + mib([GPU / half])
        print(f"call {call}: tree {tree:.1f} + .gpu/{wheel_dir} {mib(wheels[wheel_dir]):.1f} + .gpu/{half} "
              f"{mib([GPU / half]):.1f} = {total:.1f} MiB (limit {CALL_LIMIT_MIB})")
        if total > CALL_LIMIT_MIB:
            sys.exit(f"call {call} would carry {total:.1f} MiB, over the device tool's {CALL_LIMIT_MIB} MiB")


if __name__ == "__main__":
    main()
