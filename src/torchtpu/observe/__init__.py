"""Nothing slow is silent: metrics and events (metrics.py), performance warnings
(perf_warnings.py), ``explain`` (explain.py) and the user's line in messages
(locations.py). It imports nothing above it."""
