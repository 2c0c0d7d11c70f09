#!/usr/bin/env python3
"""Man pages from the command line itself: pyoffcpu(1) and one page per
command (pyoffcpu-dump(1), ...), written from click's own description of
each command (its help, options and the epilog of examples), so that the
pages cannot drift from `--help`.

    python3 tools/manpages.py OUTDIR        # writes OUTDIR/pyoffcpu*.1
"""
from __future__ import annotations

import datetime
import os
import sys
from typing import List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "pytool"))


def roff(text: str) -> str:
    """Text escaped for roff: backslashes, and a line that would start with
    a control character."""
    out = []
    for line in text.replace("\\", "\\e").splitlines():
        if line.startswith((".", "'")):
            line = "\\&" + line
        out.append(line)
    return "\n".join(out)


def _paragraphs(text: str) -> List[str]:
    """click's help text as paragraphs; a \\b paragraph kept as it is (no fill)."""
    import inspect
    out = []
    for para in inspect.cleandoc(text).split("\n\n"):
        if para.startswith("\b"):
            out.append(".nf\n" + roff(inspect.cleandoc(para[1:].strip("\n"))) + "\n.fi")
        else:
            out.append(roff(" ".join(ln.strip() for ln in para.splitlines())))
    return out


def page(name: str, cmd, ctx, version: str, date: str, see_also: List[str]) -> str:
    import click
    title = name.upper()
    lines = [f'.TH {title} 1 "{date}" "pyoffcpu {version}" "pyoffcpu manual"',
             ".SH NAME", f"{roff(name)} \\- {roff(cmd.get_short_help_str(limit=200))}",
             ".SH SYNOPSIS", f".B {roff(' '.join(name.split('-', 1)))}",
             roff(" ".join(cmd.collect_usage_pieces(ctx)))]
    if cmd.help:
        lines.append(".SH DESCRIPTION")
        lines.append("\n.PP\n".join(_paragraphs(cmd.help)))
    opts = [p for p in cmd.get_params(ctx) if isinstance(p, click.Option)]
    if opts:
        lines.append(".SH OPTIONS")
        for p in opts:
            rec = p.get_help_record(ctx)
            if rec is None:
                continue
            lines += [".TP", f"\\fB{roff(rec[0])}\\fR", roff(rec[1] or "")]
    if isinstance(cmd, click.Group):
        lines.append(".SH COMMANDS")
        for sub in cmd.list_commands(ctx):
            c = cmd.get_command(ctx, sub)
            lines += [".TP", f"\\fB{roff(sub)}\\fR", roff(c.get_short_help_str(limit=200)),
                      f"See \\fBpyoffcpu-{roff(sub)}\\fR(1)."]
    if cmd.epilog:
        lines.append(".SH EXAMPLES")
        lines.append("\n.PP\n".join(_paragraphs(cmd.epilog)))
    lines += [".SH SEE ALSO", ", ".join(f"\\fB{roff(s)}\\fR(1)" for s in see_also if s != name) +
              "; /usr/share/doc/pyoffcpu/README.md"]
    return "\n".join(lines) + "\n"


def write_pages(outdir: str) -> List[str]:
    import click
    from pyoffcpu import __version__
    from pyoffcpu.cli import main
    date = datetime.date.fromtimestamp(int(os.environ.get("SOURCE_DATE_EPOCH", "0")) or
                                       datetime.datetime.now().timestamp()).isoformat()
    os.makedirs(outdir, exist_ok=True)
    top = click.Context(main, info_name="pyoffcpu")
    names = ["pyoffcpu"] + [f"pyoffcpu-{c}" for c in main.list_commands(top)]
    written = []
    for name in names:
        if name == "pyoffcpu":
            cmd, ctx = main, top
        else:
            sub = name.split("-", 1)[1]
            cmd = main.get_command(top, sub)
            ctx = click.Context(cmd, info_name=sub, parent=top)
        path = os.path.join(outdir, name + ".1")
        with open(path, "w") as f:
            f.write(page(name, cmd, ctx, __version__, date, names))
        written.append(path)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    for p in write_pages(sys.argv[1]):
        print(p)
