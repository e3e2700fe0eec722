"""Know before you deploy: traces, the exact cache layer, and the ``kvtier simulate`` report."""
