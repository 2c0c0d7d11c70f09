"""pyoffcpu: wall-clock profiles of Python processes from eBPF."""
__version__ = "0.1.0"
