"""Measurements: each module is one `tfdist bench NAME` with NAME, HELP, add_arguments(parser), run(args)."""
