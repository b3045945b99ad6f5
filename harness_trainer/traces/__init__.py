"""traces: the OpenEnv TrainingTrace as data: reading, appending and validating trace files (files.py) and each
turn's prefix parent (prefixes.py), what a conversation repeats held once in memory (sharing.py), a trace with
each token once as the proxy ships it (compact.py). The bottom layer: imports no other package of this project,
and never torch; the proxy imports prefixes.py, sharing.py and compact.py,
so this package's own __init__ stays empty of imports."""
