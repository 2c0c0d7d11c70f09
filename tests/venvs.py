"""Virtual environments with packages from PyPI, kept across runs outside
the clone (PyTorch's is ~5 GB): the tests (conftest.cached_venv) and the
bench (tools/bench/case_torch.py) share them."""
import fcntl
import hashlib
import os
import shutil
import subprocess

VENV_CACHE = os.environ.get("PYOFFCPU_TEST_VENVS", "/var/cache/pyoffcpu/test-venvs")
TORCH = "torch==2.14.1"     # the default (CUDA) wheel from PyPI, run on the CPU: issue 23's


class VenvError(Exception):
    """pip could not install the packages."""


def cached_venv(name, base_python, packages):
    """The python of a venv made from base_python with packages from PyPI,
    under VENV_CACHE, named by `name` and a hash of the interpreter and the
    pinned packages (another pin is another venv).  It is made in a
    directory of its own and renamed into place once complete: a run killed
    halfway leaves nothing that looks ready."""
    key = hashlib.sha256(repr((os.path.realpath(base_python), sorted(packages))).encode()).hexdigest()[:12]
    dest = os.path.join(VENV_CACHE, f"{name}-{key}")
    python = os.path.join(dest, "bin", "python")
    os.makedirs(VENV_CACHE, mode=0o700, exist_ok=True)
    with open(os.path.join(VENV_CACHE, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.access(python, os.X_OK):
            return python
        work = dest + ".partial"
        shutil.rmtree(work, ignore_errors=True)
        subprocess.run([base_python, "-m", "venv", work], check=True)
        pip = subprocess.run([os.path.join(work, "bin", "python"), "-m", "pip", "install", "-q",
                              "--disable-pip-version-check", *packages],
                             capture_output=True, text=True)
        if pip.returncode != 0:
            shutil.rmtree(work, ignore_errors=True)
            raise VenvError(f"{' '.join(packages)} cannot be installed from PyPI: " + pip.stderr[-300:])
        # bin/python finds its venv by its own place: a renamed venv works
        # (only the scripts' #! lines name the old place; the callers run python -m)
        os.rename(work, dest)
        return python
