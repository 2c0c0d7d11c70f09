"""The processes being profiled: each one's life (found, registered in BPF,
exec, fork, exit: processes; procinfo: the registration; selection: which
ones -a takes), and a dead one's memory and threads (corefile).
"""
