"""`tfdist build-horovod`: builds Horovod 0.28.1 against the installed TensorFlow, cached as a wheel.

Horovod is only on PyPI as a source distribution, and 0.28.1 does not compile against the TF 2.21
wheel as shipped: `horovod/tensorflow/xla_mpi_ops.cc` includes XLA headers (xla_builder.h,
farmhash, highwayhash) that the wheel does not carry. Its body is GPU-only (`#if HAVE_GPU`), and the
one source change here drops it from `horovod/tensorflow/CMakeLists.txt`; everything else is
Horovod as released. The built wheel is cached under `~/.cache/tfdist/wheels/` keyed by the Horovod,
TensorFlow and Python versions (and cpu/gpu), so a second run only re-installs it (seconds).

Example:
    $ tfdist build-horovod            # CPU: TensorFlow + MPI + Gloo, ~4 min the first time
    $ tfdist build-horovod --gpu      # adds NCCL (HOROVOD_GPU_OPERATIONS=NCCL), needs CUDA + NCCL
    $ horovodrun --check-build        # lists TensorFlow, MPI and Gloo
"""

from __future__ import annotations

import argparse
import glob
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

from tfdist.errors import ConfigError, TfdistError, troubleshooting

HOROVOD_VERSION = "0.28.1"
CACHE_DIR = os.path.join(os.path.expanduser(os.environ.get("TFDIST_CACHE", "~/.cache/tfdist")), "wheels")

# Frameworks and controllers compiled in. PyTorch/MXNet are off: tfdist is TensorFlow-only, and
# their build steps would need those frameworks installed.
BUILD_ENV = {
    "HOROVOD_WITH_TENSORFLOW": "1",
    "HOROVOD_WITHOUT_PYTORCH": "1",
    "HOROVOD_WITHOUT_MXNET": "1",
    "HOROVOD_WITH_GLOO": "1",
    "HOROVOD_WITH_MPI": "1",
}
# GPU clusters: all-reduce, all-gather and broadcast of GPU tensors through NCCL. Needs the CUDA
# toolkit (nvcc) and NCCL headers/libraries; HOROVOD_NCCL_HOME / HOROVOD_CUDA_HOME point at
# non-default locations.
GPU_ENV = {
    "HOROVOD_GPU_OPERATIONS": "NCCL",
}
# The known fix: the GPU-only XLA custom-call ops, whose headers TF 2.21 does not ship.
_XLA_SOURCE_LINE = re.compile(r"^.*xla_mpi_ops\.cc.*\n", re.MULTILINE)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build-horovod", help=f"build and install Horovod {HOROVOD_VERSION} for this TensorFlow",
                       description=f"Builds Horovod {HOROVOD_VERSION} against the installed TensorFlow and caches "
                                   "the wheel (--cache-dir); a second run only reinstalls it.")
    p.add_argument("--gpu", action="store_true",
                   help="also build NCCL GPU operations (needs CUDA and NCCL; sets HOROVOD_GPU_OPERATIONS=NCCL)")
    p.add_argument("--rebuild", action="store_true", help="ignore the cached wheel and build again")
    p.add_argument("--cache-dir", default=CACHE_DIR, help=f"where built wheels are kept (default: {CACHE_DIR})")
    p.add_argument("--no-install", action="store_true", help="build (or find) the wheel but do not install it")
    p.set_defaults(run=run)


class BuildError(TfdistError, RuntimeError):
    """Building or checking Horovod failed; the message says which step (the output above it shows why)."""


def _tf_version() -> str:
    # Ask pip's metadata rather than importing TensorFlow (seconds, and prints C++ start-up lines).
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("tensorflow-cpu", "tensorflow"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    raise ConfigError("TensorFlow is not installed in this Python; Horovod compiles against it. "
                      "Install tfdist first: pip install -e '.[cpu]' (or make setup).")


def cache_key(gpu: bool) -> str:
    """The wheel cache folder name: Horovod, TensorFlow and Python versions, and cpu/gpu."""
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return f"horovod-{HOROVOD_VERSION}-tf{_tf_version()}-{py}-{platform.machine()}-{'gpu' if gpu else 'cpu'}"


def cached_wheel(cache_dir: str, gpu: bool) -> str | None:
    """Path of the cached wheel for this environment, or None."""
    wheels = sorted(glob.glob(os.path.join(cache_dir, cache_key(gpu), "horovod-*.whl")))
    return wheels[-1] if wheels else None


def installed_horovod() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("horovod")
    except PackageNotFoundError:
        return None


def _pip(*args: str, env: dict | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)


def _check_tools(gpu: bool) -> None:
    need = {"cmake": "cmake", "g++": "g++", "make": "make", "mpicxx": "libopenmpi-dev", "mpirun": "openmpi-bin"}
    if gpu:
        need["nvcc"] = "the CUDA toolkit"
    missing = {tool: pkg for tool, pkg in need.items() if shutil.which(tool) is None}
    if missing:
        raise ConfigError(f"building Horovod needs {sorted(missing)} on PATH; on Debian/Ubuntu: "
                          f"sudo apt-get install {' '.join(sorted(set(missing.values())))} (or: make system-deps)."
                          + troubleshooting("horovod-is-missing-or-does-not-build"))


def patch_source(src_dir: str) -> None:
    """Applies the one known fix: drop the GPU-only xla_mpi_ops.cc from the TensorFlow CMake list."""
    path = os.path.join(src_dir, "horovod", "tensorflow", "CMakeLists.txt")
    with open(path) as f:
        text = f.read()
    patched, count = _XLA_SOURCE_LINE.subn("", text)
    if count == 0 and "xla_mpi_ops" in text:
        raise BuildError(f"{path}: xla_mpi_ops.cc is referenced in a form this fix does not know."
                         + troubleshooting("horovod-is-missing-or-does-not-build"))
    with open(path, "w") as f:
        f.write(patched)
    print(f"patched {path}: removed {count} line(s) naming xla_mpi_ops.cc", flush=True)


def build_jobs(makeflags: str) -> str:
    """MAKEFLAGS for Horovod's CMake build: the user's own `-jN` if it names one, else one job per core.

    Under `make test` this process inherits the outer make's MAKEFLAGS (its options and command-line variables,
    and no job count when make runs serially); Horovod's setup.py adds its own `-j` only when MAKEFLAGS is empty,
    so passing that through would compile Horovod's sources one at a time."""
    jobs = re.search(r"(?:^|\s)-j\s*(\d+)|--jobs=(\d+)", makeflags)
    return f"-j{jobs.group(1) or jobs.group(2)}" if jobs else f"-j{os.cpu_count() or 1}"


def build_wheel(cache_dir: str, gpu: bool) -> str:
    """Downloads the Horovod sdist, patches it, builds a wheel and stores it in the cache."""
    _check_tools(gpu)
    target = os.path.join(cache_dir, cache_key(gpu))
    with tempfile.TemporaryDirectory(prefix="tfdist-horovod-") as tmp:
        _pip("download", "--no-deps", "--no-binary", ":all:", f"horovod=={HOROVOD_VERSION}", "-d", tmp)
        (sdist,) = glob.glob(os.path.join(tmp, "horovod-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            try:
                tar.extractall(tmp, filter="data")
            except TypeError:  # Python < 3.11.4 has no extraction filters
                tar.extractall(tmp)
        src = os.path.join(tmp, f"horovod-{HOROVOD_VERSION}")
        patch_source(src)
        env = {**os.environ, **BUILD_ENV, **(GPU_ENV if gpu else {})}
        env["MAKEFLAGS"] = build_jobs(env.get("MAKEFLAGS", ""))
        # No build isolation: Horovod's CMake must see (and link against) the TensorFlow installed here.
        try:
            _pip("wheel", "--no-build-isolation", "--no-deps", "-w", os.path.join(tmp, "dist"), src, env=env)
        except subprocess.CalledProcessError as err:
            raise BuildError(f"building the Horovod {HOROVOD_VERSION} wheel failed (pip exited with code "
                             f"{err.returncode}); the first compiler error in pip's output above says why."
                             + troubleshooting("horovod-is-missing-or-does-not-build")) from None
        (wheel,) = glob.glob(os.path.join(tmp, "dist", "horovod-*.whl"))
        os.makedirs(target, exist_ok=True)
        dest = os.path.join(target, os.path.basename(wheel))
        shutil.copy2(wheel, dest + ".part")
        os.replace(dest + ".part", dest)  # atomic: an interrupted build never leaves a half wheel cached
    print(f"cached {dest}", flush=True)
    return dest


def check_build() -> str:
    """Returns `horovodrun --check-build` output, raising if TensorFlow, MPI or Gloo is missing."""
    runner = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    out = subprocess.run([runner, "--check-build"], capture_output=True, text=True, check=True).stdout
    for name in ("TensorFlow", "MPI", "Gloo"):
        if not re.search(rf"\[X\] {name}\b", out):
            raise BuildError(f"horovodrun --check-build does not list {name}."
                             + troubleshooting("horovod-is-missing-or-does-not-build") + f" Its output:\n{out}")
    return out


def run(args: argparse.Namespace) -> int:
    wheel = None if args.rebuild else cached_wheel(args.cache_dir, args.gpu)
    if wheel:
        print(f"using cached wheel {wheel}", flush=True)
    else:
        wheel = build_wheel(args.cache_dir, args.gpu)
    if args.no_install:
        return 0
    # --force-reinstall of the wheel only: a cached wheel for another TF was never picked (the key
    # names the TF version), so this swaps in exactly the build that matches this environment.
    _pip("install", "-q", "--force-reinstall", "--no-deps", wheel)
    _pip("install", "-q", wheel)  # Horovod's own pure-Python dependencies (cloudpickle, psutil, pyyaml, ...)
    print(check_build(), flush=True)
    return 0
