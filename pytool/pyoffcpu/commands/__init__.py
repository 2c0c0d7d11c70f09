"""The commands, each run by cli.py: record (one recording through the
collect -> profile -> export pipeline), dump (a live process's threads;
coredump: --core; locals: --locals; postmortem: a dead process's view, from
a core or a crash capture), top, snapshot and report (snapshots for cron
and their page), crashes (the crash watcher), tasks (asyncio tasks) and
doctor (what a recording needs, checked).
"""
