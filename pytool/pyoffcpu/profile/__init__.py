"""From a Recording to a profile: the model every exporter reads (model),
native and Python frames interleaved (merge), why each wait waited
(reasons), the sampled waits' weights (waits), and the summary printed at
the end (summary).
"""
