"""pyoffcpu as a system tool: the .deb installed into a fresh Debian 12 root
and used there (no bcc, no kernel headers: the BPF programs ship compiled),
then purged.  The wheel: test_wheel.py.

The Debian 12 root is tools/build-chroot.sh's `bookworm` one (`make test`
builds it, cached): minbase and systemd, with the packages the .deb depends
on downloaded but not installed. Each test runs on an overlay of it, so it
stays as debootstrap left it.
"""
import os
import re
import subprocess
import sys

import pytest

from conftest import REQUIRE_BPF, ROOT

BOOKWORM = os.path.realpath(os.environ.get("PYOFFCPU_BOOKWORM_CHROOT", "/var/cache/pyoffcpu/chroot/bookworm"))
BUSY = """import time

def spin(seconds):
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:   # SPIN_LINE
        n += 1
    return n

spin(float(__import__("sys").argv[1]))
"""


@pytest.fixture(scope="module")
def deb(tmp_path_factory):
    out = tmp_path_factory.mktemp("deb")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "build_deb.py"), str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    path = res.stdout.strip().splitlines()[-1]
    from pyoffcpu import __version__
    assert os.path.basename(path) == f"pyoffcpu_{__version__}_amd64.deb"
    return path


def bookworm_or_skip():
    if not os.path.exists(os.path.join(BOOKWORM, ".pyoffcpu-stage-packages")):
        msg = f"no Debian 12 root at {BOOKWORM} (tools/build-chroot.sh bookworm builds it; make test runs it)"
        if REQUIRE_BPF:
            pytest.fail(msg)
        pytest.skip(msg)
    if os.geteuid() != 0:
        pytest.skip("needs root (mounts, chroot)")


def in_fresh_bookworm(tmp_path, files, script, timeout=900):
    """Runs `script` (sh, as root) in an overlay of the Debian 12 root, with
    the host's /proc, /sys (BTF, tracefs) and /dev, in a mount namespace of
    its own: nothing it does stays. files: {path inside: host path} copied in."""
    upper, work, merged = (tmp_path / n for n in ("upper", "work", "merged"))
    for d in (upper, work, merged):
        d.mkdir()
    copies = "".join(f'mkdir -p "$M{os.path.dirname(inside)}" && cp "{host}" "$M{inside}"\n'
                     for inside, host in files.items())
    outer = f"""set -e
M={merged}
mount -t overlay overlay -o lowerdir={BOOKWORM},upperdir={upper},workdir={work} "$M"
mount -t proc proc "$M/proc"
mount --rbind /sys "$M/sys"
mount --rbind /dev "$M/dev"
{copies}exec chroot "$M" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    HOME=/root LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive /bin/sh -c "$0"
"""
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", outer, script],
                          capture_output=True, text=True, timeout=timeout)


def sections(out):
    """The script's output split at its `== name` lines."""
    parts, name = {}, None
    for ln in out.splitlines():
        if ln.startswith("== "):
            name = ln[3:].strip()
            parts[name] = []
        elif name is not None:
            parts[name].append(ln)
    return {k: "\n".join(v) for k, v in parts.items()}


def test_deb_installs_works_and_purges_in_a_fresh_debian_12(tmp_path, deb, bpf):
    bookworm_or_skip()
    busy = tmp_path / "busy.py"
    busy.write_text(BUSY)
    spin_line = next(n for n, ln in enumerate(BUSY.splitlines(), 1) if "SPIN_LINE" in ln)
    script = r"""
set -u
echo "== install"
apt-get install -y -q --no-install-recommends /tmp/pyoffcpu.deb >/tmp/install.log 2>&1; echo "rc=$?"
tail -n 3 /tmp/install.log
echo "== version"
pyoffcpu --version
echo "== doctor"
pyoffcpu doctor; echo "rc=$?"
echo "== record"
pyoffcpu -d 2 -o /tmp/out.svg -- python3 /tmp/busy.py 4 2>/tmp/record.err; echo "rc=$?"
tail -n 3 /tmp/record.err
grep -o 'spin ([^)]*busy.py:[0-9]*)' /tmp/out.svg | sort -u
echo "== man"
ls /usr/share/man/man1 | grep pyoffcpu
echo "== completion"
COMP_WORDS="pyoffcpu d" COMP_CWORD=1 _PYOFFCPU_COMPLETE=bash_complete pyoffcpu
echo "== units"
systemd-analyze verify --man=no /lib/systemd/system/pyoffcpu-snapshot.service \
    /lib/systemd/system/pyoffcpu-snapshot.timer /lib/systemd/system/pyoffcpu-crashes.service 2>&1; echo "rc=$?"
for u in pyoffcpu-snapshot.timer pyoffcpu-crashes.service; do systemctl is-enabled "$u" 2>&1; done
echo "== cache"
stat -c '%U %a' /var/cache/pyoffcpu
echo "== purge"
dpkg -L pyoffcpu >/tmp/files.txt
links=$(cat /var/cache/pyoffcpu/kernel-header-links 2>/dev/null || true)
mkdir -p /var/lib/pyoffcpu/snapshots && echo kept >/var/lib/pyoffcpu/snapshots/mine.folded
apt-get purge -y -q pyoffcpu >/tmp/purge.log 2>&1; echo "rc=$?"
while read -r f; do
    case $f in
        /usr/lib/python3/dist-packages/pyoffcpu*|/usr/share/doc/pyoffcpu*|/usr/share/pyoffcpu*) [ ! -e "$f" ] || echo "LEFT $f" ;;
        *) [ -d "$f" ] || [ ! -e "$f" ] || echo "LEFT $f" ;;
    esac
done </tmp/files.txt
[ ! -e /var/cache/pyoffcpu ] || echo "LEFT /var/cache/pyoffcpu"
for l in $links; do [ ! -L "$l" ] || echo "LEFT $l"; done
echo "links were: $links"
cat /var/lib/pyoffcpu/snapshots/mine.folded
"""
    res = in_fresh_bookworm(tmp_path, {"/tmp/pyoffcpu.deb": deb, "/tmp/busy.py": str(busy)}, script)
    s = sections(res.stdout)
    assert "rc=0" in s.get("install", ""), res.stdout + res.stderr
    from pyoffcpu import __version__
    assert s["version"].strip() == f"pyoffcpu, version {__version__}"
    assert s["doctor"].rstrip().endswith("rc=0") and "FAIL" not in s["doctor"], s["doctor"]
    # the helper ships, with the capstone it decodes with (Debian's is 4.0)
    assert re.search(r"^ok +native helper: pyoffcpu-elf builds unwind tables \(prologue analysis with "
                     r"capstone 5\.", s["doctor"], re.M), s["doctor"]
    assert "rc=0" in s["record"], s["record"]
    assert re.search(rf"^spin \([^)]*busy\.py:{spin_line}\)$", s["record"], re.M), s["record"]
    assert len(s["man"].split()) >= 9 and "pyoffcpu-doctor.1.gz" in s["man"], s["man"]
    assert "doctor" in s["completion"] and "dump" in s["completion"], s["completion"]
    assert "rc=0" in s["units"] and "pyoffcpu" not in s["units"].replace("rc=0", "").replace(
        "disabled", "").strip(), s["units"]
    assert s["units"].count("disabled") == 2, s["units"]
    assert s["cache"].strip() == "root 700"
    assert "rc=0" in s["purge"] and "LEFT" not in s["purge"], s["purge"]
    assert s["purge"].strip().endswith("kept"), s["purge"]           # the snapshots stay


def test_version_is_one_value_everywhere():
    """pyoffcpu.__version__ is the one place: pyproject reads it, the .deb
    and --version say it."""
    import tomllib
    from pyoffcpu import __version__
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        conf = tomllib.load(f)
    assert "version" not in conf["project"] and "version" in conf["project"]["dynamic"]
    assert conf["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "pyoffcpu.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)
