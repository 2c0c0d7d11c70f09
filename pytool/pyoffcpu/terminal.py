"""Text for a terminal: names a target or a file chose (function and file
names, a process's comm, a path) can hold control characters, and an
escape sequence printed raw retitles the terminal, moves the cursor or
worse.  Every such byte is shown escaped (\\x1b), the text kept otherwise."""
from __future__ import annotations

import re

# C0 controls but newline and tab, DEL, and the C1 controls (U+0080-U+009F,
# which some terminals also act on); and the lone surrogates a name that was
# not UTF-8 decodes to (surrogateescape), which no UTF-8 stream can write
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def safe(text: str) -> str:
    """text with every control character but newline and tab shown as
    \\xNN, and each byte that was not UTF-8 as \\xNN too."""
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group(0)):02x}", text)
    return _SURROGATE.sub(lambda m: f"\\x{ord(m.group(0)) & 0xff:02x}", text)


def echo(message="", err: bool = False, **kw) -> None:
    """click.echo of text made safe()."""
    import click
    click.echo(safe(str(message)), err=err, **kw)
