"""Imported by early_crash.py (`import`): it crashes while it is imported."""
import ctypes

ctypes.string_at(8)         # MOD_LINE
