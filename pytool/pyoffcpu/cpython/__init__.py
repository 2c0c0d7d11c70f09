"""CPython inside a process: detection (detect: which interpreter, its
version and offsets; process: PythonProcess; offsets_table and
debug_offsets: the layouts; livecheck: a newer version's layout checked on
the live process; tls: where a thread keeps its state), the frame walker
(walker) and what it reads (code: code objects; linetable: line numbers;
objects and object_table: objects for --locals; threadnames: threading's
names; asyncio_tasks and asyncio_table: asyncio's tasks).
"""
