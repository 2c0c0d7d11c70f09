"""A compressed core is a file we did not write: what its decompression may
write is bounded by the size its own headers give and by the room in the
temporary directory (targets/corefile.py).  Built cores, no BPF."""
import os
import shutil
import struct
import subprocess

import pytest

from pyoffcpu.targets import corefile
from pyoffcpu.targets.corefile import CoreError

pytestmark = pytest.mark.skipif(shutil.which("zstd") is None, reason="needs zstd")


def core_header(segments, phnum=None):
    """An ELF core's header and program headers: one PT_LOAD per (offset, size)."""
    n = len(segments) if phnum is None else phnum
    eh = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    eh += struct.pack("<HHIQQQIHHHHHH", corefile.ET_CORE, corefile.EM_X86_64, 1, 0, 64, 0, 0,
                      64, 56, n, 0, 0, 0)
    ph = b"".join(struct.pack("<IIQQQQQQ", corefile.PT_LOAD, 4, off, 0x400000 + i * 0x100000, 0, size,
                              size, 0x1000) for i, (off, size) in enumerate(segments))
    return eh + ph


def compressed(tmp_path, header, tail_bytes):
    """header then tail_bytes zero bytes, through zstd, as a file."""
    out = tmp_path / "core.zst"
    with open(out, "wb") as f:
        p = subprocess.Popen(["zstd", "-c", "-q", "-1"], stdin=subprocess.PIPE, stdout=f)
        p.stdin.write(header)
        zeros = bytes(1 << 20)
        left = tail_bytes
        while left > 0:
            p.stdin.write(zeros[:min(left, len(zeros))])
            left -= len(zeros)
        p.stdin.close()
        assert p.wait() == 0
    return str(out)


def decompress(path, tmpdir):
    fd = os.open(path, os.O_RDONLY)
    try:
        return corefile._decompress(path, fd, os.pread(fd, 8, 0))
    finally:
        os.close(fd)


@pytest.fixture
def tmpdir_env(tmp_path, monkeypatch):
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setenv("TMPDIR", str(d))
    return d


def test_bytes_past_the_claimed_end_are_not_written(tmp_path, tmpdir_env):
    """A core whose headers end it at 1 MiB + 4 KiB, followed by 256 MiB of
    zeros: the copy is the claimed size, not a byte more."""
    hdr = core_header([(4096, 1 << 20)])
    path = compressed(tmp_path, hdr, (256 << 20))
    out, tmp, what = decompress(path, tmpdir_env)
    try:
        assert what == "zstd"
        assert os.path.getsize(out) == 4096 + (1 << 20)
        with open(out, "rb") as f:
            assert f.read(len(hdr)) == hdr
    finally:
        shutil.rmtree(tmp)


def test_a_claimed_size_beyond_the_room_is_refused_before_it_is_written(tmp_path, tmpdir_env):
    """A bomb's headers claim a petabyte: one line naming the room, nothing
    left in the temporary directory."""
    path = compressed(tmp_path, core_header([(4096, 1 << 50)]), 64 << 20)
    with pytest.raises(CoreError, match=r"decompresses to over \d+ MiB, and .* MiB to spare"):
        decompress(path, tmpdir_env)
    assert os.listdir(tmpdir_env) == []


def test_a_core_of_unknown_size_stops_at_the_room(tmp_path, tmpdir_env, monkeypatch):
    """More than 65534 mappings (PN_XNUM): the size is not in the first
    headers, so the room bounds it: with 8 MiB to spare, 32 MiB is refused
    and nothing is left; 4 MiB is read whole."""
    monkeypatch.setattr(corefile, "_room", lambda tmp: 8 << 20)
    hdr = core_header([], phnum=corefile.PN_XNUM)
    with pytest.raises(CoreError, match="decompresses to over"):
        decompress(compressed(tmp_path, hdr, 32 << 20), tmpdir_env)
    assert os.listdir(tmpdir_env) == []
    out, tmp, _ = decompress(compressed(tmp_path, hdr, 4 << 20), tmpdir_env)
    try:
        assert os.path.getsize(out) == len(hdr) + (4 << 20)
    finally:
        shutil.rmtree(tmp)


def test_compressed_text_is_not_a_core(tmp_path, tmpdir_env):
    path = tmp_path / "x.zst"
    subprocess.run(["zstd", "-q", "-c"], input=b"hello\n" * 100000, stdout=open(path, "wb"), check=True)
    with pytest.raises(CoreError, match="zstd-compressed, but not an ELF core file"):
        decompress(str(path), tmpdir_env)
    assert os.listdir(tmpdir_env) == []


def test_a_corrupt_stream_names_the_decompressor(tmp_path, tmpdir_env):
    hdr = core_header([(4096, 1 << 20)])
    path = compressed(tmp_path, hdr, 0)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:len(data) // 2])      # cut: the header is there, the rest is not
    with pytest.raises(CoreError, match="zstd failed"):
        decompress(path, tmpdir_env)
    assert os.listdir(tmpdir_env) == []
