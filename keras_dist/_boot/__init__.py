"""`sitecustomize` for the tasks keras-dist-run starts (see sitecustomize.py)."""
