"""Collection: what the kernel gathers and how it reaches user space.

platform (root, BTF, tracefs: checked before anything loads), bpfload
(compile or take from the cache, load, attach), sessionsetup and session
(the loop: drain the maps into a Recording, one batch a turn, for record,
top and snapshot alike), crashcapture (the crash watcher's programs).  The
kernel's ABI they share with every stage is kernel/'s.
"""
