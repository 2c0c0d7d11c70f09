"""The commands besides record (which cli.py runs on the collect/profile/
export pipeline): dump, top, snapshot and report.
"""
