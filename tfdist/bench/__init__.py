"""Measurements: each benchmark module is one `tfdist bench NAME` with NAME, HELP, add_arguments(parser), run(args).

Helpers they share: common (timing, bus bandwidth, JSON/PNG output), processes (starting workers),
memory (resident set, TF allocator bytes), models (the ZeRO benchmarks' MLP and data).
"""
