"""``kvtier fleet``: a whole fleet on one host from one YAML file (see :mod:`kvtier.fleet.config`)."""
